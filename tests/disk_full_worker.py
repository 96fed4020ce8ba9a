"""Writer process for the disk-full tests: writes until the disk (or its file size
limit) is full, printing what was acknowledged.

Usage: python disk_full_worker.py DATA_DIR MODE FSIZE_LIMIT [CATALOG_URL]. MODE ``memories``
puts growing values for a few subjects (half of them indexed, so LanceDB writes too);
``subjects`` puts batches for a new subject each time (the catalog and key store
grow); ``vault`` sanitizes texts. FSIZE_LIMIT > 0 runs the process under
``RLIMIT_FSIZE`` (writes past it fail with EFBIG; SIGXFSZ is ignored). Prints
``ACK <kind> <subject> <key-or-token>`` after every call returned, then ``ERR
<module.class> <message>`` for the first error, and exits (after MAX_WRITES calls
without one, too).
"""

from __future__ import annotations

import resource
import signal
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyshred import Keyshred
from keyshred.storage.memories import PutItem
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

NS = ("full",)
MAX_WRITES = 5000  # the limits the tests set are met long before
EMAIL = "mail me at person{i}@example.com, "


def _limit(limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))


def _write(ks: Keyshred, mode: str, i: int) -> list[str]:
    if mode == "memories":
        subject, key = f"full-{i % 3}", f"k{i}"
        ks.memories.put(subject, NS, key, {"text": f"fact {i} " * 600}, index=i % 2 == 0)
        return [f"memory {subject} {key}"]
    if mode == "subjects":
        subject = f"full-subject-{i}"
        keys = [f"k{i}-{j}" for j in range(20)]
        ks.memories.put_many(subject, [PutItem(NS, k, {"text": k * 40}) for k in keys])
        return [f"memory {subject} {k}" for k in keys]
    found = ks.vault.sanitize_many(
        [EMAIL.format(i=f"{i}x{j}") * 20 for j in range(20)],
        "full-vault",
        "support",
        timedelta(days=1),
    )
    return [f"token full-vault {t}" for s in found for t in s.tokens]


def main() -> None:
    data, mode = Path(sys.argv[1]), sys.argv[2]
    url = sys.argv[4] if len(sys.argv) > 4 else None
    # Memories compact often: with a PostgreSQL catalog their rows are not in a local
    # file until a compaction writes a segment, which grows with every one.
    flush = 50 if mode == "memories" else 100_000
    ks = Keyshred.open(data, make_config(url, flush_records=flush), embeddings=bag_of_words)
    if int(sys.argv[3]) > 0:
        _limit(int(sys.argv[3]))
    out = sys.stdout
    i = 0
    try:
        while i < MAX_WRITES:
            for line in _write(ks, mode, i):
                out.write(f"ACK {line}\n")
            out.flush()
            i += 1
    except Exception as exc:  # noqa: BLE001 - the parent checks the type
        out.write(f"ERR {type(exc).__module__}.{type(exc).__qualname__} {exc}\n")
        out.flush()
    try:
        ks.close(flush=False)
    except Exception as exc:  # noqa: BLE001 - reported, the parent decides
        out.write(f"CLOSE-ERR {type(exc).__module__}.{type(exc).__qualname__}\n")


if __name__ == "__main__":
    main()
