"""KEK provider fixtures: one shared behaviour suite runs against every backend.

Each test gets a fresh provider: its own key file, its own transit key on the
OpenBao dev server, its own alias prefix on moto's KMS.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keyshred.keyring.kek import KekProvider
from keyshred.keyring.kek.local import LocalKek

PROVIDERS = ["local", "vault", "aws"]
KekFactory = Callable[[], KekProvider]


def make_factory(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> KekFactory:
    """A factory for providers that share one underlying key (like two processes)."""
    unique = uuid.uuid4().hex[:12]
    if name == "local":
        path = tmp_path / "kek.json"
        return lambda: LocalKek(path, create=True)
    if name == "vault":
        from keyshred.keyring.kek.vault import VaultKek

        server = request.getfixturevalue("openbao")
        return lambda: VaultKek(server.url, server.token, key_name=f"kek-{unique}", batch_size=64)
    from keyshred.keyring.kek.aws import AwsKmsKek

    server = request.getfixturevalue("moto")
    return lambda: AwsKmsKek(
        alias_prefix=f"alias/keyshred-test/{unique}", region="us-east-1", endpoint_url=server.url
    )


@pytest.fixture(params=PROVIDERS)
def kek_factory(request: pytest.FixtureRequest, tmp_path: Path) -> KekFactory:
    return make_factory(request.param, request, tmp_path)


@pytest.fixture
def kek(kek_factory: KekFactory) -> Iterator[KekProvider]:
    provider = kek_factory()
    yield provider
    provider.close()
