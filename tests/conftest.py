"""Shared fixtures: data folders, the real servers (started once per session), and
``catalog_url``, which runs a test on SQLite and on the real PostgreSQL: the server
this machine kind runs on 127.0.0.1:5432 (database ``test``, trust auth; ``make
test`` checks it), one fresh schema per test through ``search_path``."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyshred import Keyshred
from tests.servers import Server, moto_server, openbao_dev_server

pytest_plugins = ["tests.xdist_text"]

# moto and boto3 need credentials and a region; these are moto's documented dummies
# and never reach AWS (every client gets an explicit loopback endpoint_url).
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

# pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment, and
# rich freezes a console's width from COLUMNS when the console is made (the CLI's is
# made at import): a CLI test that asks for a wider table would get 80 columns.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test`` runs the suite on two xdist workers (``--dist loadgroup``): each
    test file is one group, so its module-scoped servers start once; ``tests/api`` is
    one group, because its session server's logs are scanned by
    ``test_zz_log_scan.py`` after every other API test ran against it. First among
    the hooks: xdist's worker reads the marks in its own ``modifyitems`` (it appends
    ``@group`` to the node ids the scheduler groups by), and a mark added after it is
    ignored: tests of one file ran on both workers at once (pytest is also held
    below 9, whose node ids ignore what xdist appends: pyproject.toml)."""
    for item in items:
        parts = Path(str(item.path)).parts
        where = parts[parts.index("tests") :] if "tests" in parts else parts
        group = "tests/api" if where[:2] == ("tests", "api") else "/".join(where)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def openbao() -> Iterator[Server]:
    with openbao_dev_server() as server:
        yield server


@pytest.fixture(scope="session")
def moto() -> Iterator[Server]:
    with moto_server() as server:
        yield server


PG_DSN = "host=127.0.0.1 port=5432 dbname=test user=postgres"
BACKENDS = ["sqlite", "postgres"]


PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextlib.contextmanager
def pg_schema(prefix: str = "ks") -> Iterator[str]:
    """A fresh schema on the test PostgreSQL (``prefix`` and 12 hex digits), dropped
    with everything in it after the block; the test fails if the server is not
    reachable. ``pg_url(name)`` is keyshred's URL for it."""
    psycopg = pytest.importorskip("psycopg")
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        conn = psycopg.connect(PG_DSN, autocommit=True)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL on 127.0.0.1:5432 is not reachable: {exc}")
    try:
        conn.execute(f"CREATE SCHEMA {schema}")
        yield schema
    finally:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        conn.close()


@contextlib.contextmanager
def pg_role(*schemas: str) -> Iterator[str]:
    """A login role on the test PostgreSQL that may use ``schemas`` and nothing more;
    dropped after the block with what it owns (a schema named after it included).
    ``pg_url(schema)`` with its name for ``postgres`` connects as it (``as_role``)."""
    psycopg = pytest.importorskip("psycopg")
    role = f"ks_role_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_DSN, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        try:
            for schema in schemas:
                admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
            yield role
        finally:
            admin.execute(f"DROP SCHEMA IF EXISTS {role} CASCADE")
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


def as_role(role: str, url: str) -> str:
    """``url`` (one of ``pg_url``'s) connecting as ``role``."""
    assert "//postgres@" in url
    return url.replace("//postgres@", f"//{role}@", 1)


def pg_url(schema: str) -> str:
    """A SQLAlchemy URL of the test PostgreSQL whose ``search_path`` is ``schema``."""
    return f"{PG_URL}?options=-csearch_path%3D{schema}"


@pytest.fixture(params=BACKENDS)
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.db'}"
        return
    with pg_schema() as schema:
        yield pg_url(schema)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def ks(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Keyshred]:
    """A store on the embedded default (SQLite catalog, local folder) with the test
    scopes of ``tests/storage/conftest.make_config``; a module that needs another
    (both catalogs, a server) defines its own. Indirect ``"segments"``
    (``tests.storage.conftest.SEGMENTS``): compactions always write segments."""
    from tests.storage.conftest import make_config, parquet_config

    config = parquet_config if getattr(request, "param", "") == "segments" else make_config
    store = Keyshred.init(tmp_path / "data", config(None))
    yield store
    store.close()


def descriptors_under(folder: Path) -> list[str]:
    """The paths under ``folder`` this process holds open (Linux ``/proc``)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(str(folder)):
            out.append(target)
    return out
