"""Writer process for the crash test: puts memories and prints each acknowledged one.

Usage: python crash_writer.py DATA_DIR ROUND. Prints ``ACK <key>`` after every put
(or batch) has returned, flushing stdout each time, until it is killed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keyshred import Keyshred
from keyshred.storage.memories import PutItem
from tests.storage.conftest import make_config


def main() -> None:
    data, round_no = Path(sys.argv[1]), int(sys.argv[2])
    cfg = make_config(None, flush_records=20)
    ks = Keyshred.init(data, cfg, exist_ok=True)
    out = sys.stdout
    i = 0
    while True:
        subject = f"crash-subject-{i % 3}"
        if i % 5 == 0:
            keys = [f"r{round_no}-k{i}-{j}" for j in range(4)]
            ks.memories.put_many(subject, [PutItem(("crash",), k, {"k": k}) for k in keys])
        else:
            keys = [f"r{round_no}-k{i}"]
            ks.memories.put(subject, ("crash",), keys[0], {"k": keys[0]})
        for k in keys:
            out.write(f"ACK {subject} {k}\n")
        out.flush()
        i += 1


if __name__ == "__main__":
    main()
