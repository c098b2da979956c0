"""Reports over finished runs and sweeps (job process only).

- command.py: `python -m trainer.report DIR [DIR ...]` (run through `__main__.py`);
- run_dirs.py: run and sweep directories read back as points;
- sweep_report.py: report.md, results.csv and the charts of a sweep or of any runs compared;
- fit_table.py: a sweep's fit table (plan_table.md), every point's plan and how it ended;
- wandb_report.py: the W&B Report built from what was swept (wandb-workspaces).
"""
