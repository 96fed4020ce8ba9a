"""The catalog: asset index, provenance, registered identifiers, consent records and
the subject guard, on SQLite (embedded profile) or PostgreSQL (distributed profile).

``Catalog`` composes its parts (``catalog_guard``, ``catalog_assets``,
``catalog_identifiers``, ``catalog_consents`` on ``catalog_base``); this module holds
the catalog's construction, the assets the vault lists through its hooks (its tokens
are assets the vault stores: ``keyshred.vault.store``), and snapshots. Tables are
defined in ``keyshred.storage.schema``; schema changes are the Alembic revisions of
``keyshred.migrations``, which the facade runs before it opens the catalog.
"""

from __future__ import annotations

import os
import sqlite3
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

if TYPE_CHECKING:
    from keyshred.storage.hot import ListedSegment

from keyshred.db import Micros, create_engine, micros, sqlite_url, utc
from keyshred.errors import ConfigError
from keyshred.storage.catalog_assets import ASSET_COLUMNS, AssetsMixin
from keyshred.storage.catalog_base import (
    ACTIVE,
    ERASED,
    SUPPRESSED,
    AssetRow,
    ConsentRecord,
    GuardState,
)
from keyshred.storage.catalog_consents import ConsentsMixin
from keyshred.storage.catalog_identifiers import IdentifiersMixin
from keyshred.storage.schema import (
    DECLARED,
    DETECTED,
    VERSION_TABLE,
    asset_mentions,
    asset_sources,
    assets,
    consents,
    metadata,
    subject_guard,
)

__all__ = [
    "ACTIVE",
    "ASSET_COLUMNS",
    "DECLARED",
    "DETECTED",
    "ERASED",
    "SUPPRESSED",
    "AssetRow",
    "Catalog",
    "CatalogSnapshot",
    "ConsentRecord",
    "GuardState",
    "Micros",
    "micros",
    "sqlite_url",
    "utc",
]


class Catalog(AssetsMixin, IdentifiersMixin, ConsentsMixin):
    """The asset index and policy state on SQLite or PostgreSQL.

    With ``create`` the catalog's tables are brought up to date at open:
    ``migrate(engine)`` when given (the facade passes ``keyshred.migrations.
    migrate_catalog``: Alembic revisions, a catalog from an older release upgraded in
    place), otherwise the storage tables that are missing are created as they are
    defined now (a catalog used on its own, by tests and tools; it is stamped and
    upgraded like any unversioned catalog when the facade opens it later). The
    storage layer does not import the migrations: they assemble the tables of the
    layers above it."""

    def __init__(
        self,
        url: str,
        *,
        create: bool = True,
        migrate: Callable[[Engine], None] | None = None,
        pool_size: int = 5,
        max_overflow: int = 10,
        pool_timeout: float = 30.0,
        pre_ping: bool = False,
        durable: bool = False,
    ) -> None:
        self.url = url
        self.engine = create_engine(
            url,
            what="catalog",
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            pre_ping=pre_ping,
            durable=durable,
        )
        self.dialect = self.engine.dialect.name
        self._mark = "?" if self.dialect == "sqlite" else "%s"  # DBAPI placeholders
        if create:
            try:
                if migrate is not None:
                    migrate(self.engine)
                else:
                    metadata.create_all(self.engine)
            except sa.exc.OperationalError:
                self.engine.dispose()
                raise ConfigError("the catalog database cannot be reached") from None
            except BaseException:
                self.engine.dispose()
                raise
        # Every table of the catalog database, the layers above included, is at the
        # newest revision: they need not create or check their own (the vault's).
        self.migrated = create and migrate is not None
        self._guard_setup()
        self.on_stale = None
        # The vault's tokens as assets, set by the vault (``keyshred.vault.store``),
        # whose tables the catalog does not know: a subject's (scope's), and one by id.
        self.token_assets: Callable[[str, str | None], list[AssetRow]] | None = None
        self.token_asset: Callable[[str], AssetRow | None] | None = None
        _CATALOGS.add(self)
        self._sql = self._compile_hot_statements()

    def _compile_hot_statements(self) -> dict[str, str]:
        """The statements of the paths every put and get takes, compiled once."""
        bp = sa.bindparam
        guard = sa.select(
            subject_guard.c.status,
            subject_guard.c.deletion_epoch,
            subject_guard.c.suppressed_scopes,
        ).where(subject_guard.c.subject_ref == bp("subject_ref"))
        statements: dict[str, Any] = {
            "guard": guard,
            "guard_positional": guard,
            "guard_lock": guard.with_for_update(read=True)
            if self.dialect == "postgresql"
            else guard,
            "insert_asset": assets.insert().values({c.name: bp(c.name) for c in assets.columns}),
            "insert_source": asset_sources.insert().values(
                asset_id=bp("asset_id"), source_id=bp("source_id")
            ),
            "insert_mention": asset_mentions.insert().values(
                asset_id=bp("asset_id"), subject_ref=bp("subject_ref"), how=bp("how")
            ),
            "delete_asset": assets.delete().where(assets.c.asset_id == bp("asset_id")),
            "delete_sources": asset_sources.delete().where(
                asset_sources.c.asset_id == bp("asset_id")
            ),
            "delete_mentions": asset_mentions.delete().where(
                asset_mentions.c.asset_id == bp("asset_id")
            ),
            "asset_ids": sa.select(assets.c.asset_id, assets.c.scope).where(
                assets.c.subject_ref == bp("subject_ref"), assets.c.kind == bp("kind")
            ),
            "consents_for": sa.select(consents).where(
                consents.c.subject_ref == bp("subject_ref"),
                consents.c.purpose == bp("purpose"),
                consents.c.category == bp("category"),
                consents.c.status == bp("active"),
            ),
        }
        # On SQLite these bind by position (a tuple: cheaper per row than a dict).
        return self.compile(statements, positional={"insert_asset", "guard_positional"})

    def asset_kinds(self, subject_ref: str, scope: str | None = None) -> dict[str, str]:
        """Asset id -> kind of every asset of the subject (or one of its scopes)."""
        with self.read() as conn:
            out = {
                str(a): str(k)
                for a, k in conn.execute(
                    sa.select(assets.c.asset_id, assets.c.kind).where(
                        self.subject_filter(subject_ref, scope)
                    )
                )
            }
        if self.token_assets is not None:
            out.update((t.asset_id, t.kind) for t in self.token_assets(subject_ref, scope))
        return out

    def assets(
        self,
        subject_ref: str,
        *,
        scope: str | None = None,
        kind: str | None = None,
        status: str | None = None,
    ) -> list[AssetRow]:
        where = self.subject_filter(subject_ref, scope)
        if kind is not None:
            where = sa.and_(where, assets.c.kind == kind)
        if status is not None:
            where = sa.and_(where, assets.c.status == status)
        with self.read() as conn:
            rows = self._rows(conn, where)
        if kind in (None, "token") and status in (None, "live") and self.token_assets:
            rows += self.token_assets(subject_ref, scope)
        return rows

    def asset(self, asset_id: str) -> AssetRow | None:
        with self.read() as conn:
            rows = self._rows(conn, assets.c.asset_id == asset_id)
        if not rows and asset_id.startswith("<") and self.token_asset is not None:
            return self.token_asset(asset_id)  # a token of the vault
        return rows[0] if rows else None

    # -- snapshots (backups) -------------------------------------------------------

    @contextmanager
    def snapshot(self) -> Iterator[CatalogSnapshot]:
        """The catalog at this instant. SQLite: a one-step copy through SQLite's
        backup API (a single read, milliseconds); PostgreSQL: a ``REPEATABLE READ``
        transaction pinned by its first read. The backup takes it while writers are
        frozen and exports it after they resume."""
        if self.dialect == "sqlite":
            fairy = self.engine.raw_connection()
            try:
                copy = sqlite3.connect(":memory:", check_same_thread=False)
                fairy.driver_connection.backup(copy)  # type: ignore[union-attr]
            finally:
                fairy.close()
            try:
                yield CatalogSnapshot(None, copy)
            finally:
                copy.close()
            return
        conn = self.engine.connect()
        try:
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                conn.execute(sa.select(sa.func.count()).select_from(subject_guard)).scalar()
                yield CatalogSnapshot(conn, None)
        finally:
            conn.close()

    def close(self) -> None:
        if self._generation is not None:
            self._generation.close()
            self._generation = None
        self.engine.dispose()

    def _forked(self) -> None:
        """In a forked child: the parent's connections stay the parent's (a database
        connection must not cross a fork); the child opens its own."""
        if self._generation is not None:
            self._generation.forked()
        self.engine.dispose(close=False)

    def __repr__(self) -> str:
        return f"Catalog(dialect={self.dialect!r})"


_CATALOGS: weakref.WeakSet[Catalog] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for catalog in list(_CATALOGS):
        catalog._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class CatalogSnapshot:
    """The catalog at one instant; ``export`` writes it as an embedded catalog."""

    def __init__(self, conn: Connection | None, copy: sqlite3.Connection | None) -> None:
        self._conn = conn
        self._copy = copy

    def live_segments(self) -> list[ListedSegment]:
        """Every subject's live memory segments at the snapshot's instant."""
        # Imported here: keyshred.storage.hot is built on this module.
        from keyshred.storage.hot import live_segments

        if self._conn is not None:
            return live_segments(self._conn)
        assert self._copy is not None  # noqa: S101 - one of the two is set
        engine = sa.create_engine("sqlite://", creator=lambda: self._copy, poolclass=sa.StaticPool)
        try:
            with engine.connect() as conn:
                return live_segments(conn)
        finally:
            engine.dispose(close=False)

    def export(self, path: str | os.PathLike[str]) -> None:
        """Write every table into a new SQLite catalog file at ``path``."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        if self._copy is not None:
            out = sqlite3.connect(target)
            try:
                self._copy.backup(out)
            finally:
                out.close()
            return
        assert self._conn is not None  # noqa: S101 - one of the two is set
        engine = sa.create_engine(sqlite_url(target), future=True)
        try:
            metadata.create_all(engine)
            with engine.begin() as dst:
                for table in metadata.sorted_tables:
                    result = self._conn.execute(sa.select(table)).mappings()
                    while batch := result.fetchmany(5000):
                        dst.execute(table.insert(), [dict(r) for r in batch])
                # The revision the tables are at, so the copy opens without upgrades
                # it does not need.
                if VERSION_TABLE in sa.inspect(self._conn).get_table_names():
                    version = sa.Table(
                        VERSION_TABLE,
                        sa.MetaData(),
                        sa.Column("version_num", sa.String(32), primary_key=True),
                    )
                    version.create(dst)
                    rows = self._conn.execute(sa.select(version)).mappings().all()
                    if rows:
                        dst.execute(version.insert(), [dict(r) for r in rows])
        finally:
            engine.dispose()
