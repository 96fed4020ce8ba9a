"""Wrapped DEKs that outlive their deletion in the database's own files (issue 19).

PostgreSQL: ``DELETE`` + ``VACUUM`` frees a destroyed key's tuple but leaves its bytes
in the page's free space (and in WAL, replicas, PITR archives). Read the raw heap
pages, recover the wrapped DEKs of a destroyed subject, and show that they unwrap
with the live keyring (the finding) until the live schedule rotates the live epoch
and destroys the old one (one period later), and never after.

SQLite: a copy of the key store file and its WAL taken before the erasure (a
filesystem snapshot, a replica) holds the same rows; the live schedule ends them too.

Both run through the scheduled maintenance (``ks.backup.maintain``) with a backup
generation retained, as production does: before the live lineage, the epoch that
wrapped the store sealed that backup and could not be destroyed for months.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import Config, Keyshred
from keyshred.errors import SubjectErased
from keyshred.keyring.envelope import Place
from keyshred.keyring.keystore import KeyRecord
from tests.conftest import PG_DSN
from tests.conftest import pg_schema as fresh_pg_schema

SCOPES = ("default", "support/health", "s3", "s4", "s5")
PERIOD = timedelta(minutes=61)  # past the default live period of 60 minutes


@dataclass
class Victim:
    ref: str
    key_ids: list[bytes]
    sealed: list[tuple[bytes, Place, bytes]]  # (ciphertext, place, plaintext)


def _seed(ks: Keyshred) -> Victim:
    """Other subjects' keys first, the victim's last (the newest tuples of the page),
    data sealed under each victim key (what dead tuples elsewhere keep), a backup."""
    for i in range(30):
        ks.keyring.data_key(ks.subject_ref(f"other-{i}"), "default")
    ref = ks.subject_ref("victim@example.org")
    sealed = []
    for scope in SCOPES:
        place = Place(ref, scope, "checkpoints", f"row-{scope}", "state")
        text = f"address of the victim in {scope}".encode()
        sealed.append((ks.keyring.seal(text, place), place, text))
    key_ids = [r.key_id for r in ks.keyring.store.for_subject(ref)]
    assert len(key_ids) == len(SCOPES)
    ks.backup.create()
    return Victim(ref, key_ids, sealed)


def _check_recovered(ks: Keyshred, victim: Victim, recovered: list[KeyRecord]) -> None:
    """The finding: each recovered wrapped DEK unwraps with the live keyring and
    decrypts the victim's data. Then the live schedule runs one period later, and
    none of them unwraps again (in this process or a fresh one)."""
    assert recovered, "no wrapped DEK of the victim was found in the residue"
    opened = 0
    ks.keyring.cache.clear()
    for record in recovered:
        key = ks.keyring._unwrap_record(record)
        for ciphertext, place, text in victim.sealed:
            if place.scope == record.scope:
                assert key.open(ciphertext, place) == text
                opened += 1
    assert opened == len(recovered)

    report = ks.backup.maintain(now=datetime.now(UTC) + PERIOD)
    assert report.rotated_to is not None
    assert {r.kek_epoch for r in recovered} <= {d.epoch for d in report.destroyed}
    ks.keyring.cache.clear()
    for record in recovered:
        with pytest.raises(SubjectErased):
            ks.keyring._unwrap_record(record)
    with Keyshred.open(ks.path, ks.config) as fresh:
        for record in recovered:
            with pytest.raises(SubjectErased):
                fresh.keyring._unwrap_record(record)


# -- PostgreSQL ----------------------------------------------------------------------


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A fresh schema (``ksr_...``), dropped after the test; also the fixture of
    test_pg_identifier_residue_attack.py."""
    with fresh_pg_schema("ksr") as schema:
        yield schema


def _raw_pages(table: str) -> list[bytes]:
    """Every heap page of ``table`` as raw bytes: through ``pageinspect`` if the user
    may use it, else from the table's file when this process can read it."""
    import psycopg

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        block = int(conn.execute("SHOW block_size").fetchone()[0])  # type: ignore[index]
        size = int(
            conn.execute("SELECT pg_relation_size(%s::regclass)", (table,)).fetchone()[0]  # type: ignore[index]
        )
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
            return [
                bytes(
                    conn.execute("SELECT get_raw_page(%s, %s)", (table, n)).fetchone()[0]  # type: ignore[index]
                )
                for n in range(size // block)
            ]
        except psycopg.Error as exc:
            reason = f"pageinspect unavailable ({type(exc).__name__})"
        try:
            conn.execute("CHECKPOINT")
            base = conn.execute("SHOW data_directory").fetchone()[0]  # type: ignore[index]
            rel = conn.execute("SELECT pg_relation_filepath(%s::regclass)", (table,)).fetchone()[0]  # type: ignore[index]
            data = (Path(base) / rel).read_bytes()
        except (psycopg.Error, OSError):
            pytest.skip(f"{reason}, and the table file is not readable here")
        return [data[i : i + block] for i in range(0, len(data), block)]


def _varlena(page: bytes, pos: int) -> tuple[bytes, int]:
    """A short (1-byte header) varlena at ``pos``: its bytes and the next offset."""
    header = page[pos]
    assert header & 1, "not a short varlena"
    length = (header >> 1) - 1
    return page[pos + 1 : pos + 1 + length], pos + 1 + length


def _parse_dek_tuple(page: bytes, pos: int) -> KeyRecord:
    """The ks_dek tuple whose data starts at ``pos`` (the key id's header): key_id,
    tenant, subject_ref, scope, kek_provider (short varlenas), kek_epoch (int4,
    4-aligned), wrapped (short varlena), created_at (8-aligned), owner_tag."""
    key_id, pos = _varlena(page, pos)
    tenant, pos = _varlena(page, pos)
    subject_ref, pos = _varlena(page, pos)
    scope, pos = _varlena(page, pos)
    provider, pos = _varlena(page, pos)
    pos += -pos % 4
    epoch = int.from_bytes(page[pos : pos + 4], "little")
    wrapped, pos = _varlena(page, pos + 4)
    pos += -pos % 8 + 8  # created_at: not needed
    tag, _ = _varlena(page, pos)
    return KeyRecord(
        key_id,
        tenant.decode(),
        subject_ref.decode(),
        scope.decode(),
        provider.decode(),
        epoch,
        wrapped,
        datetime.now(UTC),
        tag.decode(),
    )


def test_dead_tuple_deks_on_postgresql_are_useless_after_the_live_epoch_rotates(
    pg_schema: str, tmp_path: Path
) -> None:
    import psycopg

    url = f"postgresql://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{pg_schema}"
    config = Config.model_validate({"keyring": {"store_url": url}})
    ks = Keyshred.init(tmp_path / "data", config)
    try:
        victim = _seed(ks)
        req = ks.erase("victim@example.org", requested_by="dpo", reason="art17")
        assert req.state == "completed", req.error
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"VACUUM {pg_schema}.ks_dek")
            left = conn.execute(
                f"SELECT count(*) FROM {pg_schema}.ks_dek WHERE key_id = ANY(%s)",
                (victim.key_ids,),
            ).fetchone()
        assert left is not None and left[0] == 0  # deleted and vacuumed

        recovered: dict[bytes, KeyRecord] = {}
        for page in _raw_pages(f"{pg_schema}.ks_dek"):
            for key_id in victim.key_ids:
                at = page.find(bytes([(len(key_id) + 1) << 1 | 1]) + key_id)
                if at >= 0 and key_id not in recovered:
                    recovered[key_id] = _parse_dek_tuple(page, at)
        for record in recovered.values():
            assert record.subject_ref == victim.ref and record.kek_provider.startswith("local")
        _check_recovered(ks, victim, list(recovered.values()))
    finally:
        ks.close()


# -- SQLite --------------------------------------------------------------------------


def test_a_copy_of_the_sqlite_key_store_and_wal_is_useless_after_the_live_epoch_rotates(
    tmp_path: Path,
) -> None:
    ks = Keyshred.init(tmp_path / "data", Config())
    try:
        victim = _seed(ks)
        keys = ks.path / "keys"
        # A filesystem snapshot or replica taken before the erasure: the database
        # file and the WAL frames not yet checkpointed into it.
        snap = tmp_path / "snapshot"
        snap.mkdir()
        for name in ("keystore.db", "keystore.db-wal"):
            if (keys / name).exists():
                shutil.copyfile(keys / name, snap / name)
        wrapped = [r.wrapped for r in ks.keyring.store.for_subject(victim.ref)]
        req = ks.erase("victim@example.org", requested_by="dpo", reason="art17")
        assert req.state == "completed", req.error
        for name in ("keystore.db", "keystore.db-wal"):  # the live files hold no copy
            if (keys / name).exists():
                data = (keys / name).read_bytes()
                assert not any(w in data for w in wrapped), name

        db = sqlite3.connect(snap / "keystore.db")
        rows: list[Any] = db.execute(
            "SELECT key_id, tenant, subject_ref, scope, kek_provider, kek_epoch, wrapped, "
            "owner_tag FROM dek WHERE subject_ref = ?",
            (victim.ref,),
        ).fetchall()
        db.close()
        recovered = [
            KeyRecord(bytes(k), t, r, s, p, e, bytes(w), datetime.now(UTC), g)
            for k, t, r, s, p, e, w, g in rows
        ]
        assert sorted(r.key_id for r in recovered) == sorted(victim.key_ids)
        _check_recovered(ks, victim, recovered)
    finally:
        ks.close()
