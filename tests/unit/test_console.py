"""trainer/console.py: the one line of an error or a warning that zerolab prints."""

from __future__ import annotations

import io

import pytest

from trainer.console import error, first_line, one_line, say, warn


def test_first_line_is_the_first_non_blank_line_stripped() -> None:
    assert first_line("\n  \n  RuntimeError: boom  \nTraceback ...\n") == "RuntimeError: boom"
    assert first_line({"message": "ValueError: bad\n  at x"}) == "ValueError: bad"  # torch's error record
    assert first_line("") == "" and first_line({}) == ""


def test_one_line_names_the_exception_type() -> None:
    assert one_line(RuntimeError("can't allocate memory\nmore")) == "RuntimeError: can't allocate memory"
    assert one_line(MemoryError()) == "MemoryError"


def test_error_says_one_line_on_stderr_and_exits_with_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        error("zero=stage5 is not an option")
    assert exited.value.code == 2  # bad input, before any rank starts
    with pytest.raises(SystemExit) as exited:
        error("the sweep stops here", 1)
    assert exited.value.code == 1
    assert capsys.readouterr() == ("", "error: zero=stage5 is not an option\nerror: the sweep stops here\n")


def test_warnings_and_stops_have_their_own_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    plan = io.StringIO()
    warn("W&B could not start")
    warn("plan.enforce=false, trying anyway", file=plan)  # the plan's warnings go with the plan
    say("preempted", "SIGTERM again: stopped at once")
    assert (
        capsys.readouterr().err == "warning: W&B could not start\npreempted: SIGTERM again: stopped at once\n"
    )
    assert plan.getvalue() == "warning: plan.enforce=false, trying anyway\n"
