"""The facade against each real KEK backend, and the no-leak rules for ids."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from keyshred import Config, Keyshred, Subject, SubjectErased
from keyshred.config import AwsSettings, KekSettings, VaultSettings
from keyshred.errors import HandleClosed
from keyshred.keyring.envelope import Place
from tests.servers import Server


def test_subject_repr_hides_the_id() -> None:
    s = Subject("jane.doe@example.com", tenant="acme")
    assert "jane" not in repr(s) and "jane" not in str(s)


def _config(provider: str, request: pytest.FixtureRequest) -> Config:
    if provider == "vault":
        server: Server = request.getfixturevalue("openbao")
        return Config(kek=KekSettings(provider="vault", vault=VaultSettings(url=server.url)))
    if provider == "aws":
        server = request.getfixturevalue("moto")
        return Config(
            kek=KekSettings(
                provider="aws",
                aws=AwsSettings(
                    endpoint_url=server.url,
                    region="us-east-1",
                    alias_prefix=f"alias/facade-{uuid.uuid4().hex[:8]}",
                ),
            )
        )
    return Config()


@pytest.mark.parametrize("provider", ["local", "vault", "aws"])
def test_init_open_erase_on_every_backend(
    provider: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if provider == "vault":
        monkeypatch.setenv("VAULT_TOKEN", request.getfixturevalue("openbao").token)
    cfg = _config(provider, request)
    with Keyshred.init(tmp_path / "d", cfg) as ks:
        ref = ks.subject_ref("alice")
        assert ref == ks.subject_ref(Subject("alice"))
        ct = ks.keyring.seal(b"secret", Place(ref, "default", "t", "1", "v"))
    with Keyshred.open(tmp_path / "d") as ks:
        assert ks.config.kek.provider == provider
        assert ks.subject_ref("alice") == ref
        assert ks.keyring.open(ct, Place(ref, "default", "t", "1", "v")) == b"secret"
        ks.keyring.destroy(ref)
    with Keyshred.open(tmp_path / "d") as ks, pytest.raises(SubjectErased):
        ks.keyring.open(ct, Place(ref, "default", "t", "1", "v"))


# -- a closed handle (issue #18, item 8) --------------------------------------------

NS_CLOSED = ("memories", "facts")


def _closed_calls(ks: Keyshred, tmp_path: Path) -> dict[str, Callable[[], object]]:
    """One call per public entry point of the facade and its components (lambdas:
    even looking the method up must wait for the call)."""
    from datetime import timedelta

    ref = "a" * 26
    return {
        "memories.put": lambda: ks.memories.put("alice", NS_CLOSED, "k", {"v": 2}),
        "memories.get": lambda: ks.memories.get("alice", NS_CLOSED, "k"),
        "memories.search": lambda: ks.memories.search("alice", NS_CLOSED),
        "memories.delete": lambda: ks.memories.delete("alice", NS_CLOSED, "k"),
        "vault.sanitize": lambda: ks.vault.sanitize(
            "mail jane@example.com", "alice", "support", timedelta(hours=1)
        ),
        "vault.detokenize": lambda: ks.vault.detokenize("<EMAIL_00ff>", "support", "t"),
        "erase": lambda: ks.erase("alice", requested_by="t", reason="r"),
        "erasure.request": lambda: ks.erasure.request(ref, None, requested_by="t", reason="r"),
        "erasure.requests": lambda: ks.erasure.requests(),  # noqa: PLW0108
        "backup.create": lambda: ks.backup.create(str(tmp_path / "bk")),
        "export": lambda: ks.export("alice", tmp_path / "x.ksx", passphrase="pw" * 8),
        "consent.list": lambda: ks.consent.list("alice"),
        "retention.run": lambda: ks.retention.run(),  # noqa: PLW0108
        "checkpoints.count": lambda: ks.checkpoints.count(ref),
        "derived.register_producer": lambda: ks.derived.register_producer(
            "p", "1", lambda *a: None
        ),
        "keyring.data_key": lambda: ks.keyring.data_key(ref, "default"),
        "catalog.guard": lambda: ks.catalog.guard(ref),
        "audit.verify": lambda: ks.audit.verify(),  # noqa: PLW0108
        "subject_ref": lambda: ks.subject_ref("alice"),
        "deletion_epoch": lambda: ks.deletion_epoch("alice"),
    }


def test_a_closed_handle_refuses_every_entry_point_and_changes_nothing(tmp_path: Path) -> None:
    data = tmp_path / "d"
    ks = Keyshred.init(data)
    ks.memories.put("alice", NS_CLOSED, "k", {"v": 1})
    ks.close()
    ks.close()  # closing twice is harmless
    for name, call in _closed_calls(ks, tmp_path).items():
        with pytest.raises(HandleClosed):
            call()
        assert name  # (the name shows in the traceback of a failing call)
    with Keyshred.open(data) as again:
        # Nothing was done: not suppressed, no request, the memory as it was.
        assert again.erasure.requests() == []
        assert again.catalog.guard(again.subject_ref("alice")).status == "active"
        m = again.memories.get("alice", NS_CLOSED, "k")
        assert m is not None and m.value == {"v": 1}
        assert not (tmp_path / "bk").exists() and not (tmp_path / "x.ksx").exists()


def test_a_component_kept_across_close_is_refused_too(tmp_path: Path) -> None:
    ks = Keyshred.init(tmp_path / "d")
    memories, put = ks.memories, ks.memories.put
    ks.close()
    with pytest.raises(HandleClosed):
        memories.get("alice", NS_CLOSED, "k")
    with pytest.raises(HandleClosed):
        put("alice", NS_CLOSED, "k", 1)


def test_close_evicts_decrypted_vectors_and_the_vector_index_is_refused(tmp_path: Path) -> None:
    # Review of #18 item 8: ``ks.vectors`` (and ``ks.memories.vectors``) was handed out
    # unguarded, and ``close`` left the decrypted vectors of searched subjects in its
    # cache: a closed handle still answered searches without any key.
    import numpy as np

    from tests.storage.conftest import make_config
    from tests.storage.test_vectors import bag_of_words

    ks = Keyshred.init(tmp_path / "d", make_config(), embeddings=bag_of_words)
    ks.memories.put("alice", NS_CLOSED, "a", {"text": "allergic to peanuts"}, index=["text"])
    assert ks.memories.search("alice", NS_CLOSED, query="peanuts", limit=5)
    ref = ks.subject_ref("alice")
    index = ks.vectors
    raw = ks._memories._vectors
    assert raw is not None
    ks.close()
    with pytest.raises(HandleClosed):
        index.search(ref, np.ones(len(bag_of_words(["x"])[0]), np.float32), 5)
    with pytest.raises(HandleClosed):
        ks.vectors.count(ref)
    assert not raw._cache  # nothing decrypted outlives the handle


def test_a_closed_handle_leaves_no_descriptor_open_on_its_folder(tmp_path: Path) -> None:
    """The partition refresh's watching connection outlived ``close`` (2 descriptors
    per handle): a long test run passed 1024 and a process opening many handles ran
    out of them."""
    from tests.conftest import descriptors_under

    data = tmp_path / "data"
    Keyshred.init(data).close()
    for i in range(3):
        with Keyshred.open(data) as ks:
            ks.memories.put("ana", ("m",), f"k{i}", {"n": i})
            assert ks.memories.get("ana", ("m",), f"k{i}") is not None
            assert ks.memories.search("ana", ("m",))
    assert descriptors_under(tmp_path) == []
