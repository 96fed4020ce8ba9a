"""``PostgresKeyStore``: the distributed profile's key store (``keyshred[postgres]``).

The one key store (``keyshred.keyring.keystore.SqlKeyStore``) on PostgreSQL through
psycopg, so several stateless workers on several machines share one set of wrapped
DEKs and tombstones (tables ``ks_dek``, ``ks_tombstone``, ...; ``keyring/schema.py``):

- one live DEK per (subject_ref, scope, owner set) by a unique index (``INSERT … ON
  CONFLICT DO NOTHING``, then read back: the first writer wins everywhere);
- ``destroy`` deletes the keys and writes the tombstone in one transaction;
- ``snapshot`` reads every table in one ``REPEATABLE READ`` transaction and returns
  an embedded (SQLite) key store image, which is what backups seal and restores open.

PostgreSQL keeps a deleted row's bytes in the table file until ``VACUUM`` reuses the
space (a dead tuple), and in its WAL; ``destroy`` runs ``VACUUM`` on the key table
afterwards, which frees the space but does not overwrite it. What bounds those copies
is the live KEK lineage: a DEK is wrapped by the live epoch key of its epoch, which the
live schedule rotates (default hourly) and destroys once every key is re-wrapped
(``ks.backup.maintain``): from then on no copy of the old wrapping can be unwrapped.
"""

from __future__ import annotations

from keyshred.keyring.keystore import SqlKeyStore

__all__ = ["PostgresKeyStore"]


class PostgresKeyStore(SqlKeyStore):
    """Wrapped DEKs, tombstones and wrapped secrets in PostgreSQL (a ``SqlKeyStore``
    on a ``postgresql://`` URL, with its bounded pool)."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 2,
        max_overflow: int = 8,
        pool_timeout: float = 30.0,
        pre_ping: bool = False,
    ) -> None:
        super().__init__(
            url,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            pre_ping=pre_ping,
        )
