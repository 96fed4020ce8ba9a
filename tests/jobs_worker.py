"""A ``keyshred worker`` process for the job tests (tests/test_worker.py).

    python jobs_worker.py DATA CONFIG_JSON MODE [ARG]

runs the real CLI (``keyshred worker``) on DATA with CONFIG_JSON (a ``Config``), the
tests' embedding function and rebuild functions, and a hook chosen by MODE:

- ``kill STEP``: SIGKILL this process inside the erasure step STEP (its effects
  done, not yet recorded);
- ``term STEP``: print ``IN STEP`` inside STEP and keep the step busy a while (the
  test sends SIGTERM then); the worker runs until stopped;
- ``race``: wait for a line on stdin (the test starts every racer at once), pause a
  little after each step so the racers overlap, run the due jobs and exit;
- ``drain``: run every due job and exit (``keyshred worker --once``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keyshred import Config, Keyshred, cli
from keyshred.erasure import ErasureRequest
from tests.erasure_worker import register_producers
from tests.storage.test_vectors import bag_of_words


def main() -> None:
    data, raw, mode, *rest = sys.argv[1:]
    config = Config.model_validate_json(raw)
    point = rest[0] if rest else ""

    def hooks(ks: Keyshred) -> None:
        def acted(step: str, req: ErasureRequest) -> None:
            del req
            if mode == "kill" and step == point:
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "term" and step == point:
                print("IN STEP", flush=True)
                time.sleep(2.0)  # the test's SIGTERM arrives inside the step

        ks.erasure.on_step_acted = acted
        if mode == "race":
            ks.erasure.on_step = lambda step, req: time.sleep(0.05)

    class Opened(Keyshred):
        @classmethod
        def open(cls, path: Any, config_: Any = None, *, embeddings: Any = None) -> Keyshred:
            del config_, embeddings
            ks = Keyshred.open(path, config, embeddings=bag_of_words)
            register_producers(ks)
            hooks(ks)
            return ks

    cli.Keyshred = Opened  # type: ignore[misc]
    if mode == "race":
        print("READY", flush=True)
        sys.stdin.readline()
    once = [] if mode == "term" else ["--once"]
    sys.argv = ["keyshred", "worker", "--path", data, *once, "--json"]
    cli.main()


if __name__ == "__main__":
    main()
