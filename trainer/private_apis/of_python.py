"""The Python standard library's private API (the table in trainer/private_apis/__init__.py); checked against
Python 3.10.13, 3.11.7 (the suite's), 3.12.1 and 3.13.0, whose multiprocessing/forkserver.py are alike here."""

from __future__ import annotations

import os
from multiprocessing import forkserver


def close_inherited_fork_server_alive_fd() -> bool:
    """In a process the fork server forked, close its copy of the write end of the server's "alive" pipe
    (`_serve_one` stores it as `forkserver._forkserver._forkserver_alive_fd`); whether there was one.
    Nothing to close in a process no fork server forked (`get_inherited_fds()` is None there)."""
    server = forkserver._forkserver
    if forkserver.get_inherited_fds() is None or server._forkserver_alive_fd is None:
        return False
    os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None  # not a closed number left behind, which a later file reuses
    return True
