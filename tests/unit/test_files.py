"""A fresh run in a directory an earlier run wrote keeps that run's metrics.jsonl aside (trainer/files.py)."""

from __future__ import annotations

from pathlib import Path

from trainer.files import set_aside_metrics


def test_an_earlier_runs_metrics_move_to_the_first_free_name(tmp_path: Path) -> None:
    assert set_aside_metrics(tmp_path) is None  # nothing written yet: nothing moved
    for n, text in enumerate(['{"step": 4}\n', '{"step": 8}\n'], start=1):
        (tmp_path / "metrics.jsonl").write_text(text)
        assert set_aside_metrics(tmp_path) == tmp_path / f"metrics.{n}.jsonl"
        assert not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"step": 4}\n'
    assert (tmp_path / "metrics.2.jsonl").read_text() == '{"step": 8}\n'
