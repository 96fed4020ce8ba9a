"""Vector search benchmark: keyshred's sealed per-subject partition vs plaintext LanceDB.

For subjects with 1,000 and 10,000 vectors (384-d, unit length), in one run:
keyshred cold (first search after opening the store: DEK unwrap, LanceDB read,
decryption of every vector, ranking), keyshred warm (decrypted cache), and plaintext
LanceDB brute-force search (no ANN index, cosine) over the same vectors. p50/p99 of
200 queries (cold: 5 fresh opens). The public path, ``ks.memories.search(subject,
prefix, query=...)`` over the same vectors written as indexed memories, is timed beside
the internal ``VectorIndex.search`` (target: within 1.5x of it, issue 25); its embedder
looks the vectors up, so the query embedding costs nothing on either side.
Run: ``.venv/bin/python benchmarks/bench_vectors.py``
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lancedb

from keyshred import Keyshred, PutItem
from keyshred.storage.vectors import VectorItem

DIMS = 384
QUERIES = 200
K = 10


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    m = rng.standard_normal((n, DIMS)).astype(np.float32)
    return m / np.linalg.norm(m, axis=1, keepdims=True)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


LOOKUP: dict[str, np.ndarray] = {}  # text -> its vector: the public path's embedder


def lookup(texts: list[str]) -> list[np.ndarray]:
    return [LOOKUP[t] for t in texts]


def main() -> None:
    rng = np.random.default_rng(7)
    queries = unit(rng, QUERIES)
    for i, q in enumerate(queries):
        LOOKUP[f"query {i}"] = q
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; {DIMS}-d, top {K}")
    print(f"{'vectors':>8} {'engine':<34} {'p50 ms':>8} {'p99 ms':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ks = Keyshred.init(root / "ks", embeddings=lookup)
        plain_db = lancedb.connect(str(root / "plain"))
        for n in (1_000, 10_000):
            matrix = unit(rng, n)
            subject = f"subject-{n}"
            ref = ks.subject_ref(subject)
            ks.keyring.data_key(ref, "default")
            items = [VectorItem(f"m{i:06d}", 0, "$", "default", 0, matrix[i]) for i in range(n)]
            for start in range(0, n, 1000):
                ks.vectors.upsert(ref, items[start : start + 1000])
            public = f"public-{n}"
            for i in range(n):
                LOOKUP[f"memory {n} {i}"] = matrix[i]
            for start in range(0, n, 1000):
                ks.memories.put_many(
                    public,
                    [
                        PutItem(("notes",), f"k{i}", {"text": f"memory {n} {i}"}, index=["text"])
                        for i in range(start, min(n, start + 1000))
                    ],
                )
            table = plain_db.create_table(
                f"plain{n}",
                pa.table(
                    {
                        "memory_id": [it.memory_id for it in items],
                        "vector": pa.FixedSizeListArray.from_arrays(
                            pa.array(matrix.reshape(-1)), DIMS
                        ),
                    }
                ),
            )
            ks.close()

            cold = []
            for _ in range(5):
                fresh = Keyshred.open(root / "ks", embeddings=lookup)
                gc.collect()  # measure the store, not the benchmark's own garbage
                start = time.perf_counter()
                fresh.vectors.search(ref, queries[0], K)
                cold.append(time.perf_counter() - start)
                ks = fresh
                if _ < 4:
                    ks.close()
            warm = []
            for q in queries:
                start = time.perf_counter()
                ks.vectors.search(ref, q, K)
                warm.append(time.perf_counter() - start)
            ks.memories.search(public, ("notes",), query="query 0", limit=K)  # load it
            public_warm = []
            for i in range(QUERIES):
                start = time.perf_counter()
                ks.memories.search(public, ("notes",), query=f"query {i}", limit=K)
                public_warm.append(time.perf_counter() - start)
            lance = []
            for q in queries:
                start = time.perf_counter()
                table.search(q).distance_type("cosine").limit(K).to_arrow()
                lance.append(time.perf_counter() - start)
            # Same answers: keyshred ranks the same vectors as the plaintext search.
            ours = [m for m, _ in ks.vectors.search(ref, queries[1], K)]
            theirs = table.search(queries[1]).distance_type("cosine").limit(K).to_arrow()
            assert ours == theirs.column("memory_id").to_pylist(), "rankings differ"
            rows = (
                ("keyshred cold (first search)", cold),
                ("keyshred warm", warm),
                ("keyshred public search warm", public_warm),
                ("plaintext LanceDB brute force", lance),
            )
            for label, xs in rows:
                print(f"{n:>8} {label:<34} {pct(xs, 0.5):>8.2f} {pct(xs, 0.99):>8.2f}")
            ratio = statistics.median(warm) / statistics.median(lance)
            print(f"{n:>8} warm / plaintext p50 = {ratio:.2f}")
            ratio = statistics.median(public_warm) / statistics.median(warm)
            print(f"{n:>8} public / internal p50 = {ratio:.2f} (target <= 1.5)")
        ks.close()


if __name__ == "__main__":
    main()
