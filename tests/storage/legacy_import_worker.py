"""Worker for the import's kill test: opens a folder of the layout before issue #21
and imports every partition, SIGKILLing itself the first time POINT is reached.

Usage: python legacy_import_worker.py DATA POINT (the configuration to open DATA
with in DATA/config.json: its catalog may be the test's PostgreSQL schema).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keyshred import Config, Keyshred
from keyshred.storage import faults
from tests.storage.test_legacy_import import MK


def main() -> None:
    data, point = Path(sys.argv[1]), sys.argv[2]

    def kill(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    config = Config.model_validate_json((data / "config.json").read_text())
    ks = Keyshred.open(data, config, embeddings=MK.embed)
    faults.hook = kill
    ks.memories.import_legacy()
    raise SystemExit(f"{point} was never reached")


if __name__ == "__main__":
    main()
