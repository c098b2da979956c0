"""Fault drills: every everyday fault, done to a real 2-rank CPU job, and whether anything was lost.

Each drill runs `python -m trainer` as a user does, does the fault to it (a signal, a host too
small, a bad token file, a broken or unwritable save, W&B's service killed, a rank killed, a
kill during a save or during a background write, an elastic restart, an out-of-memory rank, a
non-finite loss), reads back what the job reported (exit status, summary.json, its one error line)
and checks that nothing was lost: the losses after a resume equal an uninterrupted run's bit for
bit, the saves left are whole, the local files are complete, and no process of any of its jobs
(each marked with its own ZEROLAB_JOB_ID, trainer/faults/leftovers.py) is alive 30 s after the job.

    .venv/bin/python checks/fault_drills.py            # every drill, a few minutes here
    .venv/bin/python checks/fault_drills.py --only sigint wandb

Prints one Markdown table (docs/faults.md carries it) and exits 1 when a drill lost something.
Jobs run with save=off except where saves are the point; everything is written under a
temporary directory that is removed at the end (--keep keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from checks.gpucheck.runner import (  # noqa: E402
    kill_group,
    left_running,
    session_env,
    start_session,
    trainer_command,
)
from trainer.faults.leftovers import JOB_MARKER, describe, marked  # noqa: E402
from trainer.saves.dcp import list_saves, save_step  # noqa: E402
from trainer.saves.integrity import save_problem  # noqa: E402

TINY = (
    "model=tiny",
    "device=cpu",
    "seq_len=64",
    "micro_batch=2",
    "log_every=1",
    "precision=fp32",
    "optim.warmup_steps=2",
)
STEPS = 16
SAVING = ("nproc=2", f"steps={STEPS}", "save.every=4", "save.keep=3", "logger=none")
NO_SAVE = ("nproc=2", f"steps={STEPS}", "save=off", "logger=none")
REACH_STEP_S = 300  # how long a drill waits for its job to reach the step its fault is done at
LEFT_WITHIN_S = 30  # every process of a drill's job must be gone this long after the job ended
LEFT: list[str] = []
"""The processes of the current drill's jobs alive LEFT_WITHIN_S after their job ended (found by ZEROLAB_JOB_ID)."""


def marked_session() -> dict[str, str]:
    """The environment of one job: this one, the repository first on the path, a fresh mark."""
    return session_env(**{JOB_MARKER: uuid.uuid4().hex})


def note_leftovers(env: dict[str, str]) -> None:
    """Wait up to LEFT_WITHIN_S for the job's processes to be gone; note those that are not."""
    deadline = time.monotonic() + LEFT_WITHIN_S
    while (left := marked(env[JOB_MARKER])) and time.monotonic() < deadline:
        time.sleep(0.5)
    LEFT.extend(f"{describe(p)} (pid {p.pid})" for p in left)


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path
    seconds: float = 0.0
    left_running: int = 0
    """Live processes of the job's session 5 s after it exited."""

    @property
    def summary(self) -> dict[str, Any]:
        path = self.out_dir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @property
    def losses(self) -> list[float]:
        path = self.out_dir / "metrics.jsonl"
        return (
            [json.loads(line)["loss/train"] for line in path.read_text().splitlines()]
            if path.exists()
            else []
        )

    @property
    def lines(self) -> list[str]:
        """Every non-blank stderr line."""
        return [line for line in self.stderr.splitlines() if line.strip()]

    def ended(self, returncode: int, status: str | None) -> bool:
        """Whether the job ended as the table reports it must: this exit status and summary status."""
        return self.returncode == returncode and self.summary.get("status") == status

    @property
    def line(self) -> str:
        """The job's last stderr line: its one-line account of a fault."""
        return self.lines[-1] if self.lines else ""


@dataclass
class Row:
    fault: str
    reported: str
    nothing_lost: bool
    how: str


def code(text: str, limit: int) -> str:
    """A Markdown code span of at most `limit` characters of `text` (backticks inside dropped)."""
    text = text.replace("`", "")
    return f"`{text[:limit]}{'...' if len(text) > limit else ''}`"


def trainer_args(out_dir: Path, *overrides: str) -> list[str]:
    return trainer_command(*TINY, *overrides, f"hydra.run.dir={out_dir}")


def run(out_dir: Path, *overrides: str) -> Job:
    """One job to its end (600 s at most: then it is killed with its fork server and ranks)."""
    start, env = time.monotonic(), marked_session()
    proc = start_session(
        trainer_args(out_dir, *overrides), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
    seconds = time.monotonic() - start
    note_leftovers(env)
    return Job(proc.returncode, stdout, stderr, out_dir, seconds)


def run_and_do(
    out_dir: Path,
    *overrides: str,
    at_step: int,
    action: Callable[[subprocess.Popen[str], threading.Event], None],
) -> Job:
    """Start a job in a session of its own, `action` once metrics.jsonl has `at_step` records."""
    env = marked_session()
    proc = start_session(
        trainer_args(out_dir, *overrides), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stdout: list[str] = []
    stopping = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            stdout.append(line)
            if "stop after their current step" in line:
                stopping.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start = time.monotonic()
    if reached_step(out_dir / "metrics.jsonl", at_step, proc, REACH_STEP_S):
        action(proc, stopping)
    else:  # stuck before the fault: end it, and the drill reports what it got (not nothing lost)
        kill_group(proc)
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        kill_group(proc)
    seconds = time.monotonic() - start
    reader.join(10)
    time.sleep(5)
    left = left_running(proc.pid)
    note_leftovers(env)
    return Job(proc.returncode, "".join(stdout), stderr, out_dir, seconds, left)


def reached_step(metrics: Path, at_step: int, proc: subprocess.Popen[str], deadline_s: float) -> bool:
    """Wait until metrics.jsonl has `at_step` records: False when the job ended first or the
    deadline passed."""
    deadline = time.monotonic() + deadline_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= at_step):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def saves(run_dir: Path) -> list[int]:
    return [save_step(p) for p in list_saves(run_dir)]


def all_whole(run_dir: Path) -> bool:
    return all(save_problem(p) is None for p in list_saves(run_dir))


# ----------------------------------------------------------------------------- the drills


class Drills:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._reference: list[float] | None = None

    def day(self, name: str) -> Path:
        """A run directory in Hydra's <root>/<date>/<time> layout, where resume=true looks."""
        return self.root / name / "runs" / "day"

    @property
    def reference(self) -> list[float]:
        """The losses of the uninterrupted run every resumed drill is compared with."""
        if self._reference is None:
            self._reference = run(self.root / "reference", *SAVING).losses
        return self._reference

    def resumed_equal(self, job: Job, day: Path) -> tuple[bool, str]:
        resumed = run(day / "t2", *SAVING, "resume=true")
        equal = resumed.returncode == 0 and job.losses == self.reference
        return (
            equal,
            f"resume=true: {len(job.losses)} steps, losses {'bitwise equal' if equal else 'DIFFER'} to an uninterrupted run",
        )

    def signal_drill(self, name: str, sig: signal.Signals, group: bool, returncode: int, status: str) -> Row:
        day = self.day(name)
        send = (lambda p: os.killpg(p.pid, sig)) if group else (lambda p: os.kill(p.pid, sig))
        job = run_and_do(day / "t1", *SAVING, "save.every=1000", at_step=3, action=lambda p, _: send(p))
        step = job.summary.get("stopped_step")
        reported = f"exit {job.returncode}, {job.summary.get('status')} after step {step}, save at {saves(job.out_dir)}, {job.seconds:.1f} s"
        ended = job.ended(returncode, status)  # read before the resume rewrites summary.json
        equal, how = self.resumed_equal(job, day)
        ok = ended and equal and job.left_running == 0 and "Traceback" not in job.stderr
        return Row(
            f"{sig.name} ({'Ctrl-C, process group' if group else 'job process only: a scheduler'})",
            reported,
            ok,
            f"{how}; {job.left_running} processes left",
        )

    def sigint(self) -> Row:
        return self.signal_drill("sigint", signal.SIGINT, group=True, returncode=130, status="interrupted")

    def sigterm(self) -> Row:
        return self.signal_drill("sigterm", signal.SIGTERM, group=False, returncode=143, status="preempted")

    def sigint_twice(self) -> Row:
        def twice(proc: subprocess.Popen[str], stopping: threading.Event) -> None:
            os.killpg(proc.pid, signal.SIGINT)
            stopping.wait(60)
            os.killpg(proc.pid, signal.SIGINT)

        job = run_and_do(self.day("twice") / "t1", *SAVING, "save.every=1000", at_step=3, action=twice)
        reported = (
            f"exit {job.returncode}, {job.summary.get('status')}, {job.seconds:.1f} s after the second Ctrl-C"
        )
        ok = job.ended(130, "interrupted") and job.left_running == 0 and list_saves(job.out_dir) == []
        return Row(
            "Ctrl-C twice (during the stop's save)",
            reported,
            ok,
            f"{job.left_running} processes left, no partial save: {list_saves(job.out_dir) == []}",
        )

    def host_too_small(self) -> Row:
        job = run(self.root / "n64" / "run", "nproc=64", "logger=none")
        started = (job.out_dir / "metrics.jsonl").exists()
        return Row(
            "nproc=64 device=cpu on this host",
            f"exit {job.returncode} in {job.seconds:.1f} s: {code(job.line, 160)}",
            job.returncode == 2 and not started,
            "no rank started",
        )

    def token_file(self) -> Row:
        text = self.root / "corpus.txt"
        text.write_text("plain text, not token ids\n" * 50)
        job = run(self.root / "tokens" / "run", "nproc=2", "logger=none", "data=tokens", f"data.path={text}")
        one_line = len(job.lines) == 1
        line = job.line.replace(str(text), "corpus.txt")
        return Row(
            "a text file as data.path",
            f"exit {job.returncode}: {code(line, 90)}",
            job.returncode == 2 and one_line,
            "refused before any rank started",
        )

    def broken_save(self) -> Row:
        day = self.day("broken")
        job = run(day / "t1", *SAVING)
        newest = list_saves(job.out_dir)[-1]
        shard = newest / "__1_0.distcp"
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size // 2)
        resumed = run(day / "t2", *SAVING, "resume=true")
        skipped = next(
            (line for line in resumed.stdout.splitlines() if line.startswith("resume: skipping")), ""
        )
        equal = (
            job.ended(0, "ok")
            and resumed.ended(0, "ok")
            and job.losses == self.reference
            and all_whole(job.out_dir)
        )
        reported = f"{code(skipped.replace(str(newest.parent), '...'), 120)}, then resumed from step {save_step(list_saves(job.out_dir)[-2])}"
        return Row(
            "a truncated shard in the newest save",
            reported,
            equal and bool(skipped),
            "losses after the resume bitwise equal; every save whole",
        )

    def unwritable_save(self) -> Row:
        out_dir = self.root / "unwritable" / "run"
        (out_dir / "checkpoints").mkdir(parents=True)
        full = mount_small_tmpfs(self.root / "small", megabytes=16)  # room for one tiny save, not two
        if full is not None:
            shutil.rmtree(out_dir / "checkpoints")
            (out_dir / "checkpoints").symlink_to(full)
            what = "no space left (a 16 MiB file system)"
        else:  # not allowed to mount here: a path that cannot be created instead
            (out_dir / "checkpoints" / ".tmp_step_00000008").write_text("")
            what = "a path that cannot be created"
        try:
            job = run(out_dir, *SAVING)
            kept = saves(out_dir)
            ok = job.ended(1, "crashed") and kept == [4] and all_whole(out_dir) and "SaveError" in job.line
            return Row(
                f"a save that cannot be written: {what}",
                f"exit {job.returncode}, crashed: {code(job.line.split('SaveError: ')[-1], 140)}",
                ok,
                f"saves left {kept}, whole",
            )
        finally:
            if full is not None:
                subprocess.run(["umount", str(full)], check=False)

    def wandb_killed(self) -> Row:
        def kill_service(proc: subprocess.Popen[str], _: threading.Event) -> None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                if child.name().startswith("wandb"):
                    child.kill()

        job = run_and_do(
            self.root / "wandb" / "run", *NO_SAVE[:-1], "logger=wandb", at_step=3, action=kill_service
        )
        steps = len(job.losses)
        ok = job.ended(0, "ok") and steps == STEPS and len(job.lines) == 1
        return Row(
            "W&B's service killed mid-run",
            f"exit {job.returncode}, ok, one line: {code(job.line, 100)}",
            ok,
            f"metrics.jsonl has all {steps} steps, summary.json ok",
        )

    def rank_killed(self) -> Row:
        day = self.day("kill")
        job = run(day / "t1", *SAVING, "fault.kind=kill", "fault.step=7", "fault.rank=1")
        status = job.summary.get("status")  # before the resume rewrites summary.json
        ended = job.ended(1, "crashed")
        equal, how = self.resumed_equal(job, day)
        return Row(
            "rank 1 SIGKILLed at step 7",
            f"exit {job.returncode}, {status}: {code(job.line, 90)}",
            equal and ended,
            how,
        )

    def kill_during_save(self) -> Row:
        day = self.day("killsave")
        job = run(day / "t1", *SAVING, "fault.kind=kill_during_save", "fault.step=8", "fault.rank=0")
        kept, status = saves(job.out_dir), job.summary.get("status")  # before the resume
        ended = job.ended(1, "crashed")
        equal, how = self.resumed_equal(job, day)
        ok = equal and kept == [4] and ended
        return Row(
            "rank 0 SIGKILLed inside the step-8 save",
            f"exit {job.returncode}, {status}, saves left {kept}",
            ok,
            how,
        )

    def kill_during_background_save(self) -> Row:
        """SIGKILL rank 0 while its save process writes the step-8 save (save.async_mode=process)."""
        day = self.day("killasync")
        fault = ("fault.kind=kill_during_save", "fault.step=8", "fault.rank=0")
        job = run(day / "t1", *SAVING, "save.async_mode=process", *fault)
        kept, status = saves(job.out_dir), job.summary.get("status")  # before the resume
        whole, ended = all_whole(job.out_dir), job.ended(1, "crashed")
        equal, how = self.resumed_equal(job, day)
        return Row(
            "rank 0 SIGKILLed during the step-8 background write (save.async_mode=process)",
            f"exit {job.returncode}, {status}, saves listed {kept}, every one whole: {whole}",
            equal and kept == [4] and whole and ended,
            how,
        )

    def elastic_restart(self) -> Row:
        job = run(
            self.root / "restart" / "run",
            *SAVING,
            "fault.kind=kill",
            "fault.step=7",
            "fault.rank=1",
            "max_restarts=1",
        )
        equal = job.losses == self.reference
        reported = (
            f"exit {job.returncode}, {job.summary.get('status')}, restarts {job.summary.get('restarts')}"
        )
        return Row(
            "rank 1 SIGKILLed, max_restarts=1",
            reported,
            equal and job.ended(0, "ok") and job.summary.get("restarts") == 1,
            f"losses {'bitwise equal' if equal else 'DIFFER'} to an uninterrupted run",
        )

    def oom(self) -> Row:
        capped = (
            "device_memory_gib=0.25",
            "plan.enforce=false",
            "micro_batch=64",
            "seq_len=256",
            "steps=2",
            "nproc=2",
            "save=off",
            "logger=none",
        )
        job = run(self.root / "oom" / "run", *capped)
        s = job.summary
        reported = f"exit {job.returncode}, {s.get('status')} on rank {s.get('failed_rank')} at step {s.get('failed_step')} ({s.get('failed_phase')})"
        return Row(
            "out of memory under device_memory_gib=0.25",
            reported,
            job.ended(1, "oom") and s.get("failed_rank") in (0, 1) and s.get("failed_phase") is not None,
            "a result, not a crash: the sweep goes on",
        )

    def nonfinite(self) -> Row:
        job = run(self.root / "nan" / "run", *SAVING, "fault.kind=nan_loss", "fault.step=6", "fault.rank=1")
        kept = saves(job.out_dir)
        ok = job.ended(1, "diverged") and kept == [4, 5] and job.losses == self.reference[:5]
        return Row(
            "NaN loss on rank 1 at step 6",
            f"exit {job.returncode}, {job.summary.get('status')}: {code(job.line.removeprefix('error: '), 90)}",
            ok,
            f"the last good step saved: saves {kept}",
        )


def mount_small_tmpfs(path: Path, megabytes: int) -> Path | None:
    """A small file system to fill (needs the right to mount: root on Linux); None where not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)], capture_output=True
    )
    return path if proc.returncode == 0 else None


DRILLS = {
    "sigint": Drills.sigint,
    "sigterm": Drills.sigterm,
    "sigint_twice": Drills.sigint_twice,
    "host": Drills.host_too_small,
    "tokens": Drills.token_file,
    "broken_save": Drills.broken_save,
    "unwritable_save": Drills.unwritable_save,
    "wandb": Drills.wandb_killed,
    "rank_kill": Drills.rank_killed,
    "kill_during_save": Drills.kill_during_save,
    "kill_during_async_save": Drills.kill_during_background_save,
    "restart": Drills.elastic_restart,
    "oom": Drills.oom,
    "nonfinite": Drills.nonfinite,
}


def table(rows: list[Row]) -> str:
    lines = ["| fault | what the job reported | nothing lost | checked |", "|---|---|---|---|"]
    lines += [
        f"| {r.fault} | {r.reported} | {'yes' if r.nothing_lost else '**NO**'} | {r.how} |" for r in rows
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(DRILLS), help="run these drills only")
    parser.add_argument("--keep", action="store_true", help="keep the drills' output directories")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    root = Path(tempfile.mkdtemp(prefix="fault_drills_"))
    drills, rows, start = Drills(root), [], time.monotonic()
    try:
        for name in args.only or list(DRILLS):
            LEFT.clear()
            row = DRILLS[name](drills)
            if LEFT:  # a process of one of its jobs outlived it: something was left behind
                row.nothing_lost, row.how = False, f"{row.how}; LEFT RUNNING: {', '.join(LEFT)}"
            else:
                row.how = f"{row.how}; no process of its jobs alive {LEFT_WITHIN_S} s after them"
            print(
                f"{name}: {'nothing lost' if row.nothing_lost else 'LOST SOMETHING'} ({time.monotonic() - start:.0f} s so far)",
                flush=True,
            )
            rows.append(row)
    finally:
        if args.keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{table(rows)}\n\n{len(rows)} drills in {time.monotonic() - start:.0f} s on {os.cpu_count()} cores"
    )
    return 0 if all(row.nothing_lost for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
