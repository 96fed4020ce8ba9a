"""Helper process for the erasure fault-injection and race tests.

``python erasure_worker.py erase DATA REQUEST_ID CRASH_STEP`` runs an erasure of the
synthetic victim and SIGKILLs itself right after CRASH_STEP completed.
``python erasure_worker.py write DATA`` writes memories of the victim until the
store refuses, then prints how many writes were acknowledged.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyshred import Keyshred
from keyshred.errors import SubjectSuppressed
from tests.storage.conftest import make_config
from tests.storage.test_vectors import bag_of_words

VICTIM = "victim@example.org"


def main() -> None:
    mode, data = sys.argv[1], Path(sys.argv[2])
    ks = Keyshred.open(data, make_config(None), embeddings=bag_of_words)
    if mode == "erase":
        request_id, crash_step = sys.argv[3], sys.argv[4]

        def crash(step: str, _req: object) -> None:
            if step == crash_step:
                os.kill(os.getpid(), signal.SIGKILL)

        ks.erasure.on_step = crash
        ks.erase(VICTIM, requested_by="dpo", reason="fault-injection", request_id=request_id)
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
