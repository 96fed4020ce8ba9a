"""Leases on catalog rows, shared by erasure requests (``keyshred.erasure.lease``)
and jobs (``keyshred.jobs``).

A lease is two columns of a row: ``lease_owner`` (which worker) and
``lease_until`` (integer microseconds since 1970, by the *database's* clock). A
worker takes it with one conditional ``UPDATE`` (nobody holds it, or the holder's
lease ran out, or the holder was a process of this machine that died), renews it
from a heartbeat thread every third of its length, and makes every save of its
progress conditional on still holding it. Every worker dates leases by the one
clock they share, so a worker whose own clock runs ahead cannot take over a live
lease.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import threading
import uuid

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from keyshred import db

__all__ = ["Heartbeat", "db_now_us", "dead_here", "host", "new_owner", "until"]


def db_now_us(dialect: str) -> sa.ColumnElement[int]:
    """The database's clock in microseconds since 1970 (``lease_until``'s unit)."""
    if dialect == "postgresql":
        sql = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"
    else:
        sql = "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)"
    return sa.literal_column(sql, sa.BigInteger)


def until(dialect: str, seconds: float) -> sa.ColumnElement[int]:
    """``seconds`` from now by the database's clock."""
    return db_now_us(dialect) + int(seconds * 1_000_000)


@functools.cache
def host() -> str:
    """This machine, as a lease names it: a digest of the host name, the kernel's
    boot id and the process id namespace (a host name is nobody's data, but the
    catalog has no need of it). Containers that share a host name (their image's
    default, a Kubernetes pod template) but not a pid namespace are different
    hosts here: a pid one of them reads is not the other's, so neither takes the
    other's live lease for a dead process (``dead_here``)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("-")  # not Linux: the host name alone
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("-")
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:12]


def new_owner() -> str:
    """A fresh lease owner: ``host:pid:random`` (``dead_here`` reads the pid)."""
    return f"{host()}:{os.getpid()}:{uuid.uuid4().hex[:16]}"


def dead_here(owner: str) -> bool:
    """Whether ``owner`` is a process of this machine that no longer runs: its
    lease need not run out (a worker killed here is known dead at once)."""
    where, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if where != host() or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False


class Heartbeat:
    """Renews ``row``'s lease every third of ``seconds`` while ``owner`` holds it;
    ``lost`` turns True when a renewal finds the lease gone (taken over)."""

    def __init__(
        self,
        engine: Engine,
        row: sa.ColumnElement[bool],
        table: sa.Table,
        owner: str,
        seconds: float,
        *,
        name: str,
    ) -> None:
        self._engine = engine
        self._where = sa.and_(row, table.c.lease_owner == owner)
        self._table = table
        self._seconds = seconds
        self.stop_event = threading.Event()
        self.lost = False
        self._thread = threading.Thread(target=self._beat, name=name, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        dialect = self._engine.dialect.name
        while not self.stop_event.wait(self._seconds / 3):
            try:
                with db.write(self._engine) as conn:
                    renewed = conn.execute(
                        self._table.update()
                        .where(self._where)
                        .values(lease_until=until(dialect, self._seconds))
                    ).rowcount
            except Exception:  # noqa: BLE001, S112 - the database is away: try again next beat
                continue
            if renewed != 1:
                self.lost = True  # the next conditional save fails
                return

    def stop(self) -> None:
        """Stop renewing (the lease then runs out by itself unless released)."""
        self.stop_event.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
