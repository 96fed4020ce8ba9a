"""Review of ``DatabaseError`` (cb3b619): a store's databases damaged or altered the
way an operator mistake, a bad restore or an attacker would (tables dropped,
columns changed to another type, a role's privileges revoked, the schema dropped,
the SQLite file made read-only or overwritten), then every public surface called.

Found and fixed here:

* a generator method reached through a ``Guarded`` view (``ks.checkpoints
  .checkpoints``, what ``KeyshredSaver.list``/``alist`` iterate) ran its statements
  after the guarded call returned: the driver's error escaped, SQL text and all;
* the parts README names under a component (``ks.jobs.queue.list/depth/enqueue``,
  ``ks.keyring.store``) were handed out raw: the driver's error escaped, and the
  CLI's ``jobs list``, ``requests list``, ``metrics``, ``worker --once`` and ``keys
  status`` printed a traceback (exit 1) instead of one line (exit 2);
* the retention loop (``ks.retention.start``) caught ``KeyshredError`` only around
  the unguarded ``Lifecycle.run``: one driver error ended the thread for good;
* a key store column changed to another type (``wrapped`` to text, ``kek_epoch``
  to garbage) raised ``TypeError``/``ValueError`` out of every call that reads a
  key, ``ks.erase`` among them (the request stayed ``authorized``): now
  ``IntegrityError`` (an erasure then stops ``retryable_failure``).

Open (``xfail``, strict): a catalog column holding sealed bytes changed to text
(``ks_mem_hot.record``) still raises ``TypeError`` out of ``ks.memories.get``.

Holding: the typed messages name a driver class only (no subject id, value or
token original); an erasure that meets a dropped table is ``retryable_failure`` (or
raises ``DatabaseError`` with its job queued for a retry), never ``completed``,
and completes after the table is put back, another subject's data intact; on
PostgreSQL a role whose privileges are revoked mid-run, and a schema dropped
mid-run, give ``DatabaseError``; a SQLite catalog made read-only, or overwritten
with garbage, mid-run gives a ``KeyshredError``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from keyshred import DatabaseError, IntegrityError, Keyshred, KeyshredError
from keyshred.config import KeyringSettings
from tests.conftest import PG_DSN, pg_schema, pg_url
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

PROBE = "PROBE-ann-7f3a"
VALUE = "PROBE-val-9c1e"
EMAIL = f"{PROBE}@example.com"
HOUR = timedelta(hours=1)
THREAD = {"configurable": {"thread_id": f"t-{PROBE}", "checkpoint_ns": "", "subject": PROBE}}


def _fill(ks: Keyshred) -> str:
    """ann's memory, token and checkpoint, bob's memory; ann's token."""
    from langgraph.checkpoint.base import empty_checkpoint

    from keyshred.integrations.langgraph import KeyshredSaver

    ks.memories.put(PROBE, ("notes",), "trip", {"text": f"{VALUE} goes to Oslo"}, index=False)
    ks.memories.put("bob", ("notes",), "trip", "bob stays home", index=False)
    token = ks.vault.sanitize(f"mail {EMAIL}", PROBE, "support", HOUR).tokens[0]
    KeyshredSaver(ks).put(THREAD, empty_checkpoint(), {"source": "input", "step": 1}, {})
    return token


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("pristine") / "data"
    with Keyshred.init(root, embeddings=bag_of_words) as ks:
        token = _fill(ks)
    return root, token


@pytest.fixture
def store(pristine: tuple[Path, str], tmp_path: Path) -> tuple[Path, str]:
    """A copy of the pristine SQLite folder (closed); (folder, ann's token)."""
    root = tmp_path / "data"
    shutil.copytree(pristine[0], root)
    return root, pristine[1]


def _catalog(root: Path) -> Path:
    (path,) = (root / "catalog").glob("*.db")
    return path


def _sql(path: Path, *statements: str) -> list[str]:
    """Run ``statements`` on a SQLite file; the DDL of the tables they name first."""
    conn = sqlite3.connect(path)
    try:
        ddl = [r[0] for r in conn.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL")]
        for s in statements:
            conn.execute(s)
        conn.commit()
    finally:
        conn.close()
    return ddl


def _ddl_of(ddl: list[str], table: str) -> list[str]:
    return [d for d in ddl if f" {table} " in d or f" {table}(" in d or f'"{table}"' in d]


def _clean(exc: BaseException) -> None:
    """A typed error whose message carries nothing of ann's."""
    assert isinstance(exc, KeyshredError), f"{type(exc).__module__}.{type(exc).__name__}"
    text = str(exc)
    for secret in (PROBE, VALUE, EMAIL, "SELECT", "INSERT", "ks_"):
        assert secret not in text, text


def _typed(call: Callable[[], object]) -> KeyshredError:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what escapes is the finding
        _clean(exc)
        assert isinstance(exc, KeyshredError)
        return exc
    pytest.fail("the call did not fail")


def _open(root: Path, config: Any = None) -> Keyshred:
    return Keyshred.open(root, config, embeddings=bag_of_words)


def _close(ks: Keyshred) -> None:
    try:
        ks.close()
    except KeyshredError as exc:
        _clean(exc)


# -- generators behind a Guarded view ----------------------------------------------


@pytest.mark.parametrize("table", ["ks_checkpoints", "ks_checkpoint_writes"])
def test_checkpoint_listings_are_typed_when_their_table_is_gone(
    store: tuple[Path, str], table: str
) -> None:
    """``ks.checkpoints.checkpoints`` is a generator: its statements ran after the
    guarded call returned, and ``KeyshredSaver.list``/``alist`` raised the raw
    ``sqlalchemy.exc.OperationalError`` (its SQL text in the message)."""
    from keyshred.integrations.langgraph import KeyshredSaver

    root, _ = store
    _sql(_catalog(root), f"DROP TABLE {table}")
    ks = _open(root)
    try:
        saver = KeyshredSaver(ks)

        async def alist() -> list[Any]:
            return [t async for t in saver.alist(THREAD)]

        for call in (
            lambda: list(saver.list(THREAD)),
            lambda: list(saver.list(None)),
            lambda: asyncio.run(alist()),
            lambda: list(ks.checkpoints.checkpoints(None)),
        ):
            assert isinstance(_typed(call), DatabaseError)
    finally:
        _close(ks)


# -- parts under a component: ks.jobs.queue, ks.keyring.store ------------------------


def test_the_job_queue_and_key_store_parts_are_typed(store: tuple[Path, str]) -> None:
    root, _ = store
    _sql(_catalog(root), "DROP TABLE ks_jobs")
    _sql(root / "keys" / "keystore.db", "DROP TABLE dek")
    ks = _open(root)
    try:
        for call in (
            lambda: ks.jobs.queue.list(),  # noqa: PLW0108 - the part is read inside the check
            lambda: ks.jobs.queue.depth(),  # noqa: PLW0108 - the part is read inside the check
            lambda: ks.jobs.queue.enqueue("retention", {"period": "1"}, dedupe_key="r:1"),
            lambda: ks.keyring.store.counts(),  # noqa: PLW0108 - the part is read inside the check
        ):
            assert isinstance(_typed(call), DatabaseError)
    finally:
        _close(ks)
    ks = _open(root)
    ks.close()
    with pytest.raises(KeyshredError):  # closed: the part refuses as its component does
        ks.jobs.queue.depth()


@pytest.mark.parametrize(
    ("damage", "argv"),
    [
        ("ks_jobs", ["jobs", "list"]),
        ("ks_deletion_requests", ["requests", "list"]),
        ("ks_jobs", ["metrics"]),
        ("ks_jobs", ["worker", "--once"]),
        ("dek", ["keys", "status"]),
    ],
)
def test_cli_on_a_damaged_store_says_one_line_and_exits_2(
    store: tuple[Path, str],
    damage: str,
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from keyshred import cli

    root, _ = store
    target = root / "keys" / "keystore.db" if damage == "dek" else _catalog(root)
    _sql(target, f"DROP TABLE {damage}")
    monkeypatch.setenv("KEYSHRED_EMBEDDINGS", "none")
    monkeypatch.setattr(sys, "argv", ["keyshred", *argv, "--path", str(root)])
    with pytest.raises(SystemExit) as ended:
        cli.main()
    err = capsys.readouterr().err
    assert ended.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith("keyshred: error: "), err
    assert "Traceback" not in err and "SELECT" not in err and PROBE not in err


# -- background loops ---------------------------------------------------------------


def test_the_retention_loop_outlives_a_dropped_table(store: tuple[Path, str]) -> None:
    """``Lifecycle.start``'s loop caught ``KeyshredError`` around the unguarded
    ``run``: a driver error ended the thread ("retried at the next interval" no
    more) and printed SQL through ``threading.excepthook``."""
    root, _ = store
    ddl = _sql(_catalog(root), "DROP TABLE ks_mem_segments")
    died: list[str] = []
    hook = threading.excepthook
    threading.excepthook = lambda a: died.append(a.exc_type.__name__)  # type: ignore[assignment]
    ks = _open(root)
    try:
        thread = ks.retention.start(interval_minutes=0.001)  # every 60 ms
        time.sleep(0.5)
        assert thread.is_alive() and not died, died
        _sql(_catalog(root), *_ddl_of(ddl, "ks_mem_segments"))
        report = ks.retention.run()  # repaired: runs again
        assert report is not None
        assert thread.is_alive()
    finally:
        threading.excepthook = hook
        ks.retention.stop(2)
        _close(ks)


# -- columns altered to another type --------------------------------------------------


@pytest.mark.parametrize(
    "change",
    ["UPDATE dek SET wrapped = hex(wrapped)", "UPDATE dek SET kek_epoch = 'x'"],
)
def test_a_key_row_of_another_type_is_an_integrity_error(
    store: tuple[Path, str], change: str
) -> None:
    """Was ``TypeError: string argument without an encoding`` / ``ValueError``
    out of every call that reads a key, ``ks.erase`` included."""
    root, token = store
    _sql(root / "keys" / "keystore.db", change)
    ks = _open(root)
    try:
        for call in (
            lambda: ks.memories.get(PROBE, ("notes",), "trip"),
            lambda: ks.memories.put(PROBE, ("notes",), "k", VALUE, index=False),
            lambda: ks.vault.detokenize(token, "support", "app"),
        ):
            assert isinstance(_typed(call), IntegrityError)
        req = ks.erase(PROBE, requested_by="dpo", reason="art17")
        assert req.state == "retryable_failure", req.state
        assert req.error == "destroy_keys: IntegrityError"
    finally:
        _close(ks)


def _search(ks: Keyshred) -> object:
    return ks.memories.search("bob", ("facts",), query="tea", limit=1)


def _namespaces(ks: Keyshred) -> object:
    from keyshred.integrations.langgraph import KeyshredStore

    return KeyshredStore(ks).list_namespaces()


@pytest.mark.parametrize(
    ("column", "call"),
    [
        ("ks_mem_hot.record", lambda ks, token: ks.memories.get("bob", ("notes",), "trip")),
        ("ks_tokens.value", lambda ks, token: ks.vault.detokenize(token, "support", "agent")),
        (
            "ks_checkpoints.data",
            lambda ks, token: (
                __import__("keyshred.integrations.langgraph", fromlist=["KeyshredSaver"])
                .KeyshredSaver(ks)
                .get_tuple(THREAD)
            ),
        ),
        ("ks_mem_vectors.vec", lambda ks, token: _search(ks)),
        ("ks_mem_namespaces.labels", lambda ks, token: _namespaces(ks)),
    ],
)
def test_a_sealed_column_changed_to_text_is_an_integrity_error(
    store: tuple[Path, str], column: str, call: Callable[[Keyshred, str], object]
) -> None:
    """A catalog BLOB column whose values were rewritten as text (SQLite keeps any
    type in any column): the read raises ``IntegrityError``, as any other altered
    sealed value does, not ``TypeError`` out of a ``bytes(str)``."""
    root, token = store
    with _open(root) as ks:  # bob's indexed memory, for the vectors' row
        ks.memories.put("bob", ("facts",), "drink", "bob drinks tea", index=True)
    table, name = column.split(".")
    _sql(_catalog(root), f"UPDATE {table} SET {name} = hex({name})")
    ks = _open(root)
    try:
        assert isinstance(_typed(lambda: call(ks, token)), IntegrityError)
    finally:
        _close(ks)


# -- erasures on a damaged catalog, and after its repair --------------------------------


@pytest.mark.parametrize(
    ("table", "raises"),
    [
        ("ks_checkpoint_writes", False),  # a store step: retryable_failure
        ("ks_mem_namespaces", False),
        ("ks_legal_holds", True),  # before the steps: DatabaseError, job queued
        ("ks_erasure_items", True),  # a step's record: DatabaseError, job queued
    ],
)
def test_an_erasure_on_a_damaged_catalog_is_never_completed_and_resumes_after_repair(
    store: tuple[Path, str], table: str, raises: bool
) -> None:
    root, token = store
    ddl = _sql(_catalog(root), f"DROP TABLE {table}")
    ks = _open(root)
    try:
        if raises:
            _typed(lambda: ks.erase(PROBE, requested_by="dpo", reason="art17"))
            (req,) = ks.erasure.requests(PROBE)
            (job,) = ks.jobs.queue.list()
            assert job.state == "queued" and job.last_error == "OperationalError"
        else:
            req = ks.erase(PROBE, requested_by="dpo", reason="art17")
            assert req.state == "retryable_failure" and req.error is not None
            assert PROBE not in req.error and req.error.endswith(": OperationalError")
        assert req.state != "completed"
        assert ks.erasure.receipt(req.request_id) is None
    finally:
        _close(ks)
    _sql(_catalog(root), *_ddl_of(ddl, table))
    ks = _open(root)
    try:
        done = ks.erasure.resume(req.request_id)
        assert done.state == "completed", (done.state, done.error)
        assert ks.erasure.receipt(req.request_id) is not None
        assert ks.memories.get("bob", ("notes",), "trip").value == "bob stays home"
        _typed(lambda: ks.vault.detokenize(token, "support", "app"))  # erased
    finally:
        ks.close()


# -- the SQLite file itself ------------------------------------------------------------


def test_a_read_only_or_overwritten_catalog_mid_run_is_typed(store: tuple[Path, str]) -> None:
    root, _ = store
    path = _catalog(root)
    ks = _open(root)
    try:
        ks.memories.get("bob", ("notes",), "trip")
        if os.geteuid() != 0:  # root writes a 0400 file all the same
            path.chmod(stat.S_IRUSR)
            _typed(lambda: ks.memories.put("bob", ("notes",), "k", VALUE, index=False))
            path.chmod(stat.S_IRUSR | stat.S_IWUSR)
        # Garbage over the file (and its WAL) while the handle is open.
        for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            if p.exists():
                p.write_bytes(b"\x00garbage" * 4096)
        for call in (
            lambda: ks.memories.put(PROBE, ("notes",), "k2", VALUE, index=False),
            lambda: ks.vault.sanitize(f"mail {EMAIL}", PROBE, "support", HOUR),
            lambda: ks.deletion_epoch(PROBE),
            lambda: ks.erase(PROBE, requested_by="dpo", reason="art17"),
        ):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - what escapes is the finding
                _clean(exc)
    finally:
        _close(ks)
    with pytest.raises(KeyshredError) as caught:
        _open(root)
    _clean(caught.value)


# -- PostgreSQL: a role's privileges revoked mid-run, the schema dropped mid-run -----


@pytest.fixture
def pg_store(tmp_path: Path) -> Iterator[tuple[Path, Any, str, str]]:
    """A folder whose catalog and key store are one fresh PostgreSQL schema, used
    by its own role; (folder, config, schema, role)."""
    psycopg = pytest.importorskip("psycopg")
    role = f"ks_role_{uuid.uuid4().hex[:10]}"
    with pg_schema() as schema:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN")
            conn.execute(f"GRANT ALL ON SCHEMA {schema} TO {role}")
        url = pg_url(schema).replace("postgres@", f"{role}@")
        cfg = make_config(url).model_copy(update={"keyring": KeyringSettings(store_url=url)})
        try:
            yield tmp_path / "data", cfg, schema, role
        finally:
            with psycopg.connect(PG_DSN, autocommit=True) as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                    (role,),
                )
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
                conn.execute(f"DROP OWNED BY {role}")
                conn.execute(f"DROP ROLE {role}")


def _pg(statement: str) -> None:
    import psycopg

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(statement)


def test_postgres_privileges_revoked_mid_run_then_granted_back(
    pg_store: tuple[Path, Any, str, str],
) -> None:
    root, cfg, schema, role = pg_store
    ks = Keyshred.init(root, cfg, embeddings=bag_of_words)
    try:
        token = _fill(ks)
        # The tables are the role's own: take them away, as a restore by another
        # owner would leave them.
        _pg(f"REASSIGN OWNED BY {role} TO postgres")
        _pg(f"REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}")
        _pg(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {role}")
        for call in (
            lambda: ks.memories.get(PROBE, ("notes",), "trip"),
            lambda: ks.memories.put("carl", ("notes",), "k", VALUE, index=False),
            lambda: ks.vault.detokenize(token, "support", "app"),
            lambda: ks.deletion_epoch(PROBE),
            lambda: ks.jobs.queue.depth(),  # noqa: PLW0108 - the part is read inside the check
            lambda: ks.keyring.store.counts(),  # noqa: PLW0108 - the part is read inside the check
            lambda: ks.erase(PROBE, requested_by="dpo", reason="art17"),
        ):
            assert isinstance(_typed(call), DatabaseError)
        _pg(f"GRANT ALL ON ALL TABLES IN SCHEMA {schema} TO {role}")
        _pg(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA {schema} TO {role}")
        (req,) = ks.erasure.requests(PROBE) or [None]
        if req is None:  # refused before it was recorded
            req = ks.erase(PROBE, requested_by="dpo", reason="art17")
        done = ks.erasure.resume(req.request_id)
        assert done.state == "completed", (done.state, done.error)
        assert ks.memories.get("bob", ("notes",), "trip").value == "bob stays home"
    finally:
        _close(ks)


def test_postgres_schema_dropped_mid_run(pg_store: tuple[Path, Any, str, str]) -> None:
    root, cfg, schema, _ = pg_store
    ks = Keyshred.init(root, cfg, embeddings=bag_of_words)
    try:
        token = _fill(ks)
        _pg(f"DROP SCHEMA {schema} CASCADE")
        from keyshred.integrations.langgraph import KeyshredSaver, KeyshredStore

        saver, lg = KeyshredSaver(ks), KeyshredStore(ks)
        for call in (
            lambda: ks.memories.get(PROBE, ("notes",), "trip"),
            lambda: ks.memories.search(PROBE, ("notes",)),
            lambda: ks.vault.sanitize(f"mail {EMAIL}", PROBE, "support", HOUR),
            lambda: ks.vault.detokenize(token, "support", "app"),
            lambda: ks.consent.list(PROBE),
            lambda: ks.erasure.requests(PROBE),
            lambda: ks.jobs.queue.list(),  # noqa: PLW0108 - the part is read inside the check
            lambda: list(saver.list(None)),
            lambda: saver.get_tuple(THREAD),
            lambda: lg.get((PROBE, "notes"), "trip"),
            lambda: ks.erase(PROBE, requested_by="dpo", reason="art17"),
        ):
            assert isinstance(_typed(call), DatabaseError)
    finally:
        _close(ks)
    try:  # the open refuses (or starts afresh): typed either way
        _open(root, cfg).close()
    except Exception as exc:  # noqa: BLE001 - what escapes is the finding
        _clean(exc)


# -- the HTTP answer for DatabaseError -------------------------------------------------


def test_the_api_answers_database_error_with_a_500_naming_the_class_only() -> None:
    from keyshred._handle import typed
    from keyshred.api.problems import from_error

    mapped = typed(sqlite3.OperationalError(f"no such table: ks_x -- {PROBE}"))
    assert isinstance(mapped, DatabaseError)
    body = from_error(mapped).body()
    assert body["status"] == 500 and body.get("detail") == "DatabaseError", body
    assert PROBE not in str(body)
