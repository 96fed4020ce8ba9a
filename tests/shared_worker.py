"""A worker process of the shared profile (tests/test_shared_workers.py): its own
data folder, the shared PostgreSQL catalog and key store, a shared KEK and the S3
partition store. One command per run; prints ``ACK <n>`` for each acknowledged
write, ``READ <json>`` for what it read.

    python shared_worker.py FOLDER CONFIG_JSON write SUBJECT START COUNT
    python shared_worker.py FOLDER CONFIG_JSON read SUBJECT COUNT
    python shared_worker.py FOLDER CONFIG_JSON search SUBJECT QUERY
    python shared_worker.py FOLDER CONFIG_JSON compact-kill SUBJECT POINT
    python shared_worker.py FOLDER CONFIG_JSON erase SUBJECT
    python shared_worker.py FOLDER CONFIG_JSON refuses SUBJECT
    python shared_worker.py FOLDER CONFIG_JSON backup-restore TARGET INTO SUBJECT:COUNT...
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keyshred import Config, Keyshred  # noqa: E402
from keyshred.errors import SubjectSuppressed  # noqa: E402
from keyshred.storage import faults  # noqa: E402
from tests.storage.test_vectors import bag_of_words  # noqa: E402

NS = ("notes",)


def _open(folder: Path, config: Config) -> Keyshred:
    if (folder / "keyshred.toml").exists():
        return Keyshred.open(folder, config, embeddings=bag_of_words)
    return Keyshred.init(folder, config, embeddings=bag_of_words)


def main() -> None:
    folder, raw, command, *args = sys.argv[1:]
    config = Config.model_validate_json(raw)
    ks = _open(Path(folder), config)
    try:
        if command == "write":
            subject, start, count = args[0], int(args[1]), int(args[2])
            for i in range(start, start + count):
                value = {"text": f"{subject} note {i} about kayaks", "i": i}
                ks.memories.put(subject, NS, f"k{i}", value, index=i % 10 == 0)
                print(f"ACK {i}", flush=True)
        elif command == "read":
            subject, count = args[0], int(args[1])
            got = {}
            for i in range(count):
                m = ks.memories.get(subject, NS, f"k{i}")
                got[i] = None if m is None else m.value["i"]
            print("READ " + json.dumps({"count": ks.memories.count(subject), "got": got}))
        elif command == "search":
            subject, query = args
            hits = ks.memories.search(subject, query=query, limit=5)
            print("READ " + json.dumps([m.key for m in hits]))
        elif command == "compact-kill":
            subject, point = args

            def kill(at: str) -> None:
                if at == point:
                    os.kill(os.getpid(), signal.SIGKILL)

            for i in range(1000, 1010):  # acknowledged before the compaction starts
                ks.memories.put(subject, NS, f"k{i}", {"text": f"late {i}", "i": i})
                print(f"ACK {i}", flush=True)
            faults.hook = kill
            ks.memories.flush(subject)
            print("NOT KILLED", flush=True)
        elif command == "erase":
            req = ks.erase(args[0], requested_by="dpo", reason="gdpr-art17")
            print("READ " + json.dumps({"state": req.state, "error": req.error}))
        elif command == "backup-restore":
            target, into, *wanted = args
            gen = ks.backup.create(target)
            report = ks.backup.restore(gen.generation, into, target=target)
            counts = {}
            with Keyshred.open(Path(into), embeddings=bag_of_words) as copy:
                for item in wanted:
                    subject, count = item.split(":")
                    values = [copy.memories.get(subject, NS, f"k{i}") for i in range(int(count))]
                    counts[subject] = sum(1 for m in values if m is not None)
            print("READ " + json.dumps({"subjects": report.subjects_verified, "counts": counts}))
        elif command == "refuses":
            try:
                ks.memories.get(args[0], NS, "k0")
                print("READ " + json.dumps("read"))
            except SubjectSuppressed:
                print("READ " + json.dumps("refused"))
        else:
            raise SystemExit(f"unknown command {command}")
    finally:
        faults.hook = None
        ks.close()


if __name__ == "__main__":
    main()
