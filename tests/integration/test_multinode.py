"""Two nodes on one host, as `nodes=2 node_rank=0|1 rdzv_endpoint=...` runs them: each node's job
starts its rank with torch's elastic launcher and both meet at one c10d rendezvous.

Each node process is pinned to a core of its own (taskset), as a node has its own cores: its
rank then runs one thread, like each of the 1-node 2-rank reference's ranks.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, Run, free_port, run_trainer, trainer_args

STEPS = ("steps=8", "save=off")


def run_two_nodes(out: Path, *overrides: str, timeout: float = 240) -> list[Run]:
    """Both node processes of one job, started together; their Runs in node order."""
    common = [
        *TINY,
        *STEPS,
        "nproc=1",
        "nodes=2",
        f"rdzv_endpoint=localhost:{free_port()}",
        *overrides,
        f"hydra.run.dir={out}",
    ]
    procs = [
        subprocess.Popen(
            ["taskset", "-c", str(node), *trainer_args(*common, f"node_rank={node}")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = [proc.communicate(timeout=timeout) for proc in procs]
    return [Run(proc.returncode, stdout, stderr, out) for proc, (stdout, stderr) in zip(procs, outputs)]


@pytest.mark.timeout(400)
def test_two_nodes_train_like_one_node_with_two_ranks(tmp_path: Path) -> None:
    node0, node1 = run_two_nodes(tmp_path / "two_nodes")
    assert (node0.returncode, node1.returncode) == (0, 0), node0.stderr[-2000:] + node1.stderr[-2000:]
    one_node = run_trainer(tmp_path / "one_node", *TINY, *STEPS, "nproc=2")
    assert len(node0.losses) == 8
    assert node0.losses == one_node.losses  # the same global batch split over the same 2 ranks
    assert (node0.summary["status"], node0.summary["world_size"]) == ("ok", 2)
    assert "outputs:" in node0.stdout and "outputs:" not in node1.stdout  # node 0 records the job


@pytest.mark.slow  # the default tier's time (README)
@pytest.mark.timeout(300)
def test_a_killed_rank_ends_both_nodes_crashed_naming_rank_and_node(tmp_path: Path) -> None:
    node0, node1 = run_two_nodes(tmp_path / "killed", "fault.kind=kill", "fault.step=3", "fault.rank=1")
    # c10d's rendezvous decides which node holds global rank 1 (it orders the nodes by host name and
    # process id); the node that saw its rank killed said so in its record.
    killed = [
        json.loads(p.read_text()) for p in sorted((tmp_path / "killed" / "failures").glob("node*.json"))
    ]
    node = next(r["node"] for r in killed if r["exitcode"] == -9 and r["rank"] == 1)
    expected = f"error: rank 1 on node {node} failed: killed by SIGKILL (exit code -9)"
    for run in (node0, node1):
        assert run.returncode == 1
        assert run.stderr.strip().splitlines()[-1] == expected, run.stderr[-2000:]
    summary = node0.summary
    assert (summary["status"], summary["failed_rank"], summary["failed_node"]) == ("crashed", 1, node)
    assert summary["steps_done"] == 2
