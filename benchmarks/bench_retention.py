"""Retention scan: find the memories past their retain-until among 100,000 memories
of 1,000 subjects.

keyshred: ``ks.retention.expired(now)`` — the catalog's index of assets, and the
plaintext metadata columns (no key is touched) of the segments the catalog lists
whose earliest retain-until has passed, read through the partition store. Baseline
on the same data: a full decrypt-and-check scan — open every subject's partition
(unwrap its keys, decrypt every segment and hot row, authenticate) and check each
memory's retain-until. Both must find the same set; half of the subjects have 10%
of their memories in a 1-day scope.

Run: ``.venv/bin/python benchmarks/bench_retention.py``
"""

from __future__ import annotations

import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyshred import Config, Keyshred
from keyshred.storage.memories import PutItem
from keyshred.storage.partition import to_us

SUBJECTS = 1_000
PER_SUBJECT = 100


def build(root: Path, t0: datetime) -> Keyshred:
    config = Config.model_validate(
        {"scopes": {"chat": {"purpose": "chat", "basis": "contract", "max_retention_days": 1}}}
    )
    ks = Keyshred.init(root, config)
    ks.memories._clock = lambda: t0  # type: ignore[method-assign]
    for s in range(SUBJECTS):
        items = [
            PutItem(
                ("notes",),
                f"n{i}",
                {"text": f"note {i} of subject {s}", "i": i},
                scope="chat" if s % 2 == 0 and i % 10 == 0 else "default",
                index=False,
            )
            for i in range(PER_SUBJECT)
        ]
        ks.memories.put_many(f"subject-{s}", items)
    ks.memories.flush()
    return ks


def full_scan(ks: Keyshred, now: datetime) -> set[str]:
    """Decrypt every partition and check retention memory by memory."""
    found = set()
    now_us = to_us(now)
    ks.memories.close(flush=False)  # cold: nothing decrypted in memory
    ks.keyring.cache.clear()
    # Every partition the catalog holds (some only as hot rows: a flush compacts the
    # partitions open in this process, the newest ``max_open_partitions``).
    for ref in sorted(ks.memories._hot.subjects()):
        p = ks.memories._partition(ref)
        p.ensure_loaded()  # unwrap, decrypt, authenticate every segment and hot row
        found |= {r.memory_id for r in p.rows.values() if r.retain_us <= now_us}
        ks.memories.evict(ref)
    return found


def main() -> None:
    t0 = datetime.now(UTC)
    now = t0 + timedelta(days=2)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        ks = build(Path(tmp) / "data", t0)
        print(
            f"built {SUBJECTS * PER_SUBJECT} memories of {SUBJECTS} subjects in "
            f"{time.perf_counter() - t:.1f} s"
        )
        ks.memories._clock = lambda: now  # type: ignore[method-assign]
        t = time.perf_counter()
        expired = ks.retention.expired(now)
        t_scan = time.perf_counter() - t
        ours = {m for ids in expired.values() for m in ids}
        t = time.perf_counter()
        theirs = full_scan(ks, now)
        t_full = time.perf_counter() - t
        assert ours == theirs, (len(ours), len(theirs))
        ks.close(flush=False)
    print(f"expired memories found: {len(ours)} (both scans agree)")
    print(f"{'scan':44} {'seconds':>9}")
    print(f"{'keyshred (catalog + listed segments, plaintext)':44} {t_scan:9.3f}")
    print(f"{'full decrypt-and-check scan':44} {t_full:9.3f}")
    print(f"speed-up: {t_full / t_scan:.1f}x")


if __name__ == "__main__":
    main()
