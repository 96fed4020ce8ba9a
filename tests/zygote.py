"""Python processes for the tests, forked from one that has already imported keyshred.

The suite starts about 550 Python processes (workers killed inside a step, the
command line as a user runs it, racing writers); each spent 0.7-1 s of CPU importing
keyshred, SQLAlchemy, NumPy and pyarrow before its first line ran: about a quarter
of the suite's CPU on a two-core machine. ``run`` and ``Popen`` here take the same
arguments as ``subprocess``'s, and start ``python SCRIPT ARGS``, ``python -c CODE
ARGS``, ``python -m MODULE ARGS`` and the ``keyshred`` command by forking a *zygote*:
a process of this pytest process (one per xdist worker, started on first use) that
imported the heavy modules once and then only waits. Anything else is run by
``subprocess`` itself.

What a test sees is a separate process like any other: its own pid (killed with
SIGKILL inside a step as before, by the test itself), its own standard streams (the
pipes are passed to it over a Unix socket), the environment and working folder the
test gave, ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, the exit
status as ``subprocess`` reports it (negative: the signal that ended it). At exit it
runs what an interpreter runs: it joins non-daemon threads, runs ``atexit``
functions and flushes its streams. What differs: the modules the zygote imported are
not imported again, so a module that reads the environment *at import* sees the
zygote's (``keyshred.tracing`` reads ``OTEL_PYTHON_TRACER_PROVIDER`` so: its tests
use ``subprocess``; the command line's module is not preloaded, as its console reads
``COLUMNS`` at import). The zygote is single-threaded when it forks (it checks), so
no lock is copied held.

Each program is the grandchild of the zygote: a supervisor process forked per
request forks the program, sends its pid, waits for it and sends its exit status;
the zygote itself only accepts requests and reaps supervisors, and exits when the
pytest process that started it is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["Popen", "run"]

ROOT = Path(__file__).resolve().parents[1]
KEYSHRED = str(Path(sys.executable).parent / "keyshred")
PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT

# Imported by the zygote before it forks: what nearly every program here imports.
# Not ``keyshred.cli`` (its console reads COLUMNS at import) nor ``keyshred.tracing``
# (it reads OTEL_PYTHON_TRACER_PROVIDER at import).
PRELOAD = (
    "keyshred",
    "keyshred.facade",
    "keyshred.config",
    "keyshred.errors",
    "keyshred.storage.faults",
    "keyshred.storage.memories",
    "keyshred.erasure",
    "keyshred.backup.manager",
    "sqlalchemy",
    "psycopg",
    "numpy",
    "pyarrow",
    "pyarrow.parquet",
    "pyarrow.fs",
    "pydantic",
    "cryptography",
    "typer",
    "rich.console",
    "rich.table",
    "pytest",
    "boto3",
    "hvac",
)


# -- the zygote ------------------------------------------------------------------------


def _serve(path: str, parent: int) -> None:
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # an optional extra not installed
            importlib.import_module(name)
    # A fork copies no thread but the caller, and whatever lock another Python
    # thread held would stay held in the child: there must be none. Native threads
    # are as under multiprocessing's fork: jemalloc's background thread (pyarrow)
    # and OpenBLAS's workers (none here: one BLAS thread) have fork handlers.
    if threading.active_count() != 1:
        sys.exit(f"zygote: {threading.active_count()} Python threads after the imports")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    srv.settimeout(0.5)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while os.getppid() == parent:
        _reap()
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:
            srv.close()
            _supervise(conn, request, fds)  # never returns
        conn.close()
        for fd in fds:
            os.close(fd)
    sys.exit(0)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    if len(head) != 8 or len(fds) != 3:
        raise ValueError("bad request")
    (size,) = struct.unpack("!Q", head)
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(min(1 << 20, size - len(body)))
        if not chunk:
            raise ValueError("short request")
        body += chunk
    return json.loads(body), fds


def _supervise(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    try:
        pid = os.fork()
        if pid == 0:
            conn.close()
            _program(request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    finally:
        os._exit(0)


def _program(request: dict[str, Any], fds: list[int]) -> None:
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # Buffered as the interpreter buffers streams that are not a terminal:
        # stdout by blocks, stderr by lines.
        streams = [open(fd, mode, closefd=False) for fd, mode in ((0, "rb"), (1, "wb"), (2, "wb"))]  # noqa: SIM115
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(streams[0], "utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(streams[1], "utf-8")
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            streams[2], "utf-8", "backslashreplace", line_buffering=True
        )
        if request["warnings"]:
            import warnings

            for option in request["warnings"]:
                sys.warnoptions.append(option)
                warnings._setoption(option)  # type: ignore[attr-defined]
        code = _main(request)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 (the interpreter's last handler)
        # As the interpreter prints it: from the program's first frame.
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        code = 1
    code = _shutdown(code)
    os._exit(code)


def _main(request: dict[str, Any]) -> int:
    kind, target, args = request["kind"], request["target"], request["args"]
    if kind == "keyshred":
        sys.argv = [target, *args]
        sys.path[0] = str(Path(target).parent)
        from keyshred.cli import main

        return _exit_code(SystemExit(main()))
    if kind == "script":
        sys.argv = [target, *args]
        sys.path[0] = str(Path(target).resolve().parent)
        runpy.run_path(target, run_name="__main__")
        return 0
    if kind == "module":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    sys.argv = ["-c", *args]
    sys.path[0] = ""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(target, "<string>", "exec"), main.__dict__)  # noqa: S102 (python -c)
    return 0


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _shutdown(code: int) -> int:
    """What the interpreter does after the main module: wait for non-daemon threads,
    run atexit functions, flush the standard streams."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 (the interpreter prints and exits)
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120  # as the interpreter does when flushing stdout fails
    return code


# -- the client ------------------------------------------------------------------------


class _Zygote:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = ""

    def path(self) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            return os.path.join(self._dir, "z.sock")

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ks-zygote-")
        log = os.path.join(self._dir, "log")
        with open(log, "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.zygote", os.path.join(self._dir, "z.sock")],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env={
                    **os.environ,
                    "KS_ZYGOTE_PARENT": str(os.getpid()),
                    "OPENBLAS_NUM_THREADS": "1",
                },
            )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if line != b"ready\n":
            self._proc.kill()
            raise RuntimeError(f"the test zygote did not start: {Path(log).read_text()[-3000:]}")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


_ZYGOTE = _Zygote()


def _request(args: Sequence[str]) -> dict[str, Any] | None:
    """What the zygote runs for ``args``, or None if it is not a Python program it
    can fork (``subprocess`` runs it)."""
    argv = [os.fspath(a) for a in args]
    if not argv:
        return None
    if argv[0] == KEYSHRED:
        return {"kind": "keyshred", "target": KEYSHRED, "args": argv[1:], "warnings": []}
    if argv[0] != sys.executable:
        return None
    rest, warnings = argv[1:], []
    while len(rest) >= 2 and rest[0] == "-W":
        warnings.append(rest[1])
        rest = rest[2:]
    if not rest:
        return None
    if rest[0] == "-c" and len(rest) >= 2:
        return {"kind": "code", "target": rest[1], "args": rest[2:], "warnings": warnings}
    if rest[0] == "-m" and len(rest) >= 2:
        return {"kind": "module", "target": rest[1], "args": rest[2:], "warnings": warnings}
    if rest[0].startswith("-"):
        return None
    return {"kind": "script", "target": rest[0], "args": rest[1:], "warnings": warnings}


class Popen:
    """A program started by the zygote, with the part of ``subprocess.Popen``'s
    interface the tests use (``args``, ``pid``, ``returncode``, ``stdin``,
    ``stdout``, ``stderr``, ``poll``, ``wait``, ``communicate``, ``send_signal``,
    ``terminate``, ``kill``, a context manager)."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        text: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        request = _request(args)
        if request is None:
            raise ValueError(f"not a Python program the zygote forks: {list(args)[:2]}")
        self.args = args
        self.returncode: int | None = None
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        request["env"] = dict(os.environ if env is None else env)
        request["cwd"] = os.path.abspath(os.getcwd() if cwd is None else cwd)
        child: list[int] = []
        ours: list[int] = []
        try:
            for n, (spec, mode) in enumerate(((stdin, "w"), (stdout, "r"), (stderr, "r"))):
                if n == 2 and spec == STDOUT:
                    child.append(child[1])
                    continue
                fd, mine = _stream(spec, n, mode)
                child.append(fd)
                ours.append(fd)
                if mine is not None:
                    stream = _wrap(mine, mode, text)
                    setattr(self, ("stdin", "stdout", "stderr")[n], stream)
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._conn.connect(_ZYGOTE.path())
            body = json.dumps(request).encode()
            socket.send_fds(self._conn, [struct.pack("!Q", len(body))], child)
            self._conn.sendall(body)
        finally:
            for fd in ours:
                os.close(fd)
        self._buffer = b""
        line = self._line(None)
        if line is None:
            raise RuntimeError("the test zygote closed the request")
        self.pid = int(line)

    def _line(self, timeout: float | None) -> bytes | None:
        """The supervisor's next line; None if none came within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], wait)[0]:
                return None
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError("the test zygote's supervisor closed before the status")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        line = self._line(timeout)
        if line is None:
            return None
        self.returncode = int(line)
        self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def communicate(
        self, input: str | bytes | None = None, timeout: float | None = None
    ) -> tuple[Any, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[str, Any] = {}
        readers = []
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                t = threading.Thread(
                    target=lambda s=stream, n=name: results.__setitem__(n, s.read()), daemon=True
                )
                t.start()
                readers.append(t)
        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
                self.stdin.close()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                stream.close()
        return results.get("stdout"), results.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.wait()


def _stream(spec: int | IO[Any] | None, n: int, mode: str) -> tuple[int, int | None]:
    """(the descriptor the program gets, ours to read or write, if a pipe)."""
    if spec is None:
        return os.dup(n), None
    if spec == DEVNULL:
        return os.open(os.devnull, os.O_RDWR), None
    if spec == PIPE:
        read, write = os.pipe()
        return (read, write) if mode == "w" else (write, read)
    if isinstance(spec, int):
        return os.dup(spec), None
    return os.dup(spec.fileno()), None


def _wrap(fd: int, mode: str, text: bool) -> IO[Any]:
    if text:
        return open(fd, mode, encoding="utf-8", errors="strict")
    return open(fd, mode + "b")


def run(
    args: Sequence[str],
    *,
    input: str | bytes | None = None,
    capture_output: bool = False,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    text: bool = False,
    timeout: float | None = None,
    check: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` of a Python program, forked from the zygote (or by
    ``subprocess`` when it is not one the zygote forks)."""
    if capture_output:
        stdout = stderr = PIPE
    if _request(args) is None:
        return subprocess.run(
            args,
            input=input,
            stdout=stdout,
            stderr=stderr,
            text=text,
            timeout=timeout,
            check=check,
            env=env,
            cwd=cwd,
        )
    with Popen(
        args,
        stdin=PIPE if input is not None else None,
        stdout=stdout,
        stderr=stderr,
        text=text,
        env=env,
        cwd=cwd,
    ) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(args, proc.wait(), out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _serve(sys.argv[1], int(os.environ["KS_ZYGOTE_PARENT"]))
