"""A worker process holding a subject in memory (tests/test_eviction.py,
benchmarks/bench_eviction.py): it opens its own data folder on the shared
PostgreSQL catalog and key store, reads each subject named on the command line
(its unwrapped DEKs, decrypted rows and decrypted vectors then sit in its caches),
prints ``READY <json>`` and answers commands on stdin, one per line:

    held SUBJECT...   -> HELD {"<subject>": {"keys": n, "memories": n, "vectors": n}}
    quit              -> closes the handle and exits

    python eviction_worker.py FOLDER CONFIG_JSON SUBJECT...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyshred import Config, Keyshred  # noqa: E402
from keyshred.erasure.eviction import PROCESS_ID  # noqa: E402
from tests.storage.test_vectors import bag_of_words  # noqa: E402

NS = ("notes",)


def main() -> None:
    folder, raw, *subjects = sys.argv[1:]
    config = Config.model_validate_json(raw)
    root = Path(folder)
    if (root / "keyshred.toml").exists():
        ks = Keyshred.open(root, config, embeddings=bag_of_words)
    else:
        ks = Keyshred.init(root, config, embeddings=bag_of_words)
    try:
        for subject in subjects:
            ks.memories.get(subject, NS, "k0")  # decrypted rows and the scope key
            ks.memories.search(subject, query="kayaks", limit=3)  # decrypted vectors
        print("READY " + json.dumps({"process": PROCESS_ID.get()}), flush=True)
        for line in sys.stdin:
            command, *args = line.split()
            if command == "held":
                held = {s: ks._eviction.held(ks.subject_ref(s)) for s in args}
                print("HELD " + json.dumps(held), flush=True)
            elif command == "quit":
                break
    finally:
        ks.close()
    print("BYE", flush=True)


if __name__ == "__main__":
    main()
