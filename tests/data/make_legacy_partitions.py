"""Make tests/data/legacy_70c7cef.tar.gz: a data folder written by the release before
issue #21 (keyshred main at 70c7cef, tagged ``pre-h21-merge``), whose memory
partitions are folders of ``MANIFEST`` + PME Parquet segments + an append log.

The tests of the importer (tests/storage/test_legacy_import.py) unpack it; they never
need the old code or git history. To make it again (the archive changes, the tests
do not: they check what the folder holds, not its bytes)::

    git worktree add --detach /tmp/ks-old 70c7cef
    .venv/bin/python tests/data/make_legacy_partitions.py --old-tree /tmp/ks-old \\
        --out tests/data/legacy_70c7cef.tar.gz
    git worktree remove /tmp/ks-old

The script runs itself again on the old tree (a symlink tree laid out as the
installed package, first on ``PYTHONPATH``: the editable install's finder comes
after ``sys.path``), so the folder is written by the old engine only. Every value is
a made-up probe string; the key file holds random test keys.

What the folder holds (``SUBJECTS`` below is what the tests expect to read back):

- alice: three memories compacted into a segment, one deleted (its segment
  rewritten without it), one in scope ``support/health`` (a second segment), then a
  put and an update only in the append log;
- bob: an own memory, a memory mentioning zed and a derived one from alice's, in a
  segment; another mention of zed only in the log; zed's keys are then destroyed,
  so both mention rows are *opaque* (the catalog still holds their assets);
- carol: only log records, no ``MANIFEST`` (never compacted), one of them indexed
  (vectors through a hash embedder, ``embed`` below); a delete killed (SIGKILL)
  after its log record, its asset still marked ``deleting``; then a torn tail;
- erin: one memory compacted, one in the log (the tests suppress and erase her);
- victim: erased through the old release (folder gone, guard ``erased``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

NS = ("notes",)
DIM = 8

# subject -> {key: value} of the memories readable after the import (opaque rows and
# the deleted ones left out).
SUBJECTS: dict[str, dict[str, Any]] = {
    "alice": {
        "a1": "alice-probe-one",
        "a2": "alice-probe-two-updated",
        "a4": {"text": "alice-probe-four-in-the-log"},
        "h1": "alice-probe-health",
    },
    "bob": {"b1": "bob-probe-own", "b3": "bob-probe-derived-from-alice"},
    "carol": {"c1": {"text": "carol-probe-kayaks"}, "c2": "carol-probe-two"},
    "erin": {"e1": "erin-probe-compacted", "e2": "erin-probe-logged"},
}
SCOPES = {"h1": "support/health"}
OPAQUE = {"bob": ["b2", "b4"]}  # rows of bob's whose shared key (with zed) is gone
PROBES = ["zed-probe-mention-segment", "zed-probe-mention-log", "victim-probe-erased"]


def embed(texts: list[str]) -> list[list[float]]:
    """A deterministic embedding (the tests query with it): hash bytes as floats."""
    out = []
    for text in texts:
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        out.append([b / 255.0 for b in digest[:DIM]])
    return out


def config(catalog_url: str | None = None) -> Any:
    from keyshred import Config
    from keyshred.config import ScopeSettings, StorageSettings

    return Config(
        # Never compact on our own: the log records stay in the log.
        storage=StorageSettings(flush_records=1000, catalog_url=catalog_url),
        scopes={
            "support/health": ScopeSettings(
                purpose="support", categories=["health"], basis="contract"
            ),
        },
    )


def _old_tree_path(old: Path) -> Path:
    """A symlink tree of the old checkout laid out as the installed package."""
    tree = Path(tempfile.mkdtemp(prefix="ks-old-tree-"))
    pkg = tree / "keyshred"
    pkg.mkdir()
    for entry in (old / "keyshred").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry.resolve())
    for component in ("keyring", "storage", "vault", "backup"):
        (pkg / component).symlink_to((old / component).resolve())
    return tree


def _write(data: Path) -> None:
    from keyshred import Keyshred

    ks = Keyshred.init(data, config(os.environ.get("LEGACY_CATALOG_URL")), embeddings=embed)
    put = ks.memories.put
    # Compacted: ``flush`` compacts every open partition, so it comes first.
    a1 = put("alice", NS, "a1", "alice-probe-one")
    put("alice", NS, "a2", "alice-probe-two")
    put("alice", NS, "a3", "alice-probe-three-deleted")
    put("alice", NS, "h1", "alice-probe-health", scope="support/health")
    put("bob", NS, "b1", "bob-probe-own")
    put("bob", NS, "b2", "zed-probe-mention-segment", mentions=["zed"])
    put("bob", NS, "b3", "bob-probe-derived-from-alice", sources=[a1.memory_id])
    put("erin", NS, "e1", "erin-probe-compacted")
    put("victim", NS, "v1", "victim-probe-erased")
    ks.memories.flush()
    assert ks.memories.delete("alice", NS, "a3")  # rewrites the segment without it
    req = ks.erase("victim", requested_by="fixture", reason="test", probes=PROBES[2:])
    assert req.state == "completed", req.state

    # Only in the append logs from here on.
    put("alice", NS, "a4", {"text": "alice-probe-four-in-the-log"})
    ks.memories.update("alice", NS, "a2", "alice-probe-two-updated")
    put("bob", NS, "b4", "zed-probe-mention-log", mentions=["zed"])
    put("erin", NS, "e2", "erin-probe-logged")
    # carol: never compacted, no MANIFEST at all.
    put("carol", NS, "c1", {"text": "carol-probe-kayaks"}, index=["text"])
    put("carol", NS, "c2", "carol-probe-two")
    put("carol", NS, "c3", "carol-probe-delete-killed")
    # zed's keys destroyed (an erasure's first step): bob's two rows about zed are
    # opaque, their assets still in the catalog.
    ks.keyring.destroy(ks.subject_ref("zed"))
    ks.close(flush=False)  # the logged writes stay in their logs


def _killed_delete(data: Path) -> None:
    """Delete carol's c3 and die (SIGKILL) once its log record is written."""
    from keyshred import Keyshred
    from keyshred.storage import faults

    def hook(point: str) -> None:
        if point == "delete.after_log":
            os.kill(os.getpid(), signal.SIGKILL)

    ks = Keyshred.open(data, embeddings=embed)
    faults.hook = hook
    ks.memories.delete("carol", NS, "c3")
    raise SystemExit("the delete was not killed")


def _tear_tail(data: Path) -> None:
    """A record cut short at the end of carol's log (a crash mid-append)."""
    from keyshred import Keyshred

    ks = Keyshred.open(data, embeddings=embed)
    ref = ks.subject_ref("carol")
    ks.close(flush=False)
    log = data / "memories" / f"subject={ref}" / "log-00000001.ksl"
    assert log.exists() and not log.with_name("MANIFEST").exists()
    with open(log, "ab") as f:
        f.write(struct.pack(">I", 400) + b"\x00\x07default" + b"\x00" * 20)


# The distributed profile of that release: the catalog on PostgreSQL, partitions in
# the local folder. ``data-pg/`` holds the folder, its catalog is dumped (plain SQL,
# the schema's name replaced by the tests) into ``data-pg/catalog.postgresql.sql``.
PG_SCHEMA = "ks_legacy_fixture"
PG_DUMP = "catalog.postgresql.sql"
_PG = ["-h", "127.0.0.1", "-p", "5432", "-U", "postgres", "test"]


def _pg_url() -> str:
    subprocess.run(
        [
            "psql",
            *_PG,
            "-qc",
            f"DROP SCHEMA IF EXISTS {PG_SCHEMA} CASCADE; CREATE SCHEMA {PG_SCHEMA}",
        ],
        check=True,
    )
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{PG_SCHEMA}"


def _dump_pg(out: Path) -> None:
    dump = subprocess.run(
        ["pg_dump", *_PG, "--schema", PG_SCHEMA, "--inserts", "--no-owner", "--no-privileges"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # Plain SQL only: pg_dump's psql meta-commands (``\\restrict``) are no statements.
    out.write_text("".join(ln for ln in dump.splitlines(True) if not ln.startswith("\\")))
    subprocess.run(["psql", *_PG, "-qc", f"DROP SCHEMA {PG_SCHEMA} CASCADE"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, help="a checkout of 70c7cef")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("legacy_70c7cef.tar.gz")
    )
    parser.add_argument("--step", choices=["write", "kill", "tear"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step is not None:
        import keyshred.storage.applog  # noqa: F401 - only the old release has it

        {"write": _write, "kill": _killed_delete, "tear": _tear_tail}[args.step](args.data)
        return
    if args.old_tree is None:
        parser.error("--old-tree is required")
    tree = _old_tree_path(args.old_tree)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, catalog_url in (("data", None), ("data-pg", _pg_url())):
            data = Path(tmp) / name
            me = [sys.executable, str(Path(__file__).resolve()), "--data", str(data), "--step"]
            step_env = {**env, "LEGACY_CATALOG_URL": catalog_url or ""}
            if catalog_url is None:
                step_env.pop("LEGACY_CATALOG_URL")
            subprocess.run([*me, "write"], env=step_env, check=True)
            killed = subprocess.run([*me, "kill"], env=step_env, check=False)
            assert killed.returncode == -signal.SIGKILL, killed.returncode
            subprocess.run([*me, "tear"], env=step_env, check=True)
        _dump_pg(Path(tmp) / "data-pg" / PG_DUMP)
        with tarfile.open(args.out, "w:gz") as tar:
            # Sorted, owner-less entries: the archive says nothing of this machine.
            for path in sorted(Path(tmp).rglob("*")):
                info = tar.gettarinfo(str(path), arcname=str(path.relative_to(tmp)))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if path.is_file():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
