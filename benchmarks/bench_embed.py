"""The default embedding model's load: sentence-transformers (PyTorch) vs NumPy runtime.

Each runtime runs in a fresh interpreter (so imports are not shared and the load is
cold), one after the other in the same run: the time to import and load the model, the
first ``embed`` of one text, and texts/s over the first 1,000 texts of
``tests/data/pii_corpus.jsonl`` in batches of 32. Then the largest absolute difference
per component and the smallest cosine between the two runtimes' vectors on those texts,
and whether the load wrote anything on stderr; then a store with the default embeddings:
the first indexed put right after the open and after a 1 s pause (the background load
started by the open runs meanwhile). The figures are printed, never asserted.

Run: ``nice -n 19 .venv/bin/python benchmarks/bench_embed.py [--rounds N]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "pii_corpus.jsonl"
TEXTS = 1_000
BATCH = 32

# Runs in the child. ``MiniLM(runtime=...)`` exists once the NumPy runtime does; before
# that the only runtime is sentence-transformers, which is what ``MiniLM()`` loads.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from keyshred.storage.embeddings import MiniLM
runtime, corpus, out, texts_n, batch = sys.argv[1:6]
try:
    model = MiniLM(runtime=runtime)
except TypeError:
    if runtime != "sentence-transformers":
        print(json.dumps({"missing": True})); sys.exit(0)
    model = MiniLM()
model._load()
t1 = time.perf_counter()
model.embed(["My daughter Mila is allergic to peanuts."])
t2 = time.perf_counter()
with open(corpus, encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for line in f][: int(texts_n)]
import numpy as np
t3 = time.perf_counter()
vectors = [model.embed(texts[i : i + int(batch)]) for i in range(0, len(texts), int(batch))]
t4 = time.perf_counter()
np.save(out, np.concatenate(vectors))
heavy = sorted(m for m in ("torch", "sentence_transformers", "transformers") if m in sys.modules)
print(json.dumps({"load": t1 - t0, "first": t2 - t1, "rate": len(texts) / (t4 - t3),
                  "heavy": heavy}))
"""


# Runs in the child: a store with the default embeddings, the first indexed put right
# after the open, or after the application spent ``pause`` seconds on other work (the
# background load started by the open runs meanwhile).
STORE_CHILD = r"""
import json, sys, tempfile, time
t0 = time.perf_counter()
from keyshred import Keyshred
pause, custom = float(sys.argv[1]), sys.argv[2] == "custom"
# A constant function: the first put's cost without any model (LanceDB, keys, ...).
kwargs = {"embeddings": lambda texts: [[1.0, 0.0]] * len(texts)} if custom else {}
with tempfile.TemporaryDirectory() as tmp:
    t1 = time.perf_counter()
    ks = Keyshred.init(tmp + "/data", **kwargs)
    t2 = time.perf_counter()
    time.sleep(pause)
    t3 = time.perf_counter()
    ks.memories.put("A", ("notes",), "k", "My daughter Mila is allergic to peanuts.", index=True)
    t4 = time.perf_counter()
    ks.memories.search("A", (), query="food allergy", limit=1)
    t5 = time.perf_counter()
    ks.close()
print(json.dumps({"import": t1 - t0, "open": t2 - t1, "put": t4 - t3, "search": t5 - t4}))
"""


def run_store(pause: float, embeddings: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-c", STORE_CHILD, str(pause), embeddings],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run(runtime: str, out: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, runtime, str(CORPUS), str(out), str(TEXTS), str(BATCH)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = len(proc.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    print(f"{TEXTS} texts of {CORPUS.name}, batches of {BATCH}")
    header = (
        f"{'runtime':<22} {'import+load s':>13} {'first embed ms':>14} "
        f"{'texts/s':>9} {'stderr chars':>12}  heavy modules"
    )
    with tempfile.TemporaryDirectory(prefix="h24e-bench-") as tmp:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}\n{header}")
            vectors: dict[str, np.ndarray] = {}
            for runtime in ("sentence-transformers", "numpy"):
                out = Path(tmp) / f"{runtime}.npy"
                result = run(runtime, out)
                if result.get("missing"):
                    print(f"{runtime:<22} (not available on this checkout)")
                    continue
                vectors[runtime] = np.load(out)
                print(
                    f"{runtime:<22} {result['load']:>13.2f} {result['first'] * 1e3:>14.1f} "
                    f"{result['rate']:>9.1f} {result['stderr']:>12}  "
                    + (",".join(result["heavy"]) or "-")  # type: ignore[arg-type]
                )
            if len(vectors) == 2:
                a, b = vectors["sentence-transformers"], vectors["numpy"]
                cosine = np.sum(a * b, axis=1) / (
                    np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
                )
                print(
                    f"equivalence on {len(a)} texts: max |difference| "
                    f"{np.abs(a - b).max():.2e}, min cosine {cosine.min():.8f}"
                )
        print("store with the default embeddings (Keyshred.init, then the first indexed put)")
        for pause, embeddings in ((0.0, "default"), (1.0, "default"), (0.0, "custom")):
            r = run_store(pause, embeddings)
            print(
                f"  {embeddings:<7} embeddings, pause {pause:.1f} s after the open: "
                f"import keyshred {r['import']:.2f} s, "
                f"open {r['open'] * 1e3:.0f} ms, first put {r['put'] * 1e3:.0f} ms, "
                f"first search {r['search'] * 1e3:.0f} ms"
            )
    print("load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
