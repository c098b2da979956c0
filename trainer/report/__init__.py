"""Reports over finished runs and sweeps (job process only).

- command.py: `python -m trainer.report DIR [DIR ...]` (run through `__main__.py`);
- run_dirs.py: run and sweep directories read back as points;
- sweep_report.py: report.md, results.csv and the charts of a sweep or of any runs compared;
- wandb_report.py: the W&B Report built from what was swept (wandb-workspaces).
"""
