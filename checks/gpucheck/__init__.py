"""The GPU check (`python checks/gpu_check.py`, docs/gpu.md) as modules the command puts together:

- runner.py: a `python -m trainer` job or any command as a process in a session of its own, killed
  with its fork server and ranks at its timeout (checks/fault_drills.py runs its jobs with it too);
- catalog.py: where the check runs (GPU or the dry run's CPU), every job it runs in order with its
  budget and estimate (the performance run's first: its compile warm-ups, then its timings), the
  schedule those estimates add up to, and the helpers it runs as processes (the environment, the
  largest micro-batch the plan fits, the advisor's predictions, the kernel rates, the text corpus);
- scheduler.py: the jobs run under their budgets and the deadline, a few at once, what each left;
- rows.py: the table of rows and one row's evaluation, with the rows that are neither of:
- memory.py: the rows that judge memory (against the plan, the headroom, the device limit, the
  host), and the candidate headroom fit;
- numerics.py: the rows that judge losses (against a reference run, reproducibility, fp16, NaN);
- perf.py: the performance run's rows (the kernel rates, the profiled step's kernel breakdown, the
  CUPTI A/B, a larger micro-batch against a smaller, text data) and the text row's corpus helper;
- rates.py: the kernel-rates job's measurements (torch only), written as JSON for the advisor;
- report.py: a row, results.md and results.json rewritten after every row, and the --bundle.
"""
