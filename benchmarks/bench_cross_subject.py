"""Cross-subject store operations (issue #25 item 2): ``KeyshredStore.search`` over a
namespace prefix that spans every subject, and ``list_namespaces``, against LangGraph's
``SqliteStore`` (WAL) on the same data, in one run.

``SUBJECTS`` users x ``PER`` memories of ~120-byte values, in two namespaces per user
(``("users", id, "notes")`` and ``("users", id, "prefs")``; ``subject_from=1``). Each
operation is timed once on a handle opened afresh (cold: no partition, no key in
memory) and then as the best of ``REPEAT`` calls (warm). keyshred encrypts every
item under its subject's keys; SqliteStore stores plaintext. Every keyshred result is
compared with LangGraph's reference ``InMemoryStore`` on the same data.

Run: ``.venv/bin/python benchmarks/bench_cross_subject.py [subjects]``
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from langgraph.store.base import PutOp
from langgraph.store.memory import InMemoryStore
from langgraph.store.sqlite import SqliteStore

from keyshred import Keyshred
from keyshred.integrations.langgraph import KeyshredStore

SUBJECTS = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
PER = 20
REPEAT = 3


def value(u: int, i: int) -> dict[str, Any]:
    text = f"memory {i} of user {u}: prefers window seats, travels in spring; " + "x" * 40
    return {"text": text[:100], "i": i}


def fill(store: Any) -> float:
    t = time.perf_counter()
    for u in range(SUBJECTS):
        store.batch(
            [
                PutOp(
                    ("users", f"user-{u:05d}", "notes" if i % 2 else "prefs"),
                    f"m{i}",
                    value(u, i),
                    index=False,
                )
                for i in range(PER)
            ]
        )
    return time.perf_counter() - t


OPS: dict[str, Callable[[Any], Any]] = {
    "search(('users',), limit=10)": lambda s: s.search(("users",), limit=10),
    "search(('users',), filter, limit=10)": lambda s: s.search(
        ("users",), filter={"i": 3}, limit=10
    ),
    "list_namespaces(prefix=('users',))": lambda s: s.list_namespaces(prefix=("users",)),
    "list_namespaces(max_depth=2, limit=1000)": lambda s: s.list_namespaces(
        max_depth=2, limit=1000
    ),
}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        conn = sqlite3.connect(base / "lg.db", check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        theirs = SqliteStore(conn)
        theirs.setup()
        fill_theirs = fill(theirs)
        reference = InMemoryStore()  # the semantics every result is checked against
        fill(reference)
        ks = Keyshred.init(base / "ks")
        fill_ours = fill(KeyshredStore(ks, subject_from=1))
        ks.close()
        print(f"{SUBJECTS} subjects x {PER} memories")
        print(
            f"fill (batch per subject): keyshred {fill_ours:.2f} s, SqliteStore {fill_theirs:.2f} s"
        )
        print(f"{'operation':44} {'ks cold':>9} {'ks warm':>9} {'sqlite':>9} {'ratio':>7}")
        for name, op in OPS.items():
            ks = Keyshred.open(base / "ks")
            try:
                ours = KeyshredStore(ks, subject_from=1)
                cold, got = timed(lambda: op(ours))
                warm = min(timed(lambda: op(ours))[0] for _ in range(REPEAT))
            finally:
                ks.close()
            ref = min(timed(lambda: op(theirs))[0] for _ in range(REPEAT))
            want = op(reference)
            same = _norm(got) == _norm(want)
            print(
                f"{name:44} {cold * 1e3:8.1f}m {warm * 1e3:8.1f}m {ref * 1e3:8.1f}m "
                f"{warm / ref:7.1f}{'' if same else '  (differs from InMemoryStore!)'}"
            )
        conn.close()


def _norm(result: Any) -> Any:
    return [(tuple(r.namespace), r.key, r.value) if hasattr(r, "key") else tuple(r) for r in result]


if __name__ == "__main__":
    main()
