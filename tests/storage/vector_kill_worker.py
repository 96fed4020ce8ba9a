"""Helper process for ``test_vector_rows``: ``python vector_kill_worker.py DATA URL|-
POINT`` writes indexed memories of two subjects (printing ``ACK subject key`` for
each acknowledged put), then puts an indexed memory of a third and SIGKILLs itself
at the storage fault POINT inside that put."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keyshred import Keyshred
from keyshred.storage import faults
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

SUBJECTS = ("alice@example.org", "bob@example.org")
KILLED = "carol@example.org"
NS = ("m",)


def value(subject: str, i: int) -> dict[str, str]:
    return {"text": f"{subject.split('@', maxsplit=1)[0]} likes topic{i} very much"}


def main() -> None:
    data, url, point = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    ks = Keyshred.open(data, make_config(None if url == "-" else url), embeddings=bag_of_words)
    for subject in SUBJECTS:
        for i in range(3):
            ks.memories.put(subject, NS, f"k{i}", value(subject, i), index=True)
            print(f"ACK {subject} k{i}", flush=True)

    def kill(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    faults.hook = kill
    ks.memories.put(KILLED, NS, "k0", value(KILLED, 0), index=True)
    print("finished without crashing", flush=True)


if __name__ == "__main__":
    main()
