"""Shared fixtures: data folders, and the real servers (started once per session)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import Server, moto_server, openbao_dev_server

# moto and boto3 need credentials and a region; these are moto's documented dummies
# and never reach AWS (every client gets an explicit loopback endpoint_url).
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def openbao() -> Iterator[Server]:
    with openbao_dev_server() as server:
        yield server


@pytest.fixture(scope="session")
def moto() -> Iterator[Server]:
    with moto_server() as server:
        yield server


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"
