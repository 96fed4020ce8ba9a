"""Scale benchmark (issue #25 item 4): keyshred's public API against LangGraph's
``SqliteStore`` (WAL) or ``PostgresStore`` and plaintext LanceDB, at 100 and 10,000
subjects (``--subjects 100,10000``; 1,000,000 accepted), 20 memories per subject
(``--per-subject``), ~120-byte values, in one run.

Every side runs in a child process of its own per size, so one side's memory and
caches never touch another's; each reports its own peak RSS (``getrusage``), the
files and bytes under its data folder and its open file descriptors. The parent
drives them line by line: the load in 6 chunks, then the measurement rounds, both
interleaved between the sides (the order reversed every other chunk or round);
medians of the chunks and rounds are reported.

Per side and size, after loading N subjects (one batched put per subject: 20 items,
one commit):

- put: single puts of new keys into random subjects;
- get: within the caches (the same 20 subjects again and again, warmed) and spread
  (random subjects over all N: beyond keyshred's 256 open partitions at 10,000);
- search: a subject's namespace, first 10 (no query), random subjects;
- semantic search: top 10 by a query inside one subject, hot (20 warmed subjects)
  and spread; for keyshred the public path ``ks.memories.search(..., query=...)``
  and, on the same subjects and queries, the internal ``ks.vectors.search`` (target:
  public within 1.5x of internal);
- list: the namespaces of one subject, and of every subject (``KeyshredStore``
  ``list_namespaces``), and a search across every subject's namespaces;
- delete: single deletes of keys the put phase wrote;
- erase: a whole subject. keyshred: ``ks.erase``, with the receipt's
  ``requested_at``/``keys_destroyed_at``/``completed_at`` giving the time to
  crypto-erased and to completed (target: crypto-erased flat, 10,000 : 100 <= 1.2).
  SqliteStore/PostgresStore: the subject's items deleted in one batch (the bytes
  stay in free pages, WAL or dead tuples until VACUUM); LanceDB: ``delete`` of the
  subject's rows (the bytes stay in older versions until cleanup).

Embedding: a hashed bag of words, 64 dimensions (``tests.storage.test_vectors``'s
``bag_of_words``, as ``bench_memories.py`` uses): the benchmark measures storage, not
a model. keyshred and LanceDB embed the text field with it on put (keyshred's put is
also timed unindexed). ``SqliteStore`` and ``PostgresStore`` embed nothing and have
no semantic search here: sqlite-vec needs SQLite extension loading, which this
Python's ``sqlite3`` is built without, and pgvector is not installed.

Durability: keyshred's default (``storage.durability = "fsync"``: SQLite WAL,
``synchronous=FULL``, one fsync'd commit per put) against ``SqliteStore`` set to WAL
with ``synchronous=FULL``; ``--fsyncs`` counts each side's fsync/fdatasync calls per
operation with strace and prints them. LanceDB writes files without fsync.

Shared profile (``--profile shared``): keyshred on PostgreSQL (a fresh schema), OpenBao
Transit and moto's S3 (started as ``bench_erasure_workers.py`` starts them) against
``PostgresStore`` (a fresh schema) and plaintext LanceDB on the same moto S3.

Run: ``.venv/bin/python benchmarks/bench_scale.py [--subjects 100,10000]
[--rounds 3] [--profile embedded|shared] [--fsyncs] [--pyinstrument PHASE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from _common import Child, count_ops, strace_syncs, uptime

from tests.storage.test_vectors import DIMS, bag_of_words

# moto and boto3 need credentials and a region: moto's documented dummies (as in
# tests/conftest.py); every client gets an explicit loopback endpoint.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
K = 10
WORDS = [
    "tea",
    "coffee",
    "dog",
    "cat",
    "walks",
    "runs",
    "morning",
    "evening",
    "garden",
    "kayak",
    "river",
    "bread",
    "cheese",
    "piano",
    "guitar",
    "novel",
    "poem",
    "train",
    "bicycle",
    "rain",
    "snow",
    "summer",
    "winter",
    "mountain",
    "beach",
    "market",
    "chess",
    "football",
    "swims",
    "cooks",
    "paints",
    "reads",
    "sleeps",
    "early",
    "late",
    "quiet",
    "loud",
]
SAMPLES = {"put": 200, "get": 500, "search": 200, "semantic": 200, "list": 200, "delete": 150}
ERASES = 5
HOT = 20  # subjects in the "within the caches" working set
LOAD_CHUNKS = 6  # the load, in chunks interleaved between the sides


def subject(s: int) -> str:
    return f"user{s:07d}"


def text(s: int, i: int) -> str:
    rnd = random.Random(s * 1_000_003 + i)
    return f"memory {i} of {subject(s)}: " + " ".join(rnd.choice(WORDS) for _ in range(12))


def value(s: int, i: int) -> dict[str, Any]:
    # ~120 bytes of JSON, as the issue measured
    return {"text": text(s, i), "n": i}


def embed_one(t: str) -> np.ndarray:
    return np.asarray(bag_of_words([t])[0], dtype=np.float32)


def query_text(j: int) -> str:
    rnd = random.Random(-j - 1)
    return " ".join(rnd.choice(WORDS) for _ in range(3))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


def lat(fn: Callable[[Any], Any], args: list[Any]) -> list[float]:
    out = []
    for a in args:
        start = time.perf_counter()
        fn(a)
        out.append(time.perf_counter() - start)
    return out


def disk(root: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
    return files, size


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# =====================================================================================
# Sides
# =====================================================================================


class Side:
    name = ""
    durability = ""
    semantic_supported = True
    internal_supported = False

    def load(self, s: int, n: int) -> None: ...
    def put(self, s: int, key: str, s_i: int) -> None: ...
    def get(self, s: int, key: str) -> Any: ...
    def search(self, s: int) -> list[Any]: ...
    def semantic(self, s: int, q: str) -> list[Any]: ...
    def internal(self, s: int, q: str) -> list[Any]:
        raise NotImplementedError

    def list_one(self, s: int) -> list[Any]: ...
    def list_all(self) -> list[Any]: ...
    def search_all(self) -> list[Any]: ...
    def delete(self, s: int, key: str) -> None: ...
    def erase(self, s: int) -> dict[str, float]: ...
    def after_load(self) -> None:
        """Once the load is done (outside every timing)."""

    def close(self) -> None: ...


def _ns(s: int) -> tuple[str, str]:
    return (subject(s), "notes")


class KeyshredSide(Side):
    internal_supported = True

    def __init__(self, root: Path, shared: dict[str, str] | None) -> None:
        from keyshred import Config, Keyshred
        from keyshred.integrations.langgraph import KeyshredStore

        self.stack = contextlib.ExitStack()
        if shared is None:
            self.name = "keyshred"
            config = Config()
        else:
            from keyshred.drill_servers import LocalServer, scratch_schema
            from keyshred.drill_shared import make_bucket, shared_config

            self.name = "keyshred (shared)"
            bao = LocalServer("openbao", shared["bao_url"], shared["bao_token"], 0)
            s3 = LocalServer("moto", shared["s3_url"], "", 0)
            os.environ["VAULT_TOKEN"] = bao.token
            url = self.stack.enter_context(scratch_schema(shared["postgres_url"]))
            config = shared_config(url, bao, s3, make_bucket(s3))
        self.root = root / "data"
        self.ks = Keyshred.init(self.root, config, embeddings=bag_of_words)
        self.store = KeyshredStore(self.ks)
        if shared is None:
            with self.ks.catalog.engine.connect() as conn:
                journal = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
                sync = conn.exec_driver_sql("PRAGMA synchronous").scalar()
            self.durability = f"catalog SQLite journal_mode={journal}, synchronous={sync}"
        else:
            self.durability = "catalog PostgreSQL (fsync=on, synchronous_commit=on)"

    def load(self, s: int, n: int) -> None:
        from keyshred import PutItem

        self.ks.memories.put_many(
            subject(s),
            [PutItem(_ns(s), f"m{i}", value(s, i), index=["text"]) for i in range(n)],
        )

    def put(self, s: int, key: str, s_i: int) -> None:
        self.ks.memories.put(subject(s), _ns(s), key, value(s, s_i), index=["text"])

    def put_plain(self, s: int, key: str, s_i: int) -> None:
        self.ks.memories.put(subject(s), _ns(s), key, value(s, s_i), index=False)

    def get(self, s: int, key: str) -> Any:
        m = self.ks.memories.get(subject(s), _ns(s), key)
        assert m is not None
        return m.value

    def search(self, s: int) -> list[Any]:
        return self.ks.memories.search(subject(s), _ns(s), limit=K)

    def semantic(self, s: int, q: str) -> list[Any]:
        return self.ks.memories.search(subject(s), _ns(s), query=q, limit=K)

    def internal(self, s: int, q: str) -> list[Any]:
        # The internal ranking the public path is held to (bench_vectors.py's): the
        # subject's sealed vectors, decrypted and cached, ranked by cosine; the query
        # embedded by the same function as on the public path.
        return self.ks.vectors.search(self.ks.subject_ref(subject(s)), embed_one(q), K)

    def list_one(self, s: int) -> list[Any]:
        return self.store.list_namespaces(prefix=(subject(s),))

    def list_all(self) -> list[Any]:
        return self.store.list_namespaces(limit=100)

    def search_all(self) -> list[Any]:
        return self.store.search((), limit=K)

    def delete(self, s: int, key: str) -> None:
        assert self.ks.memories.delete(subject(s), _ns(s), key)

    def erase(self, s: int) -> dict[str, float]:
        start = time.perf_counter()
        req = self.ks.erase(subject(s), requested_by="bench", reason="benchmark")
        call = time.perf_counter() - start
        assert req.state == "completed", req.error
        r = self.ks.erasure.receipt(req.request_id)
        assert r is not None
        return {
            "crypto-erased ms": (r.keys_destroyed_at - r.requested_at).total_seconds() * 1e3,
            "completed ms": (r.completed_at - r.requested_at).total_seconds() * 1e3,
            "erase call ms": call * 1e3,
        }

    def close(self) -> None:
        try:
            self.ks.close()
        finally:
            self.stack.close()


class LangGraphSide(Side):
    """``SqliteStore`` (WAL, ``synchronous`` as keyshred's catalog) or
    ``PostgresStore`` (a fresh schema), used the way an application would."""

    def __init__(self, root: Path, shared: dict[str, str] | None, sync: str) -> None:
        self.stack = contextlib.ExitStack()
        self.root = root / "data"
        self.root.mkdir()
        if shared is None:
            from langgraph.store.sqlite import SqliteStore

            self.name = f"SqliteStore WAL+{sync}"
            # No index config: its vector search needs sqlite-vec loaded as an SQLite
            # extension, and this Python's sqlite3 is built without extension loading.
            self.semantic_supported = False
            self.store = self.stack.enter_context(
                SqliteStore.from_conn_string(str(self.root / "store.db"))
            )
            self.store.conn.execute("PRAGMA journal_mode=WAL")
            self.store.conn.execute(f"PRAGMA synchronous={sync}")
            self.store.setup()
            journal = self.store.conn.execute("PRAGMA journal_mode").fetchone()[0]
            got = self.store.conn.execute("PRAGMA synchronous").fetchone()[0]
            self.durability = f"journal_mode={journal}, synchronous={got}"
        else:
            from langgraph.store.postgres import PostgresStore

            from keyshred.drill_servers import scratch_schema

            self.name = "PostgresStore"
            self.semantic_supported = False  # pgvector is not installed here
            url = self.stack.enter_context(scratch_schema(shared["postgres_url"]))
            conn = "postgresql://" + url.split("://", 1)[1]
            self.store = self.stack.enter_context(PostgresStore.from_conn_string(conn))
            self.store.setup()
            self.durability = "PostgreSQL (fsync=on, synchronous_commit=on)"

    def load(self, s: int, n: int) -> None:
        from langgraph.store.base import PutOp

        self.store.batch([PutOp(_ns(s), f"m{i}", value(s, i)) for i in range(n)])

    def put(self, s: int, key: str, s_i: int) -> None:
        self.store.put(_ns(s), key, value(s, s_i))

    def get(self, s: int, key: str) -> Any:
        item = self.store.get(_ns(s), key)
        assert item is not None
        return item.value

    def search(self, s: int) -> list[Any]:
        return self.store.search(_ns(s), limit=K)

    def semantic(self, s: int, q: str) -> list[Any]:
        return self.store.search(_ns(s), query=q, limit=K)

    def list_one(self, s: int) -> list[Any]:
        return self.store.list_namespaces(prefix=(subject(s),))

    def list_all(self) -> list[Any]:
        return self.store.list_namespaces(limit=100)

    def search_all(self) -> list[Any]:
        return self.store.search((), limit=K)

    def delete(self, s: int, key: str) -> None:
        self.store.delete(_ns(s), key)

    def erase(self, s: int) -> dict[str, float]:
        from langgraph.store.base import PutOp

        start = time.perf_counter()
        items = self.store.search(_ns(s), limit=1000)
        self.store.batch([PutOp(_ns(s), it.key, None) for it in items])
        ms = (time.perf_counter() - start) * 1e3
        return {"completed ms": ms, "erase call ms": ms}

    def close(self) -> None:
        self.stack.close()


class LanceSide(Side):
    """Plaintext LanceDB, one table for every subject (the layout an application
    with a shared vector store uses), rows filtered by subject; brute-force vector
    search (no ANN index), a scalar BTREE index on the subject column."""

    def __init__(self, root: Path, shared: dict[str, str] | None) -> None:
        import lancedb
        import pyarrow as pa

        self.pa = pa
        self.root = root / "data"
        if shared is None:
            self.name = "LanceDB plaintext"
            self.db = lancedb.connect(str(self.root))
            self.durability = "files written without fsync"
        else:
            from keyshred.drill_servers import LocalServer
            from keyshred.drill_shared import make_bucket

            self.name = "LanceDB plaintext (S3)"
            bucket = make_bucket(LocalServer("moto", shared["s3_url"], "", 0))
            self.db = lancedb.connect(
                f"s3://{bucket}/plain",
                storage_options={
                    "endpoint": shared["s3_url"],
                    "allow_http": "true",
                    "region": "us-east-1",
                    "aws_access_key_id": "testing",
                    "aws_secret_access_key": "testing",
                },
            )
            self.durability = "objects on moto's S3"
            self.root.mkdir()
        self.schema = pa.schema(
            [
                ("subject", pa.string()),
                ("ns", pa.string()),
                ("key", pa.string()),
                ("value", pa.string()),
                ("vector", pa.list_(pa.float32(), DIMS)),
            ]
        )
        self.table = self.db.create_table("memories", schema=self.schema)

    def _rows(self, s: int, keyed: list[tuple[str, int]]) -> Any:
        texts = [text(s, i) for _, i in keyed]
        vecs = np.asarray(bag_of_words(texts), dtype=np.float32)
        pa = self.pa
        return pa.table(
            {
                "subject": [subject(s)] * len(keyed),
                "ns": ["/".join(_ns(s))] * len(keyed),
                "key": [k for k, _ in keyed],
                "value": [json.dumps(value(s, i)) for _, i in keyed],
                "vector": pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), DIMS),
            },
            schema=self.schema,
        )

    def load(self, s: int, n: int) -> None:
        self.table.add(self._rows(s, [(f"m{i}", i) for i in range(n)]))

    def after_load(self) -> None:
        # One version per add; an application compacts once loaded (not timed).
        self.table.optimize()
        with warnings.catch_warnings():  # (the name of the call changes in lancedb)
            warnings.simplefilter("ignore", DeprecationWarning)
            self.table.create_scalar_index("subject")

    def put(self, s: int, key: str, s_i: int) -> None:
        self.table.add(self._rows(s, [(key, s_i)]))

    def get(self, s: int, key: str) -> Any:
        rows = self.table.search().where(f"subject = '{subject(s)}' AND key = '{key}'").limit(1)
        out = rows.to_list()
        assert out
        return json.loads(out[0]["value"])

    def search(self, s: int) -> list[Any]:
        return self.table.search().where(f"subject = '{subject(s)}'").limit(K).to_list()

    def semantic(self, s: int, q: str) -> list[Any]:
        return (
            self.table.search(embed_one(q))
            .where(f"subject = '{subject(s)}'", prefilter=True)
            .distance_type("cosine")
            .limit(K)
            .to_list()
        )

    def list_one(self, s: int) -> list[Any]:
        got = self.table.search().where(f"subject = '{subject(s)}'").select(["ns"]).to_arrow()
        return sorted(set(got.column("ns").to_pylist()))

    def list_all(self) -> list[Any]:
        got = self.table.to_arrow().select(["ns"])
        return sorted(set(got.column("ns").to_pylist()))[:100]

    def search_all(self) -> list[Any]:
        return self.table.search().limit(K).to_list()

    def delete(self, s: int, key: str) -> None:
        self.table.delete(f"subject = '{subject(s)}' AND key = '{key}'")

    def erase(self, s: int) -> dict[str, float]:
        start = time.perf_counter()
        self.table.delete(f"subject = '{subject(s)}'")
        ms = (time.perf_counter() - start) * 1e3
        return {"completed ms": ms, "erase call ms": ms}

    def close(self) -> None:
        pass


SIDES: dict[str, dict[str, Callable[[Path, dict[str, str] | None], Side]]] = {
    "embedded": {
        "keyshred": KeyshredSide,
        "sqlite": lambda root, shared: LangGraphSide(root, shared, "FULL"),
        "lancedb": LanceSide,
    },
    "shared": {
        "keyshred": KeyshredSide,
        "postgres": lambda root, shared: LangGraphSide(root, shared, ""),
        "lancedb": LanceSide,
    },
}


# =====================================================================================
# One side in one process
# =====================================================================================


@contextlib.contextmanager
def maybe_profiled(phase: str, wanted: str | None, side: str) -> Iterator[None]:
    if wanted is None or phase not in wanted.split(","):
        yield
        return
    from pyinstrument import Profiler

    prof = Profiler(interval=0.0005)
    prof.start()
    try:
        yield
    finally:
        prof.stop()
        fd, path = tempfile.mkstemp(prefix=f"bench-scale-{side}-{phase}-", suffix=".txt")
        with os.fdopen(fd, "w") as fh:
            fh.write(prof.output_text(unicode=False, color=False, show_all=False))
        print(f"pyinstrument profile of {side} {phase}: {path}", file=sys.stderr, flush=True)


class Measured:
    """One side in its process: loads in chunks, then runs measurement rounds, each
    on command from the parent (so rounds of every side interleave, while each
    side's store is built once)."""

    def __init__(self, side: Side, n: int, per: int, profile: str | None) -> None:
        self.side, self.n, self.per, self.profile = side, n, per, profile
        rnd = random.Random(n)
        self.order = list(range(n))
        rnd.shuffle(self.order)  # erasure victims: taken from the front, per round
        self.erased: set[int] = set()
        self.slow: set[str] = set()  # the cross-subject calls that took over 5 s

    def load(self, lo: int, hi: int) -> dict[str, float]:
        with maybe_profiled("load", self.profile, self.side.name):
            start = time.perf_counter()
            for s in range(lo, hi):
                self.side.load(s, self.per)
            took = time.perf_counter() - start
        return {"load memories/s": (hi - lo) * self.per / took}

    def loaded(self) -> dict[str, float]:
        self.side.after_load()
        files, size = disk(self.side.root)
        return {"files": float(files), "bytes": float(size), "open fds": float(open_fds())}

    def round(self, r: int) -> dict[str, float]:
        side, per = self.side, self.per
        rnd = random.Random(self.n * 100 + r)
        out: dict[str, float] = {}

        def report(name: str, xs: list[float]) -> None:
            out[f"{name} p50 ms"] = pct(xs, 0.5)
            out[f"{name} p99 ms"] = pct(xs, 0.99)

        victims = [s for s in self.order if s not in self.erased][:ERASES]
        live = [s for s in range(self.n) if s not in self.erased and s not in set(victims)]
        hot = live[:HOT]
        base = per + 1000 * (r + 1)  # new keys and values of this round
        puts = [(rnd.choice(live), j) for j in range(SAMPLES["put"])]
        with maybe_profiled("put", self.profile, side.name):
            report("put", lat(lambda a: side.put(a[0], f"x{r}-{a[1]}", base + a[1]), puts))
        if isinstance(side, KeyshredSide):
            # Without the vector write: what SqliteStore (no sqlite-vec here) does. On
            # subjects drawn afresh: those of ``puts`` were opened by the indexed puts,
            # which made the unindexed ones look cheaper by a partition's first load.
            plain_rnd = random.Random(self.n * 100 + r + 50)
            plain = [(plain_rnd.choice(live), j) for j in range(100)]
            report(
                "put unindexed",
                lat(lambda a: side.put_plain(a[0], f"y{r}-{a[1]}", base + a[1]), plain),
            )
        for s in hot:
            side.get(s, "m0")  # warm the working set
        hot_gets = [(rnd.choice(hot), f"m{rnd.randrange(per)}") for _ in range(SAMPLES["get"])]
        with maybe_profiled("get", self.profile, side.name):
            report("get hot", lat(lambda a: side.get(*a), hot_gets))
        spread = [(rnd.choice(live), f"m{rnd.randrange(per)}") for _ in range(SAMPLES["get"])]
        with maybe_profiled("get-spread", self.profile, side.name):
            report("get spread", lat(lambda a: side.get(*a), spread))
        report("search", lat(side.search, [rnd.choice(live) for _ in range(SAMPLES["search"])]))
        if side.semantic_supported:
            qs = [(rnd.choice(hot), query_text(j)) for j in range(SAMPLES["semantic"])]
            for s in hot:
                side.semantic(s, "tea")  # warm: decrypted vectors cached
                if side.internal_supported:
                    side.internal(s, "tea")
            # Alternating per query, so neither path runs on a cooler machine.
            pub: list[float] = []
            inner: list[float] = []
            with maybe_profiled("semantic", self.profile, side.name):
                for a in qs:
                    pub += lat(lambda a: side.semantic(*a), [a])
                    if side.internal_supported:
                        inner += lat(lambda a: side.internal(*a), [a])
            report("semantic hot", pub)
            if inner:
                report("internal semantic hot", inner)
            spread_q = [(rnd.choice(live), query_text(j)) for j in range(SAMPLES["semantic"])]
            with maybe_profiled("semantic-spread", self.profile, side.name):
                report("semantic spread", lat(lambda a: side.semantic(*a), spread_q))
        ones = [rnd.choice(live) for _ in range(SAMPLES["list"])]
        report("list one", lat(side.list_one, ones))
        for name, fn in (("list all", side.list_all), ("search all", side.search_all)):
            if name in self.slow:
                continue  # over 5 s in an earlier round: measured once
            reps: list[float] = []
            with maybe_profiled(name.replace(" ", "-"), self.profile, side.name):
                for _ in range(3):
                    reps += lat(lambda _a, fn=fn: fn(), [None])
                    if reps[-1] > 5:  # one is enough at that cost
                        self.slow.add(name)
                        break
            out[f"{name} ms"] = statistics.median(reps) * 1e3
        with maybe_profiled("delete", self.profile, side.name):
            deletes = puts[: SAMPLES["delete"]]
            report("delete", lat(lambda a: side.delete(a[0], f"x{r}-{a[1]}"), deletes))
        erasures = []
        with maybe_profiled("erase", self.profile, side.name):
            for s in victims:
                erasures.append(side.erase(s))
                self.erased.add(s)
        for key in erasures[0]:
            out[key] = statistics.median(e[key] for e in erasures)
        out["open fds"] = float(open_fds())
        return out


def fsync_probe(side: Side, per: int) -> None:
    """The operations ``--fsyncs`` counts, between markers in strace's log."""
    for s in range(10):
        side.load(s, per)
    side.after_load()
    ops: list[tuple[str, Callable[[int], Any]]] = [
        ("load", lambda j: side.load(100 + j, per)),
        ("put", lambda j: side.put(j % 10, f"x{j}", per + j)),
        ("get", lambda j: side.get(j % 10, "m1")),
        ("delete", lambda j: side.delete(j % 10, f"x{j}")),
        ("erase", lambda j: side.erase(100 + j)),
    ]
    for name, op in ops:
        count_ops(name, 20, op)  # a warm-up call, then 20 between markers


def child(args: argparse.Namespace) -> None:
    """Commands on stdin, one JSON answer per line on stdout: ``load LO HI``,
    ``loaded``, ``round R``, ``end``."""
    shared = json.loads(os.environ["KS_BENCH_SERVERS"]) if args.profile == "shared" else None
    with tempfile.TemporaryDirectory(prefix="ks-bench-scale-") as tmp:
        side = SIDES[args.profile][args.child](Path(tmp), shared)
        try:
            if args.fsync_probe:
                fsync_probe(side, args.per_subject)
                return
            m = Measured(side, args.child_subjects, args.per_subject, args.pyinstrument)
            print(json.dumps({"side": side.name, "durability": side.durability}), flush=True)
            for line in sys.stdin:
                cmd, *rest = line.split()
                if cmd == "load":
                    doc = m.load(int(rest[0]), int(rest[1]))
                elif cmd == "loaded":
                    doc = m.loaded()
                elif cmd == "round":
                    doc = m.round(int(rest[0]))
                else:
                    break
                print(json.dumps(doc), flush=True)
        finally:
            side.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"max RSS MiB": rss}), flush=True)


# =====================================================================================
# The run
# =====================================================================================


def count_fsyncs(args: argparse.Namespace, name: str, env: dict[str, str]) -> dict[str, float]:
    """fsync + fdatasync per operation of one side, from strace's log between the
    probe's markers (every thread and child process of the side traced)."""
    argv = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--profile",
        args.profile,
        "--per-subject",
        str(args.per_subject),
        "--fsync-probe",
    ]
    return strace_syncs(argv, env)


@contextlib.contextmanager
def servers(profile: str) -> Iterator[dict[str, str]]:
    env = dict(os.environ)
    if profile != "shared":
        yield env
        return
    from keyshred.drill_servers import moto, openbao

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ks-bench-srv-")))
        bao = stack.enter_context(openbao(tmp))
        s3 = stack.enter_context(moto(tmp))
        env["KS_BENCH_SERVERS"] = json.dumps(
            {
                "bao_url": bao.url,
                "bao_token": bao.token,
                "s3_url": s3.url,
                "postgres_url": POSTGRES_URL,
            }
        )
        yield env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subjects", default=None, help="sizes, e.g. 100,10000 or 1000000")
    parser.add_argument("--per-subject", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=None, help="default: 3")
    parser.add_argument("--profile", choices=("embedded", "shared"), default="embedded")
    parser.add_argument("--sides", default=None, help="comma-separated subset of the sides")
    parser.add_argument("--fsyncs", action="store_true", help="only count fsyncs per op (strace)")
    parser.add_argument("--pyinstrument", default=None, help="profile one phase (put, get, …)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-subjects", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fsync-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    default_sizes = "100,10000" if args.profile == "embedded" else "100,1000"
    sizes = [int(x) for x in (args.subjects or default_sizes).split(",")]
    names = list(SIDES[args.profile]) if args.sides is None else args.sides.split(",")
    print(f"uptime before: {uptime()}")
    print(
        f"profile {args.profile}; sizes {sizes} subjects x {args.per_subject} memories; "
        f"sides {names}; cores {os.cpu_count()}; python {sys.version.split()[0]}",
        flush=True,
    )
    with servers(args.profile) as env:
        if args.fsyncs:
            print("\nfsync/fdatasync calls per operation (strace -f, 20 operations each):")
            for name in names:
                print(f"  {name:<10} {json.dumps(count_fsyncs(args, name, env))}", flush=True)
            return  # a count only: the sizes run without strace
        summary: dict[int, dict[str, dict[str, float]]] = {}
        for n in sizes:
            rounds = args.rounds or 3
            started = time.perf_counter()
            children = {}
            for name in names:
                argv = ["--child", name, "--profile", args.profile]
                argv += ["--child-subjects", str(n), "--per-subject", str(args.per_subject)]
                if args.pyinstrument:
                    argv += ["--pyinstrument", args.pyinstrument]
                children[name] = Child(__file__, argv, env)
            label = {name: c.header["side"] for name, c in children.items()}
            runs: dict[str, list[dict[str, float]]] = {label[x]: [] for x in names}
            loads: dict[str, list[dict[str, float]]] = {label[x]: [] for x in names}
            bounds = [n * c // LOAD_CHUNKS for c in range(LOAD_CHUNKS + 1)]
            for c in range(LOAD_CHUNKS):
                order = names if c % 2 == 0 else list(reversed(names))
                for name in order:
                    if bounds[c] < bounds[c + 1]:
                        doc = children[name].ask(f"load {bounds[c]} {bounds[c + 1]}")
                        loads[label[name]].append(doc)
            fixed: dict[str, dict[str, float]] = {}
            for name in names:
                fixed[label[name]] = {
                    "load memories/s": statistics.median(
                        x["load memories/s"] for x in loads[label[name]]
                    ),
                    **{f"{k} after load": v for k, v in children[name].ask("loaded").items()},
                }
            print(f"  {n} subjects loaded: {time.perf_counter() - started:.0f} s", flush=True)
            for r in range(rounds):
                order = names if r % 2 == 0 else list(reversed(names))
                for name in order:
                    doc = children[name].ask(f"round {r}")
                    runs[label[name]].append(doc)
                    print(f"  {n} subjects, round {r + 1}, {label[name]}: {json.dumps(doc)}")
            for name in names:
                fixed[label[name]].update(children[name].end())
            med = {
                side: {
                    **fixed[side],
                    **{m: statistics.median(x[m] for x in xs if m in x) for m in xs[0]},
                }
                for side, xs in runs.items()
            }
            summary[n] = med
            took = time.perf_counter() - started
            print(
                f"\n## {n} subjects x {args.per_subject}: medians of {rounds} rounds ({took:.0f} s)"
            )
            for name in names:
                print(f"  durability {label[name]}: {children[name].header['durability']}")
            metrics: list[str] = []
            for xs in med.values():
                metrics += [m for m in xs if m not in metrics]
            sides = list(med)
            print(f"{'metric':<28}" + "".join(f"{s:>26}" for s in sides))
            for m in metrics:
                cells = "".join(
                    f"{med[s][m]:>26,.3f}" if m in med[s] else f"{'-':>26}" for s in sides
                )
                print(f"{m:<28}{cells}")
            ks_name = next((s for s in sides if s.startswith("keyshred")), None)
            base = next((s for s in sides if s.startswith(("SqliteStore", "PostgresStore"))), None)
            if ks_name is None:
                continue
            ks = med[ks_name]
            print("targets:")
            if "internal semantic hot p50 ms" in ks:
                ratio = ks["semantic hot p50 ms"] / ks["internal semantic hot p50 ms"]
                print(f"  public / internal semantic search p50: {ratio:.2f} (<= 1.5)")
            if base is not None:
                pairs = [
                    (f"{m} {q}", f"{m} {q}")
                    for m in ("put", "get hot", "get spread")
                    for q in ("p50 ms", "p99 ms")
                ]
                pairs += [(f"put unindexed {q}", f"put {q}") for q in ("p50 ms", "p99 ms")]
                for ours, theirs in pairs:
                    ratio = ks[ours] / med[base][theirs]
                    print(f"  keyshred {ours} / {base} {theirs}: {ratio:.2f} (<= 2)")
                ratio = med[base]["load memories/s"] / ks["load memories/s"]
                print(f"  {base} load rate / keyshred's: {ratio:.2f}")
        ks_sizes = [n for n in sizes if any(s.startswith("keyshred") for s in summary[n])]
        if len(ks_sizes) > 1:
            lo, hi = min(ks_sizes), max(ks_sizes)
            k_lo = next(v for s, v in summary[lo].items() if s.startswith("keyshred"))
            k_hi = next(v for s, v in summary[hi].items() if s.startswith("keyshred"))
            ratio = k_hi["crypto-erased ms"] / k_lo["crypto-erased ms"]
            print(f"\ncrypto-erased {hi:,} : {lo:,} subjects = {ratio:.2f} (<= 1.2)")
    print(f"uptime after: {uptime()}")


if __name__ == "__main__":
    main()
