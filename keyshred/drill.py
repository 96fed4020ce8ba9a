"""The erasure drill: write a synthetic agent workload, erase one subject through the
front door, and prove it on every path.

This is the main job (``keyshred drill``, ``make demo``). Workload: several subjects
with indexed memories in two scopes (one under consent), tokens issued by the vault,
a summary derived from two subjects' memories (with a rebuild function), a fact of a
third subject that mentions the first, a memory of the last subject that holds the
first one's registered e-mail and phone (a mention nobody declares: the detector finds
it), and LangGraph threads (a two-node graph with
``KeyshredSaver``, no LLM) of the first two subjects. Then a backup, ``ks.erase`` for
the first subject, and checks that each try to read what should be gone: key
unwrap, partitions, catalog, key search, semantic search, token resolution, the
rebuilt summary, the dropped fact, the agent threads, a restore of the pre-erasure
backup into an isolated folder (tombstone replay), a byte scan of the whole data
folder (backups and the restored copy included), the audit chain, the receipt's
signature, the keys other holders shared with the subject (destroyed with its own),
a residue scan of the data folder and the pre-erasure backup (raw and decrypted with
the live keyring) after the erasure and again after the live KEK epoch rotated, and
the pre-erasure backup's key store once its archive KEK epoch is destroyed.
Every check is timed; probe strings are random per run.

Why ~620 lines: the drill is the project's end-to-end proof; its workload and its
checks stay in one file so that each check sits next to the write it tries to undo.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypedDict

from keyshred.backup.targets import LocalTarget
from keyshred.config import Config, ScopeSettings
from keyshred.errors import (
    KekEpochDestroyed,
    KeyshredError,
    SubjectErased,
    SubjectSuppressed,
    TokenError,
)
from keyshred.facade import Keyshred
from keyshred.keyring.kek import WrappedKey
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import SQLiteKeyStore
from keyshred.receipts import verify_receipt
from keyshred.storage.memories import PutItem

__all__ = [
    "DRILL_EVENT",
    "DrillCheck",
    "DrillFailure",
    "DrillReport",
    "record_report",
    "run_drill",
    "scan_bytes",
]

HEALTH = "support/health"
# The audit event a service's store keeps of a drill run against it (``keyshred drill
# --record-in DATA``): the console's "latest drill" page reads the newest one.
DRILL_EVENT = "drill.report"
_DETAIL_MAX = 300


class DrillFailure(KeyshredError):
    """A drill check found something that should be gone (or broken)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise DrillFailure(message)


@dataclass(frozen=True, slots=True)
class DrillCheck:
    name: str
    passed: bool
    seconds: float
    detail: str


@dataclass(slots=True)
class DrillReport:
    path: str
    subjects: int
    records: int
    erased_subject_ref: str
    request_id: str = ""
    receipt_file: str | None = None
    checks: list[DrillCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "subjects": self.subjects,
            "records": self.records,
            "erased_subject_ref": self.erased_subject_ref,
            "request_id": self.request_id,
            "receipt_file": self.receipt_file,
            "passed": self.passed,
            "checks": [
                {"name": c.name, "passed": c.passed, "seconds": c.seconds, "detail": c.detail}
                for c in self.checks
            ],
        }


def record_report(ks: Keyshred, report: DrillReport, *, profile: str = "embedded") -> None:
    """Record ``report`` in the audit chain of ``ks`` (a service's store: the drill
    itself ran in a folder of its own). Metadata only: the drill's subjects are
    synthetic and named nowhere; its request id and subject_ref are the drill
    folder's, and its folder's path (it may name a person's home) is left out.
    The checks are parallel lists, so their order is kept (an audit event's
    fields are stored with sorted keys, and hold no list of objects)."""
    checks = report.checks
    ks.audit.record(
        DRILL_EVENT,
        profile=profile,
        passed=report.passed,
        subjects=report.subjects,
        records=report.records,
        drill_request_id=report.request_id,
        drill_subject_ref=report.erased_subject_ref,
        seconds=round(sum(c.seconds for c in checks), 3),
        check_names=[c.name for c in checks],
        check_passed=[c.passed for c in checks],
        check_seconds=[round(c.seconds, 4) for c in checks],
        check_details=[c.detail[:_DETAIL_MAX] for c in checks],
    )


def scan_bytes(root: Path, needles: list[bytes]) -> list[tuple[str, int]]:
    """Every (file, needle index) where a needle occurs in a file under ``root``."""
    hits: list[tuple[str, int]] = []
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        data = file.read_bytes()
        hits.extend((str(file.relative_to(root)), i) for i, n in enumerate(needles) if n in data)
    return hits


def _config() -> Config:
    return Config(
        scopes={HEALTH: ScopeSettings(purpose="support", categories=["health"])},
    )


def run_drill(
    path: Path | None = None,
    *,
    subjects: int = 5,
    records: int = 20,
    embeddings: Any = None,
    receipt_dir: Path | None = None,
    progress: Callable[[str, int, int], None] = lambda step, done, total: None,
) -> DrillReport:
    """Run the drill in ``path`` (a fresh temporary folder when ``None``, removed
    afterwards). The signed receipt is written under ``<path>/receipts/``; with a
    temporary folder, it is copied to ``receipt_dir`` (the working directory by
    default) so that it outlives the run."""
    if subjects < 3 or records < 2:
        raise KeyshredError("the drill needs at least 3 subjects and 2 records each")
    tmp = None
    if path is None:
        tmp = Path(tempfile.mkdtemp(prefix="keyshred-drill-"))
        path = tmp / "data"
    try:
        report = _drill(path, subjects, records, embeddings, progress)
        if tmp is not None and report.receipt_file:
            keep = (receipt_dir or Path.cwd()) / f"keyshred-drill-receipt-{report.request_id}.jws"
            shutil.copyfile(report.receipt_file, keep)
            report.receipt_file = str(keep)
        return report
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _drill(
    path: Path,
    n_subjects: int,
    n_records: int,
    embeddings: Any,
    progress: Callable[[str, int, int], None],
) -> DrillReport:
    run = secrets.token_hex(5)
    probe = f"zq{run}"  # in every text of the victim, nowhere else
    ids = [f"drill-{run}-person-{i}@example.com" for i in range(n_subjects)]
    victim = ids[0]
    ks = Keyshred.init(path, _config(), exist_ok=True, embeddings=embeddings)
    report = DrillReport(str(path), n_subjects, n_subjects * n_records, ks.subject_ref(victim))

    def check(name: str, fn: Callable[[], str]) -> None:
        progress(name, 0, 0)
        start = time.perf_counter()
        try:
            detail, ok = fn(), True
        except KeyshredError as exc:
            detail, ok = str(exc) or type(exc).__name__, False
        report.checks.append(DrillCheck(name, ok, time.perf_counter() - start, detail))

    # -- workload ------------------------------------------------------------------
    start = time.perf_counter()
    truth: dict[tuple[str, str], Any] = {}
    topics = ["hiking in the Alps", "sourdough baking", "jazz piano", "chess openings"]
    for n, subject in enumerate(ids):
        progress("writing the workload", n, n_subjects)
        mark = probe if subject == victim else f"other{n}"
        ks.consent.grant(subject, scope=HEALTH, category="health")
        items = []
        for i in range(n_records):
            value = {"text": f"{mark} note {i}: likes {topics[(n + i) % len(topics)]}"}
            items.append(PutItem(("memories",), f"k{i}", value, index=["text"]))
            truth[(subject, f"k{i}")] = value
        ks.memories.put_many(subject, items)
        health = {"text": f"{mark} is allergic to peanuts"}
        ks.memories.put(
            subject,
            ("memories",),
            "allergy",
            health,
            scope=HEALTH,
            category="health",
            index=["text"],
        )
        truth[(subject, "allergy")] = health
    a = ks.memories.get(victim, ("memories",), "k0")
    b = ks.memories.get(ids[1], ("memories",), "k0")
    assert a is not None and b is not None  # noqa: S101 - just written

    def summarize(sources: list[Any]) -> str:
        return " + ".join(sorted(str(m.value["text"]) for m in sources))

    summary = ks.derived.register(
        "summary",
        subject=ids[1],
        namespace=("shared",),
        key="summary",
        value=summarize([a, b]),
        produced_from=[a.memory_id, b.memory_id],
        producer="drill-summarizer",
        producer_version="1",
        rebuild=summarize,
        index=True,
    )
    ks.memories.put(
        ids[2], ("facts",), "met", f"person 2 met {probe} at the conference", mentions=[victim]
    )
    # The victim's registered e-mail, found in what another subject writes: nobody
    # declares this mention, the detector finds it and the key is shared with them.
    ks.subjects.register_identifiers(victim, emails=[victim], phones=["+86 138 1234 5678"])
    ks.memories.put(
        ids[-1],
        ("facts",),
        "contact",
        {"text": f"ask {victim.upper()} or call 138-1234-5678 about the {probe} trip"},
    )
    tokens = ks.vault.sanitize(
        f"{probe}: call 13812345678 or mail {victim}", victim, "support-reply", timedelta(days=1)
    )
    progress("writing the workload", n_subjects, n_subjects)
    saver, graph = _agent(ks)
    threads = {s: f"drill-{run}-thread-{n}" for n, s in enumerate(ids[:2])}
    for subject, thread in threads.items():
        mark = probe if subject == victim else "other"
        graph.invoke({"notes": [f"{mark} asked about the allergy"]}, _thread(thread, subject))
    ks.memories.flush()
    found = ks.catalog.mention_counts()
    keys = ks.keyring.store.counts()
    report.checks.append(
        DrillCheck(
            "workload written (memories, vectors, tokens, derived, agent threads)",
            True,
            time.perf_counter() - start,
            f"{report.records + n_subjects} memories with vectors, {len(tokens.tokens)} tokens, "
            f"1 shared summary, {found['declared']} declared and {found['detected']} detected "
            f"mention(s), {len(threads)} LangGraph threads; {keys['dek']} keys, of which "
            f"{keys['shared']} shared by an owner set",
        )
    )
    victim_keys = [r.key_id for r in ks.keyring.store.for_subject(report.erased_subject_ref)]

    # -- a backup before the erasure ---------------------------------------------------
    start = time.perf_counter()
    gen = ks.backup.create(
        progress=lambda phase, done, total: progress(f"backup: {phase}", done, total)
    )
    report.checks.append(
        DrillCheck(
            "backup taken before the erasure",
            True,
            time.perf_counter() - start,
            f"generation {gen.generation}: {gen.segments} segments, {gen.bytes_total} bytes, "
            f"key store sealed under KEK epoch {gen.kek_epoch}",
        )
    )

    # -- erase through the front door ----------------------------------------------
    progress("erasing one subject", 0, 0)
    start = time.perf_counter()
    req = ks.erase(victim, requested_by="drill", reason="drill", probes=[probe])
    receipt = ks.erasure.receipt(req.request_id)
    report.request_id = req.request_id
    report.checks.append(
        DrillCheck(
            "erasure completed (suppress, crypto-erase, drop, rebuild, verify)",
            req.state == "completed" and receipt is not None,
            time.perf_counter() - start,
            f"state {req.state}" + (f" ({req.error})" if req.error else ""),
        )
    )
    if receipt is not None:
        file = path / "receipts" / f"{req.request_id}.jws"
        file.parent.mkdir(exist_ok=True)
        file.write_text(receipt.serialize(), "utf-8")
        report.receipt_file = str(file)

    def receipt_valid() -> str:
        _require(receipt is not None, "no receipt")
        assert receipt is not None  # noqa: S101 - for the type checker
        verify_receipt(receipt, ks.keyring.signer().public_key)
        _require(
            probe not in receipt.to_json() and victim not in receipt.to_json(),
            "the receipt names the subject",
        )
        failed = [c.name for c in receipt.verification if not c.passed]
        _require(not failed, f"receipt verification failed: {failed}")
        return f"Ed25519 signature valid; {len(receipt.verification)} verification checks"

    def keys_dead() -> str:
        for key_id in victim_keys:
            try:
                ks.keyring.data_key_by_id(key_id)
            except SubjectErased:
                continue
            raise DrillFailure(f"key {key_id.hex()} still unwraps")
        return f"{len(victim_keys)} keys raise SubjectErased"

    def partitions_gone() -> str:
        part = ks.memories.partition_path(report.erased_subject_ref)
        _require(not part.exists() or not any(part.rglob("*.*")), "memory partition left")
        rows = ks.memories.partition_rows(report.erased_subject_ref)
        _require(rows == (0, 0, 0), "the catalog still holds the memory partition")
        _require(not ks.vectors.exists(report.erased_subject_ref), "vector rows left")
        return "Parquet partition, the catalog's partition rows and vector rows removed"

    def catalog_clean() -> str:
        n = ks.catalog.count(report.erased_subject_ref)
        _require(n == 0, f"{n} assets of the subject left")
        _require(not ks.catalog.mentioning(report.erased_subject_ref), "mentions left")
        return "no asset, provenance edge or mention of the subject"

    def reads_refused() -> str:
        for call in (
            lambda: ks.memories.get(victim, ("memories",), "k1"),
            lambda: ks.memories.search(victim, ("memories",), query="peanuts"),
            lambda: ks.memories.put(victim, ("memories",), "new", 1),
        ):
            try:
                call()
            except SubjectSuppressed:
                continue
            raise DrillFailure("a read or write of the erased subject was not refused")
        return "get, search and put raise SubjectSuppressed"

    def key_search() -> str:
        hits = 0
        for subject in ids[1:]:
            for m in ks.memories.search(subject, (), limit=10_000):
                hits += probe in json.dumps(m.value)
        _require(hits == 0, f"{hits} memories of other subjects hold the probe")
        return f"{len(ids) - 1} subjects searched by key, probe found nowhere"

    def semantic_search() -> str:
        hits = 0
        for subject in ids[1:]:
            for m in ks.memories.search(subject, (), query=f"{probe} allergic to peanuts"):
                hits += probe in json.dumps(m.value)
        _require(hits == 0, f"{hits} semantic hits carry the probe")
        return f"{len(ids) - 1} subjects searched by meaning, probe found nowhere"

    def derived_rebuilt() -> str:
        rebuilt = ks.memories.get(ids[1], ("shared",), "summary")
        _require(rebuilt is not None, "the shared summary is gone")
        assert rebuilt is not None  # noqa: S101
        _require(probe not in str(rebuilt.value), "the summary still holds the subject")
        _require(rebuilt.sources == (b.memory_id,), "the summary's provenance was not rebuilt")
        _require(ks.memories.get(ids[2], ("facts",), "met") is None, "the mention survived")
        return f"summary {summary.memory_id[:8]}… rebuilt from 1 source; mentioning fact dropped"

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
            if subject == victim:
                continue
            got = ks.memories.get(subject, ("memories",), key)
            _require(got is not None and got.value == value, f"{key} of another subject changed")
            n += 1
        return f"{n} memories of {len(ids) - 1} other subjects unchanged"

    def threads_gone() -> str:
        victim_cfg = _thread(threads[victim], victim)
        try:
            saver.get_tuple(victim_cfg)
        except SubjectSuppressed:
            pass
        else:
            raise DrillFailure("the erased subject's thread is still readable")
        left = ks.checkpoints.count(report.erased_subject_ref)
        _require(left == 0, f"{left} thread or checkpoint rows of the subject left")
        other = graph.get_state(_thread(threads[ids[1]], ids[1])).values
        _require(
            other.get("notes") == ["other asked about the allergy", "recalled", "answered"],
            "another subject's thread changed",
        )
        return "thread rows and keys gone; the other subject's thread resumes intact"

    restored_path = path / "restore-check"

    def backup_restore() -> str:
        shutil.rmtree(restored_path, ignore_errors=True)
        result = ks.backup.restore(
            gen.generation,
            restored_path,
            progress=lambda phase, done, total: progress(f"restore: {phase}", done, total),
        )
        replayed = [r["subject_ref"] for r in result.replayed]
        _require(report.erased_subject_ref in replayed, "the erasure's tombstone was not replayed")
        with Keyshred.open(restored_path, embeddings=embeddings) as r:
            try:
                r.memories.get(victim, ("memories",), "k0")
            except SubjectSuppressed:
                pass
            else:
                raise DrillFailure("the restored copy still serves the erased subject")
            _require(
                not r.memories.partition_path(report.erased_subject_ref).exists()
                and r.memories.partition_rows(report.erased_subject_ref) == (0, 0, 0),
                "the restored copy holds the erased subject's partition",
            )
            _require(r.catalog.count(report.erased_subject_ref) == 0, "restored catalog not clean")
            n = 0
            for (subject, key), value in truth.items():
                if subject == victim:
                    continue
                got = r.memories.get(subject, ("memories",), key)
                _require(got is not None and got.value == value, "restored data differs")
                n += 1
            restored_saver = _agent(r)[0]
            tup = restored_saver.get_tuple(_thread(threads[ids[1]], ids[1]))
            _require(tup is not None, "the other subject's thread was not restored")
        return (
            f"generation {gen.generation} restored into an isolated folder; "
            f"{len(replayed)} tombstone(s) replayed; {n} memories of the others verified"
        )

    def byte_scan() -> str:
        ks.memories.flush()
        needles = [victim.encode(), probe.encode(), b"13812345678"]
        hits = scan_bytes(path, needles)
        _require(not hits, f"found in {sorted({h[0] for h in hits})}")
        files = sum(1 for p in path.rglob("*") if p.is_file())
        return (
            f"{files} files scanned (backups and the restored copy included): "
            "no subject id, probe or token value"
        )

    def shared_keys_destroyed() -> str:
        _require(receipt is not None, "no receipt")
        assert receipt is not None  # noqa: S101 - for the type checker
        shared = receipt.shared_keys or []
        holders = {k.holder_subject_ref for k in shared}
        wanted = {ks.subject_ref(s) for s in (ids[1], ids[2], ids[-1])}
        _require(wanted <= holders, "a co-owned key of another holder was not destroyed")
        for k in shared:
            try:
                ks.keyring.data_key_by_id(bytes.fromhex(k.key_id))
            except SubjectErased:
                continue
            raise DrillFailure("a co-owned key still unwraps")
        _require(
            ks.memories.get(ids[-1], ("facts",), "contact") is None,
            "the memory with the detected mention survived",
        )
        assets = sum(len(k.assets) for k in shared)
        return (
            f"{len(shared)} keys of {len(holders)} other holders destroyed with the subject's "
            f"({assets} assets: the summary's old version, the declared and the detected "
            "mention), unreadable in every copy"
        )

    needles = [probe, victim, "13812345678"]
    target = ks.backup.target()
    backups = target.root if isinstance(target, LocalTarget) else None

    def residue(after: str) -> Callable[[], str]:
        def scan() -> str:
            ks.memories.flush()
            paths = [path]
            if backups is not None and not backups.resolve().is_relative_to(path.resolve()):
                paths.append(backups)
            result = ks.erasure.residue_scan(needles, paths)
            _require(
                not result.hits,
                f"{len(result.hits)} hit(s): "
                + ", ".join(sorted({f"{h.kind}/{h.layer}" for h in result.hits})),
            )
            undecryptable = sum(result.undecryptable.values())
            _require(undecryptable > 0, "nothing of the subject left to find undecryptable")
            return (
                f"{result.files_scanned} files ({result.bytes_scanned} bytes) of the data "
                f"folder and the pre-erasure backup {after}: no probe raw or decrypted with "
                f"the live keyring in any encoding; {sum(result.decrypted.values())} items "
                f"decrypted, {undecryptable} undecryptable (erased)"
            )

        return scan

    def audit_chain() -> str:
        return f"{ks.audit.verify()} events, hash chain intact"

    def old_keystore_copy() -> str:
        # The pre-erasure generation's key store, unsealed as an attacker holding a
        # copy of the backup (and access to the archive KEK) would, without replay.
        manifest = ks.backup.manifest(gen.generation)
        target = ks.backup.target()
        sealed = target.get_bytes(manifest.keystore.object)
        wrapped = WrappedKey(
            manifest.keystore.kek_epoch, base64.b64decode(manifest.keystore.wrapped)
        )
        label = f"backup:{gen.generation}"
        archive = ks.keyring.archive_kek
        _require(archive is not None, "no archive KEK provider")
        assert archive is not None  # noqa: S101 - for the type checker
        image = ks.keyring.open_archive(manifest.kek_epoch, wrapped, sealed, label)
        copy = path.parent / f"{path.name}-keystore-copy-{run}.db"
        SQLiteKeyStore.from_snapshot(copy, image).close()
        del image

        def copy_keyring() -> Keyring:
            return Keyring(
                SQLiteKeyStore(copy), ks.keyring.kek, archive_kek=archive, cache_max_entries=0
            )

        try:
            old = copy_keyring()
            try:
                old.data_key_by_id(victim_keys[0])  # the risk that archive epochs bound
            finally:
                old.store.close()
            # The live lineage rotating changes nothing for a backup copy...
            rotation = ks.keyring.rotate_kek()
            ks.destroy_kek_epochs_before(rotation.new_epoch, force=True)
            old = copy_keyring()
            try:
                old.data_key_by_id(victim_keys[0])
            finally:
                old.store.close()
            # ...its archive epoch's destruction (forced here: the schedule does it
            # when the generation expires) ends it.
            archive.destroy_epochs_before(archive.rotate())
            try:
                old = copy_keyring()  # its secrets are under the archive epoch too
                try:
                    old.data_key_by_id(victim_keys[0])
                finally:
                    old.store.close()
            except (SubjectErased, KekEpochDestroyed):
                pass
            else:
                raise DrillFailure("the old key-store copy still unwraps the erased key")
            try:
                ks.keyring.open_archive(manifest.kek_epoch, wrapped, sealed, label)
            except KekEpochDestroyed:
                pass
            else:
                raise DrillFailure("the generation's sealed key store still opens")
            return (
                f"unwrapped while archive epoch {manifest.kek_epoch} lived (also after live "
                f"epoch {rotation.new_epoch - 1} was destroyed), then neither the copy nor the "
                f"generation yields a key; {rotation.keys_rewrapped} live keys re-wrapped"
            )
        finally:
            copy.unlink(missing_ok=True)

    check("receipt signed and complete", receipt_valid)
    check("erased keys no longer unwrap", keys_dead)
    check("partitions removed", partitions_gone)
    check("catalog clean", catalog_clean)
    check("reads and writes refused", reads_refused)
    check("key search finds nothing", key_search)
    check("semantic search finds nothing", semantic_search)
    check("shared summary rebuilt, mention dropped", derived_rebuilt)
    check("tokens no longer resolve", tokens_dead)
    check("agent threads and checkpoints gone", threads_gone)
    check("other subjects intact", others_intact)
    check("pre-erasure backup restored with tombstone replay", backup_restore)
    check("byte scan of the data folder", byte_scan)
    check("co-owned keys destroyed with the subject", shared_keys_destroyed)
    check("residue scan after the erasure", residue("after the erasure"))
    check("audit chain verifies", audit_chain)
    check("pre-erasure backup's key store dies with its KEK epoch", old_keystore_copy)
    check("other subjects intact after KEK rotation", others_intact)
    check(
        "residue scan after the live epoch rotated",
        residue("after the live KEK epoch rotated and the old one was destroyed"),
    )
    ks.close()
    return report


class _AgentState(TypedDict):
    notes: list[str]


def _thread(thread_id: str, subject: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread_id, "subject_id": subject}}


def _agent(ks: Keyshred) -> tuple[Any, Any]:
    """A two-node LangGraph graph (no LLM) checkpointed by ``KeyshredSaver``."""
    try:
        from langgraph.graph import END, START, StateGraph

        from keyshred.integrations.langgraph import KeyshredSaver
    except (ImportError, KeyshredError):
        raise DrillFailure("the drill needs LangGraph: pip install 'keyshred[langgraph]'") from None

    def recall(state: _AgentState) -> dict[str, Any]:
        return {"notes": [*state["notes"], "recalled"]}

    def answer(state: _AgentState) -> dict[str, Any]:
        return {"notes": [*state["notes"], "answered"]}

    g = StateGraph(_AgentState)
    g.add_node("recall", recall)
    g.add_node("answer", answer)
    g.add_edge(START, "recall")
    g.add_edge("recall", "answer")
    g.add_edge("answer", END)
    saver = KeyshredSaver(ks)
    return saver, g.compile(checkpointer=saver)
