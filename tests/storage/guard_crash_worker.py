"""Helper process for the guard-cache crash test.

``python guard_crash_worker.py DATA SUBJECT`` suppresses SUBJECT and SIGKILLs itself
right after the suppression committed, before its process could tell the others
(``Catalog._guard_changed``, where the shared guard generation settles).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keyshred import Keyshred
from tests.storage.conftest import make_config


def main() -> None:
    data, subject = Path(sys.argv[1]), sys.argv[2]
    ks = Keyshred.open(data, make_config(None))

    def crash() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    ks.catalog._guard_changed = crash  # type: ignore[method-assign]
    ks.catalog.suppress(ks.subject_ref(subject))
    print("finished without crashing")


if __name__ == "__main__":
    main()
