"""Bad input gets a typed error (issue #18, item 9): the cases found by hand. The
property-based sweep over the whole API is ``tests/test_inputs_property.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from keyshred import Config, Keyshred
from keyshred.config import StorageSettings, TokenSettings
from keyshred.errors import ConfigError, InvalidInput, ValueTooLarge

NS = ("notes",)
LONE = "\udc80"  # a lone surrogate: not encodable as UTF-8
HOUR = timedelta(hours=1)


@pytest.fixture
def ks(tmp_path: Path) -> Iterator[Keyshred]:
    store = Keyshred.init(tmp_path / "data")
    store.memories.put("alice", NS, "kept", {"v": 1})
    yield store
    store.close()


def _nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def _bad_calls(ks: Keyshred) -> dict[str, Callable[[], object]]:
    m = ks.memories
    return {
        "surrogate subject": lambda: m.put(f"al{LONE}ice", NS, "k", 1),
        "surrogate namespace": lambda: m.put("alice", (f"n{LONE}",), "k", 1),
        "surrogate key": lambda: m.put("alice", NS, f"k{LONE}", 1),
        "surrogate get": lambda: m.get("alice", NS, f"k{LONE}"),
        "surrogate search subject": lambda: m.search(f"{LONE}"),
        "value 100k deep": lambda: m.put("alice", NS, "k", _nested(100_000)),
        "filter str": lambda: m.search("alice", NS, filter="str"),  # type: ignore[arg-type]
        "limit str": lambda: m.search("alice", NS, limit="5"),  # type: ignore[arg-type]
        "offset float": lambda: m.search("alice", NS, offset=1.5),  # type: ignore[arg-type]
        "namespace int": lambda: m.put("alice", 5, "k", 1),  # type: ignore[arg-type]
        "prefix int": lambda: m.search("alice", 5),  # type: ignore[arg-type]
        "index int": lambda: m.put("alice", NS, "k", 1, index=5),  # type: ignore[arg-type]
        "mentions int": lambda: m.put("alice", NS, "k", 1, mentions=5),  # type: ignore[arg-type]
        "restore None": lambda: ks.vault.restore(None, "support", "agent"),  # type: ignore[arg-type]
        "detokenize None": lambda: ks.vault.detokenize(None, "support", "agent"),  # type: ignore[arg-type]
        "sanitize surrogate": lambda: ks.vault.sanitize(f"x{LONE}", "alice", "support", HOUR),
        "sanitize ttl int": lambda: ks.vault.sanitize("x", "alice", "support", 5),  # type: ignore[arg-type]
        "erase scope list": lambda: ks.erase("bob", [], requested_by="t", reason="r"),  # type: ignore[arg-type]
    }


def test_each_bad_input_is_invalid_input_and_changes_nothing(ks: Keyshred) -> None:
    for name, call in _bad_calls(ks).items():
        try:
            call()
        except InvalidInput:
            continue
        pytest.fail(f"{name}: no InvalidInput")
    assert ks.memories.get("alice", NS, "k") is None
    assert ks.erasure.requests() == []
    m = ks.memories.get("alice", NS, "kept")
    assert m is not None and m.value == {"v": 1}


def test_value_depth_is_a_setting(tmp_path: Path) -> None:
    cfg = Config(storage=StorageSettings(max_value_depth=3))
    with Keyshred.init(tmp_path / "d", cfg) as ks:
        ks.memories.put("alice", NS, "ok", {"a": [{"b": 1}]})  # three levels
        with pytest.raises(ValueTooLarge, match=r"storage\.max_value_depth"):
            ks.memories.put("alice", NS, "deep", {"a": [{"b": [1]}]})


def test_sanitize_refuses_a_text_above_tokens_max_text_bytes(tmp_path: Path) -> None:
    with Keyshred.init(tmp_path / "d") as ks:
        assert ks.config.tokens.max_text_bytes == 1024 * 1024
        with pytest.raises(ValueTooLarge, match=r"tokens\.max_text_bytes"):
            ks.vault.sanitize("a@b.example.com " * 1_500_000, "alice", "support", HOUR)
    cfg = Config(tokens=TokenSettings(max_text_bytes=100))
    with Keyshred.init(tmp_path / "small", cfg) as ks:
        ks.vault.sanitize("mail a@b.example.com", "alice", "support", HOUR)
        with pytest.raises(ValueTooLarge):
            ks.vault.sanitize_many(["é" * 51], "alice", "support", HOUR)  # 102 bytes


def test_init_over_a_file_is_a_config_error(tmp_path: Path) -> None:
    a_file = tmp_path / "taken"
    a_file.write_bytes(b"data")
    with pytest.raises(ConfigError):
        Keyshred.init(a_file)
    with pytest.raises(ConfigError):
        Keyshred.init(a_file / "below")
    assert a_file.read_bytes() == b"data"


def test_a_value_whose_keys_json_would_merge_is_refused_not_half_stored(ks: Keyshred) -> None:
    # Review of #18 item 9: JSON turns the key 1 into "1", so {"1": a, 1: b} was
    # stored as {"1": b}: one value dropped, and no error.
    for value in ({"1": "kept?", 1: "other"}, [{"a": 1, (1, 2): 2}], {"x": {None: 1}}):
        with pytest.raises(InvalidInput):
            ks.memories.put("alice", NS, "merged", value)
    assert ks.memories.get("alice", NS, "merged") is None


def test_open_export_of_text_instead_of_bytes_is_invalid_input(ks: Keyshred) -> None:
    # Review of #18 item 9: a package read as text raised the driver's TypeError.
    with pytest.raises(InvalidInput):
        ks.open_export("not the bytes of a package", passphrase="p" * 16)  # type: ignore[arg-type]
