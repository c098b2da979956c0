"""A warm process, one per test worker, that forks each `python -m trainer` job the tests run.

Why: a job process spends about 2 of its 7-8 CPU-seconds (a tiny 2-rank step) starting Python and
importing torch, Hydra and the trainer before it reads its command line; the suite starts a few
hundred. This server imports them once and forks a child per job that then runs `python -m trainer`
exactly as the interpreter's `-m` would (runpy, the job's argv, environment, working directory and
stdout/stderr), and reports the child's exit status as a process's. What the child inherits is what
a fresh interpreter would have after the same imports; nothing else runs here (no thread, no device,
no job), so the fork is as clean as the fork server's (trainer/rank/main.py). Python's multiprocessing
has no way to hand a pre-imported interpreter a new `-m` command line, hence this small server.

A job is sent here only when its environment differs from this server's in keys the trainer reads at
run time (RUNTIME_ENV_PREFIXES); anything torch or OpenMP reads when imported (OMP_*, TORCH_*, ...)
would already be fixed, so such a job starts a real process instead (tests/helpers.py `run_command`).
The command itself, signals, torchrun and the README's commands are still run as real processes by
the tests that are about them.

    python -m tests.job_zygote SOCKET_PATH    (its client, JobZygote below, starts it)
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

RUNTIME_ENV_PREFIXES = ("ZEROLAB_", "WANDB_", "HYDRA_", "PYTEST_")
"""Environment keys a job may set differently from the server's: read by the trainer and wandb when
the job runs, never when imported (wandb is not imported here); and pytest's own, which names the
test running now and nothing reads."""

STATUS = struct.Struct("q")


def warm_imports() -> None:
    """What `python -m trainer` imports before it runs a job (trainer/__main__.py and the launcher)."""
    import hydra  # noqa: F401

    import trainer.cli  # noqa: F401
    import trainer.cluster  # noqa: F401
    import trainer.job  # noqa: F401
    import trainer.launch  # noqa: F401


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One job: {"argv", "env", "cwd"} as JSON (its length first), and the job's stdout and stderr fds."""
    (size,) = STATUS.unpack(conn.recv(STATUS.size, socket.MSG_WAITALL))
    data, fds, _, _ = socket.recv_fds(conn, size, 2, socket.MSG_WAITALL)
    return json.loads(data), fds


def serve(path: str) -> tuple[dict, list[int]] | None:
    """Fork a child per request; in the parent, wait for it and send its exit status (as subprocess
    reports it: negative for a signal). Returns the request in the child, which then runs the job."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen()
        print("ready", flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                try:
                    request, fds = recv_request(conn)
                except (OSError, ValueError, struct.error):
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                try:
                    conn.sendall(STATUS.pack(pid))
                    _, status = os.waitpid(pid, 0)
                    conn.sendall(STATUS.pack(os.waitstatus_to_exitcode(status)))
                except OSError:  # the test gave up on it (a timeout): it kills the child itself
                    try:
                        os.waitpid(pid, 0)
                    except ChildProcessError:
                        pass


def become_job(request: dict, fds: list[int]) -> None:
    """In the child: take the job's streams, environment, directory and command line, as its own process would have them."""
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # `python -m` puts the working directory first
    sys.argv = ["-m", *request["argv"]]


# ----------------------------------------------------------------------------- the client


class JobZygote:
    """The client (tests/helpers.py `job_zygote`): one job at a time, as a worker runs its tests."""

    def __init__(self, proc: subprocess.Popen[bytes], path: Path, env: dict[str, str]) -> None:
        self.proc, self.path, self.env = proc, path, env

    @classmethod
    def start(cls) -> JobZygote | None:
        path = Path(tempfile.mkdtemp(prefix="zerolab-zygote-")) / "socket"
        env = dict(os.environ)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.job_zygote", str(path)],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            proc.kill()
            proc.wait()
            return None
        atexit.register(cls.stop, proc, path)
        return cls(proc, path, env)

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], path: Path) -> None:
        proc.kill()
        proc.wait()
        shutil.rmtree(path.parent, ignore_errors=True)

    def takes(self, env: dict[str, str]) -> bool:
        """Whether `env` differs from the server's only where the trainer reads it at run time."""
        prefixes = RUNTIME_ENV_PREFIXES
        differing = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return self.proc.poll() is None and all(k.startswith(prefixes) for k in differing)

    def run(
        self, args: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        request = json.dumps({"argv": args[3:], "env": env, "cwd": str(cwd)}).encode()
        with (
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
            socket.socket(socket.AF_UNIX) as conn,
        ):
            conn.connect(str(self.path))
            conn.sendall(STATUS.pack(len(request)))
            socket.send_fds(conn, [request], [out.fileno(), err.fileno()])
            (pid,) = STATUS.unpack(conn.recv(STATUS.size, socket.MSG_WAITALL))
            conn.settimeout(timeout)
            try:
                (returncode,) = STATUS.unpack(conn.recv(STATUS.size, socket.MSG_WAITALL))
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)  # as subprocess.run does on its timeout
                raise subprocess.TimeoutExpired(args, timeout) from None
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(), err.read().decode()
        return subprocess.CompletedProcess(args, returncode, stdout, stderr)


if __name__ == "__main__":
    warm_imports()
    request_fds = serve(sys.argv[1])
    if request_fds is not None:
        become_job(*request_fds)
        # Here, at the top level, so that the job's SystemExit or uncaught exception ends this process
        # the way it ends `python -m trainer`: atexit handlers, the traceback on stderr, the exit code.
        runpy.run_module("trainer", run_name="__main__", alter_sys=True)
