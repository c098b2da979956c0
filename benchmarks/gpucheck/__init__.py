"""The GPU check (`python benchmarks/gpu_check.py`, docs/gpu.md) as modules the command puts together:

- runner.py: a `python -m trainer` job or any command as a process in a session of its own, killed
  with its fork server and ranks at its timeout (benchmarks/fault_drills.py runs its jobs with it too);
- catalog.py: where the check runs (GPU or the dry run's CPU), every job it runs in order, and the
  helpers it runs as processes (the environment, the largest micro-batch the plan fits);
- scheduler.py: the jobs run under their budgets and the deadline, a few at once, what each left;
- rows.py: each row's verdict on its jobs, and the table of rows;
- report.py: results.md and results.json, rewritten after every row.
"""
