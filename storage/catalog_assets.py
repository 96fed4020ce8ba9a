"""The asset index: assets with their provenance (``sources``) and mention edges,
registered in one write transaction that re-checks every subject's guard."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from keyshred.db import utc
from keyshred.errors import InvalidInput, SubjectSuppressed
from keyshred.storage.catalog_base import (
    ACTIVE,
    AssetRow,
    GuardState,
    chunks,
    sqlite_time,
)
from keyshred.storage.catalog_guard import GuardMixin
from keyshred.storage.schema import (
    DECLARED,
    DETECTED,
    asset_mentions,
    asset_sources,
    assets,
    subject_guard,
)

__all__ = ["ASSET_COLUMNS", "AssetsMixin"]

ASSET_COLUMNS = tuple(c.name for c in assets.columns)
_TIME_COLUMNS = tuple(i for i, c in enumerate(assets.columns) if isinstance(c.type, sa.DateTime))


class AssetsMixin(GuardMixin):
    """Assets, provenance and mentions."""

    # -- assets --------------------------------------------------------------------

    def register(
        self,
        rows: Sequence[AssetRow],
        *,
        expected_epoch: int | None = None,
        replace: bool = True,
        remove: Sequence[str] = (),
    ) -> None:
        """Insert (or, with ``replace``, replace) assets and delete ``remove``,
        re-checking every subject's guard in the same write transaction: nothing is
        written if any subject is suppressed or the epoch is stale."""
        if not rows and not remove:
            return
        self.insert_assets(
            [self.asset_params(r) for r in rows],
            scopes={(r.subject_ref, r.scope) for r in rows},
            expected_epoch=expected_epoch,
            replace=[*remove, *(r.asset_id for r in rows)] if replace or remove else (),
            sources=[(r.asset_id, src) for r in rows for src in r.sources],
            mentions=[(r.asset_id, m) for r in rows for m in set(r.mentions)],
        )

    def asset_params(self, r: AssetRow) -> tuple[Any, ...]:
        """An asset as ``insert_assets`` takes it: its ``ASSET_COLUMNS``, times bound
        for this dialect."""
        values = [getattr(r, name) for name in ASSET_COLUMNS]
        for i in _TIME_COLUMNS:
            if values[i] is not None:
                values[i] = self.time_param(values[i])
        return tuple(values)

    def insert_assets(
        self,
        params: Sequence[tuple[Any, ...]],
        *,
        scopes: Iterable[tuple[str, str]],
        expected_epoch: int | None = None,
        replace: Sequence[str] = (),
        sources: Sequence[tuple[str, str]] = (),
        mentions: Sequence[tuple[str, str]] = (),
        detected: Collection[tuple[str, str]] = (),
        also: Callable[[Any], None] | None = None,
    ) -> None:
        """``register``'s one transaction, for callers that build rows themselves
        (a batch of memories): ``params`` are tuples in ``ASSET_COLUMNS`` order with
        times from ``time_param``; ``replace`` names assets (and their edges) to
        delete first; ``sources``/``mentions`` are ``(asset_id, other)`` edges, those
        of ``mentions`` also in ``detected`` recorded as found in the value rather
        than declared. The guard of every ``(subject_ref, scope)`` is re-checked in
        the transaction; ``also`` then runs its statements on the same cursor (a
        put's hot rows: one transaction, one commit)."""
        sql = self._sql
        with self._hot(write=True) as cur:
            states: dict[str, GuardState] = {}
            for ref, scope in scopes:
                state = states.get(ref)
                if state is None:
                    state = states[ref] = self._guard_row(cur, ref, True)
                self.enforce(ref, state, expected_epoch, scope)
            if also is not None:
                also(cur)
            if replace:
                ids = [{"asset_id": a} for a in dict.fromkeys(replace)]
                for name in ("delete_sources", "delete_mentions", "delete_asset"):
                    cur.executemany(sql[name], ids)
            if not params:
                return
            bound: Sequence[Any] = params
            if self.dialect != "sqlite":
                bound = [dict(zip(ASSET_COLUMNS, row, strict=True)) for row in params]
            if len(bound) == 1:
                cur.execute(sql["insert_asset"], bound[0])
            else:
                cur.executemany(sql["insert_asset"], bound)
            if sources:
                cur.executemany(
                    sql["insert_source"], [{"asset_id": a, "source_id": s} for a, s in sources]
                )
            if mentions:
                # A mention of a subject suppressed or erased meanwhile: refused in the
                # transaction that would record it (its erasure's closure may already
                # have been taken, and would miss this asset).
                for ref, state in self._guard_rows(cur, {m for _, m in mentions}).items():
                    if state.status != ACTIVE:
                        raise SubjectSuppressed(
                            f"the memory is about subject_ref {ref}, which is being erased "
                            "or was erased"
                        )
                found = set(detected)
                cur.executemany(
                    sql["insert_mention"],
                    [
                        {
                            "asset_id": a,
                            "subject_ref": m,
                            "how": DETECTED if (a, m) in found else DECLARED,
                        }
                        for a, m in mentions
                    ],
                )

    def time_param(self, value: datetime) -> Any:
        """A datetime as this dialect's hot statements bind it."""
        return sqlite_time(value) if self.dialect == "sqlite" else value

    def update_assets(self, asset_ids: Sequence[str], **values: Any) -> int:
        """Update metadata columns (status, retain_until, …) of existing assets."""
        allowed = {"status", "retain_until", "storage_key", "lookup"}
        if not set(values) <= allowed:
            raise InvalidInput(f"only {sorted(allowed)} can be updated")
        with self._write() as conn:
            n = 0
            for chunk in chunks(asset_ids):
                n += conn.execute(
                    assets.update().where(assets.c.asset_id.in_(chunk)).values(**values)
                ).rowcount
            return n

    @staticmethod
    def _delete_ids(conn: Connection, ids: Sequence[str]) -> int:
        n = 0
        for chunk in chunks(ids):
            conn.execute(asset_sources.delete().where(asset_sources.c.asset_id.in_(chunk)))
            conn.execute(asset_mentions.delete().where(asset_mentions.c.asset_id.in_(chunk)))
            n += conn.execute(assets.delete().where(assets.c.asset_id.in_(chunk))).rowcount
        return n

    def delete(self, asset_ids: Sequence[str], conn: Connection | None = None) -> int:
        """Physically remove asset rows and their provenance edges: in ``conn``'s
        transaction when given (with the rows the assets stand for), else in one
        of their own."""
        if conn is not None:
            return self._delete_ids(conn, asset_ids)
        with self._write() as own:
            return self._delete_ids(own, asset_ids)

    @staticmethod
    def subject_filter(subject_ref: str, scope: str | None, table: sa.Table = assets) -> Any:
        """The rows of ``table`` (assets, tokens) of a subject, or of one scope."""
        where = table.c.subject_ref == subject_ref
        return where if scope is None else sa.and_(where, table.c.scope == scope)

    def delete_subject_assets(self, subject_ref: str, scope: str | None = None) -> int:
        """Delete every asset of the subject (or scope) and its provenance edges in
        three statements, however many assets there are."""
        own = sa.select(assets.c.asset_id).where(self.subject_filter(subject_ref, scope))
        with self._write() as conn:
            conn.execute(asset_sources.delete().where(asset_sources.c.asset_id.in_(own)))
            conn.execute(asset_mentions.delete().where(asset_mentions.c.asset_id.in_(own)))
            return int(
                conn.execute(
                    assets.delete().where(self.subject_filter(subject_ref, scope))
                ).rowcount
            )

    def _rows(self, conn: Connection, where: Any) -> list[AssetRow]:
        rows = conn.execute(sa.select(assets).where(where)).all()
        if not rows:
            return []
        ids = [r.asset_id for r in rows]
        srcs: dict[str, list[str]] = {}
        mens: dict[str, list[str]] = {}
        for chunk in chunks(ids):
            for a, s in conn.execute(
                sa.select(asset_sources.c.asset_id, asset_sources.c.source_id).where(
                    asset_sources.c.asset_id.in_(chunk)
                )
            ):
                srcs.setdefault(a, []).append(s)
            for a, m in conn.execute(
                sa.select(asset_mentions.c.asset_id, asset_mentions.c.subject_ref).where(
                    asset_mentions.c.asset_id.in_(chunk)
                )
            ):
                mens.setdefault(a, []).append(m)
        return [
            AssetRow(
                r.asset_id,
                r.subject_ref,
                r.scope,
                r.kind,
                r.storage_system,
                r.storage_key,
                r.purpose,
                r.category,
                utc(r.created_at),  # type: ignore[arg-type]
                utc(r.retain_until),
                r.status,
                r.lookup,
                r.producer,
                r.producer_version,
                tuple(sorted(srcs.get(r.asset_id, ()))),
                tuple(sorted(mens.get(r.asset_id, ()))),
            )
            for r in rows
        ]

    def asset_ids(self, subject_ref: str, kind: str) -> dict[str, str]:
        """Asset id -> scope of a subject's assets of one kind."""
        with self._hot(write=False) as cur:
            cur.execute(self._sql["asset_ids"], {"subject_ref": subject_ref, "kind": kind})
            return {row[0]: row[1] for row in cur.fetchall()}

    def count(self, subject_ref: str | None = None, kind: str | None = None) -> int:
        query = sa.select(sa.func.count()).select_from(assets)
        if subject_ref is not None:
            query = query.where(assets.c.subject_ref == subject_ref)
        if kind is not None:
            query = query.where(assets.c.kind == kind)
        with self.read() as conn:
            return int(conn.execute(query).scalar_one())

    def expired(self, kind: str, now: datetime) -> dict[str, list[str]]:
        """Asset ids of ``kind`` whose retain-until has passed, by subject_ref."""
        out: dict[str, list[str]] = {}
        with self.read() as conn:
            for asset_id, ref in conn.execute(
                sa.select(assets.c.asset_id, assets.c.subject_ref).where(
                    assets.c.kind == kind,
                    assets.c.retain_until.is_not(None),
                    assets.c.retain_until <= now,
                )
            ):
                out.setdefault(str(ref), []).append(str(asset_id))
        return out

    def subjects_with(self, kind: str) -> list[str]:
        """subject_refs that hold assets of ``kind`` and are not suppressed."""
        with self.read() as conn:
            refs = [
                str(r)
                for (r,) in conn.execute(
                    sa.select(assets.c.subject_ref).where(assets.c.kind == kind).distinct()
                )
            ]
            hidden = {
                str(r)
                for (r,) in conn.execute(
                    sa.select(subject_guard.c.subject_ref).where(subject_guard.c.status != ACTIVE)
                )
            }
        return sorted(r for r in refs if r not in hidden)

    def derived_from(self, source_ids: Iterable[str]) -> list[AssetRow]:
        """Assets whose provenance names any of ``source_ids`` (reverse index)."""
        ids = list(source_ids)
        found: set[str] = set()
        with self.read() as conn:
            for chunk in chunks(ids):
                found.update(
                    conn.execute(
                        sa.select(asset_sources.c.asset_id).where(
                            asset_sources.c.source_id.in_(chunk)
                        )
                    ).scalars()
                )
            return self._rows(conn, assets.c.asset_id.in_(sorted(found))) if found else []

    def derived_from_subject(self, subject_ref: str, scope: str | None = None) -> list[AssetRow]:
        """Assets of other subjects (or scopes) whose provenance names any asset of
        this subject (scope): one join, however many assets the subject has."""
        own = sa.select(assets.c.asset_id).where(self.subject_filter(subject_ref, scope))
        with self.read() as conn:
            ids = set(
                conn.execute(
                    sa.select(asset_sources.c.asset_id).where(asset_sources.c.source_id.in_(own))
                ).scalars()
            )
            own_ids = set(conn.execute(own).scalars())
            ids -= own_ids
            return self._rows(conn, assets.c.asset_id.in_(sorted(ids))) if ids else []

    def source_owners(self, source_ids: Iterable[str]) -> dict[str, set[str]]:
        """Every owner each source asset is about, as owner tokens
        (``keyshred.keyring.keystore.owner_token``): its holder's data in its scope
        (``ref@scope``) and the subjects it mentions (``ref``), and the same of its own
        sources, transitively (a derived asset of a derived asset). One recursive
        query over the provenance and mention tables, however many sources and
        levels. Sources the catalog does not hold (erased) have no owners."""
        ids = sorted(set(source_ids))
        if not ids:
            return {}
        # UNION, not UNION ALL: a cycle in the provenance graph ends the walk.
        sql = sa.text(
            f"""
            WITH RECURSIVE walk(root, asset_id) AS (
                SELECT asset_id, asset_id FROM {assets.name} WHERE asset_id IN :ids
                UNION
                SELECT walk.root, s.source_id FROM walk
                JOIN {asset_sources.name} s ON s.asset_id = walk.asset_id
            )
            SELECT walk.root, a.subject_ref || '@' || a.scope FROM walk
            JOIN {assets.name} a ON a.asset_id = walk.asset_id
            UNION
            SELECT walk.root, m.subject_ref FROM walk
            JOIN {asset_mentions.name} m ON m.asset_id = walk.asset_id
            """  # noqa: S608 - table names are ours, values are bound
        ).bindparams(sa.bindparam("ids", expanding=True))
        out: dict[str, set[str]] = {}
        with self.read() as conn:
            for root, owner in conn.execute(sql, {"ids": ids}):
                out.setdefault(str(root), set()).add(str(owner))
        return out

    def any_source_in(self, source_ids: Sequence[str]) -> int:
        """How many provenance edges still name one of ``source_ids``."""
        n = 0
        with self.read() as conn:
            for chunk in chunks(list(source_ids), 900):
                n += int(
                    conn.execute(
                        sa.select(sa.func.count())
                        .select_from(asset_sources)
                        .where(asset_sources.c.source_id.in_(chunk))
                    ).scalar_one()
                )
        return n

    def mentioning(self, subject_ref: str) -> list[AssetRow]:
        with self.read() as conn:
            ids = list(
                conn.execute(
                    sa.select(asset_mentions.c.asset_id).where(
                        asset_mentions.c.subject_ref == subject_ref
                    )
                ).scalars()
            )
            return self._rows(conn, assets.c.asset_id.in_(ids)) if ids else []

    def detected_mentions(self, asset_id: str) -> frozenset[str]:
        """The subjects an asset mentions because their identifiers were found in its
        value (not declared): a rewrite that keeps the mentions keeps how they came."""
        with self.read() as conn:
            return frozenset(
                conn.execute(
                    sa.select(asset_mentions.c.subject_ref).where(
                        asset_mentions.c.asset_id == asset_id,
                        asset_mentions.c.how == DETECTED,
                    )
                ).scalars()
            )

    def mention_counts(self) -> dict[str, int]:
        """Mentions recorded, by how they came: ``{"declared": n, "detected": m}``."""
        counts = {DECLARED: 0, DETECTED: 0}
        with self.read() as conn:
            for how, n in conn.execute(
                sa.select(asset_mentions.c.how, sa.func.count()).group_by(asset_mentions.c.how)
            ):
                counts[str(how)] = int(n)
        return counts
