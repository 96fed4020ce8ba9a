"""Helper process for the fault-injection and race tests.

``python erasure_worker.py erase DATA REQUEST_ID POINT [CATALOG_URL]`` runs an
erasure of the synthetic victim and SIGKILLs itself at POINT: right after the
erasure step of that name, or inside a step at a storage fault point
(``keyshred.storage.faults.POINTS``); the catalog is SQLite unless CATALOG_URL.
``python erasure_worker.py erase-scope DATA REQUEST_ID POINT`` moves the store
test's subject's memory "moved" into its "marketing" scope, then erases that scope
the same way (the move still in the hot rows).
``python erasure_worker.py store DATA OP POINT`` writes a few memories (printing
``ACK subject key`` for each), then runs OP (``delete``, ``update`` or ``compact``)
on the store's own subject and SIGKILLs itself at POINT.
``python erasure_worker.py write DATA`` writes memories of the victim until the
store refuses, then prints how many writes were acknowledged.
``python erasure_worker.py resume DATA REQUEST_ID CATALOG_URL|- PAUSE`` resumes a
request, pausing PAUSE seconds after each step (so that racing workers overlap),
then prints its state.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyshred import Keyshred
from keyshred.errors import SubjectSuppressed
from keyshred.storage import faults
from keyshred.storage.memories import Memory
from tests.storage.conftest import make_config, parquet_config
from tests.storage.test_vectors import bag_of_words

VICTIM = "victim@example.org"
# The store test's subject, its memory the operations act on, and a bystander.
OWNER, BYSTANDER = "alice@example.org", "bob@example.org"
TARGET = (("m",), "k1")
UPDATED = {"text": "updated value"}


def digest(sources: list[Memory]) -> Any:
    """The rebuild function of the "digest" producer (derived assets)."""
    return f"digest of {len(sources)} memories"


def concat(sources: list[Memory]) -> Any:
    """The "concat" producer's rebuild function: it drops its output (``None``)
    instead of rebuilding it. Registered, so the erasure knows the producer; an
    unknown producer stops the erasure in manual review instead."""
    del sources
    return None


def register_producers(ks: Keyshred) -> None:
    ks.derived.register_producer("digest", "1", digest)
    ks.derived.register_producer("concat", "1", concat)


def kill_at(ks: Keyshred, point: str) -> None:
    """SIGKILL this process the first time ``point`` is reached: the end of the
    erasure step of that name, or a storage fault point inside a step."""

    def kill(reached: str, *_: object) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    ks.erasure.on_step = kill
    faults.hook = kill


def late_writes(ks: Keyshred) -> None:
    """Acknowledged writes of this process, before the operation that is killed."""
    for subject in (OWNER, BYSTANDER):
        ks.memories.put(subject, ("late",), "late", {"text": f"late {subject}"}, index=True)
        print(f"ACK {subject}", flush=True)


def store_op(ks: Keyshred, op: str) -> None:
    if op == "delete":
        ks.memories.delete(OWNER, *TARGET)
    elif op == "delete_many":  # the batched path (a store's batch of deletions)
        ks.memories.delete_many(OWNER, [TARGET, (("m",), "never-stored")])
    elif op == "update":
        ks.memories.update(OWNER, *TARGET, UPDATED)
    elif op == "compact":
        ks.memories.flush(OWNER)
    else:
        raise SystemExit(f"unknown operation {op}")


def main() -> None:
    mode, data = sys.argv[1], Path(sys.argv[2])
    # An update flushes (flush_records=1), so flushes happen inside it too.
    flush_records = 1 if sys.argv[3:4] == ["update"] else 1000
    url = sys.argv[5] if mode == "erase" and len(sys.argv) > 5 else None
    if mode == "resume":
        url = None if sys.argv[4] == "-" else sys.argv[4]
    # KS_TEST_LAYOUT=parquet: compactions write segments however small the partition.
    config = parquet_config if os.environ.get("KS_TEST_LAYOUT") == "parquet" else make_config
    ks = Keyshred.open(data, config(url, flush_records=flush_records), embeddings=bag_of_words)
    register_producers(ks)
    if mode == "resume":
        pause = float(sys.argv[5])
        ks.erasure.on_step = lambda step, req: time.sleep(pause)
        print("READY", flush=True)
        sys.stdin.readline()  # the test starts every racer at once
        req = ks.erasure.resume(sys.argv[3])
        print(f"STATE {req.state}", flush=True)
    elif mode == "erase":
        request_id, point = sys.argv[3], sys.argv[4]
        kill_at(ks, point)
        ks.erase(VICTIM, requested_by="dpo", reason="fault-injection", request_id=request_id)
        print("finished without crashing")
    elif mode == "erase-scope":  # OWNER's "marketing" scope, right after a move into it
        request_id, point = sys.argv[3], sys.argv[4]
        ks.memories.put(OWNER, ("m",), "moved", "new", scope="marketing", category="preference")
        kill_at(ks, point)
        ks.erase(OWNER, "marketing", requested_by="dpo", reason="consent", request_id=request_id)
        print("finished without crashing")
    elif mode == "store":
        op, point = sys.argv[3], sys.argv[4]
        late_writes(ks)
        kill_at(ks, point)
        store_op(ks, op)
        print("finished without crashing")
    else:
        n = 0
        try:
            while True:
                ks.memories.put(VICTIM, ("race",), f"p{os.getpid()}-{n}", {"n": n}, index=True)
                n += 1
                print(f"ACK {n}", flush=True)
        except SubjectSuppressed:
            print(f"REFUSED after {n}", flush=True)


if __name__ == "__main__":
    main()
