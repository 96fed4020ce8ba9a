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
status as ``subprocess`` reports it (negative: the signal that ended it). It ends as
an interpreter ends (it leaves by ``SystemExit``: non-daemon threads joined,
``atexit`` run, streams flushed, modules finalized). What differs: the modules the
zygote imported are not imported again, so a module that reads the environment *at import* sees the
zygote's (``keyshred.tracing`` reads ``OTEL_PYTHON_TRACER_PROVIDER`` so: its tests
use ``subprocess``; the command line's module is not preloaded, as its console reads
``COLUMNS`` at import). The zygote is single-threaded when it forks (it checks), so
no lock is copied held.

What forking cannot give a program, and no test here relies on: its own string
hash seed (every program shares the zygote's; ``PYTHONHASHSEED`` is ignored), and
``PYTHONWARNINGS``, locale variables and ``OPENBLAS_NUM_THREADS`` (1) as the zygote
read them; the ``tests`` package is importable without the repository on the path;
warning filters set by preloaded libraries stay set. What the interpreter reads at
start-up and a test may set is applied: ``PYTHONPATH``, ``TZ``, ``PYTHONUNBUFFERED``.

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
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
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


# sys.path after sys.path[0] and the zygote's own PYTHONPATH: a program's path is
# its sys.path[0], its PYTHONPATH, then these (set by _serve before the imports).
_BASE_PATH: list[str] = []


def _serve(path: str, parent: int) -> None:
    import importlib

    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    _BASE_PATH[:] = sys.path[1 + len(own) :]
    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # an optional extra not installed
            importlib.import_module(name)
    # A fork copies no thread but the caller, and whatever lock another Python
    # thread held would stay held in the child: there must be none. Native threads
    # are as under multiprocessing's fork: jemalloc's background thread (pyarrow)
    # and OpenBLAS's workers (none here: one BLAS thread) have fork handlers.
    if threading.active_count() != 1:
        sys.exit(f"zygote: {threading.active_count()} Python threads after the imports")
    import gc

    gc.freeze()  # the imports' objects: never scanned (nor copied) by a program's collections
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
    program = False
    try:
        pid = os.fork()
        if pid == 0:
            program = True
            conn.close()
            _program(request, fds)  # raises SystemExit: the interpreter's own exit
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        # Not reaped until the test has seen the status (poll, wait): a dead program
        # stays a zombie until then, as a child of the test's own would.
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        conn.sendall(f"{code}\n".encode())
        with contextlib.suppress(OSError):
            conn.recv(1)  # the test saw it (or is gone)
        os.waitpid(pid, 0)
        conn.sendall(b"reaped\n")
    finally:
        if not program:
            os._exit(0)


def _program(request: dict[str, Any], fds: list[int]) -> None:
    """Become the program, run it, and leave by raising SystemExit (or an uncaught
    KeyboardInterrupt) up to the interpreter: it then does what it does at any
    program's end (joins non-daemon threads, runs atexit, flushes the standard
    streams, finalizes the modules, dies of SIGINT after a KeyboardInterrupt)."""
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        # What the interpreter reads from the environment at start-up.
        time.tzset()
        extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = ["", *extra, *_BASE_PATH]
        _stdio(bool(env.get("PYTHONUNBUFFERED")))
        if request["warnings"]:
            import warnings

            for option in request["warnings"]:
                sys.warnoptions.append(option)
                warnings._setoption(option)  # type: ignore[attr-defined]
        _main(request)
    except SystemExit:
        raise
    except BaseException as exc:
        # As the interpreter reports it: by sys.excepthook, from the program's frame.
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):
            sys.excepthook = lambda *_: None  # printed: the interpreter only exits by SIGINT
            raise
        raise SystemExit(1) from None
    raise SystemExit(0)


def _stdio(unbuffered: bool) -> None:
    """The standard streams as the interpreter opens them: the zygote's encoding and
    error handler, no newline translation; stdout by blocks and stderr by lines, or
    both unbuffered under PYTHONUNBUFFERED."""
    own = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
    made = []
    for fd, stream in enumerate(own):
        assert stream is not None
        if fd == 0:
            buffer: Any = open(0, "rb", closefd=False)  # noqa: SIM115
        else:
            buffer = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        made.append(
            io.TextIOWrapper(
                buffer,
                stream.encoding,
                stream.errors,
                newline="\n",
                line_buffering=fd == 2 and not unbuffered,
                write_through=fd > 0 and unbuffered,
            )
        )
    sys.stdin = sys.__stdin__ = made[0]
    sys.stdout = sys.__stdout__ = made[1]
    sys.stderr = sys.__stderr__ = made[2]


def _main(request: dict[str, Any]) -> None:
    kind, target, args = request["kind"], request["target"], request["args"]
    # A __main__ of the program's own that stays in sys.modules to the end (for its
    # threads and atexit functions), as the interpreter's does.
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if kind == "keyshred":
        sys.argv = [target, *args]
        sys.path[0] = str(Path(target).parent)
        from keyshred.cli import main as cli

        raise SystemExit(cli())
    if kind == "module":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        return
    if kind == "script":
        sys.argv = [target, *args]
        sys.path[0] = str(Path(target).resolve().parent)
        if not os.path.isfile(target):  # a folder or a zip file with __main__.py
            runpy.run_path(target, run_name="__main__")
            return
        try:
            source = Path(target).read_bytes()
        except OSError as exc:
            print(f"{sys.executable}: can't open file {target!r}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        main.__file__ = target
        main.__cached__ = None  # type: ignore[attr-defined]
        exec(compile(source, target, "exec"), main.__dict__)  # noqa: S102
        return
    sys.argv = ["-c", *args]
    sys.path[0] = ""
    exec(compile(target, "<string>", "exec"), main.__dict__)  # noqa: S102 (python -c)


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
        shutil.rmtree(self._dir, ignore_errors=True)


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
        self._text = text
        self._output: dict[IO[Any], list[bytes]] | None = None
        self._input = memoryview(b"")
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
        self._conn.sendall(b"r")  # seen: the supervisor reaps it now, as wait() would
        self._line(None)
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
        """As subprocess's: in this thread, what was read kept for a call after a
        TimeoutExpired (which carries the output so far)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._output is None:
            self._output = {s: [] for s in (self.stdout, self.stderr) if s is not None}
            if self.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    self.stdin.flush()
                data = input.encode("utf-8") if isinstance(input, str) else input or b""
                self._input = memoryview(data)
                if not data:
                    with contextlib.suppress(BrokenPipeError):
                        self.stdin.close()
        with selectors.DefaultSelector() as sel:
            if self.stdin is not None and not self.stdin.closed:
                sel.register(self.stdin, selectors.EVENT_WRITE)
            for stream in self._output:
                if not stream.closed:
                    sel.register(stream, selectors.EVENT_READ)
            while sel.get_map():
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    out, err = (self._output.get(s) for s in (self.stdout, self.stderr))
                    raise subprocess.TimeoutExpired(
                        self.args,
                        timeout or 0.0,
                        output=None if out is None else b"".join(out),
                        stderr=None if err is None else b"".join(err),
                    )
                for key, _ in sel.select(wait):
                    stream = key.fileobj
                    if stream is self.stdin:
                        try:
                            self._input = self._input[os.write(key.fd, self._input[:65536]) :]
                        except BrokenPipeError:
                            self._input = memoryview(b"")
                        if not self._input:
                            sel.unregister(stream)
                            with contextlib.suppress(BrokenPipeError):
                                stream.close()  # type: ignore[union-attr]
                    else:
                        data = os.read(key.fd, 32768)
                        if data:
                            self._output[stream].append(data)  # type: ignore[index]
                        else:
                            sel.unregister(stream)
                            stream.close()  # type: ignore[union-attr]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        results = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                results.append(None)
                continue
            data = b"".join(self._output[stream])
            if self._text:
                text = data.decode("utf-8")
                results.append(text.replace("\r\n", "\n").replace("\r", "\n"))
            else:
                results.append(data)
        return results[0], results[1]

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
