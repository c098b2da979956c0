"""trainer/console.py: the one line of an error that zerolab prints."""

from __future__ import annotations

from trainer.console import first_line, one_line


def test_first_line_is_the_first_non_blank_line_stripped() -> None:
    assert first_line("\n  \n  RuntimeError: boom  \nTraceback ...\n") == "RuntimeError: boom"
    assert first_line({"message": "ValueError: bad\n  at x"}) == "ValueError: bad"  # torch's error record
    assert first_line("") == "" and first_line({}) == ""


def test_one_line_names_the_exception_type() -> None:
    assert one_line(RuntimeError("can't allocate memory\nmore")) == "RuntimeError: can't allocate memory"
    assert one_line(MemoryError()) == "MemoryError"
