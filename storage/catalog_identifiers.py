"""Registered identifiers (``keyshred.storage.mentions``): keyed lookup hashes of a
subject's identifiers, their sealed normal forms, and the identifier key version."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from keyshred import db
from keyshred.storage.catalog_guard import GuardMixin
from keyshred.storage.schema import identifier_key_version, identifier_kinds, identifiers

__all__ = ["IdentifiersMixin"]


class IdentifiersMixin(GuardMixin):
    """Registration, lookup and re-hashing of identifiers."""

    def add_identifiers(
        self,
        subject_ref: str,
        rows: Iterable[tuple[str, str, bytes | None]],
        kinds: Iterable[str],
        version: int = 1,
    ) -> int | None:
        """Store ``(hash, kind, sealed normal form)`` of a subject's identifiers,
        hashed under identifier key ``version``, and ``kinds``
        (``keyshred.storage.mentions`` marks: the kinds, names by their number of
        words) among the kinds ever registered; returns how many hashes were new, or
        None (nothing stored) when the catalog's hashes are under another version
        (hash again under ``identifier_version()`` and retry). The subject's guard
        is re-read in the same write transaction: a suppressed or erased subject
        registers nothing."""
        wanted = {h: (k, sealed) for h, k, sealed in rows}
        now = datetime.now(UTC)
        with self._write() as conn:
            self.enforce(subject_ref, self._lock_guard(conn, subject_ref), None)
            if self._lock_identifier_version(conn, exclusive=False) != version:
                return None
            have = set(
                conn.execute(
                    sa.select(identifiers.c.hash).where(identifiers.c.subject_ref == subject_ref)
                ).scalars()
            )
            new = [
                {"hash": h, "subject_ref": subject_ref, "kind": k, "created_at": now, "sealed": b}
                for h, (k, b) in wanted.items()
                if h not in have
            ]
            if new:
                # A concurrent registration of the same identifier is no error.
                conn.execute(self.insert_ignore(identifiers), new)
            marks = [{"kind": k} for k in sorted(set(kinds))]
            if marks:
                conn.execute(self.insert_ignore(identifier_kinds), marks)
        return len(new)

    def _lock_identifier_version(self, conn: Connection, *, exclusive: bool) -> int:
        """The identifier key version, its row created if absent and locked (shared
        for a registration, exclusive for a re-hash) until ``conn`` commits. SQLite
        write transactions are serialised anyway."""
        conn.execute(self.insert_ignore(identifier_key_version), [{"id": 1, "version": 1}])
        query = sa.select(identifier_key_version.c.version).where(identifier_key_version.c.id == 1)
        if self.dialect == "postgresql":
            query = query.with_for_update(read=not exclusive)
        return int(conn.execute(query).scalar_one())

    def identifier_version(self) -> int:
        """The identifier key version the registered hashes are under."""
        with self.read() as conn:
            version = conn.execute(
                sa.select(identifier_key_version.c.version).where(identifier_key_version.c.id == 1)
            ).scalar()
        return 1 if version is None else int(version)

    def rehash_identifiers(
        self, version: int, rehash: Callable[[str, str, bytes], str | None]
    ) -> tuple[int, int, int]:
        """Move every registered identifier to identifier key ``version`` in one
        write transaction (concurrent lookups see the old hashes until it commits,
        then the new ones; a concurrent registration waits for it and is redone):
        ``rehash(subject_ref, kind, sealed)`` gives a row's new hash, or None when
        its subject's key is gone (the row is deleted). Rows without a sealed value
        (registered before it existed) cannot be re-hashed: they are kept as they
        are, matching nothing any more, until the subject registers them again.
        Returns (re-hashed, deleted, kept)."""
        done = deleted = kept = 0
        with self._write() as conn:
            self._lock_identifier_version(conn, exclusive=True)
            rows = conn.execute(
                sa.select(
                    identifiers.c.hash,
                    identifiers.c.subject_ref,
                    identifiers.c.kind,
                    identifiers.c.sealed,
                )
            ).all()
            moves: list[dict[str, Any]] = []
            gone: list[dict[str, Any]] = []
            for old, ref, kind, sealed in rows:
                if sealed is None:
                    kept += 1
                    continue
                new = rehash(str(ref), str(kind), db.blob(sealed))
                if new is None:
                    gone.append({"o": old, "r": ref})
                elif new != old:
                    moves.append({"o": old, "r": ref, "n": new})
                done += new is not None
            where = sa.and_(
                identifiers.c.hash == sa.bindparam("o"),
                identifiers.c.subject_ref == sa.bindparam("r"),
            )
            if gone:
                conn.execute(identifiers.delete().where(where), gone)
            if moves:
                conn.execute(
                    identifiers.update().where(where).values(hash=sa.bindparam("n")), moves
                )
            conn.execute(
                identifier_key_version.update()
                .where(identifier_key_version.c.id == 1)
                .values(version=version)
            )
        deleted = len(gone)
        return done, deleted, kept

    def delete_identifiers(self, subject_ref: str) -> int:
        """Delete every identifier hash of the subject (``forget_identifiers``, and
        the erasure's catalog step)."""
        with self._write() as conn:
            return int(
                conn.execute(
                    identifiers.delete().where(identifiers.c.subject_ref == subject_ref)
                ).rowcount
            )

    def count_identifiers(self, subject_ref: str) -> int:
        with self.read() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(identifiers)
                    .where(identifiers.c.subject_ref == subject_ref)
                ).scalar_one()
            )

    def identifier_kinds(self) -> frozenset[str]:
        """The kinds of identifier registered at least once in this catalog (see
        ``add_identifiers``)."""
        with self.read() as conn:
            return frozenset(conn.execute(sa.select(identifier_kinds.c.kind)).scalars())

    def identifier_subjects(self, hashes: Collection[str]) -> list[tuple[str, str]]:
        """``(hash, subject_ref)`` of every registered identifier among ``hashes``,
        in one statement however many there are (a JSON array on SQLite, an array
        on PostgreSQL: one parameter, one plan)."""
        if not hashes:
            return []
        if self.dialect == "sqlite":
            sql = (
                "SELECT hash, subject_ref FROM ks_identifiers "
                "WHERE hash IN (SELECT value FROM json_each(?))"
            )
            param: Any = json.dumps(list(hashes))
        else:
            sql = "SELECT hash, subject_ref FROM ks_identifiers WHERE hash = ANY(%s)"
            param = list(hashes)
        with self._hot(write=False) as cur:
            cur.execute(sql, (param,))
            return [(str(h), str(r)) for h, r in cur.fetchall()]
