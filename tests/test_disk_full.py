"""A full disk (issue #18, item 8): every layer's error (EFBIG from a file size
limit, ENOSPC on a full file system, SQLite's "database or disk is full" and its
"disk I/O error") becomes one ``StorageFull``, and nothing acknowledged is lost.

The writer runs in a subprocess (``tests/disk_full_worker.py``) under a real limit:
``RLIMIT_FSIZE`` everywhere, and a small tmpfs when the tests run as root."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyshred import Keyshred
from tests import zygote
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

WORKER = Path(__file__).with_name("disk_full_worker.py")
NS = ("full",)
ROOM = 256 * 1024
JOURNAL_SEGMENT = 1 << 20  # keyshred.vault.journal preallocates its files


def _seed(data: Path, url: str | None) -> None:
    with Keyshred.init(data, make_config(url), embeddings=bag_of_words) as ks:
        ks.memories.put("full-0", NS, "seed", {"text": "seed fact"}, index=True)


def _fill(data: Path, mode: str, limit: int, url: str | None) -> list[str]:
    """Run the writer until its first error; its acknowledged writes."""
    args = [sys.executable, str(WORKER), str(data), mode, str(limit)] + ([url] if url else [])
    proc = zygote.run(args, capture_output=True, text=True, timeout=300, check=False)
    lines = proc.stdout.splitlines()
    errors = [line for line in lines if line.startswith("ERR ")]
    assert errors, proc.stderr[-3000:]
    assert errors[0].startswith("ERR keyshred.errors.StorageFull "), errors[0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    acked = [line.removeprefix("ACK ") for line in lines if line.startswith("ACK ")]
    assert acked, "the limit left no room for a single write"
    return acked


def _check_all_readable(data: Path, url: str | None, acked: list[str]) -> None:
    """Everything acknowledged reads back, and writing works again."""
    with Keyshred.open(data, make_config(url), embeddings=bag_of_words) as ks:
        # Every memory; of the tokens (each resolution is audited: slow) the last
        # hundred, the likeliest to be lost, and every tenth before them.
        tokens = [n for n, line in enumerate(acked) if line.startswith("token ")]
        skip = set(tokens[:-100]) - set(tokens[:-100:10])
        for line in (line for n, line in enumerate(acked) if n not in skip):
            kind, subject, name = line.split(" ")
            if kind == "memory":
                m = ks.memories.get(subject, NS, name)
                assert m is not None, line
            else:
                value = ks.vault.detokenize(name, "support", "test", subject=subject)
                assert value.endswith("@example.com"), line
        ks.memories.put("full-0", NS, "after", {"text": "after the space came back"}, index=True)
        hits = ks.memories.search("full-0", NS, query="space came back", limit=1)
        assert [h.key for h in hits] == ["after"]
    with Keyshred.open(data, make_config(url), embeddings=bag_of_words) as ks:
        assert ks.memories.get("full-0", NS, "after") is not None


def _limit_above(folder: Path, mode: str) -> int:
    """A file size limit ROOM bytes above the largest file there now (and above the
    vault journal's preallocated segments, for the vault)."""
    sizes = [p.stat().st_size for p in folder.rglob("*") if p.is_file()]
    return max(*sizes, JOURNAL_SEGMENT if mode == "vault" else 0) + ROOM


@pytest.mark.parametrize("mode", ["memories", "subjects", "vault"])
def test_a_file_size_limit_is_storage_full_and_loses_nothing(
    mode: str, catalog_url: str, tmp_path: Path
) -> None:
    # On SQLite the catalog meets the limit first ("disk I/O error"); on PostgreSQL
    # the files do: raw EFBIG from the memory segments, LanceDB and the key store. (The
    # vault on PostgreSQL writes no local file: nothing to fill.)
    if mode == "vault" and catalog_url.startswith("postgresql"):
        pytest.skip("the vault keeps nothing on the local disk with a PostgreSQL catalog")
    data = tmp_path / "data"
    _seed(data, catalog_url)
    acked = _fill(data, mode, _limit_above(tmp_path, mode), catalog_url)
    _check_all_readable(data, catalog_url, acked)


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    done = zygote.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode:
        pytest.skip("no tmpfs mount here (needs root)")
    try:
        yield where
    finally:
        zygote.run(["umount", "-l", str(where)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.parametrize("mode", ["memories", "vault"])
def test_a_full_file_system_is_storage_full_and_loses_nothing(mode: str, tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "mnt", "3m") as mnt:
        data = mnt / "data"
        _seed(data, None)
        acked = _fill(data, mode, 0, None)
        # Space comes back: the same file system, grown.
        zygote.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        _check_all_readable(data, None, acked)
