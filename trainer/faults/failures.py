"""Out of memory as a result: cap a rank's memory, note where the rank is, record how it failed.

A rank that fails writes `failures/rank{r}.json` in the job's output directory (rank, step,
phase, whether it ran out of memory, the error's line) before it exits non-zero; the job process
(trainer/launch.py) reads these records to end the job as `oom` or `crashed`. The elastic
launcher's own error carries only exit codes and tracebacks, not the step or the phase.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.console import one_line
from trainer.faults.tensor_cap import TensorCap, active_cap
from trainer.telemetry.memory import AT_FAILURE
from trainer.telemetry.snapshot import ACTIVE
from trainer.units import GIB

FAILURES_DIR = "failures"

# What torch's allocators say when an allocation fails: the CPU allocator raises a RuntimeError
# ("DefaultCPUAllocator: can't allocate memory" / "not enough memory"), C++ code that
# allocates with new raises std::bad_alloc, CUDA raises torch.OutOfMemoryError.
OOM_MARKERS = ("can't allocate memory", "not enough memory", "out of memory", "bad_alloc")
# What gloo and NCCL say when the process at the other end of a connection is gone.
# (RendezvousConnectionError: the node hosting the rendezvous store has ended; launch.py.)
LOST_PEER_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "RendezvousConnectionError",
)
LOST_PEER_LINGER_S = 1.0  # ten of the launcher's monitor intervals (trainer/launch.py)


@dataclass
class Position:
    """Where this rank's training is: the optimizer step (1-based, 0 before the first), its phase, the
    transformer block running (None: outside the blocks, the embedding, output head and loss) and the
    micro-batch (0-based) within the step."""

    step: int = 0
    phase: str = "setup"
    block: int | None = None
    micro_batch: int = 0


POSITION = Position()  # one per rank process; the loop moves it, a failure reads it


def mark_phase(step: int, phase: str, micro_batch: int | None = None) -> None:
    """Note the step and phase the loop enters (a few assignments: free on every step)."""
    POSITION.step, POSITION.phase = step, phase
    if micro_batch is not None:
        POSITION.micro_batch = micro_batch
    if phase != "backward":  # backward starts at the loss, outside the blocks, until a block's hook says
        POSITION.block = None


def watch_blocks(blocks: Sequence[nn.Module]) -> None:
    """Let POSITION name the block an out-of-memory failure happened in: a forward pre-hook marks block i
    on entry, the last block's forward hook marks leaving the blocks (the norm, head and loss follow), and
    a hook on each block's output marks block i when its gradient arrives, where the block's backward
    begins. Hooks, not code in the model: the block is the model's, the position is the rank's."""

    def entering(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            POSITION.block = index

        return hook

    def left(index: int, last: bool) -> Callable[..., None]:
        def mark_backward(grad: torch.Tensor) -> None:
            POSITION.block = index

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(mark_backward)
            if last:
                POSITION.block = None

        return hook

    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(entering(index))
        block.register_forward_hook(left(index, last=index == len(blocks) - 1))


def where(record: dict[str, Any]) -> str:
    """A failure record's moment in words: `step 3 (backward, block 1, micro-batch 2)`."""
    if record.get("step") is None:
        return "an unknown step"
    parts = [record["phase"]]
    if record.get("phase") in ("forward", "backward"):
        block = record.get("block")
        parts.append("outside the blocks" if block is None else f"block {block}")
        parts.append(f"micro-batch {record.get('micro_batch', 0)}")
    return f"step {record['step']} ({', '.join(parts)})"


def is_out_of_memory(err: BaseException) -> bool:
    """Whether an exception is an allocation failure (CPU or GPU, or the CPU cap's), by type or by the
    allocator's words."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in OOM_MARKERS)


def apply_memory_cap(cap_gib: float | None, device: torch.device) -> None:
    """Let this rank's tensors hold at most `cap_gib` GiB, the quantity the plan counts.

    GPU: the caching allocator's per-process fraction of the device (the CUDA context is outside
    it, as it is here). CPU: the bytes of live tensor storages, counted op by op and refused past the
    cap with torch.OutOfMemoryError (trainer/faults/tensor_cap.py, which says why not a process limit).
    """
    if cap_gib is None:
        return
    cap = int(cap_gib * GIB)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        return
    TensorCap(cap).__enter__()  # left on for the rank's life; lift_memory_cap ends it on a failure


def lift_memory_cap() -> None:
    """Undo the CPU cap, so that a rank that ran out can still write its record and exit."""
    if (cap := active_cap()) is not None:
        cap.__exit__(None, None, None)


def failure_path(out_dir: Path, rank: int) -> Path:
    return out_dir / FAILURES_DIR / f"rank{rank}.json"


@contextlib.contextmanager
def recording_failures(out_dir: Path, rank: int) -> Iterator[None]:
    """Around a rank's training: on an exception, write the rank's failure record, then re-raise."""
    path = failure_path(out_dir, rank)
    path.unlink(missing_ok=True)  # left by an earlier attempt of an elastic restart: not this one
    try:
        yield
    except Exception as err:
        cap = active_cap()
        lift_memory_cap()
        oom = is_out_of_memory(err)
        record = {
            **asdict(POSITION),
            "rank": rank,
            "oom": oom,
            "message": one_line(err),
            "time": time.time(),  # torch's failure timestamps are whole seconds; see explain()
            "traceback": traceback.format_exc(),  # the console shows one line; the whole story is kept here
            **({"measured_bytes": held_at_failure(cap)} if oom else {}),
        }
        if oom and ACTIVE:  # memory.snapshot: the allocator's history (CUDA) or the held split (CPU)
            record["snapshot"] = str(ACTIVE[0].on_oom(record["measured_bytes"]))
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(record) + "\n")
        if lost_peer(record["message"]):
            # The launcher reports the first rank it sees end, and only that one. A rank that merely
            # lost its peer lingers, so that a peer killed by a signal (it leaves no record, and its
            # exit code is all there is to say) is seen to end first: see explain().
            time.sleep(LOST_PEER_LINGER_S)
        raise


def held_at_failure(cap: TensorCap | None = None) -> dict[str, float]:
    """What this rank's tensors held when it ran out: under the CPU cap, the capped quantity and the cap
    (and what the refused op added), by category where the tensor tracker ran that step (CPU,
    trainer/telemetry/memory.py), else the CUDA allocator's own figures (no split); empty when
    nothing was measured."""
    held: dict[str, float] = dict(AT_FAILURE)
    if cap is not None:
        return {**held, **cap.at_failure()}
    if held:
        return held
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "held": float(torch.cuda.memory_allocated()),
            "reserved": float(torch.cuda.memory_reserved()),
        }
    return {}


def read_failures(out_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's failure record of this job, by rank."""
    records = [json.loads(p.read_text()) for p in sorted((out_dir / FAILURES_DIR).glob("rank*.json"))]
    return {record["rank"]: record for record in records}


def explain(first_rank: int, exitcodes: dict[int, int], out_dir: Path, capped: bool) -> dict[str, Any] | None:
    """The record that explains a failed job, whatever order the launcher saw the ranks end in:
    any rank's out-of-memory record first (its peers then fail on a broken connection, sometimes
    earlier), else the earliest record of a rank that raised something other than a lost peer,
    else a rank killed by a signal (it leaves no record; its peers only lost it).

    A rank killed by SIGKILL while a memory cap is set was the kernel's OOM killer's: out of
    memory, at an unknown step and phase.
    """
    records = read_failures(out_dir)
    oom = [records[rank] for rank in sorted(records) if records[rank]["oom"]]
    if oom:
        return oom[0]
    # Ranks a signal ended leave no record: an abort last (see aborted), the launcher's first failure
    # first among the rest.
    killed = sorted(
        (rank for rank, code in exitcodes.items() if code < 0 and rank not in records),
        key=lambda rank: (exitcodes[rank] == -signal.SIGABRT, rank != first_rank),
    )
    if capped and killed and exitcodes[killed[0]] == -signal.SIGKILL:
        return {
            "rank": killed[0],
            "step": None,
            "phase": None,
            "oom": True,
            "message": "killed by SIGKILL (the kernel's OOM killer)",
        }
    # torch orders failures by whole-second timestamps, so a peer that failed on the broken
    # connection in the same second can be named first; the records' own clock says who began it.
    raised = [record for record in records.values() if not lost_peer(record["message"])]
    if raised:
        return min(raised, key=lambda record: record.get("time", math.inf))
    if killed:
        rank = killed[0]
        return {
            "rank": rank,
            "step": None,
            "phase": None,
            "oom": False,
            "message": killed_by(exitcodes[rank]),
        }
    return min(records.values(), key=lambda record: record.get("time", math.inf)) if records else None


def lost_peer(cause: str) -> bool:
    """Whether a rank failed only because another rank's process went away (its connection broke)."""
    return any(marker in cause for marker in LOST_PEER_MARKERS)


def aborted(cause: str) -> bool:
    """Whether a rank died by SIGABRT without a record of its own: a consequence of a lost peer too
    when the broken connection is met where no exception can reach Python (a communication library's
    own thread ends the process in std::terminate). Seen here: gloo, in a loaded CI run, on the
    peer of a rank killed by SIGKILL."""
    return cause == killed_by(-signal.SIGABRT)


def weakness(cause: str) -> int:
    """How little a failure's cause says about what began it, for choosing among the ranks' and the
    nodes' failures: 0 a rank's own exception or a signal from outside, 1 an abort (aborted), 2 a
    lost peer (lost_peer)."""
    return 2 if lost_peer(cause) else 1 if aborted(cause) else 0


def killed_by(exitcode: int) -> str:
    """A rank's cause of death when a signal ended it (a negative exit code)."""
    return f"killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
