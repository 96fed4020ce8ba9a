"""Helper process for the backup kill test.

``python backup_worker.py DATA POINT`` opens the data folder DATA, makes a backup
and SIGKILLs itself when the backup reaches POINT (``keyshred.storage.faults``)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keyshred import Keyshred
from keyshred.storage import faults
from tests.storage.test_vectors import bag_of_words


def main() -> None:
    data, point = sys.argv[1:3]
    ks = Keyshred.open(Path(data), embeddings=bag_of_words)

    def crash(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    faults.hook = crash
    ks.backup.create()
    print("finished without crashing")


if __name__ == "__main__":
    main()
