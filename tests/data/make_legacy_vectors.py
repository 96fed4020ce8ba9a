"""Make tests/data/vectors_c4f07aa.tar.gz: a data folder written by the release
before vectors moved into the catalog (keyshred main at c4f07aa), whose vectors are
one LanceDB dataset per subject (``vectors/<subject_ref>.lance``).

The tests of the import (tests/storage/test_vector_import.py) unpack it; they never
need the old code or git history. To make it again::

    git worktree add --detach /tmp/ks-old c4f07aa
    .venv/bin/python tests/data/make_legacy_vectors.py --old-tree /tmp/ks-old \\
        --out tests/data/vectors_c4f07aa.tar.gz
    git worktree remove /tmp/ks-old

The script runs itself again on the old tree (a symlink tree laid out as the
installed package, first on ``PYTHONPATH``), so the folder is written by the old
engine only. Every value is a made-up probe string; the key file holds random test
keys.

What the folder holds (``SUBJECTS`` is what the tests expect searches to find):

- alice: three indexed memories (one in scope ``support/health``), one more in a
  second embedding space (``OTHER``), and one not indexed;
- bob: one indexed memory, and one that mentions carol (sealed under the owner-set
  key of bob and carol, its vector too);
- carol: one indexed memory;
- victim: an indexed memory, erased through the old release (dataset gone).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

NS = ("notes",)
DIM = 8
OTHER = "hashed-other"  # the second embedding space's name (DIM dimensions too)

SUBJECTS: dict[str, dict[str, str]] = {
    "alice": {
        "a1": "alice-probe kayaks on the lake",
        "a2": "alice-probe gardens and roses",
        "h1": "alice-probe health allergy",
    },
    "bob": {"b1": "bob-probe trains to work", "b2": "bob-probe met carol-probe at lunch"},
    "carol": {"c1": "carol-probe plays violin"},
}
SCOPES = {"h1": "support/health"}
MENTIONS = {"b2": ["carol"]}
SPACE_OTHER = {"alice": {"a3": "alice-probe other space note"}}
PLAIN = {"alice": {"a4": "alice-probe not indexed"}}
VICTIM = ("victim", "v1", "victim-probe erased before")


def embed(texts: list[str]) -> list[list[float]]:
    """A deterministic embedding (the tests query with it): hash bytes as floats."""
    out = []
    for text in texts:
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        out.append([b / 255.0 + 0.01 for b in digest[:DIM]])
    return out


def embed_other(texts: list[str]) -> list[list[float]]:
    out = []
    for text in texts:
        digest = hashlib.sha256(b"other" + text.encode("utf-8")).digest()
        out.append([b / 255.0 + 0.01 for b in digest[:DIM]])
    return out


def config() -> Any:
    from keyshred import Config
    from keyshred.config import ScopeSettings

    return Config(
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
    from keyshred.storage.embeddings import Embedder

    ks = Keyshred.init(data, config(), embeddings=embed)
    put = ks.memories.put
    for subject, memories in SUBJECTS.items():
        for key, value in memories.items():
            put(
                subject,
                NS,
                key,
                value,
                index=True,
                scope=SCOPES.get(key, "default"),
                mentions=MENTIONS.get(key, []),
            )
    other = Embedder(embed_other, dims=DIM, space=OTHER)
    for subject, memories in SPACE_OTHER.items():
        for key, value in memories.items():
            put(subject, NS, key, value, index=True, embedder=other)
    for subject, memories in PLAIN.items():
        for key, value in memories.items():
            put(subject, NS, key, value)
    subject, key, value = VICTIM
    put(subject, NS, key, value, index=True)
    req = ks.erase(subject, requested_by="dpo", reason="fixture")
    assert req.state == "completed", req.state
    assert not (data / "vectors" / f"{ks.subject_ref(subject)}.lance").exists()
    assert (data / "vectors" / f"{ks.subject_ref('alice')}.lance").is_dir()
    ks.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-tree", type=Path, help="a checkout of c4f07aa")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("vectors_c4f07aa.tar.gz")
    )
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.data is not None:
        _write(args.data)
        return
    if args.old_tree is None:
        parser.error("--old-tree is required")
    tree = _old_tree_path(args.old_tree)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        me = [sys.executable, str(Path(__file__).resolve()), "--data", str(data)]
        subprocess.run(me, env=env, check=True)
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
