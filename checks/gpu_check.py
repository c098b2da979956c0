"""One prepared check of zerolab on a GPU: what the CPU tests cannot prove, in one command.

    python checks/gpu_check.py [--out DIR] [--bundle DIR] [--deadline S] [--dry-run] [--rows ROW]...

Made for one H200 (world size 1: NCCL refuses two ranks on one device). Without --rows it is the
performance run (issue 59, item 7), at most 7 minutes: kernel rates, the profiled step's kernel
breakdown, the CUPTI A/B, eager and compiled timings of 1b and 125m each alone after compile
warm-ups that share the GPU, a text-data row; the functional rows of the first run by name. Every row
runs `python -m trainer` as a user would (W&B off, nothing saved unless the row is about saving)
and is written to DIR/results.md and DIR/results.json as soon as it is known, so a run cut short
still reports what it reached. Each job runs in its own process group under a timeout that fits
the deadline; at its timeout the whole group (the job, its fork server, its ranks) is killed, so
no rank holds GPU memory into the rows after it. Rows whose jobs the deadline leaves unstarted are
`skip`. What explains each job stays under DIR/jobs/<job>/ (summary.json, metrics.jsonl, failures/,
plan.json) and DIR/logs/<job>.log (the console). `--bundle DIR` also keeps results.md, results.json
and one archive of jobs/ and logs/ (checkpoints left out) in a folder of their own, after every
row: the three files a device tool that brings back only a few shallow files returns.

This file is the command; the check is checks/gpucheck/: the jobs and their budgets in
catalog.py, the rows, most valuable first, in rows.py (docs/gpu.md tabulates them with the time
estimate), how jobs run in scheduler.py and runner.py, results.md and results.json in report.py. --dry-run runs the same sequence on CPU with the tiny
model and every row (rows that need CUDA say `skip`; the fault, comparison and performance trainer
jobs as the points of one sweep, which start once), to prove the script before GPU time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # checks.gpucheck, and trainer's tables for the helper processes

from checks.gpucheck.catalog import (  # noqa: E402
    Setup,
    advisor_predictions,
    all_jobs,
    environment,
    largest_fitting_micro_batch,
    limit_base,
)
from checks.gpucheck.perf import make_text_corpus  # noqa: E402
from checks.gpucheck.rates import measure  # noqa: E402
from checks.gpucheck.report import Report, timed  # noqa: E402
from checks.gpucheck.rows import NOT_REACHED, RowSpec, chosen_rows, evaluate, jobs_for  # noqa: E402
from checks.gpucheck.scheduler import Scheduler  # noqa: E402

DEADLINE_S = 420.0
"""The performance run on the GPU: 7 minutes, so that the machine's start and a rerun of the rows
that failed (--rows) fit a 15-minute device lease (docs/gpu.md has the estimate,
catalog.schedule_estimate the arithmetic)."""
WORKERS = 4
"""Jobs at once on the GPU, exclusive ones alone: the four compile warm-ups together (16 cores;
1b's three at 8-16 micro-batches and 125m's), or up to four of the rows run by --rows (under 10 GiB
of GPU memory each)."""
DRY_DEADLINE_S = 900.0
"""A dry run's deadline; its jobs have no budgets of their own (CPU timings on a shared machine say
nothing of the GPU's), so only the deadline cuts them. Every row's dry run took 584 s of wall time on
2 cores shared with other jobs (load average about 7, 2026-12-05): 600 s would have cut it."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = REPO / "outputs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S")
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--dry-run", action="store_true", help="the same sequence on CPU with the tiny model")
    parser.add_argument(
        "--bundle",
        type=Path,
        metavar="DIR",
        help="also write results.md, results.json and one archive of the jobs' folders and logs "
        "(no checkpoints) into DIR after every row, and nothing else",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help=f"seconds for the whole check (default {DEADLINE_S:g}, dry run {DRY_DEADLINE_S:g})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="jobs at once (default 4 on the GPU, exclusive ones alone; 2 in a dry run)",
    )
    parser.add_argument(
        "--rows",
        action="append",
        metavar="ROW",
        help="only this row and the jobs it reads (repeatable; without it: the performance run; the "
        "rows the first GPU run passed run only so, as does a rerun of the rows a run failed)",
    )
    parser.add_argument(
        "--inject-hang", metavar="JOB", help="tests only: JOB runs until the deadline kills it"
    )
    parser.add_argument("--environment", type=Path, help=argparse.SUPPRESS)  # the environment job
    parser.add_argument("--largest-micro-batch", type=Path, help=argparse.SUPPRESS)  # the plans job
    parser.add_argument("--advise", type=Path, help=argparse.SUPPRESS)  # the plans job
    parser.add_argument("--kernel-rates", type=Path, help=argparse.SUPPRESS)  # the kernel-rates job
    parser.add_argument("--text-corpus", type=Path, help=argparse.SUPPRESS)  # the text row's helper
    return parser.parse_args(argv)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup = Setup(args.dry_run, args.out.resolve(), 0.0, args.inject_hang)
    if args.environment is not None:  # a helper process of the check (catalog.py's jobs)
        args.environment.write_text(json.dumps(environment(setup)))
        return 0
    if args.kernel_rates is not None:
        args.kernel_rates.write_text(json.dumps(measure(args.dry_run), indent=1))
        return 0
    if args.text_corpus is not None:
        make_text_corpus(args.text_corpus, args.text_corpus / "cache")
        return 0
    if args.largest_micro_batch is not None or args.advise is not None:  # the plans job
        if args.largest_micro_batch is not None:
            micro_batch = largest_fitting_micro_batch(setup, limit_base(setup))
            args.largest_micro_batch.write_text(json.dumps({"micro_batch": micro_batch}))
        if args.advise is not None:
            args.advise.write_text(json.dumps(advisor_predictions(setup)))
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():  # NVML's count: no CUDA context in this process
            print("error: no CUDA device visible; --dry-run runs the sequence on CPU", file=sys.stderr)
            return 2
    deadline = (
        args.deadline if args.deadline is not None else (DRY_DEADLINE_S if args.dry_run else DEADLINE_S)
    )
    setup.deadline = time.monotonic() + deadline
    bundle = args.bundle.resolve() if args.bundle is not None else None
    if bundle is not None and bundle == setup.out:
        print(
            "error: --bundle must be another folder than --out: it holds the three files only",
            file=sys.stderr,
        )
        return 2
    try:
        rows = chosen_rows(args.rows, every=args.dry_run)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run_check(setup, args.jobs or (2 if args.dry_run else WORKERS), bundle, rows)


def run_check(setup: Setup, workers: int, bundle: Path | None, rows: list[RowSpec]) -> int:
    """The rows in order, each written as soon as its jobs are judged; 0 when every row passed
    (or informs, or needs CUDA in a dry run) and the deadline cut none."""
    report = Report(setup.out, setup.dry_run, bundle)
    (setup.out / "jobs").mkdir(exist_ok=True)
    scheduler = Scheduler(setup, jobs_for(rows, all_jobs(setup)), workers)
    for spec in rows:
        timed(report, spec.name, lambda spec=spec: evaluate(setup, scheduler, spec))
    scheduler.thread.join()
    print(f"results: {setup.out / 'results.md'}", flush=True)
    cut = [r.check for r in report.rows if r.note.startswith(NOT_REACHED)]
    if cut:
        print(f"the deadline cut {len(cut)} rows: {', '.join(cut)}", flush=True)
    return 0 if not cut and all(r.status in ("pass", "info", "skip") for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
