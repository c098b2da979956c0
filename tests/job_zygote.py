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

The job's ranks come from multiprocessing's fork server (trainer/rank/main.py), which a job starts as a
fresh interpreter that imports torch and the rank's modules: about 2.7 of a tiny job's CPU-seconds,
more than the job's own start. Here the job forks it instead (`fork_servers_by_fork`), from this
server's imports plus the rank preload's (`warm_imports`), with what a fresh interpreter would hold
put back first: signal handlers and mask, logging, warnings filters, multiprocessing's own records
(private attributes of the standard library's fork server and resource tracker), no file descriptor
but those multiprocessing passes it; and only while the job is still as single-threaded as this
server (no thread of its own: what a fork may not copy) and has no CUDA context (a GPU job's plan reads
the device, and a process forked after that cannot use CUDA). Otherwise the job spawns one as the trainer
does. The forked server keeps this process's command line, not multiprocessing.forkserver's, so
trainer/launch.py `start_fork_server` does not find it (and takes it as alive, as it does any server
it cannot find): the test that kills a job's fork server runs a real process (test_leftovers.py).

A forked process also keeps the environment block the kernel shows in /proc/PID/environ, where
trainer/faults/leftovers.py (and tests/helpers.py `assert_nothing_left`) look for a job's marks: this
server starts with room for each mark there, and the job and its fork server write theirs into it
(`show_marks`), so their processes, and every rank forked below them, carry the marks as visibly as a
process started with the job's environment would.

    python -m tests.job_zygote SOCKET_PATH    (its client, JobZygote below, starts it)
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import logging
import os
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from multiprocessing import forkserver, resource_tracker, util
from pathlib import Path

from trainer.faults.leftovers import JOB_MARKER, LAUNCH_MARKER

RUNTIME_ENV_PREFIXES = ("ZEROLAB_", "WANDB_", "HYDRA_", "PYTEST_")
"""Environment keys a job may set differently from the server's: read by the trainer and wandb when
the job runs, never when imported (wandb is not imported here); and pytest's own, which names the
test running now and nothing reads."""

STATUS = struct.Struct("q")
MARKS = (JOB_MARKER, LAUNCH_MARKER)
MARK_ROOM = 48
"""Characters held for each mark's value in this server's /proc/PID/environ (a mark is 32 or fewer)."""
STRAYS: list[logging.Handler] = []
"""The job's logging handlers a forked fork server took off its loggers: kept referenced, so that none
is collected and closes a descriptor number the server has since reused."""


def warm_imports() -> None:
    """What `python -m trainer` imports before it runs a job (trainer/__main__.py and the launcher)."""
    import hydra  # noqa: F401

    import trainer.cli  # noqa: F401
    import trainer.cluster  # noqa: F401
    import trainer.job  # noqa: F401
    import trainer.launch  # noqa: F401
    import trainer.rank.preload  # noqa: F401  (the ranks' fork server's, forked from here)


class Pristine:
    """What a fresh interpreter holds after `warm_imports`, recorded here before any job runs, for a
    forked fork server to take back (`become_fork_server`)."""

    def __init__(self) -> None:
        self.threads = len(os.listdir("/proc/self/task"))  # torch's own native thread is one
        self.signals = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.warnings = list(warnings.filters)
        self.loggers = {name: logger_state(log) for name, log in all_loggers().items()}


def all_loggers() -> dict[str, logging.Logger]:
    known = logging.Logger.manager.loggerDict.items()
    return {"": logging.getLogger(), **{n: log for n, log in known if isinstance(log, logging.Logger)}}


def logger_state(log: logging.Logger) -> tuple:
    return log.level, list(log.handlers), log.disabled, log.propagate


def single_threaded(pristine: Pristine) -> bool:
    return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) <= pristine.threads


def cuda_untouched() -> bool:
    """No CUDA context in this process: a job on a GPU reads the device's memory for its plan, and a
    process forked after that cannot use CUDA (torch: "Cannot re-initialize CUDA in forked subprocess")."""
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def fork_servers_by_fork(pristine: Pristine) -> None:
    """In a job: multiprocessing starts its fork server (and nothing else) by forking this process."""
    spawn_fresh = util.spawnv_passfds

    def spawnv_passfds(path: bytes, args: list, passfds: list[int]) -> int:
        forkable = single_threaded(pristine) and cuda_untouched()
        if not args[-1].startswith("from multiprocessing.forkserver import main") or not forkable:
            return spawn_fresh(path, args, passfds)
        sys.stdout.flush()  # or the server would write the job's buffered lines a second time
        sys.stderr.flush()
        pid = os.fork()
        if pid != 0:
            return pid
        code = 1
        try:
            become_fork_server(pristine, passfds)
            exec(args[-1], {"__name__": "__main__"})  # `python -c`'s command: forkserver.main
        except SystemExit as end:  # the job, its last client, ended: main's way out
            code = end.code if isinstance(end.code, int) else 0
        except BaseException:
            sys.excepthook(*sys.exc_info())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # never the job's atexit handlers, nor runpy's unwinding

    util.spawnv_passfds = spawnv_passfds


def become_fork_server(pristine: Pristine, passfds: list[int]) -> None:
    """In the forked fork server: a fresh interpreter's state back, then the preload imported and frozen."""
    # First, so that no object of the job is ever collected: one that owns a descriptor closed below
    # would close whatever later takes that number.
    gc.freeze()
    keep = sorted({0, 1, 2, *passfds})
    for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
        os.closerange(low + 1, high)  # spawnv_passfds' close_fds: only the passed ones stay
    signal.set_wakeup_fd(-1)
    for sig, handler in pristine.signals.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, pristine.mask)
    warnings.filters[:] = pristine.warnings
    for name, log in all_loggers().items():  # the job's handlers stay referenced (their descriptors)
        level, handlers, disabled, propagate = pristine.loggers.get(name, (logging.NOTSET, [], False, True))
        STRAYS.extend(log.handlers)
        log.setLevel(level)
        log.handlers[:] = handlers
        log.disabled, log.propagate = disabled, propagate
    preload = list(forkserver._forkserver._preload_modules)
    forkserver._forkserver.__init__()  # its lock is held in the job (ensure_running forks under it)
    resource_tracker._resource_tracker.__init__()
    show_marks()  # both marks: the job process set them before it started this server
    for name in preload:  # as forkserver.main would; imported before the freeze, as the trainer's are
        __import__(name)
    gc.freeze()


def show_marks() -> None:
    """Write this process's marks (os.environ) over their room in the environment block the kernel
    shows as /proc/self/environ; a fork copies the block, so every process forked below carries them.
    Why by hand: that block is the one exec gave the process (here the server's); changing os.environ
    never touches it, and Python has no call that does."""
    fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of proc(5)
    block = ctypes.string_at(start, end - start)
    for key in MARKS:
        value, entry = os.environ.get(key, "").encode(), f"\0{key}=".encode()
        found = block.find(entry)
        if found < 0 or len(value) >= MARK_ROOM:
            raise RuntimeError(f"no room for {key}={value.decode()} in this process's environment block")
        at = found + len(entry)
        # the rest of the room as an entry without '=', which readers of the block skip
        room = value + b"\0" + b"_" * (MARK_ROOM - len(value) - 1)
        ctypes.memmove(start + at, room, MARK_ROOM)


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


def become_job(request: dict, fds: list[int], pristine: Pristine) -> None:
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
    show_marks()
    fork_servers_by_fork(pristine)


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
            env={**env, **dict.fromkeys(MARKS, "_" * MARK_ROOM)},  # room for the marks (show_marks)
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
    pristine = Pristine()
    request_fds = serve(sys.argv[1])
    if request_fds is not None:
        become_job(*request_fds, pristine)
        # Here, at the top level, so that the job's SystemExit or uncaught exception ends this process
        # the way it ends `python -m trainer`: atexit handlers, the traceback on stderr, the exit code.
        runpy.run_module("trainer", run_name="__main__", alter_sys=True)
