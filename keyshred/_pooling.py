"""What the catalog's and the PostgreSQL key store's connection pools share: a pooled
PostgreSQL connection whose server has hung up is replaced at checkout.

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
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine

__all__ = ["replace_hung_up"]


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
