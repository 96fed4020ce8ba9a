"""The attack and review tests' ``ks``: a store on both catalogs (SQLite and the real
PostgreSQL: ``catalog_url`` of tests/conftest.py) with the test scopes of
``tests.storage.conftest.make_config``. It overrides the root ``ks`` (the embedded
default) for every file here, without an import (a fixture imported into each module
made ruff flag every test's ``ks`` argument, F811); a file that needs the embedded
default defines its own ``ks``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from keyshred import Keyshred
from tests.storage.conftest import make_config


@pytest.fixture
def ks(catalog_url: str, tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    yield store
    store.close()
