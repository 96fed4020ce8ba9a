"""What the catalog's and the key stores' database connections share: a pooled
PostgreSQL connection whose server has hung up is replaced at checkout, and one
test of which driver errors mean "the database cannot be reached right now"
(``unreachable``, ``sqlite_busy``), which callers raise as ``BackendUnavailable``.

A server that restarts, or a network path that is cut, closes the connection's
socket; the client learns it when it next reads. SQLAlchemy's ``pool_pre_ping``
asks with a round trip per checkout, which doubled a PostgreSQL ``get`` here. An
idle connection (between transactions) has nothing to read unless the server has
hung up (PostgreSQL sends its last error, then EOF), so polling the socket without
waiting answers the same question in a microsecond: a readable idle connection is
dropped and the pool opens another (``DisconnectionError``). A silently vanished
peer (no FIN, no RST) is caught by neither; ``pre_ping=True`` adds the round trip.
"""

from __future__ import annotations

import select
import sqlite3
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine

__all__ = ["replace_hung_up", "sqlite_busy", "unreachable"]

# SQLite's primary result codes for "another connection holds the lock" (the
# extended codes carry them in their low byte).
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6


def replace_hung_up(engine: Engine) -> None:
    """Make ``engine``'s pool drop, at checkout, a connection whose server hung up."""

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if hung_up(dbapi_connection):
            raise sa.exc.DisconnectionError("the server closed this connection")


def hung_up(conn: Any) -> bool:
    """Whether an idle psycopg connection is closed, broken, or its socket has
    something to read (the server's goodbye or EOF)."""
    if getattr(conn, "closed", False) or getattr(conn, "broken", False):
        return True
    try:
        fd = conn.fileno()
    except Exception:  # noqa: BLE001 - a connection that cannot say is not usable
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


def sqlite_busy(exc: BaseException) -> bool:
    """Whether a SQLite error says another connection held the lock past the busy
    timeout ("database is locked"): the database is there but cannot be written
    now, and the next call may succeed."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED):
        return True
    return "locked" in str(exc)


def unreachable(dialect: str, dbapi: Any, exc: BaseException) -> bool:
    """Whether a driver error means the database cannot be reached right now (a
    refused or dropped connection, an exhausted pool, SQLite locked too long),
    rather than a bug or a conflict the caller handles."""
    if isinstance(exc, sa.exc.TimeoutError):  # no pooled connection came free
        return True
    if isinstance(exc, sa.exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        if exc.orig is not None:
            exc = exc.orig
    if dialect == "sqlite":
        return sqlite_busy(exc)
    if dbapi is None:
        return False
    rollback = getattr(getattr(dbapi, "errors", None), "TransactionRollback", ())
    return isinstance(exc, (dbapi.OperationalError, dbapi.InterfaceError)) and not isinstance(
        exc, rollback
    )
