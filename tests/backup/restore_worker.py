"""Helper process for the restore fault-injection test.

``python restore_worker.py DATA GENERATION INTO POINT N`` restores GENERATION of the
data folder DATA into INTO and SIGKILLs itself the N-th time the restore reaches
POINT (one of ``keyshred.backup.manager.RESTORE_POINTS``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keyshred import Keyshred
from tests.storage.test_vectors import bag_of_words


def main() -> None:
    data, generation, into, point, n = sys.argv[1:6]
    ks = Keyshred.open(Path(data), embeddings=bag_of_words)
    seen = [0]

    def crash(step: str) -> None:
        if step == point:
            seen[0] += 1
            if seen[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)

    ks.backup.on_restore_step = crash
    ks.backup.restore(generation, Path(into))
    print("finished without crashing")


if __name__ == "__main__":
    main()
