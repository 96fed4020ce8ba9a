"""Erasure benchmark (issue #25 item 5): how fast a subject is crypto-erased and
completed in a realistic store with a backup, against two plaintext baselines, medians
of interleaved rounds.

Every side runs in a process of its own (``_common.Child``) and holds the same data:

- ``--others`` other subjects (sizes, default ``100,500``: within and beyond the 256
  open partitions), 20 memories each (~75-byte text, indexed: a 384-d vector each),
  one in five of them with one memory that mentions a victim;
- ``--rounds`` victims (default 5), ``--victim`` memories each (default 2,000, indexed),
  whose text carries a probe string unique to the victim;
- a backup taken after the load and before the first erasure.

Each round erases one victim on every side, the order of the sides reversed every
other round; the figures are medians of the rounds.

- **keyshred** (default config: SQLite catalog WAL + ``synchronous=FULL``): ``ks.erase``;
  from its receipt the time to crypto-erased (keys destroyed: from here every copy,
  the backup included, is unreadable) and to completed; the steps' times (the
  coordinator's ``on_step``). The backup: ``ks.backup.create`` to a local folder.
- **SqliteStore** WAL + ``synchronous=FULL``: the victim's items *and* the other
  subjects' memories that mention the victim (keys the application tracks) deleted in
  one batch (one transaction); then ``wal_checkpoint(TRUNCATE)`` + ``VACUUM`` until the
  probe is in no file. The backup: SQLite's online backup API to a file.
- **LanceDB** (plaintext, one table of every subject, the text in a binary column with
  random padding so Lance's string compression cannot hide the probe): ``delete``,
  then ``optimize`` with ``cleanup_older_than=0`` until the probe is in no file. The
  backup: a copy of the folder.

After each erasure every side's live files and its backup are scanned for the probe.
``--fsyncs`` counts each side's fsync/fdatasync calls per erasure with strace.

Run: ``.venv/bin/python benchmarks/bench_erasure.py [--others 100,500] [--rounds 5]
[--victim 2000] [--fsyncs]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import Child, count_ops, interleaved, median_of, serve, strace_syncs, uptime

DIMS = 384
PER_OTHER = 20
MENTION_EVERY = 5  # one in five other subjects mentions a victim once
BATCH = 1000


def random_embeddings(texts: list[str]) -> Any:
    rng = np.random.default_rng(len(texts))
    return rng.standard_normal((len(texts), DIMS)).astype(np.float32)


def probe(v: int) -> str:
    return f"zqprobe-{v:03d}-41d7"


def victim(v: int) -> str:
    return f"victim-{v:03d}"


def other_text(s: int, i: int) -> str:
    return f"memory {i} of other-{s}: prefers tea over coffee, walks the dog every morning"


def mention_of(s: int, rounds: int) -> int | None:
    """The victim other subject ``s`` mentions (in its memory ``m0``), if any."""
    return (s // MENTION_EVERY) % rounds if s % MENTION_EVERY == 0 else None


def bytes_present(root: Path, needle: bytes) -> bool:
    for p in root.rglob("*"):
        if p.is_file():
            try:
                if needle in p.read_bytes():
                    return True
            except OSError:
                continue
    return False


# =====================================================================================
# Sides
# =====================================================================================


class Side:
    name = ""
    durability = ""

    def __init__(self, root: Path, rounds: int) -> None:
        self.root, self.rounds = root, rounds
        self.live = root / "data"
        self.backup_dir = root / "backup"

    def load_other(self, s: int) -> None: ...
    def load_victim(self, v: int, n: int) -> None: ...
    def backup(self) -> None: ...
    def erase(self, v: int) -> dict[str, float]: ...
    def close(self) -> None: ...


class KeyshredSide(Side):
    name = "keyshred"

    def __init__(self, root: Path, rounds: int) -> None:
        super().__init__(root, rounds)
        from keyshred import Keyshred

        self.ks = Keyshred.init(self.live, embeddings=random_embeddings)
        with self.ks.catalog.engine.connect() as conn:
            journal = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
            sync = conn.exec_driver_sql("PRAGMA synchronous").scalar()
        self.durability = f"catalog journal_mode={journal}, synchronous={sync}"

    def load_other(self, s: int) -> None:
        from keyshred import PutItem

        v = mention_of(s, self.rounds)
        items = [
            PutItem(("m",), f"m{i}", {"text": other_text(s, i)}, index=["text"])
            for i in range(1, PER_OTHER)
        ]
        if v is None:
            items.append(PutItem(("m",), "m0", {"text": other_text(s, 0)}, index=["text"]))
        else:
            text = f"met {victim(v)} today ({probe(v)})"
            items.append(
                PutItem(("m",), "m0", {"text": text}, index=["text"], mentions=[victim(v)])
            )
        self.ks.memories.put_many(f"other-{s}", items)

    def load_victim(self, v: int, n: int) -> None:
        from keyshred import PutItem

        for lo in range(0, n, BATCH):
            self.ks.memories.put_many(
                victim(v),
                [
                    PutItem(("m",), f"k{i}", {"text": f"{probe(v)} {i}"}, index=["text"])
                    for i in range(lo, min(n, lo + BATCH))
                ],
            )

    def backup(self) -> None:
        from keyshred.backup import LocalTarget

        self.ks.memories.flush()
        self.ks.backup.create(LocalTarget(self.backup_dir))

    def erase(self, v: int) -> dict[str, float]:
        marks: dict[str, float] = {}
        self.ks.erasure.on_step = lambda step, _req: marks.setdefault(step, time.perf_counter())
        start = time.perf_counter()
        req = self.ks.erase(victim(v), requested_by="bench", reason="benchmark")
        call = time.perf_counter() - start
        assert req.state == "completed", req.error
        r = self.ks.erasure.receipt(req.request_id)
        assert r is not None
        out = {
            "crypto-erased ms": (r.keys_destroyed_at - r.requested_at).total_seconds() * 1e3,
            "completed ms": (r.completed_at - r.requested_at).total_seconds() * 1e3,
            "erase call ms": call * 1e3,
        }
        prev = start
        for step, at in sorted(marks.items(), key=lambda kv: kv[1]):
            out[f"step {step} ms"] = (at - prev) * 1e3
            prev = at
        return out

    def close(self) -> None:
        self.ks.close()


class SqliteSide(Side):
    name = "SqliteStore WAL+FULL"

    def __init__(self, root: Path, rounds: int) -> None:
        super().__init__(root, rounds)
        from langgraph.store.sqlite import SqliteStore

        self.live.mkdir()
        self.backup_dir.mkdir()
        self.path = self.live / "store.db"
        self.conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.store = SqliteStore(self.conn)
        self.store.setup()
        journal = self.conn.execute("PRAGMA journal_mode").fetchone()[0]
        sync = self.conn.execute("PRAGMA synchronous").fetchone()[0]
        self.durability = f"journal_mode={journal}, synchronous={sync}"
        self.mentions: dict[int, list[tuple[tuple[str, ...], str]]] = {}

    def load_other(self, s: int) -> None:
        from langgraph.store.base import PutOp

        v = mention_of(s, self.rounds)
        ns = ("m", f"other-{s}")
        ops = [PutOp(ns, f"m{i}", {"text": other_text(s, i)}) for i in range(1, PER_OTHER)]
        if v is None:
            ops.append(PutOp(ns, "m0", {"text": other_text(s, 0)}))
        else:
            ops.append(PutOp(ns, "m0", {"text": f"met {victim(v)} today ({probe(v)})"}))
            self.mentions.setdefault(v, []).append((ns, "m0"))
        self.store.batch(ops)

    def load_victim(self, v: int, n: int) -> None:
        from langgraph.store.base import PutOp

        for lo in range(0, n, BATCH):
            self.store.batch(
                [
                    PutOp(("m", victim(v)), f"k{i}", {"text": f"{probe(v)} {i}"})
                    for i in range(lo, min(n, lo + BATCH))
                ]
            )
        self.victim_n = n

    def backup(self) -> None:
        dest = sqlite3.connect(self.backup_dir / "store.db")
        self.conn.backup(dest)
        dest.close()

    def erase(self, v: int) -> dict[str, float]:
        from langgraph.store.base import PutOp

        start = time.perf_counter()
        ops = [PutOp(("m", victim(v)), f"k{i}", None) for i in range(self.victim_n)]
        ops += [PutOp(ns, key, None) for ns, key in self.mentions.get(v, [])]
        self.store.batch(ops)  # one transaction
        done = time.perf_counter()
        still = bytes_present(self.live, probe(v).encode())
        t0 = time.perf_counter()
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.conn.execute("VACUUM")
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        scrub = time.perf_counter() - t0
        return {
            "completed ms": (done - start) * 1e3,
            "erase call ms": (done - start) * 1e3,
            "probe in live files after the deletes": float(still),
            "until the probe is in no live file ms": (done - start + scrub) * 1e3,
        }

    def close(self) -> None:
        self.conn.close()


class LanceSide(Side):
    name = "LanceDB plaintext"

    def __init__(self, root: Path, rounds: int) -> None:
        super().__init__(root, rounds)
        import lancedb
        import pyarrow as pa

        self.pa = pa
        self.db = lancedb.connect(str(self.live))
        self.durability = "files written without fsync"
        self.schema = pa.schema(
            [
                ("subject", pa.string()),
                ("key", pa.string()),
                ("payload", pa.binary()),
                ("vector", pa.list_(pa.float32(), DIMS)),
            ]
        )
        self.table = self.db.create_table("memories", schema=self.schema)
        self.pending: list[tuple[str, str, str]] = []
        self.mentions: dict[int, list[str]] = {}

    def _add(self, rows: list[tuple[str, str, str]]) -> None:
        pa = self.pa
        vecs = random_embeddings([t for _, _, t in rows])
        self.table.add(
            pa.table(
                {
                    "subject": [s for s, _, _ in rows],
                    "key": [k for _, k, _ in rows],
                    "payload": [t.encode() + os.urandom(32) for _, _, t in rows],
                    "vector": pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), DIMS),
                },
                schema=self.schema,
            )
        )

    def load_other(self, s: int) -> None:
        v = mention_of(s, self.rounds)
        rows = [(f"other-{s}", f"m{i}", other_text(s, i)) for i in range(1, PER_OTHER)]
        if v is None:
            rows.append((f"other-{s}", "m0", other_text(s, 0)))
        else:
            rows.append((f"other-{s}", "m0", f"met {victim(v)} today ({probe(v)})"))
            self.mentions.setdefault(v, []).append(f"other-{s}")
        self._add(rows)

    def load_victim(self, v: int, n: int) -> None:
        for lo in range(0, n, BATCH):
            self._add(
                [(victim(v), f"k{i}", f"{probe(v)} {i}") for i in range(lo, min(n, lo + BATCH))]
            )

    def backup(self) -> None:
        self.table.optimize()  # one version per add: an application compacts (untimed)
        shutil.copytree(self.live, self.backup_dir)

    def erase(self, v: int) -> dict[str, float]:
        cond = f"subject = '{victim(v)}'"
        for s in self.mentions.get(v, []):
            cond += f" OR (subject = '{s}' AND key = 'm0')"
        start = time.perf_counter()
        self.table.delete(cond)
        done = time.perf_counter()
        still = bytes_present(self.live, probe(v).encode())
        t0 = time.perf_counter()
        self.table.optimize(cleanup_older_than=timedelta(0), delete_unverified=True)
        scrub = time.perf_counter() - t0
        return {
            "completed ms": (done - start) * 1e3,
            "erase call ms": (done - start) * 1e3,
            "probe in live files after the deletes": float(still),
            "until the probe is in no live file ms": (done - start + scrub) * 1e3,
        }


SIDES: dict[str, Callable[[Path, int], Side]] = {
    "keyshred": KeyshredSide,
    "sqlite": SqliteSide,
    "lancedb": LanceSide,
}


# =====================================================================================
# One side in one process
# =====================================================================================


class Measured:
    def __init__(self, side: Side, victim_n: int) -> None:
        self.side, self.victim_n = side, victim_n

    def load(self, lo: str, hi: str) -> dict[str, float]:
        start = time.perf_counter()
        for s in range(int(lo), int(hi)):
            self.side.load_other(s)
        return {"load s": time.perf_counter() - start}

    def victims(self) -> dict[str, float]:
        start = time.perf_counter()
        for v in range(self.side.rounds):
            self.side.load_victim(v, self.victim_n)
        self.side.backup()
        return {"load s": time.perf_counter() - start}

    def erase(self, v: str) -> dict[str, float]:
        side = self.side
        out = side.erase(int(v))
        needle = probe(int(v)).encode()
        out["probe in live files after"] = float(bytes_present(side.live, needle))
        out["probe in the backup after"] = float(bytes_present(side.backup_dir, needle))
        return out


def fsync_probe(side: Side, n: int) -> None:
    for s in range(20):
        side.load_other(s)
    for v in range(side.rounds):
        side.load_victim(v, 100)
    side.backup()
    count_ops("erase", n, side.erase)


def child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="ks-bench-erasure-") as tmp:
        if args.fsync_probe:
            side = SIDES[args.child](Path(tmp), 6)
            try:
                fsync_probe(side, 5)
            finally:
                side.close()
            return
        side = SIDES[args.child](Path(tmp), args.rounds)
        try:
            m = Measured(side, args.victim)
            header = {"side": side.name, "durability": side.durability}
            serve({"load": m.load, "victims": m.victims, "erase": m.erase}, header)
        finally:
            side.close()


# =====================================================================================
# The run
# =====================================================================================


def run_size(others: int, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    started = time.perf_counter()
    argv = ["--rounds", str(args.rounds), "--victim", str(args.victim)]
    env = dict(os.environ)
    children = {name: Child(__file__, ["--child", name, *argv], env) for name in SIDES}
    label = {name: c.header["side"] for name, c in children.items()}
    try:
        chunks = 4
        bounds = [others * c // chunks for c in range(chunks + 1)]
        loads = interleaved(children, [f"load {bounds[c]} {bounds[c + 1]}" for c in range(chunks)])
        vics = interleaved(children, ["victims"])
        answers = interleaved(children, [f"erase {v}" for v in range(args.rounds)])
    finally:
        for c in children.values():
            c.end()
    took = time.perf_counter() - started
    print(
        f"\n## {others} other subjects; medians of {args.rounds} interleaved rounds ({took:.0f} s)"
    )
    med = {}
    for name, c in children.items():
        load = sum(x["load s"] for x in loads[name])
        print(
            f"  {label[name]}: {c.header['durability']}; load: others {load:.1f} s, "
            f"victims + backup {vics[name][0]['load s']:.1f} s"
        )
        med[label[name]] = median_of(answers[name])
    metrics: list[str] = []
    for xs in med.values():
        metrics += [m for m in xs if m not in metrics]
    names = list(med)
    print(f"{'metric':<42}" + "".join(f"{n:>22}" for n in names))
    for m in metrics:
        cells = "".join(f"{med[n][m]:>22,.1f}" if m in med[n] else f"{'-':>22}" for n in names)
        print(f"{m:<42}{cells}")
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--others", default="100,500", help="other subjects, e.g. 100,500")
    parser.add_argument("--rounds", type=int, default=5, help="victims (one erased per round)")
    parser.add_argument("--victim", type=int, default=2000, help="memories per victim")
    parser.add_argument("--fsyncs", action="store_true", help="only count fsyncs per erasure")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fsync-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    print(f"uptime before: {uptime()}", flush=True)
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cores; victims: {args.rounds} x "
        f"{args.victim} memories; others: {PER_OTHER} memories each, indexed",
        flush=True,
    )
    if args.fsyncs:
        print("fsync/fdatasync calls per erasure (strace -f, 5 erasures of 100-memory victims):")
        for name in SIDES:
            argv = [sys.executable, __file__, "--child", name, "--fsync-probe"]
            print(f"  {name:<10} {strace_syncs(argv, dict(os.environ))}", flush=True)
        print(f"uptime after: {uptime()}")
        return
    sizes = [int(x) for x in args.others.split(",")]
    results = {n: run_size(n, args) for n in sizes}
    if len(sizes) > 1:
        lo, hi = results[min(sizes)]["keyshred"], results[max(sizes)]["keyshred"]
        for m in ("crypto-erased ms", "completed ms"):
            print(f"keyshred {m} {max(sizes):,} : {min(sizes):,} others = {hi[m] / lo[m]:.2f}")
    print(f"uptime after: {uptime()}")


if __name__ == "__main__":
    main()
