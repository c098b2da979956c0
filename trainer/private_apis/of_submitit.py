"""submitit's private API (the table in trainer/private_apis/__init__.py); checked against submitit 1.5.4."""

from __future__ import annotations

import signal


def requeue_signal() -> signal.Signals:
    """The signal submitit's preemption handler (checkpoint and requeue) is installed for."""
    import submitit

    return submitit.JobEnvironment._usr_sig()
