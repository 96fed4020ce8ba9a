"""Cost of mention detection per put (issue 19, item 3), in one run.

Workload: batched writes (``put_many`` of 100 items, ~200-byte texts with names,
an e-mail and a phone number in some of them) for 20 subjects, on three embedded
stores made the same way:

- ``none``: no identifier registered (detection is skipped entirely);
- ``ids``: 1,000 subjects registered with an e-mail, a phone and a resident id each,
  no names (the detector runs, no n-grams);
- ``ids+names``: the same plus a two-word name each (word n-grams of every text).

Printed: microseconds per item (median of 9 rounds, interleaved across the three
stores) and the ratio to ``none``, and how many mentions were recorded.

Run: ``.venv/bin/python benchmarks/bench_mentions.py``
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyshred import Config, Keyshred
from keyshred.config import StorageSettings
from keyshred.storage.memories import PutItem

BATCH = 100
SUBJECTS = 20
ROUNDS = 9
REGISTERED = 1_000
WORDS = ["tea", "coffee", "meeting", "tomorrow", "project", "deadline", "called", "about", "and"]
FIRST = ["anna", "boris", "chen", "dara", "emil", "fatima", "goran", "hana", "ivo", "jun"]
LAST = ["novak", "li", "schmidt", "garcia", "kim", "rossi", "weber", "sato", "silva", "berg"]


def person(i: int) -> tuple[str, str, str, str]:
    name = f"{FIRST[i % 10]} {LAST[(i // 10) % 10]}{i // 100}"
    return name, f"user{i}@example.org", f"+49 30 {1000000 + i}", f"{i:08d}"


def text(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(28)]
    if n % 4 == 0:
        name, email, phone, _ = person(rng.randrange(REGISTERED))
        words[5:5] = [name.title(), "at", email, "or", phone]
    return " ".join(words)


def make(root: Path, *, ids: bool, names: bool) -> Keyshred:
    ks = Keyshred.init(root, Config(storage=StorageSettings(durability="flush")))
    if ids:
        for i in range(REGISTERED):
            name, email, phone, rid = person(i)
            ks.subjects.register_identifiers(
                f"p{i}",
                emails=[email],
                phones=[phone],
                resident_ids=[rid],
                names=[name] if names else [],
            )
    return ks


def one_round(ks: Keyshred, r: int) -> float:
    """Microseconds per item of one round (the same texts on every store)."""
    rng = random.Random(r)
    batches = [
        [PutItem(("notes",), f"r{r}-k{n}", {"text": text(rng, n)}) for n in range(BATCH)]
        for _ in range(SUBJECTS)
    ]
    start = time.perf_counter()
    for s, items in enumerate(batches):
        ks.memories.put_many(f"writer-{s}", items)
    return (time.perf_counter() - start) / (SUBJECTS * BATCH) * 1e6


def main() -> None:
    setups = {"none": (False, False), "ids": (True, False), "ids+names": (True, True)}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {k: make(Path(tmp) / k, ids=i, names=n) for k, (i, n) in setups.items()}
        try:
            times: dict[str, list[float]] = {k: [] for k in stores}
            for r in range(ROUNDS + 1):
                # Rounds interleaved across the stores: a noisy neighbour slows all.
                for label, ks in stores.items():
                    us = one_round(ks, r)
                    if r:  # round 0 warms up: imports, keys, partitions
                        times[label].append(us)
            counts = {k: ks.catalog.mention_counts() for k, ks in stores.items()}
        finally:
            for ks in stores.values():
                ks.close()
    base = statistics.median(times["none"])
    print(f"put_many of {BATCH} items, {SUBJECTS} subjects, median of {ROUNDS} rounds")
    print(f"{'registered':<12} {'us/item':>9} {'ratio':>7}  mentions")
    for label, values in times.items():
        us = statistics.median(values)
        print(f"{label:<12} {us:9.1f} {us / base:7.2f}  {counts[label]}")


if __name__ == "__main__":
    main()
