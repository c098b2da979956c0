"""trainer/jsonl.py: one policy for torn lines, wherever a JSON-lines file is read."""

from __future__ import annotations

from pathlib import Path

from trainer.jsonl import parse_line, read_jsonl


def test_a_torn_or_blank_line_is_not_a_record_wherever_it_stands(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    # A rank killed mid-write leaves `{"step": 3, "lo`; its restarted successor appends after it.
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo{"step": 3}\n{"step": 4}\n{"step": 5, "lo')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 4}]
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_parse_line_takes_text_and_bytes() -> None:
    assert parse_line(b'{"step": 1, "loss/train": NaN}\n')["step"] == 1
    assert (parse_line(""), parse_line(b"\xff"), parse_line('{"step": ')) == (None, None, None)
