"""The facade's components as callers reach them: closed handles, full disks and
failed database statements.

``Keyshred`` hands out its components (``ks.memories``, ``ks.vault``, ``ks.backup``
...) wrapped in a ``Guarded`` view. Every method called through the view first
checks that the handle is open (``HandleClosed`` otherwise, before anything is
read or written) and turns a full disk, whichever layer hit it, into one typed
``StorageFull``, and any other driver error of the catalog or key store database
(a damaged or hand-altered database) into ``DatabaseError``: only ``KeyshredError``
leaves a public call. Components keep references to each other's real objects, so
the checks cost one function call per public call, not one per internal step.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import os
import re
import resource
import sqlite3
import sys
import types
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from keyshred.errors import DatabaseError, HandleClosed, KeyshredError, StorageFull

__all__ = [
    "Guarded",
    "check_open",
    "disk_full_test",
    "guarded",
    "is_disk_full",
    "typed",
    "typed_errors",
    "typed_method",
]

T = TypeVar("T")

_FULL_ERRNOS = frozenset(
    code for code in (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", None)) if code
)
# How the layers that do not keep an errno say it: SQLite (SQLITE_FULL), Rust's
# std::io (LanceDB), Arrow's C++ status text, PostgreSQL's SQLSTATE 53100.
_OS_CODES = "|".join(str(code) for code in sorted(_FULL_ERRNOS))
_FULL_TEXT = re.compile(
    "database or disk is full|no space left on device|file too large|disk quota exceeded"
    rf"|could not extend file|\(os error (?:{_OS_CODES})\)",
    re.IGNORECASE,
)
_SQLITE_FULL = 13
# Below this much free space, or this close to RLIMIT_FSIZE (a few WAL frames), a
# database write fails for want of room.
_LOW_SPACE = 1024 * 1024
_NEAR_LIMIT = 64 * 1024
_PG_DISK_FULL = "53100"


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps (``__cause__``, ``__context__``, a driver's ``orig``)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 16:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo.extend([e.__cause__, e.__context__, getattr(e, "orig", None)])
    return seen


def _says_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
        return True
    if isinstance(e, sqlite3.Error) and getattr(e, "sqlite_errorcode", None) == _SQLITE_FULL:
        return True
    if getattr(e, "sqlstate", None) == _PG_DISK_FULL or getattr(e, "pgcode", None) == (
        _PG_DISK_FULL
    ):
        return True
    # Only the error's own text (a backend's message), never arguments of ours.
    return isinstance(e, OSError | RuntimeError | sqlite3.Error | ValueError) and bool(
        _FULL_TEXT.search(str(e))
    )


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it wraps) says the disk or a file size limit is full."""
    if isinstance(exc, StorageFull):
        return False  # already typed
    return any(_says_full(e) for e in _causes(exc))


def _sqlite_io_error(exc: BaseException) -> bool:
    # SQLite reports ENOSPC as SQLITE_FULL, but any other failed write (EFBIG from a
    # file size limit among them) as SQLITE_IOERR_WRITE, "disk I/O error".
    return any(
        isinstance(e, sqlite3.Error)
        and (
            str(getattr(e, "sqlite_errorname", "")).startswith("SQLITE_IOERR")
            or "disk i/o error" in str(e).lower()
        )
        for e in _causes(exc)
    )


def _no_room(folder: Path) -> bool:
    """Whether ``folder``'s file system, or this process's file size limit, leaves
    no room for the SQLite databases in it to grow."""
    try:
        st = os.statvfs(folder)
        if st.f_bavail * st.f_frsize < _LOW_SPACE:
            return True
        limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if limit == resource.RLIM_INFINITY:
            return False
        return any(p.stat().st_size + _NEAR_LIMIT > limit for p in folder.glob("*") if p.is_file())
    except OSError:
        return False


def disk_full_test(folders: Sequence[Path]) -> Callable[[BaseException], bool]:
    """The facade's test for a full disk: what the error says or, for SQLite's
    unspecific "disk I/O error", what the file systems of ``folders`` (those
    holding SQLite databases) say."""

    def full(exc: BaseException) -> bool:
        if is_disk_full(exc):
            return True
        return _sqlite_io_error(exc) and any(_no_room(f) for f in folders)

    return full


def _storage_full() -> StorageFull:
    return StorageFull(
        "the disk is full (no space, quota or file size limit left): the call failed; "
        "data stored before it is intact; free space and retry"
    )


def _is_driver_error(exc: BaseException) -> bool:
    """A database driver's error, raw or as SQLAlchemy wraps it. The optional
    drivers' and SQLAlchemy's classes are looked up only if already imported: an
    error of a module never imported cannot have been raised."""
    if isinstance(exc, sqlite3.Error):
        return True
    for module, name in (("sqlalchemy.exc", "DBAPIError"), ("psycopg", "Error")):
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(exc, getattr(loaded, name)):
            return True
    return False


def typed(exc: Exception, full: Callable[[BaseException], bool] = is_disk_full) -> Exception:
    """What a public call raises for ``exc``, an error that is not a
    ``KeyshredError``: ``StorageFull`` for a full disk, ``DatabaseError`` for any
    other driver error (the driver's message is not kept: it can quote a
    statement), ``exc`` itself otherwise."""
    if full(exc):
        return _storage_full()
    if _is_driver_error(exc):
        return DatabaseError(
            f"a catalog or key store statement failed ({type(exc).__name__}): the "
            "database may be damaged or altered by hand; nothing of the call is reported done"
        )
    return exc


class Guarded:
    """A view of one component: calls check the handle and map a full disk.

    Attribute reads pass through (after the open check); attribute writes reach the
    component (``monkeypatch.setattr`` in tests, wiring done after construction), and
    ``__dict__`` is the component's own.
    """

    __slots__ = ("_cache", "_closed", "_full", "_target")

    def __init__(
        self, target: Any, closed: Callable[[], bool], full: Callable[[BaseException], bool]
    ) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_closed", closed)
        object.__setattr__(self, "_full", full)
        object.__setattr__(self, "_cache", {})

    def __getattribute__(self, name: str) -> Any:
        # Every attribute read lands here: a wrapped method is one dict lookup away
        # (no AttributeError raised and caught, as a __getattr__ fallback would).
        cached = object.__getattribute__(self, "_cache").get(name)
        if cached is not None:
            return cached
        if name == "__dict__":  # the component's (pytest's monkeypatch reads it)
            return vars(object.__getattribute__(self, "_target"))
        return object.__getattribute__(self, "_resolve")(name)

    def _resolve(self, name: str) -> Any:
        closed: Callable[[], bool] = object.__getattribute__(self, "_closed")
        check_open(closed())
        target = object.__getattribute__(self, "_target")
        value = getattr(target, name)
        if not _is_routine(value):
            if name in getattr(type(target), "GUARDED_PARTS", ()):
                # A part callers reach through the component (``ks.jobs.queue``,
                # ``ks.keyring.store``): its calls are checked and typed alike.
                return Guarded(value, closed, object.__getattribute__(self, "_full"))
            return value  # data, other sub-objects, classes: as they are
        wrapper = _guard_call(value, closed, object.__getattribute__(self, "_full"))
        if inspect.ismethod(value) and name not in getattr(target, "__dict__", {}):
            # A method of the class, not set on the instance: stable.
            object.__getattribute__(self, "_cache")[name] = wrapper
        return wrapper

    def __setattr__(self, name: str, value: Any) -> None:
        object.__getattribute__(self, "_cache").pop(name, None)  # a wrapper of the old one
        setattr(object.__getattribute__(self, "_target"), name, value)

    def __delattr__(self, name: str) -> None:
        object.__getattribute__(self, "_cache").pop(name, None)
        delattr(object.__getattribute__(self, "_target"), name)

    def __repr__(self) -> str:
        return repr(object.__getattribute__(self, "_target"))


def _is_routine(value: Any) -> bool:
    return inspect.ismethod(value) or inspect.isfunction(value) or inspect.isbuiltin(value)


def check_open(closed: bool) -> None:
    """``HandleClosed`` if ``closed``: the first thing every public entry point does."""
    if closed:
        raise HandleClosed("this keyshred handle is closed; open the folder again")


@contextlib.contextmanager
def typed_errors(full: Callable[[BaseException], bool] = is_disk_full) -> Iterator[None]:
    """Type a full disk or a driver error met inside the block (``typed``)."""
    try:
        yield
    except KeyshredError:
        raise  # typed already (an IntegrityError stays one, whatever it met before)
    except Exception as exc:
        mapped = typed(exc, full)
        if mapped is not exc:
            raise mapped from None
        raise


def _guard_call(
    fn: Callable[..., Any], closed: Callable[[], bool], full: Callable[[BaseException], bool]
) -> Callable[..., Any]:
    # The hot path of every public call: plain try/except, no context manager.
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if closed():
            check_open(True)
        try:
            result = fn(*args, **kwargs)
        except KeyshredError:
            raise
        except Exception as exc:
            mapped = typed(exc, full)
            if mapped is not exc:
                raise mapped from None
            raise
        if type(result) is types.GeneratorType:
            # A generator method's statements run as the caller iterates, after
            # this call returned: its steps are typed alike.
            return _typed_steps(result, full)
        return result

    return call


def _typed_steps(
    steps: Generator[Any, Any, Any], full: Callable[[BaseException], bool]
) -> Generator[Any, Any, Any]:
    """``steps`` (a guarded method's generator), raising what the call would."""
    with typed_errors(full):
        return (yield from steps)


F = TypeVar("F", bound=Callable[..., Any])


def typed_method(fn: F) -> F:
    """A ``Keyshred`` method that raises only ``KeyshredError`` (``typed``, with the
    handle's own full-disk test): the facade's entry points that are not reached
    through a ``Guarded`` view (``erase``, ``close`` ...)."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with typed_errors(getattr(self, "_full", is_disk_full)):
            return fn(self, *args, **kwargs)

    return cast(F, call)


def guarded(
    target: T, closed: Callable[[], bool], full: Callable[[BaseException], bool] = is_disk_full
) -> T:
    """``target`` behind a ``Guarded`` view, typed as itself for callers."""
    return cast(T, Guarded(target, closed, full))
