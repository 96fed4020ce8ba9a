"""KEK provider calls per keyring operation (issue #22 item 3).

For each KEK provider (local key file; OpenBao Transit on a dev server and AWS KMS on
moto's server, both started here on loopback) a counting wrapper sits between the
keyring and the real provider and counts every call that reaches the provider
(``calls``) and the keys those calls carried (``keys``: a Transit batch of 200 is one
call of 200 keys; KMS has no batch API, so its provider sends one request per key).
Operations, on a SQLite key store:

- open: a fresh ``Keyring`` on an existing store (what a new process builds);
- new subject, warm: ``data_key`` of a new subject in a keyring that already made one;
- new subject, cold: open + ``data_key`` of a new subject (a fresh process's first);
- warm put: ``seal`` for a subject whose key is cached;
- cold read of 1 and of 200 subjects: a fresh keyring, ``open`` of one ciphertext
  of each subject (one key each; the per-key path the memory store takes), and the
  same 200 through ``data_keys_by_id`` (the batch path);
- KEK rotation with 1,000 DEKs: ``rotate_kek``;
- erasure: ``destroy`` of one subject;
- backup create / restore: ``archive_copy`` of the key store and ``open_archive``
  (the archive lineage; n/a in code without it).

The script only uses keyring calls that exist before and after the two-level
lineage, so the same file measures an older checkout: ``--root PATH`` imports
keyshred from a folder laid out as the package (``--layout`` builds one from a git
checkout; see benchmarks/README.md).

Run: ``.venv/bin/python benchmarks/bench_kek_calls.py [--providers local,vault,aws]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]


def _setup_path() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--root")
    known, _ = parser.parse_known_args()
    if known.root:
        sys.path.insert(0, known.root)  # before the editable install's finder
    sys.path.insert(1 if known.root else 0, str(HERE))


_setup_path()
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

from keyshred.keyring.envelope import Place  # noqa: E402
from keyshred.keyring.kek import (  # noqa: E402
    Context,
    DestroyedEpoch,
    EpochInfo,
    KekProvider,
    WrappedKey,
)
from keyshred.keyring.kek.local import LocalKek  # noqa: E402
from keyshred.keyring.keyring import Keyring  # noqa: E402
from keyshred.keyring.keystore import SQLiteKeyStore  # noqa: E402
from tests.servers import Server, moto_server, openbao_dev_server  # noqa: E402


class Counting(KekProvider):
    """Forwards to a real provider; counts calls and keys that reach it."""

    def __init__(self, inner: KekProvider) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls = 0
        self.keys = 0
        self.by_op: dict[str, int] = {}

    def _n(self, op: str, keys: int = 0) -> None:
        self.calls += 1
        self.keys += keys
        self.by_op[op] = self.by_op.get(op, 0) + 1

    def reset(self) -> None:
        self.calls = self.keys = 0
        self.by_op = {}

    def current_epoch(self) -> int:
        # Remote for Transit and KMS (it reads the key / lists aliases) unless cached.
        self._n("current_epoch")
        return self.inner.current_epoch()

    def epochs(self) -> list[EpochInfo]:
        self._n("epochs")
        return self.inner.epochs()

    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        self._n("wrap", 1)
        return self.inner.wrap(key, context)

    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        self._n("unwrap", 1)
        return self.inner.unwrap(wrapped, context)

    def wrap_many(self, items: Sequence[tuple[bytes, Context]]) -> list[WrappedKey]:
        self._n("wrap_many", len(items))
        return self.inner.wrap_many(items)

    def unwrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[bytes]:
        self._n("unwrap_many", len(items))
        return self.inner.unwrap_many(items)

    def rewrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[WrappedKey]:
        self._n("rewrap_many", 2 * len(items))
        return self.inner.rewrap_many(items)

    def rotate(self) -> int:
        self._n("rotate")
        return self.inner.rotate()

    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        self._n("destroy_epochs_before")
        return self.inner.destroy_epochs_before(epoch)

    def close(self) -> None:
        self.inner.close()


def factory(
    name: str, servers: dict[str, Server], tmp: Path, suffix: str
) -> Callable[[], KekProvider]:
    unique = uuid.uuid4().hex[:10] + suffix
    if name == "local":
        path = tmp / f"kek-{unique}.json"
        return lambda: LocalKek(path, create=True)
    if name == "vault":
        from keyshred.keyring.kek.vault import VaultKek

        s = servers["vault"]
        return lambda: VaultKek(s.url, s.token, key_name=f"bench-{unique}")
    from keyshred.keyring.kek.aws import AwsKmsKek

    s = servers["aws"]
    return lambda: AwsKmsKek(
        alias_prefix=f"alias/bench-{unique}", region="us-east-1", endpoint_url=s.url
    )


def place(ref: str) -> Place:
    return Place(subject_ref=ref, scope="default", table="bench", record_id="r1", column="v")


def run(provider: str, servers: dict[str, Server], tmp: Path) -> dict[str, str]:
    live = factory(provider, servers, tmp, "")
    archive = factory(provider, servers, tmp, "-archive")
    store_path = tmp / f"ks-{uuid.uuid4().hex[:8]}.db"
    rows: dict[str, str] = {}
    counters: list[Counting] = []

    def opened() -> tuple[Keyring, Counting]:
        # What a new process builds: a new provider client and keyring (no cache).
        kek = Counting(live())  # the provider's own constructor calls count too
        counters.append(kek)
        arch = Counting(archive())
        counters.append(arch)
        kwargs: dict[str, Any] = {}
        if "archive_kek" in Keyring.__init__.__code__.co_varnames:
            kwargs["archive_kek"] = arch
        return Keyring(SQLiteKeyStore(store_path), kek, **kwargs), kek

    def measure(label: str, kek: Counting, fn: Callable[[], object]) -> None:
        kek.reset()
        fn()
        rows[label] = f"{kek.calls} ({kek.keys} keys)"

    ring, kek = opened()  # makes the store, its secrets and first epoch
    ring.data_key("s-warmup", "default")
    measure("new subject, warm", kek, lambda: ring.data_key("s-new-warm", "default"))
    ring.seal(b"x", place("s-new-warm"))
    measure("warm put", kek, lambda: ring.seal(b"hello", place("s-new-warm")))
    sealed = {}
    for i in range(200):
        ref = f"s-{i:04d}"
        sealed[ref] = ring.seal(b"memory", place(ref))
    for i in range(1000 - 203):
        ring.data_key(f"f-{i:05d}", "default")
    ring.close()

    counting = Counting(live())
    counting.reset()

    def cold_open() -> None:
        r, k = opened()
        rows["open (fresh process)"] = f"{k.calls} ({k.keys} keys)"
        r.data_key("s-new-cold", "default")
        rows["open + new subject (fresh process)"] = f"{k.calls} ({k.keys} keys)"
        r.close()

    cold_open()

    def cold_read(n: int, batch: bool) -> str:
        r, k = opened()  # counted from the open on: what a fresh process pays
        refs = list(sealed)[:n]
        if batch:
            from keyshred.keyring.envelope import key_id_of

            r.data_keys_by_id([key_id_of(sealed[ref]) for ref in refs])
        else:
            for ref in refs:
                assert r.open(sealed[ref], place(ref)) == b"memory"
        out = f"{k.calls} ({k.keys} keys)"
        r.close()
        return out

    rows["open + cold read, 1 subject"] = cold_read(1, batch=False)
    rows["open + cold read, 200 subjects (one by one)"] = cold_read(200, batch=False)
    rows["open + cold read, 200 subjects (data_keys_by_id)"] = cold_read(200, batch=True)

    ring, kek = opened()
    ring.data_key("s-0000", "default")
    measure("KEK rotation, 1,000 DEKs", kek, ring.rotate_kek)
    measure("erasure (destroy one subject)", kek, lambda: ring.destroy("s-0001"))
    if hasattr(ring, "archive_copy"):
        snapshot = ring.store.snapshot() if hasattr(ring.store, "snapshot") else None
        arch = counters[-1]
        if snapshot is not None:
            arch.reset()
            kek.reset()
            copy = ring.archive_copy(snapshot, "gen-1")
            rows["backup create (archive copy)"] = (
                f"{arch.calls + kek.calls} ({arch.keys + kek.keys} keys)"
            )
            r, k = opened()
            a = counters[-1]
            k.reset()
            a.reset()
            r.open_archive(copy.epoch, copy.wrapped, copy.sealed, "gen-1")
            rows["restore (open archive copy)"] = f"{k.calls + a.calls} ({k.keys + a.keys} keys)"
            r.close()
    else:
        rows["backup create (archive copy)"] = "n/a"
        rows["restore (open archive copy)"] = "n/a"
    ring.close()
    counting.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", default="local,vault,aws")
    parser.add_argument("--root", help="import keyshred from this package folder")
    parser.add_argument("--json", action="store_true", help="print JSON rows only")
    args = parser.parse_args()
    providers = args.providers.split(",")
    results: dict[str, dict[str, str]] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmpdir:
        servers: dict[str, Server] = {}
        if "vault" in providers:
            servers["vault"] = stack.enter_context(openbao_dev_server())
        if "aws" in providers:
            servers["aws"] = stack.enter_context(moto_server())
        for p in providers:
            results[p] = run(p, servers, Path(tmpdir))
    if args.json:
        print(json.dumps(results))
        return
    ops = list(next(iter(results.values())))
    print("| operation | " + " | ".join(providers) + " |")
    print("| --- |" + " --- |" * len(providers))
    for op in ops:
        print(f"| {op} | " + " | ".join(results[p].get(op, "") for p in providers) + " |")


if __name__ == "__main__":
    main()
