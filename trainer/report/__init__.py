"""Reports over finished runs and sweeps (job process only).

- command.py: `python -m trainer.report DIR [DIR ...]` (run through `__main__.py`);
- run_dirs.py: run and sweep directories read back as points, and the Report made of them;
- sweep_report.py: the report of a sweep or of any runs compared, written stage by stage:
- rows.py: one row per point, and results.csv;
- charts.py: the PNG charts (throughput, peak memory per rank, memory saved against bytes moved,
  losses, the fp16 loss scale);
- markdown.py: report.md, and the summary line printed at the end;
- where_memory.py: where the memory went, plan against measured by category per point and rank;
- fit_table.py: a sweep's fit table (plan_table.md), every point's plan and how it ended;
- wandb_report.py: the W&B Report built from what was swept (wandb-workspaces);
- summary_run.py: with logger=wandb, the W&B summary run and the Report published and linked.
- accelerators.py: a mode=advise run across accelerators (advise.accelerators): its table again, in
  report.md and with logger=wandb in W&B (a bar chart of cost per million tokens per accelerator);
- cost.py: that table's arithmetic (tokens/s and the user's prices) and its text, for the console and the report.

The names other modules use are imported from `trainer.report` itself.
"""

from trainer.report.markdown import summary_line
from trainer.report.rows import COLUMNS
from trainer.report.run_dirs import Point, Report, load_point, load_points
from trainer.report.summary_run import mirror_to_wandb, publish_and_link
from trainer.report.sweep_report import write_report, write_sweep_report

__all__ = [
    "COLUMNS",
    "Point",
    "Report",
    "load_point",
    "load_points",
    "mirror_to_wandb",
    "publish_and_link",
    "summary_line",
    "write_report",
    "write_sweep_report",
]
