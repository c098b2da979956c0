"""Memory that creeps (trainer/telemetry/creep.py): the slope of the per-window peak and when it reaches the limit."""

from __future__ import annotations

from trainer.telemetry.creep import creep_line, find_creep

MIB = 1 / 1024  # GiB


def records(per_step_mib: float, noise: list[float] | None = None, figure: str = "peak_rss") -> list[dict]:
    """Two ranks' windows at steps 1..8; rank 1 grows by `per_step_mib` from 1 GiB."""
    noise = noise or [0.0] * 8
    return [
        {
            "step": step,
            f"memory/rank0/{figure}_gib": 1.0,
            f"memory/rank1/{figure}_gib": 1.0 + (step * per_step_mib + noise[step - 1]) * MIB,
        }
        for step in range(1, 9)
    ]


def test_a_leak_is_its_growth_per_step_and_the_step_it_reaches_the_limit() -> None:
    creep = find_creep(records(8.0), after=1, limit_gib=0.5, planned_gib=0.25, device_kind="cpu")
    assert creep is not None
    # the later half of the windows after step 1: steps 5-8
    assert (creep["rank"], creep["figure"], creep["first_step"], creep["at_step"]) == (1, "peak_rss", 5, 8)
    assert abs(creep["gib_per_step"] - 8 * MIB) < 1e-12
    # CPU: the room the plan's peak leaves under the cap, 0.25 GiB = 32 steps of 8 MiB, from step 5
    assert creep["reaches_limit_at_step"] == 5 + 32
    assert creep_line(creep).startswith("memory creeps on rank 1: peak_rss grows 8.00 MiB per step")


def test_on_a_gpu_the_growth_runs_on_from_the_last_peak() -> None:
    creep = find_creep(records(8.0, figure="peak_allocated"), 1, 1.0 + 64 * MIB + 16 * MIB, None, "cuda")
    assert creep is not None and creep["reaches_limit_at_step"] == 8 + 2


def test_flat_or_noisy_peaks_are_no_creep() -> None:
    assert find_creep(records(0.0), 1, 0.5, 0.25, "cpu") is None
    assert find_creep(records(0.5), 1, 0.5, 0.25, "cpu") is None  # below 1 MiB per step
    wobble = [0.0, 3.0, -3.0, 3.0, -3.0, 3.0, -3.0, 3.0]
    assert find_creep(records(2.0, wobble), 1, 0.5, 0.25, "cpu") is None  # not rising window after window
    settling = [0.0, 30.0, 50.0, 60.0, 60.0, 60.0, 60.0, 60.0]  # the process's own growth, then flat
    assert find_creep(records(0.0, settling), 1, 0.5, 0.25, "cpu") is None


def test_a_host_peak_that_grows_less_than_4_mib_a_step_is_the_process_own() -> None:
    """A normal 6-step CPU run's host peak rose 2.5 MiB a step over its later windows: no creep on a
    CPU; the same rise of the allocator's peak on a GPU counts tensors alone and is one."""
    six = [r for r in records(2.5) if r["step"] <= 6]
    assert find_creep(six, 1, 0.5, 0.25, "cpu") is None
    assert find_creep(records(2.5), 1, 0.5, 0.25, "cpu") is None
    gpu = find_creep(records(2.5, figure="peak_allocated"), 1, 2.0, None, "cuda")
    assert gpu is not None and abs(gpu["gib_per_step"] - 2.5 * MIB) < 1e-12
    # 4 MiB a step and more is a creep on a CPU: steps 4-6 of a 6-step run are judged
    creep = find_creep([r for r in records(4.5) if r["step"] <= 6], 1, 0.5, 0.25, "cpu")
    assert creep is not None and (creep["first_step"], creep["at_step"]) == (4, 6)


def test_one_jump_among_flat_windows_is_no_creep() -> None:
    """A cache filled once between two late windows: rising window after window, with a slope of 8.1 MiB
    a step over steps 5-8, but two of its three rises are 0.2 MiB."""
    jump = [0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 20.2, 20.4]
    assert find_creep(records(0.0, jump), 1, 0.5, 0.25, "cpu") is None


def two_creeping(per_step_mib: dict[int, float], base_gib: dict[int, float], figure: str) -> list[dict]:
    """Three ranks' windows at steps 1..8: each of `per_step_mib`'s ranks grows by its MiB per step from
    its `base_gib`, the other one (rank 0) stays flat."""
    return [
        {"step": step, f"memory/rank0/{figure}_gib": 1.0}
        | {
            f"memory/rank{rank}/{figure}_gib": base_gib[rank] + step * mib * MIB
            for rank, mib in per_step_mib.items()
        }
        for step in range(1, 9)
    ]


def test_of_two_creeping_ranks_the_faster_is_the_worst_whichever_comes_first() -> None:
    """Ranks 1 and 2 both creep (8 and 5 MiB a step): the one reported is the one growing faster, rank 1
    here and rank 2 with the rates swapped; its own figures (slope, last window) are the ones reported,
    whatever order the ranks' keys come in (the faster's first or last in a record)."""
    for fast, rates in ((1, {2: 5.0, 1: 8.0}), (1, {1: 8.0, 2: 5.0}), (2, {1: 5.0, 2: 8.0})):
        creep = find_creep(two_creeping(rates, {1: 1.0, 2: 1.0}, "peak_rss"), 1, 0.5, 0.25, "cpu")
        assert creep is not None and creep["rank"] == fast
        assert abs(creep["gib_per_step"] - 8 * MIB) < 1e-12 and creep["last_gib"] == 1.0 + 8 * 8 * MIB
        assert creep["reaches_limit_at_step"] == 5 + 32  # 0.25 GiB of room at 8 MiB a step, from step 5
        assert creep_line(creep).startswith(f"memory creeps on rank {fast}: peak_rss grows 8.00 MiB per step")
    # On a GPU too: the faster, its growth run on from its own last peak (the slower's is 1.0391 GiB)
    creep = find_creep(
        two_creeping({2: 5.0, 1: 8.0}, {1: 1.0, 2: 1.0}, "peak_allocated"), 1, 2.0, None, "cuda"
    )
    assert creep is not None and (creep["rank"], creep["last_gib"]) == (1, 1.0 + 64 * MIB)
    assert creep["reaches_limit_at_step"] == 8 + 120  # (2.0 - 1.0625) GiB = 960 MiB at 8 MiB a step
