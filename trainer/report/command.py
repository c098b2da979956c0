"""`python -m trainer.report`: the report over any run and sweep directories, and publishing its W&B Report.

    python -m trainer.report SWEEP_DIR                 the sweep's report, written into the sweep directory
    python -m trainer.report DIR [DIR ...] [--out OUT] one report over every point of every directory given:
                                                       run directories (one job each) and sweep directories
                                                       together, into OUT (default: a new directory under
                                                       outputs/reports/<date>/<time>/)
    python -m trainer.report --wandb DIR               publish DIR's wandb_report.json (after `wandb sync`
                                                       uploaded the runs) and write its URL into DIR/report.md
    python -m trainer.report ADVICE_DIR [--out OUT]    a mode=advise run across accelerators (advise.accelerators):
                                                       its table again, in report.md, and in W&B with logger=wandb
                                                       (trainer/report/accelerators.py)

A directory that is neither a run nor a sweep is refused in one line naming it (exit 2).
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import replace
from pathlib import Path

from trainer.console import error
from trainer.files import claim_directory
from trainer.report.accelerators import is_accelerator_advice, write_accelerator_report
from trainer.report.markdown import summary_line
from trainer.report.run_dirs import Point, Report, load_point, load_points
from trainer.report.summary_run import mirror_to_wandb, publish_and_link
from trainer.report.sweep_report import write_report, write_sweep_report

REPORTS_DIR = Path("outputs/reports")


def is_run_dir(path: Path) -> bool:
    """One job's directory: Hydra's record of it and what the job wrote."""
    return (path / ".hydra" / "hydra.yaml").is_file() and any(
        (path / name).is_file() for name in ("summary.json", "plan.json")
    )


def is_sweep_dir(path: Path) -> bool:
    return path.is_dir() and bool(load_points(path))


def load_compared(dirs: list[Path]) -> list[Point]:
    """Every point of every directory, in the order given (a sweep's points in job order), numbered afresh."""
    points: list[Point] = []
    for path in dirs:
        points += [load_point(path)] if is_run_dir(path) else load_points(path)
    return [replace(point, num=num) for num, point in enumerate(points)]


def claim_reports_dir(now: datetime.datetime) -> Path:
    """A new outputs/reports/<date>/<time>/ (`_1`, `_2`, ... when one was made in the same second)."""
    return claim_directory(REPORTS_DIR / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S"))


def write_comparison(dirs: list[Path], out: Path | None) -> Report:
    """One sweep directory alone is that sweep's report, written into it (unless --out); anything
    else is a comparison written into `out`."""
    if len(dirs) == 1 and out is None and not is_run_dir(dirs[0]):
        return write_sweep_report(dirs[0])
    out = out if out is not None else claim_reports_dir(datetime.datetime.now())
    out.mkdir(parents=True, exist_ok=True)
    return write_report(out, load_compared(dirs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.report", description="Write the report over run and sweep directories."
    )
    parser.add_argument(
        "dirs", type=Path, nargs="*", metavar="DIR", help="run directories and sweep directories"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write a comparison (default: a new directory under outputs/reports/)",
    )
    parser.add_argument(
        "--wandb",
        type=Path,
        metavar="DIR",
        help="publish DIR/wandb_report.json to W&B and link it from DIR/report.md",
    )
    args = parser.parse_args(argv)
    if args.wandb is not None:
        if not (args.wandb / "wandb_report.json").is_file():
            error(
                f"--wandb {args.wandb}: no wandb_report.json there; write the report first (python -m trainer.report DIR ...)"
            )
        raise SystemExit(0 if publish_and_link(args.wandb) else 1)
    if not args.dirs:
        error("name at least one run or sweep directory (python -m trainer.report DIR [DIR ...])")
    if any(is_accelerator_advice(path) for path in args.dirs):
        others = [str(path) for path in args.dirs if not is_accelerator_advice(path)]
        if others:
            error(
                f"{', '.join(others)}: not a mode=advise run across accelerators; report those apart from "
                "the advice runs"
            )
        write_accelerator_report(args.dirs, args.out or claim_reports_dir(datetime.datetime.now()))
        return
    for path in args.dirs:
        if not (is_run_dir(path) or is_sweep_dir(path)):
            error(
                f"{path} is neither a run directory (.hydra/ and summary.json) nor a sweep directory (point directories with .hydra/)"
            )
    report = write_comparison(args.dirs, args.out)
    print(summary_line(report), flush=True)
    mirror_to_wandb(report)
