"""The distributed drill: ``keyshred drill --profile shared``.

The embedded drill (``keyshred.drill``) proves an erasure inside one process. This one
proves it across processes, on the shared profile's real services, started for the
run from the installed packages (``keyshred.drill_servers``): the OpenBao dev server
(Transit holds the KEK), moto's server (S3 holds the partitions, the vectors and the
backups), and the PostgreSQL given by a URL (catalog and key store, in a fresh schema
dropped afterwards). Every process has its own data folder with the same
``keyshred.toml``, as separate machines would.

1. The drill process writes the workload: subjects with indexed memories in two
   scopes (one under consent), a fact of a third subject that declares a mention of
   the first, a memory of the last that holds the first one's registered e-mail and
   phone (a mention the detector finds), vault tokens; it compacts to S3 and takes a
   backup on S3.
2. A *holder* process (an application process: it serves reads) reads and searches
   every subject, so that it holds the erased subjects' unwrapped keys, decrypted
   rows and vectors in memory; so does the drill process.
3. N worker processes start; two erasures are submitted (recorded and queued, not
   run by the submitter). While a worker runs the first one, the drill SIGKILLs it
   inside a step: once the request is ``propagating`` with its keys destroyed and
   its receipt not yet signed, the worker holding the request's lease (its pid is in
   the lease) is killed. Another worker must finish it.
4. Checks: the request finished by another worker, exactly one receipt and one
   ``erasure.completed`` per request, every process's caches evicted (the holder and
   the drill process are asked what they still hold), keys dead, no object version
   left in the bucket, catalog clean, reads refused, key and semantic search clean,
   mentions dropped, tokens dead, other subjects intact, a byte scan of every
   process's folder, log and server log and of every row of every table in the
   schema, the residue scan (raw and decrypted, S3 versions and the live catalog),
   the audit chain.

The workers are ``keyshred worker --concurrency 1`` processes (``keyshred.worker``):
the erasures are submitted to the job queue (``ks.erasure.submit``) and run there.

Why ~660 lines: like the embedded drill, the workload and the checks that undo each
write stay in one file; the servers are in ``keyshred.drill_servers``, the worker and
holder processes in ``keyshred.drill_processes``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from keyshred.config import Config
from keyshred.drill import HEALTH, DrillCheck, DrillFailure, DrillReport, _config, scan_bytes
from keyshred.drill_processes import (
    Holder,
    Workers,
    held_in_memory,
    refuse_embedding,
    submit,
    wait_done,
    watch_and_kill,
)
from keyshred.drill_servers import (
    LocalServer,
    moto,
    openbao,
    scratch_schema,
    signals_held,
)
from keyshred.errors import KeyshredError, SubjectErased, SubjectSuppressed, TokenError
from keyshred.facade import Keyshred
from keyshred.receipts import verify_receipt
from keyshred.storage.memories import PutItem

__all__ = ["DEFAULT_POSTGRES_URL", "make_bucket", "run_shared_drill", "shared_config"]

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise DrillFailure(message)


# -- the environment every process of the run shares -------------------------------


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set variables for this process and the ones it starts, then restore them.
    OpenBao's token goes to the processes through ``VAULT_TOKEN`` (never a file);
    moto takes any AWS credentials: its documented dummies unless some are set."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _sigterm_is_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every server and worker started is stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def shared_config(catalog_url: str, bao: LocalServer, s3: LocalServer, bucket: str) -> Config:
    """The shared profile on the run's servers: catalog and key store on PostgreSQL,
    the KEK in OpenBao's Transit (a key per run), partitions, vectors and backups in
    one versioned bucket."""
    base = _config().model_dump(mode="json", exclude_unset=True)
    return Config.model_validate(
        {
            **base,
            "profile": "distributed",
            "storage": {"catalog_url": catalog_url, "uri": f"s3://{bucket}/parts"},
            "keyring": {"store_url": catalog_url},
            "kek": {
                "provider": "vault",
                "vault": {"url": bao.url, "key": f"ks-drill-{secrets.token_hex(4)}"},
            },
            "vectors": {"uri": f"s3://{bucket}/vectors"},
            "s3": {"endpoint_url": s3.url, "region": "us-east-1"},
            # The workers run the erasures only: no periodic retention run or backup
            # maintenance competing with them (the benchmark counts erasures alone).
            "jobs": {"retention_every_seconds": 0, "backup_maintain_every_seconds": 0},
            "backup": {
                "target": f"s3://{bucket}/backups",
                "s3_endpoint_url": s3.url,
                "s3_region": "us-east-1",
            },
        }
    )


def make_bucket(s3: LocalServer) -> str:
    import boto3

    bucket = f"ks-drill-{secrets.token_hex(5)}"
    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return bucket


def _versions(s3: LocalServer, bucket: str, prefix: str) -> list[str]:
    """Every object version and delete marker under ``prefix``."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    out: list[str] = []
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
        out += [v["Key"] for v in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]]
    return out


# -- the drill ---------------------------------------------------------------------


def run_shared_drill(
    postgres_url: str = DEFAULT_POSTGRES_URL,
    *,
    workers: int = 3,
    subjects: int = 5,
    records: int = 10,
    receipt_dir: Path | None = None,
    embeddings: Any = None,
    timeout: float = 120.0,
    progress: Callable[[str, int, int], None] = lambda step, done, total: None,
) -> DrillReport:
    """Run the distributed drill; every server, worker and folder it made is gone
    when it returns or raises. The signed receipt of the killed worker's request is
    copied to ``receipt_dir`` (the working directory by default)."""
    if workers < 2:
        raise KeyshredError("the shared drill needs at least 2 workers: one is killed")
    if subjects < 4 or records < 2:
        raise KeyshredError("the shared drill needs at least 4 subjects and 2 records each")
    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="keyshred-shared-drill-"))
        stack.callback(shutil.rmtree, tmp, True)  # last: after every process stopped
        stack.enter_context(_sigterm_is_interrupt())
        progress("starting OpenBao, moto and a PostgreSQL schema", 0, 0)
        bao = stack.enter_context(openbao(tmp))
        s3 = stack.enter_context(moto(tmp))
        stack.enter_context(
            _environment(
                {
                    "VAULT_TOKEN": bao.token,
                    "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
                    "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"),
                    "AWS_DEFAULT_REGION": "us-east-1",
                }
            )
        )
        catalog_url = stack.enter_context(scratch_schema(postgres_url))
        bucket = make_bucket(s3)
        config = shared_config(catalog_url, bao, s3, bucket)
        (tmp / "keyshred-shared.json").write_text(config.model_dump_json(indent=2), "utf-8")
        run = _Run(tmp, config, s3, bucket, workers, subjects, records, embeddings, progress)
        stack.callback(run.close)
        report = run.drill(timeout)
        if report.receipt_file:
            keep = (receipt_dir or Path.cwd()) / f"keyshred-drill-receipt-{report.request_id}.jws"
            shutil.copyfile(report.receipt_file, keep)
            report.receipt_file = str(keep)
        return report
    raise AssertionError("unreachable")  # pragma: no cover - for the type checker


class _Run:
    """One run's processes and handles (``close`` stops them in reverse order)."""

    def __init__(  # noqa: PLR0917 - one private call site
        self,
        tmp: Path,
        config: Config,
        s3: LocalServer,
        bucket: str,
        n_workers: int,
        n_subjects: int,
        n_records: int,
        embeddings: Any,
        progress: Callable[[str, int, int], None],
    ) -> None:
        self.tmp, self.config, self.s3, self.bucket = tmp, config, s3, bucket
        self.n_workers, self.n_subjects, self.n_records = n_workers, n_subjects, n_records
        self.progress = progress
        self.workers = Workers()
        self.holder: Holder | None = None
        self.closing: list[Callable[[], None]] = []
        self.ks = Keyshred.init(tmp / "drill", config, embeddings=embeddings)

    def close(self) -> None:
        for close in reversed(self.closing):
            close()
        self.workers.stop()
        if self.holder is not None:
            self.holder.stop()
        self.ks.close()

    def drill(self, timeout: float) -> DrillReport:
        ks, tmp, progress = self.ks, self.tmp, self.progress
        run = secrets.token_hex(5)
        probe, probe2 = f"zq{run}", f"zw{run}"  # in every text of the two erased subjects
        ids = [f"drill-{run}-person-{i}@example.com" for i in range(self.n_subjects)]
        victim, second = ids[0], ids[1]
        ref, ref2 = ks.subject_ref(victim), ks.subject_ref(second)
        report = DrillReport(str(tmp), self.n_subjects, self.n_subjects * self.n_records, ref)

        def check(name: str, fn: Callable[[], str]) -> None:
            progress(name, 0, 0)
            start = time.perf_counter()
            try:
                detail, ok = fn(), True
            except KeyshredError as exc:
                detail, ok = str(exc) or type(exc).__name__, False
            report.checks.append(DrillCheck(name, ok, time.perf_counter() - start, detail))

        # -- processes: started first, so that their start-up (the holder loads the
        # embedding model) overlaps the workload; the workers find nothing to do yet.
        progress("starting the holder and the workers", 0, 0)
        start = time.perf_counter()
        folders = [tmp / "holder", *(tmp / f"worker-{i}" for i in range(self.n_workers))]
        for folder in folders:
            Keyshred.init(folder, self.config, embeddings=refuse_embedding).close()
        with signals_held():  # started and registered for stopping as one step
            self.holder = Holder(folders[0])
        self.workers.start(folders[1:])
        pids = [p.pid for p in self.workers.procs]
        report.checks.append(
            DrillCheck(
                f"a holder process and {self.n_workers} worker processes started",
                True,
                time.perf_counter() - start,
                f"each with its own data folder; workers: keyshred worker, pids {pids}",
            )
        )

        # -- workload ------------------------------------------------------------
        start = time.perf_counter()
        truth: dict[tuple[str, str], Any] = {}
        topics = ["hiking in the Alps", "sourdough baking", "jazz piano", "chess openings"]
        for n, subject in enumerate(ids):
            progress("writing the workload", n, len(ids))
            mark = {victim: probe, second: probe2}.get(subject, f"other{n}")
            ks.consent.grant(subject, scope=HEALTH, category="health")
            items = []
            for i in range(self.n_records):
                value = {"text": f"{mark} note {i}: likes {topics[(n + i) % len(topics)]}"}
                items.append(PutItem(("memories",), f"k{i}", value, index=["text"]))
                truth[(subject, f"k{i}")] = value
            ks.memories.put_many(subject, items)
            health = {"text": f"{mark} is allergic to peanuts"}
            ks.memories.put(
                subject, ("memories",), "allergy", health, scope=HEALTH, category="health",
                index=["text"],
            )  # fmt: skip
            truth[(subject, "allergy")] = health
        ks.memories.put(
            ids[2], ("facts",), "met", f"person 2 met {probe} at the conference", mentions=[victim]
        )
        ks.subjects.register_identifiers(victim, emails=[victim], phones=["+86 138 1234 5678"])
        ks.memories.put(
            ids[-1],
            ("facts",),
            "contact",
            {"text": f"ask {victim.upper()} or call 138-1234-5678 about the {probe} trip"},
        )
        tokens = ks.vault.sanitize(
            f"{probe}: call 13812345678 or mail {victim}",
            victim,
            "support-reply",
            timedelta(days=1),
        )
        ks.memories.flush()
        progress("writing the workload", len(ids), len(ids))
        found = ks.catalog.mention_counts()
        report.checks.append(
            DrillCheck(
                "workload written on PostgreSQL, OpenBao Transit and S3",
                True,
                time.perf_counter() - start,
                f"{report.records + len(ids)} memories with vectors of {len(ids)} subjects, "
                f"{len(tokens.tokens)} tokens, {found['declared']} declared and "
                f"{found['detected']} detected mention(s); bucket {self.bucket}",
            )
        )
        victim_keys = [r.key_id for r in ks.keyring.store.for_subject(ref)]
        victim_keys += [r.key_id for r in ks.keyring.store.for_subject(ref2)]
        victim_keys += [r.key_id for r in ks.keyring.store.owned_by(ref)]

        start = time.perf_counter()
        gen = ks.backup.create()
        report.checks.append(
            DrillCheck(
                "backup on S3 taken before the erasure",
                True,
                time.perf_counter() - start,
                f"generation {gen.generation}: {gen.segments} segments, {gen.bytes_total} bytes",
            )
        )

        warm_query = f"{probe} {probe2} allergic to peanuts"

        def caches_warm() -> str:
            assert self.holder is not None  # noqa: S101
            read = self.holder.ask(op="warm", subjects=ids, query=warm_query)["read"]
            for subject in ids:  # the drill process reads too
                ks.memories.search(subject, (), limit=10_000)
                ks.memories.search(subject, (), query=warm_query, limit=5)
            holder = self.holder.ask(
                op="held", refs=[ref, ref2], key_ids=[k.hex() for k in victim_keys]
            )
            here = held_in_memory(ks, [ref, ref2], victim_keys)
            for name, held in (("holder", holder), ("drill", here)):
                _require(
                    held["keys"] > 0 and held["partitions"] > 0 and held["vectors"] > 0,
                    f"the {name} process holds nothing of the subjects to evict: {held}",
                )
            return (
                f"holder process read {read} memories and holds {holder['keys']} keys, "
                f"{holder['partitions']} partitions, {holder['vectors']} vector sets of the "
                f"two subjects; the drill process {here['keys']}, {here['partitions']}, "
                f"{here['vectors']}"
            )

        check("caches warm in the holder and the drill process", caches_warm)

        # -- erasures through the queue, a worker killed inside one -------------------
        progress("erasing two subjects through the workers", 0, 0)
        start = time.perf_counter()
        first = submit(ks, victim)
        other = submit(ks, second)
        report.request_id = first
        seen = watch_and_kill(ks, first, self.workers, timeout)
        state2 = wait_done(ks, other, timeout)
        took = time.perf_counter() - start
        # What a process started after the erasures sees (an auditor's): no cache.
        auditor = Keyshred.init(tmp / "auditor", self.config, embeddings=refuse_embedding)
        self.closing.append(auditor.close)

        def killed_inside() -> str:
            _require(seen.killed_pid is not None, "no worker was killed inside the erasure")
            return (
                f"SIGKILLed worker pid {seen.killed_pid} while it held the request's lease in "
                f"state {seen.state_at_kill}: steps done {seen.done_at_kill}, "
                f"'{seen.running_at_kill}' running and not recorded; "
                f"{seen.killed_after:.1f} s after the submission"
            )

        def finished_by_another() -> str:
            _require(seen.final_state == "completed", f"the request ended {seen.final_state}")
            _require(bool(seen.owners_after), "no other worker was seen holding the request")
            _require(state2 == "completed", f"the second request ended {state2}")
            return (
                f"taken over {seen.taken_over_after or 0:.1f} s after the kill and completed "
                f"by worker pid(s) {sorted(seen.owners_after)} "
                f"{seen.finished_after_kill:.1f} s after it; the second request "
                f"completed too; both in {took:.1f} s"
            )

        receipts: dict[str, Any] = {}

        def one_receipt() -> str:
            public = ks.receipts_jwks()
            for rid in (first, other):
                receipt = ks.erasure.receipt(rid)
                _require(receipt is not None, f"request {rid} has no receipt")
                assert receipt is not None  # noqa: S101
                verify_receipt(receipt, public)
                text = receipt.to_json()
                for needle in (probe, probe2, victim, second):
                    _require(needle not in text, "a receipt names a subject")
                failed = [c.name for c in receipt.verification if not c.passed]
                _require(not failed, f"receipt verification failed: {failed}")
                completed = ks.audit.events(request_id=rid, event="erasure.completed")
                _require(len(completed) == 1, f"{len(completed)} erasure.completed for {rid}")
                states = [
                    e
                    for e in ks.audit.events(request_id=rid, event="erasure.state")
                    if e.data.get("state") == "completed"
                ]
                _require(len(states) == 1, f"{len(states)} transitions to completed for {rid}")
                receipts[rid] = receipt
            # The receipt as issued (its compact JWS), as the embedded drill keeps it:
            # ``to_json`` is the bare fields, which verify against nothing.
            file = tmp / "drill" / "receipts" / f"{first}.jws"
            file.parent.mkdir(exist_ok=True)
            file.write_text(receipts[first].serialize(), "utf-8")
            report.receipt_file = str(file)
            return (
                "each request: one signed receipt (Ed25519 valid, no subject named), one "
                "erasure.completed event, one transition to completed"
            )

        destroyed: list[bytes] = []

        def caches_evicted() -> str:
            assert self.holder is not None  # noqa: S101
            for rid in (first, other):
                keys = ks.erasure.status(rid).doc["details"]["destroy_keys"]
                destroyed.extend(bytes.fromhex(k) for k in keys["key_ids"])
                destroyed.extend(bytes.fromhex(k) for k, _ in keys.get("shared_keys", []))
            wanted = sorted({*destroyed, *victim_keys})
            deadline = time.monotonic() + 10.0
            while True:
                holder = self.holder.ask(
                    op="held", refs=[ref, ref2], key_ids=[k.hex() for k in wanted]
                )
                here = held_in_memory(ks, [ref, ref2], wanted)
                if not any(holder.values()) and not any(here.values()):
                    break
                if time.monotonic() > deadline:
                    raise DrillFailure(
                        f"10 s after the erasures completed the holder process still holds "
                        f"{holder} and the drill process {here} of the erased subjects"
                    )
                time.sleep(0.1)
            acks = _ack_figures(receipts.get(first))
            return (
                f"the holder and the drill process hold no key (of {len(wanted)}), partition "
                f"or vector of the erased subjects; {acks}"
            )

        def keys_dead() -> str:
            for key_id in sorted({*destroyed, *victim_keys}):
                try:
                    auditor.keyring.data_key_by_id(key_id)
                except SubjectErased:
                    continue
                raise DrillFailure(f"key {key_id.hex()} still unwraps")
            return (
                f"{len({*destroyed, *victim_keys})} keys (own and co-owned) raise "
                "SubjectErased in a process started after the erasures"
            )

        def bucket_clean() -> str:
            left = [
                key
                for r in (ref, ref2)
                for prefix in (f"parts/subject={r}/", f"vectors/{r}.lance/")
                for key in _versions(self.s3, self.bucket, prefix)
            ]
            _require(not left, f"{len(left)} object versions of the erased subjects left")

            def intact(subject: str) -> bool:
                # Its segment objects, or (a partition small enough to be compacted
                # into the catalog has none) its rows, read through the catalog.
                if _versions(self.s3, self.bucket, f"parts/subject={ks.subject_ref(subject)}/"):
                    return True
                try:
                    return ks.memories.count(subject) > 0
                except KeyshredError:
                    return False  # a segment the catalog lists is gone, or worse

            _require(all(intact(s) for s in ids[2:]), "another subject's partition is gone")
            return "no object version or delete marker under their partition or vector prefixes"

        def catalog_clean() -> str:
            for r in (ref, ref2):
                n = ks.catalog.count(r)
                _require(n == 0, f"{n} assets of an erased subject left")
                _require(not ks.vectors.exists(r), "vector rows of an erased subject left")
                _require(not ks.catalog.mentioning(r), "mentions left")
            return "no asset, vector row or mention of the erased subjects"

        def reads_refused() -> str:
            for subject in (victim, second):
                for call in (
                    lambda s=subject: ks.memories.get(s, ("memories",), "k1"),
                    lambda s=subject: ks.memories.search(s, ("memories",), query="peanuts"),
                    lambda s=subject: ks.memories.put(s, ("memories",), "new", 1),
                ):
                    try:
                        call()
                    except SubjectSuppressed:
                        continue
                    raise DrillFailure("a read or write of an erased subject was not refused")
            return "get, search and put raise SubjectSuppressed in the drill process"

        def searches_clean() -> str:
            hits = 0
            for subject in ids[2:]:
                for m in ks.memories.search(subject, (), limit=10_000):
                    hits += probe in json.dumps(m.value) or probe2 in json.dumps(m.value)
                for m in ks.memories.search(subject, (), query=warm_query):
                    hits += probe in json.dumps(m.value) or probe2 in json.dumps(m.value)
            _require(hits == 0, f"{hits} memories of other subjects hold a probe")
            _require(ks.memories.get(ids[2], ("facts",), "met") is None, "the mention survived")
            _require(
                ks.memories.get(ids[-1], ("facts",), "contact") is None,
                "the detected mention survived",
            )
            return (
                f"{len(ids) - 2} subjects searched by key and by meaning: no probe; the "
                "declared and the detected mention dropped with their co-owned keys"
            )

        def tokens_dead() -> str:
            for token in tokens.tokens:
                try:
                    ks.vault.detokenize(token, "support-reply", "drill")
                except TokenError:
                    continue
                raise DrillFailure("a token still resolves")
            return f"{len(tokens.tokens)} tokens unresolvable"

        def others_intact() -> str:
            n = 0
            for (subject, key), value in truth.items():
                if subject in (victim, second):
                    continue
                got = ks.memories.get(subject, ("memories",), key)
                _require(
                    got is not None and got.value == value, f"{key} of another subject changed"
                )
                n += 1
            return f"{n} memories of {len(ids) - 2} other subjects unchanged"

        needles = [probe, probe2, victim, second, "13812345678"]

        def byte_scan() -> str:
            ks.memories.flush()
            raw = [n.encode() for n in needles]
            hits = scan_bytes(tmp, raw)
            _require(not hits, f"found in {sorted({h[0] for h in hits})}")
            rows = _catalog_hits(ks, [*raw, *(n.hex().encode() for n in raw)])
            _require(not rows, f"found in PostgreSQL tables {rows}")
            files = sum(1 for p in tmp.rglob("*") if p.is_file())
            return (
                f"{files} files (every process's folder and log, the servers' logs) and every "
                "row of every table in the PostgreSQL schema: no subject id, probe or phone"
            )

        def residue() -> str:
            # From the auditor's handle: the keys the key store and OpenBao still open.
            # What the drill process itself may still hold is the eviction check's.
            # The run's folder holds every process's data folder: the bucket's prefixes
            # and the live catalog come with them.
            result = auditor.erasure.residue_scan(needles, [tmp])
            _require(
                not result.hits,
                f"{len(result.hits)} hit(s): "
                + ", ".join(sorted({f"{h.kind}/{h.layer}" for h in result.hits})),
            )
            undecryptable = sum(result.undecryptable.values())
            _require(undecryptable > 0, "nothing of the subjects left to find undecryptable")
            return (
                f"{result.files_scanned} files and objects ({result.bytes_scanned} bytes: the "
                "bucket's partitions, vectors and backups with every version, the live "
                "catalog): no probe raw or decrypted with the live keyring; "
                f"{sum(result.decrypted.values())} items decrypted, {undecryptable} "
                "undecryptable (erased)"
            )

        def audit_chain() -> str:
            n = ks.audit.verify()
            return f"{n} events written by the drill process and the workers, hash chain intact"

        check("a worker SIGKILLed inside an erasure step", killed_inside)
        check("the request finished by another worker", finished_by_another)
        check("exactly one receipt and one erasure.completed", one_receipt)
        check("every process's caches evicted", caches_evicted)
        check("erased keys no longer unwrap", keys_dead)
        check("no object version left in the bucket", bucket_clean)
        check("catalog clean", catalog_clean)
        check("reads and writes refused", reads_refused)
        check("key and semantic search find nothing, mentions dropped", searches_clean)
        check("tokens no longer resolve", tokens_dead)
        check("other subjects intact", others_intact)
        check("byte scan of every folder, log and catalog table", byte_scan)
        check("residue scan (S3 versions, live catalog)", residue)
        check("audit chain verifies", audit_chain)
        return report


def _ack_figures(receipt: Any) -> str:
    """The receipt's eviction acknowledgements (``metrics``), where this install's
    receipts carry them (issue #22 item 2)."""
    metrics = getattr(receipt, "metrics", None)
    if metrics is None:
        return "this install's receipts carry no eviction acknowledgements"
    latency = metrics.eviction_max_latency_ms
    return (
        f"the receipt counts {metrics.eviction_processes} process(es) that acknowledged "
        "the eviction, the last "
        + ("(none)" if latency is None else f"{latency:.1f} ms after the suppression's commit")
    )


def _catalog_hits(ks: Keyshred, needles: Sequence[bytes]) -> list[str]:
    """Tables of the catalog's schema in which a row, as text, holds a needle."""
    hits: list[str] = []
    with ks.catalog.engine.connect() as conn:
        tables = conn.execute(
            sa.text(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
            )
        ).scalars()
        for table in list(tables):
            # Every column of every row as PostgreSQL's text form (bytea as hex).
            rows = conn.execute(sa.text(f'SELECT t::text FROM "{table}" AS t')).scalars()  # noqa: S608 - names from the catalog
            for row in rows:
                data = str(row).encode()
                if any(n in data for n in needles):
                    hits.append(table)
                    break
    return hits
