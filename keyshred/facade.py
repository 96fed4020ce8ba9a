"""``Keyshred``: the one object an application opens.

It holds the keyring (per-subject keys, crypto-erasure), the catalog (assets,
consent, the subject guard) and the memory store; vectors, the erasure coordinator,
the vault and backups attach here as they are built.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path, PurePath
from types import TracebackType
from typing import Any, TypeVar

from keyshred import db
from keyshred._backends import KEYS_DIR, make_archive_kek, make_kek, make_keystore
from keyshred._handle import check_open, disk_full_test, guarded, typed_errors, typed_method
from keyshred.audit import AuditLog
from keyshred.backup.manager import BackupManager
from keyshred.config import CONFIG_FILE, Config, load_config, save_config
from keyshred.erasure import DerivedApi, DerivedStore, ErasureCoordinator, ErasureRequest
from keyshred.erasure.callbacks import JOB_KIND as WEBHOOK_JOB
from keyshred.erasure.eviction import Eviction
from keyshred.errors import ConfigError
from keyshred.export import ExportResult, ExportStore, expire_exports, export_subject, open_export
from keyshred.ids import (
    RESERVED_IDS,
    OwnSubject,
    Subject,
    SubjectLike,
    as_subject,
    check_not_reserved,
)
from keyshred.jobs import Job, JobOutcome, JobQueue, JobRunner
from keyshred.jose import jwks
from keyshred.keyring.kek import DestroyedEpoch
from keyshred.keyring.kek.resilient import ResilientKek
from keyshred.keyring.keyring import Keyring
from keyshred.lifecycle import Consent, Lifecycle
from keyshred.metrics import Metrics
from keyshred.migrations import migrate_catalog
from keyshred.storage.catalog import Catalog, sqlite_url
from keyshred.storage.checkpoints import CheckpointStore
from keyshred.storage.embeddings import Embedder, MiniLM, as_embedder
from keyshred.storage.freeze import FreezeLock
from keyshred.storage.memories import MemoryStore
from keyshred.storage.mentions import MentionFinder, SubjectsApi
from keyshred.storage.policy import Policy
from keyshred.storage.s3 import open_partition_store, s3_storage_options
from keyshred.storage.vectors import VectorIndex
from keyshred.tracing import span, trace_instance, traced_class
from keyshred.vault.tokens import TokenVault

__all__ = ["Keyshred"]

CATALOG_DIR = "catalog"
VECTORS_DIR = "vectors"
MEMORIES_DIR = "memories"  # the default partition store: a folder
CATALOG_FILE = "catalog.db"
JOURNAL_DIR = "tokens"  # the vault's group-commit journals (keyshred.vault.journal)
T = TypeVar("T")
# Request states a run of the caller's own job returns as they are.
_SETTLED = ("completed", "rejected", "legal_hold", "retryable_failure", "manual_review")
# The calls that get an OpenTelemetry span (keyshred.tracing) when the application
# configured a tracer provider.
_TRACED_MEMORIES = (
    "put",
    "put_many",
    "get",
    "search",
    "delete",
    "delete_many",
    "update",
    "correct",
)
_TRACED_KEK = (
    "wrap",
    "unwrap",
    "wrap_many",
    "unwrap_many",
    "rewrap_many",
    "rotate",
    "destroy_epochs_before",
)


class Keyshred:
    """An open keyshred data folder."""

    def __init__(
        self,
        path: Path,
        config: Config,
        keyring: Keyring,
        catalog: Catalog,
        *,
        embeddings: Any = None,
    ) -> None:
        self.path = path
        self.config = config
        self._closed = False
        self._full = disk_full_test(_sqlite_folders(path, catalog))
        self._keyring = keyring
        self._catalog = catalog
        # Callers reach every component through a view that refuses a closed handle
        # and types a full disk (keyshred._handle); the components themselves hold
        # each other's real objects.
        self.keyring = self._guard(keyring)
        self.catalog = self._guard(catalog)
        self.policy = Policy(config.scopes, config.storage.default_max_retention_days)
        settings = config.storage
        vec = config.vectors
        self._audit = AuditLog(catalog, retention_days=config.audit.retention_days)
        self.audit = self._guard(self._audit)
        # Shared by the memory store and the vector index: every partition write
        # holds it shared, a backup's snapshot exclusive.
        freeze = FreezeLock(path / "FREEZE")
        s3 = config.s3  # one S3 service for partitions, vectors and backups
        partitions = open_partition_store(
            settings.uri,
            path / MEMORIES_DIR,
            endpoint_url=s3.endpoint_url,
            region=s3.region,
            addressing_style=s3.addressing_style,
        )
        vector_uri = vec.uri or str(path / VECTORS_DIR)
        # Vectors are rows of the catalog; ``vector_uri`` is only where datasets of
        # the layout before revision 0013 may be left (imported on first touch).
        self._vectors = VectorIndex(
            vector_uri,
            keyring,
            catalog=catalog,
            cache_max_vectors=vec.cache_max_vectors,
            compact_every=vec.compact_every,
            storage_options=(
                s3_storage_options(s3.endpoint_url, s3.region, s3.addressing_style)
                if vector_uri.startswith("s3://")
                else None
            ),
            freeze=freeze,
            cache_ttl_seconds=settings.cache_ttl_seconds,
            store=(
                open_partition_store(
                    vector_uri,
                    path / VECTORS_DIR,
                    endpoint_url=s3.endpoint_url,
                    region=s3.region,
                    addressing_style=s3.addressing_style,
                )
                if vector_uri.startswith("s3://")
                else None
            ),
        )
        self.vectors = self._guard(self._vectors)
        embedder: Callable[[], Embedder] = (
            MiniLM if embeddings is None else (lambda: as_embedder(embeddings))
        )
        if embeddings is None:
            # The bundled model loads on a daemon thread from here, so the first indexed
            # put or search waits for what remains of the load rather than all of it.
            MiniLM().preload()
        # Registered identifiers found in values, tokens and threads add mentions.
        mentions = MentionFinder(catalog, keyring, self.policy, max_chars=settings.max_value_bytes)
        self._memories = traced_class(MemoryStore, "memories", _TRACED_MEMORIES)(
            path,
            catalog,
            keyring,
            self.policy,
            self._subject_ref,
            max_value_bytes=settings.max_value_bytes,
            max_value_depth=settings.max_value_depth,
            flush_records=settings.flush_records,
            max_open_partitions=settings.max_open_partitions,
            vectors=self._vectors,
            embedder=embedder,
            mentions=mentions,
            freeze=freeze,
            audit=self._audit,
            objects=partitions,
            retired_grace_seconds=settings.retired_grace_seconds,
            cache_ttl_seconds=settings.cache_ttl_seconds,
            inline_max_rows=settings.inline_max_rows,
        )
        self.memories = self._guard(self._memories)
        self.metrics = Metrics()
        catalog.on_stale = self.metrics.stale_job
        if isinstance(keyring.kek, ResilientKek):
            # KEK calls by operation and outcome (keyshred_kek_calls_total).
            keyring.kek.on_call = self.metrics.kek_call
        self.subjects = self._guard(SubjectsApi(mentions, self._subject_ref, self._audit))
        self._derived = DerivedApi(self._memories, catalog, self._audit, self._subject_ref)
        self.derived = self._guard(self._derived)
        self._vault = TokenVault(
            catalog,
            keyring,
            self._subject_ref,
            self._audit,
            first_key=self._memories.first_key,
            group_commit_ms=config.tokens.commit_ms(catalog.dialect),
            journal=path / JOURNAL_DIR,
            on_flush_failure=self.metrics.token_flush_failure,
            max_text_bytes=config.tokens.max_text_bytes,
            mentions=mentions,
        )
        self.vault = self._guard(self._vault)
        self._checkpoints = CheckpointStore(
            catalog,
            keyring,
            tenant=config.tenant,
            locked=self._memories.locked,
            mentions=mentions,
        )
        self.checkpoints = self._guard(self._checkpoints)
        self._backup = BackupManager(
            path,
            config,
            keyring,
            catalog,
            self._audit,
            freeze=self._memories.frozen,
            flush_tokens=self._vault.flush,
            open_copy=self._open_restored,
            catalog_file=PurePath(CATALOG_DIR, CATALOG_FILE),
            partitions=partitions,
            import_legacy=self._memories.import_legacy,
        )
        self.backup = self._guard(self._backup)
        # Work that outlives a call (keyshred.jobs): every erasure request is
        # recorded with its job; workers (keyshred.worker) run them.
        self._jobs = JobRunner(JobQueue(catalog, config.jobs), on_retry=self.metrics.job_retry)
        # Every store holding personal data, in the order the erasure runs them
        # (keyshred.storage.erasable); the coordinator never sees this handle.
        self._erasure = ErasureCoordinator(
            [
                self._memories,
                self._vectors,
                self._vault,
                self._checkpoints,
                ExportStore(catalog, keyring),
                DerivedStore(catalog, self._memories, self._derived),
            ],
            catalog,
            keyring,
            partitions=self._memories,
            audit=self._audit,
            metrics=self.metrics,
            backups=self._backup,
            policy=self.policy,
            subject_ref=self._subject_ref,
            residue=self._residue_scan,
            lease_seconds=config.erasure.lease_seconds,
            jobs=self._jobs.queue,
            webhooks=config.webhooks,
        )
        self.erasure = self._guard(self._erasure)
        consent = Consent(catalog, self.policy, self._subject_ref, self._audit, self._erasure)
        self.consent = self._guard(consent)
        self._lifecycle = Lifecycle(
            config,
            catalog,
            self._audit,
            memories=self._memories,
            checkpoints=self._checkpoints,
            backups=self._backup,
            erasures=self._erasure,
            expire_exports=lambda now: expire_exports(self, now),
            consent=consent,
        )
        self.retention = self._guard(self._lifecycle)
        keyring.epoch_users = self._backup.epoch_users
        self._jobs.register("erasure", self._erasure.run_job)
        self._jobs.register("retention", self._lifecycle.run_job)
        self._jobs.register("backup.maintain", self._maintain_job)
        self._jobs.register(WEBHOOK_JOB, self._erasure.webhooks.run_job)
        self.jobs = self._guard(self._jobs)
        # Evicts this process's caches when a subject is suppressed anywhere, and
        # drops expired entries on a schedule (keyshred.erasure.eviction).
        self._eviction = Eviction(
            catalog,
            keyring,
            [self._memories, self._vectors],
            [self._vault, self._checkpoints],
            sweep_seconds=settings.cache_sweep_seconds,
            on_evicted=self.metrics.evicted,
        )
        self._eviction.start()

    def _maintain_job(self, job: Job, stop: object) -> JobOutcome:
        """The ``backup.maintain`` job (one per period): ``keyshred maintain``."""
        del stop  # one unit
        self._backup.maintain(job.payload.get("target"))
        return JobOutcome.done()

    def _is_closed(self) -> bool:
        return self._closed

    def _guard(self, component: T) -> T:
        return guarded(component, self._is_closed, self._full)

    @typed_method
    def erase(
        self,
        subject: SubjectLike,
        scope: str | None = None,
        *,
        requested_by: str,
        reason: str,
        request_id: str | None = None,
        probes: Sequence[str] = (),
        block: bool = False,
    ) -> ErasureRequest:
        """Erase a subject (or one scope of it) and return the request.

        Suppression comes first: from the moment this call reaches the catalog, every
        read and write of the subject fails. Then keys are destroyed, partitions
        dropped, derived assets rebuilt, external processors called, everything
        verified and a signed receipt stored (``ks.erasure.receipt(request_id)``).
        Idempotent by ``request_id``; ``ks.erasure.resume`` continues a request that
        stopped (a crash, a failed step, a released legal hold). ``probes`` are
        synthetic strings that verification must not find anywhere afterwards.
        An erasure that finds nothing of the subject says so (``req.found_data`` is
        False, and so is the receipt's) and leaves the id free for later writes;
        ``block=True`` keeps it ``erased`` until re-admitted all the same.

        The request is recorded with its job (``keyshred.jobs``) and this call runs
        that job itself: a caller killed halfway leaves the job to any worker
        (``keyshred worker``); ``ks.erasure.submit`` records without running.
        """
        check_open(self._closed)
        with span("keyshred.erase") as erase_span:
            req = self.erasure.request(
                self._subject_ref(subject),
                scope,
                requested_by=requested_by,
                reason=reason,
                request_id=request_id,
                probes=probes,
                block=block,
                claim=True,
            )
            erase_span.set("keyshred.request_id", req.request_id)
            # Its job was leased to this call when it was recorded: no worker starts
            # it (and runs it without this call's probes) before we do.
            claimed = self._erasure.take_claimed(req.request_id)
            if claimed is not None:
                self._jobs.run(claimed, reraise=True)
                req = self.erasure.status(req.request_id)
                if req.state in _SETTLED:
                    erase_span.set("keyshred.state", req.state)
                    return req
            job_id = self._erasure.job_id(req.request_id)
            if job_id is not None and self._jobs.run_id(job_id, reraise=True) is not None:
                req = self.erasure.status(req.request_id)
                if req.state in _SETTLED:
                    erase_span.set("keyshred.state", req.state)
                    return req
            # No job to claim (a worker holds it, or the request predates jobs), or
            # another worker ran the request meanwhile: wait for it as run does.
            done = self.erasure.run(req.request_id)
            erase_span.set("keyshred.state", done.state)
            return done

    def _residue_scan(self, probes: Sequence[str], paths: Sequence[str | os.PathLike[str]]) -> Any:
        from keyshred.residue import residue_scan

        return residue_scan(self, probes, paths)

    def _open_restored(self, folder: Path, config: Config) -> Keyshred:
        """Open a folder ``ks.backup.restore`` is building: with the live embedding
        model (loaded only if a rebuild needs it) and the live producers, so derived
        data is rebuilt there as it would be here."""
        live = self._memories

        def embed(texts: list[str]) -> Any:
            return live.embedder.embed(texts)

        restored = Keyshred.open(folder, config, embeddings=embed)
        try:
            restored.derived.copy_producers(self.derived)
        except BaseException:
            restored.close()
            raise
        return restored

    @typed_method
    def destroy_kek_epochs_before(self, epoch: int, *, force: bool = False) -> list[DestroyedEpoch]:
        """Destroy live KEK epochs older than ``epoch``: ``EpochInUse`` while an
        unexpired backup generation is sealed under one, unless ``force`` (then
        audited, with the generations it breaks); see ``ks.backup``."""
        check_open(self._closed)
        return self._backup.destroy_kek_epochs_before(epoch, force=force)

    @classmethod
    def init(
        cls,
        path: str | os.PathLike[str],
        config: Config | None = None,
        *,
        exist_ok: bool = False,
        embeddings: Any = None,
    ) -> Keyshred:
        """Create a data folder: configuration, key folder (0700), KEK, key store.

        ``embeddings`` is the embedding function for indexed memories: a callable on
        a list of texts, a LangChain ``Embeddings``, or ``None`` for the bundled
        all-MiniLM-L6-v2 (``keyshred[embeddings]``), loaded in the background from
        the open on (the first embed waits for it)."""
        root = Path(path)
        # A keyshred.toml alone (written by an operator first) is not yet a folder.
        if (root / CONFIG_FILE).exists() and (root / KEYS_DIR).exists():
            if not exist_ok:
                raise ConfigError(f"{root} is already a keyshred folder")
            return cls.open(root, config, embeddings=embeddings)
        config = config or Config()
        _make_folder(root)
        ks = cls._assemble(root, config, create=True, embeddings=embeddings)
        try:
            save_config(root, config)
        except BaseException:
            ks.close()  # its threads and connections do not outlive a failed init
            raise
        return ks

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        config: Config | None = None,
        *,
        embeddings: Any = None,
    ) -> Keyshred:
        """Open an existing data folder (``ConfigError`` if it is not one)."""
        root = Path(path)
        if not (root / CONFIG_FILE).exists():
            raise ConfigError(
                f"{root} is not a keyshred folder: name the data folder (the CLI's "
                "--path/-p, or KEYSHRED_PATH), or create one with 'keyshred init PATH'"
            )
        return cls._assemble(root, config or load_config(root), create=False, embeddings=embeddings)

    @classmethod
    def _assemble(
        cls, root: Path, config: Config, *, create: bool, embeddings: Any = None
    ) -> Keyshred:
        with typed_errors():  # a driver error opening a damaged store: DatabaseError
            return cls._build(root, config, create=create, embeddings=embeddings)

    @classmethod
    def _build(
        cls, root: Path, config: Config, *, create: bool, embeddings: Any = None
    ) -> Keyshred:
        kek = trace_instance(make_kek(config, root, create=create), "kek", _TRACED_KEK)
        keyring = Keyring(
            make_keystore(config, root),
            kek,
            tenant=config.tenant,
            cache_max_entries=config.keyring.cache_max_entries,
            cache_ttl_seconds=config.keyring.cache_ttl_seconds,
            archive_kek=lambda: make_archive_kek(config, root),
        )
        url = config.storage.catalog_url or sqlite_url(root / CATALOG_DIR / CATALOG_FILE)
        try:
            catalog = Catalog(
                url,
                migrate=migrate_catalog,  # Alembic: created, or upgraded in place
                pool_size=config.storage.pool_size,
                max_overflow=config.storage.pool_max_overflow,
                pool_timeout=config.storage.pool_timeout_seconds,
                pre_ping=config.storage.pool_pre_ping,
                # Memory writes commit their hot rows here: "fsync" durability is
                # the catalog's commit surviving power loss.
                durable=config.storage.durability == "fsync",
            )
        except BaseException:
            keyring.close()
            raise
        return cls(root, config, keyring, catalog, embeddings=embeddings)

    @typed_method
    def export(
        self,
        subject: SubjectLike,
        dest: str | os.PathLike[str],
        *,
        passphrase: str | None = None,
        recipient_public_key: str | None = None,
        expires_in: timedelta = timedelta(days=7),
    ) -> ExportResult:
        """Write the subject's data (access / portability request) as a sealed,
        expiring package; see ``keyshred.export``."""
        check_open(self._closed)
        return export_subject(
            self,
            subject,
            dest,
            passphrase=passphrase,
            recipient_public_key=recipient_public_key,
            expires_in=expires_in,
        )

    @typed_method
    def open_export(
        self,
        package: bytes,
        *,
        passphrase: str | None = None,
        private_key: str | None = None,
    ) -> dict[str, Any]:
        """Open an export package issued here (before its expiry, while the subject
        is not erased); returns its files, parsed."""
        check_open(self._closed)
        return open_export(self, package, passphrase=passphrase, private_key=private_key)

    @typed_method
    def subject_ref(self, subject: SubjectLike) -> str:
        """The pseudonymous reference that stands for ``subject`` everywhere."""
        check_open(self._closed)
        return self._subject_ref(subject)

    def _subject_ref(self, subject: SubjectLike) -> str:
        # The components' own entry (every put, sanitize): they checked the handle.
        if type(subject) is str:  # the hot case: no Subject built
            if subject in RESERVED_IDS:
                check_not_reserved(subject)
            return self._keyring.subject_ref(subject, self.config.tenant)
        s: Subject = as_subject(subject, self.config.tenant)
        if type(s) is not OwnSubject and s.id in RESERVED_IDS:
            check_not_reserved(s.id)
        return self._keyring.subject_ref(s.id, s.tenant)

    @typed_method
    def receipts_jwks(self) -> dict[str, list[dict[str, str]]]:
        """The receipt signing keys as a JWK Set (RFC 7517): one OKP/Ed25519 JWK
        (``kid`` its RFC 7638 thumbprint, ``use: sig``, ``alg: EdDSA``) for every
        key that signed a receipt this store keeps, the current one last. Public
        halves only; publish it wherever verifiers fetch keys from."""
        check_open(self._closed)
        return jwks(self._keyring.signing_public_keys())

    @typed_method
    def deletion_epoch(self, subject: SubjectLike) -> int:
        """The subject's current deletion epoch; jobs carry it into their writes
        (``epoch=``) so that a write planned before an erasure is refused after it."""
        check_open(self._closed)
        return self._catalog.check_guard(self._subject_ref(subject))

    @typed_method
    def close(self, *, flush: bool = True) -> None:
        """Close; ``flush=False`` leaves logged writes in their logs (still durable).
        Every later call on this handle raises ``HandleClosed``; closing again is a
        no-op."""
        if self._closed:
            return
        self._closed = True
        # Jobs running in this process's threads (run_pending, a worker's
        # --concurrency) stop at their next step and go back to the queue; the
        # components close once they have (or after a lease's length: a step that
        # long is left to its lease, which another worker takes over).
        self._jobs.drain(self.config.jobs.lease_seconds)
        # Every close runs even if one before it fails (a vault flush on a cut
        # database); the last error raised propagates, earlier ones as its
        # context. Last in, first run: vault, memories, backup, vectors, catalog,
        # keyring.
        with contextlib.ExitStack() as closes:
            closes.callback(self._keyring.close)
            closes.callback(self._catalog.close)
            closes.callback(self._eviction.close)  # its thread uses the catalog
            # Decrypted vectors must not outlive the handle (the cache answers a
            # search without any key).
            closes.callback(self._vectors.evict)
            closes.callback(self._backup.close)
            closes.callback(self._memories.close, flush=flush)
            closes.callback(self._vault.close)

    def __enter__(self) -> Keyshred:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Keyshred(path={str(self.path)!r}, profile={self.config.profile!r})"


def _sqlite_folders(root: Path, catalog: Catalog) -> list[Path]:
    """Folders of the SQLite databases (key store, embedded catalog): where a
    "disk I/O error" may mean a full disk (``keyshred._handle``)."""
    folders = [root / KEYS_DIR]
    database = db.sqlite_file(catalog.engine.url)
    if database is not None:
        folders.append(Path(database).parent)
    return folders


def _make_folder(root: Path) -> None:
    """Create the data folder and its key folder (0700); a path that cannot hold
    one (a file, a read-only or virtual file system) is a ``ConfigError``."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        (root / KEYS_DIR).mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create a keyshred folder at {root}: {exc.strerror or type(exc).__name__}"
        ) from None
