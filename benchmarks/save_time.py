"""How long a synchronous save takes: trainer.saves.dcp.save_training_state of model=tiny, in process.

    python benchmarks/save_time.py [--saves 5] [--max-median-s 0.5]

One rank (a one-rank gloo group in this process) builds model=tiny (918,656 parameters), takes
one optimizer step so that AdamW's state exists, and saves it --saves times, each into a fresh
temporary directory. Prints every save's seconds, the median, the noise (slowest over fastest,
less 1) and the bytes written. The first save also pays DCP's one-time set-up and is reported
apart from the median of the rest.

Pass rule (docs/resume.md: "about 0.2 s"): the median of the saves after the first within
--max-median-s (0.5 s: the figure with room for a shared machine's load); exits 1 when over.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def save_seconds(saves: int) -> tuple[list[float], int]:
    """Seconds of each save, and the bytes one save writes."""
    import torch.distributed as dist

    from tests.helpers import WORLD, run_steps, tiny_config
    from trainer.config import TrainConfig, from_plain, to_plain
    from trainer.rank.loop import build_trainee
    from trainer.saves.dcp import Progress, SaveSpec, save_training_state

    plain = to_plain(tiny_config())
    plain["model"] = to_plain(TrainConfig())[
        "model"
    ]  # the model=tiny preset, not the unit tests' smaller one
    config = from_plain(plain)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainee = build_trainee(config, WORLD)
        run_steps(trainee, config, 1, 1)  # AdamW's state exists from the first step
        seconds, size = [], 0
        for step in range(1, saves + 1):
            with tempfile.TemporaryDirectory() as out:
                start = time.perf_counter()
                save_training_state(trainee, SaveSpec.of(config), WORLD, Path(out), Progress(step=step))
                seconds.append(time.perf_counter() - start)
                size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
        return seconds, size
    finally:
        dist.destroy_process_group()


def too_slow(seconds: list[float], max_median_s: float) -> bool:
    """The pass rule: the median of the saves after the first above the ceiling."""
    return statistics.median(seconds[1:]) > max_median_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--max-median-s", type=float, default=0.5)
    args = parser.parse_args()
    if args.saves < 2:
        parser.error("--saves must be at least 2: the first save is reported apart")
    seconds, size = save_seconds(args.saves)
    rest = seconds[1:]
    print(f"saves (s): {', '.join(f'{s:.3f}' for s in seconds)}; {size:,} bytes each")
    print(
        f"first {seconds[0]:.3f} s; the rest: median {statistics.median(rest):.3f} s, "
        f"noise {max(rest) / min(rest) - 1:.0%} (ceiling {args.max_median_s:g} s)"
    )
    return 1 if too_slow(seconds, args.max_median_s) else 0


if __name__ == "__main__":
    sys.exit(main())
