"""Subject export (access and portability requests): ``ks.export`` / ``keyshred export``.

One consistent point in time: the subject's partition lock is held (no write of the
subject can land) while the memories are read and the catalog is read in one
transaction (``REPEATABLE READ`` on PostgreSQL). The package holds:

- ``manifest.json``: the stores read, counts, the snapshot point (time and audit
  sequence), the expiry;
- ``memories.json``: every memory of the subject (namespace, key, value, scope,
  purpose, category, times, retention; derived ones marked with their kind and
  provenance), correction history included;
- ``threads.json``: the subject's agent threads (``KeyshredSaver``): each thread's
  id, scope and creation time, and every checkpoint with its metadata and pending
  writes, decoded to JSON by LangGraph's default serializer (a value it cannot
  decode, written by a custom or encrypting ``serde``, is given as its serializer's
  type name and base64 bytes);
- ``mentions.json``: ids and kinds of other subjects' assets that mention the
  subject — not their content, which is other people's data;
- ``tokens.json``: each token's kind, purpose, creation and expiry (no values);
- ``consents.json``: consent records with their history and policy versions;
- ``audit.json``: the audit references about the subject (sequence, time, event,
  request id, hash).

The package is sealed (``keyshred.keyring.package``) to a passphrase or an X25519
public key *and* to a DEK of the subject made for this export; it is a registered
asset (kind ``export``) that expires. Erasing the subject, or the retention run after
the expiry, destroys that DEK: every copy of the package is unreadable from then on.
The package holds memories about other subjects too (one that mentions someone, a
summary built from someone else's data): its DEK is owned by every subject any
exported memory's key is owned by, so erasing any of them makes it unreadable as well.
"""

from __future__ import annotations

import base64
import io
import json
import os
import uuid
import zipfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from keyshred._validate import check_text
from keyshred.errors import (
    IntegrityError,
    InvalidInput,
    KeyNotFound,
    SubjectErased,
    TokenExpired,
)
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.package import open_package, read_header, seal_package
from keyshred.schema import audit_events
from keyshred.storage import faults
from keyshred.storage.catalog import AssetRow, Catalog
from keyshred.storage.checkpoints import unpack
from keyshred.storage.erasable import DROP, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.storage.partition import row_key_id
from keyshred.storage.schema import asset_mentions, assets
from keyshred.vault.schema import tokens

if TYPE_CHECKING:
    from keyshred.audit import AuditLog
    from keyshred.storage.checkpoints import CheckpointStore, ExportedThread
    from keyshred.storage.memories import MemoryStore
    from keyshred.vault.tokens import TokenVault


class Keyshred(Protocol):
    """What exports need of an open data folder (an open ``keyshred.Keyshred`` is
    one): services never import the facade."""

    @property
    def catalog(self) -> Catalog: ...

    @property
    def keyring(self) -> Keyring: ...

    @property
    def memories(self) -> MemoryStore: ...

    @property
    def vault(self) -> TokenVault: ...

    @property
    def audit(self) -> AuditLog: ...

    @property
    def checkpoints(self) -> CheckpointStore: ...

    def subject_ref(self, subject: Any) -> str: ...


__all__ = ["ExportResult", "ExportStore", "export_subject", "open_export"]

EXPORT_KIND = "export"
_LABEL = b"subject-export"


@dataclass(frozen=True)
class ExportResult:
    export_id: str
    path: str
    expires_at: datetime
    counts: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {
            "export_id": self.export_id,
            "path": self.path,
            "expires_at": self.expires_at.isoformat(),
            "counts": self.counts,
        }


def _iso(value: Any) -> Any:
    """A time as ISO 8601 with its offset (SQLite hands the catalog's UTC times back
    without one)."""
    if not isinstance(value, datetime):
        return value
    return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).isoformat()


def _json_bytes(data: Any) -> bytes:
    """UTF-8 JSON; text UTF-8 cannot carry (a lone surrogate an application's serde
    stored) is written as JSON's escapes instead, not refused."""
    try:
        return json.dumps(data, ensure_ascii=False, indent=1, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(data, ensure_ascii=True, indent=1, default=str).encode("ascii")


def _threads(exported: list[ExportedThread]) -> list[dict[str, Any]]:
    return [
        {
            "thread_id": t.thread_id,
            "scope": t.scope,
            "created_at": _iso(t.created_at),
            "checkpoints": [
                {
                    "checkpoint_ns": row.checkpoint_ns,
                    "checkpoint_id": row.checkpoint_id,
                    "parent_checkpoint_id": row.parent_checkpoint_id,
                    **dict(zip(("checkpoint", "metadata"), _decoded(row.data), strict=False)),
                    "pending_writes": [
                        {
                            "task_id": w.task_id,
                            "task_path": w.task_path,
                            "channel": w.channel,
                            "value": next(iter(_decoded(w.data)), None),
                        }
                        for w in writes
                    ],
                }
                for row, writes in t.checkpoints
            ],
        }
        for t in exported
    ]


def _decoded(packed: bytes) -> list[Any]:
    """The values of a checkpoint row (checkpoint, metadata) or a write row (its
    value) as the saver packed them, ``(type name, bytes)`` each: decoded by
    LangGraph's default serializer when it can, as JSON; else (a custom or
    encrypting ``serde``, or LangGraph not installed) the type name and the bytes,
    base64: the subject gets everything stored, readable where we can read it."""
    parts = unpack(packed)
    serde = _serde()
    out = []
    for type_name, data in zip(parts[::2], parts[1::2], strict=False):
        name = type_name.decode("utf-8", "replace")
        value = _loaded(serde, name, data)
        out.append(
            value
            if value is not _UNREAD
            else {"serialized_as": name, "base64": base64.b64encode(data).decode("ascii")}
        )
    return out


_UNREAD = object()


def _loaded(serde: Any, name: str, data: bytes) -> Any:
    if serde is None:
        return _UNREAD
    try:
        return _jsonable(serde.loads_typed((name, data)))
    except Exception:  # noqa: BLE001 - a type only the app's own serde reads
        return _UNREAD


def _serde() -> Any:
    try:
        from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
    except ImportError:
        return None
    return JsonPlusSerializer()


def _jsonable(value: Any) -> Any:
    """A decoded checkpoint value as JSON: LangChain objects (messages) in their own
    serialized form (``to_json``), pydantic models dumped, bytes as base64, the
    rest as text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        if all(type(k) is str for k in value):
            return {k: _jsonable(v) for k, v in value.items()}
        # Keys JSON cannot hold as they are (1 and "1" would collide): as pairs.
        return {"pairs": [[_jsonable(k), _jsonable(v)] for k, v in value.items()]}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, datetime):
        return value.isoformat()
    for method, args in (("to_json", {}), ("model_dump", {"mode": "json"})):
        dump = getattr(value, method, None)
        if callable(dump):
            try:
                return _jsonable(dump(**args))
            except Exception:  # noqa: BLE001, S112 - not that kind of object after all
                continue
    return str(value)


def _check_export_args(dest: Any, passphrase: Any, recipient_public_key: Any) -> None:
    if isinstance(dest, str):
        check_text(dest, "an export destination")
    elif not isinstance(dest, os.PathLike):
        raise InvalidInput("an export destination is a file path")
    for secret, what in ((passphrase, "a passphrase"), (recipient_public_key, "a public key")):
        if secret is not None:
            check_text(secret, what)


def export_subject(
    ks: Keyshred,
    subject: Any,
    dest: str | os.PathLike[str],
    *,
    passphrase: str | None = None,
    recipient_public_key: str | None = None,
    expires_in: timedelta = timedelta(days=7),
) -> ExportResult:
    """Write the subject's export package to ``dest``; see the module docstring."""
    _check_export_args(dest, passphrase, recipient_public_key)
    if not isinstance(expires_in, timedelta):
        raise InvalidInput("expires_in is a timedelta")
    if expires_in <= timedelta(0) or expires_in > timedelta(days=90):
        raise InvalidInput("an export expires within 1 second to 90 days")
    ref = ks.subject_ref(subject)
    ks.catalog.check_guard(ref)  # an erased or suppressed subject is refused early
    ks.vault.flush()  # tokens held for group commit are the subject's too
    export_id = uuid.uuid4().hex
    now = datetime.now(UTC)
    expires_at = now + expires_in
    files: dict[str, Any] = {}
    with ks.memories.locked(ref):
        rows = ks.memories.live_rows(ref)
        conn = ks.catalog.engine.connect()
        if ks.catalog.dialect == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        try:
            with conn.begin():
                kinds = {
                    str(a): (str(k), p, v)
                    for a, k, p, v in conn.execute(
                        sa.select(
                            assets.c.asset_id,
                            assets.c.kind,
                            assets.c.producer,
                            assets.c.producer_version,
                        ).where(assets.c.subject_ref == ref)
                    )
                }
                mentions = [
                    {"asset_id": str(a), "kind": str(k)}
                    for a, k in conn.execute(
                        sa.select(assets.c.asset_id, assets.c.kind)
                        .join(asset_mentions, asset_mentions.c.asset_id == assets.c.asset_id)
                        .where(asset_mentions.c.subject_ref == ref, assets.c.subject_ref != ref)
                    )
                ]
                token_rows = [
                    {
                        "kind": str(r.kind),
                        "purpose": str(r.purpose),
                        "scope": str(r.scope),
                        "deterministic": bool(r.deterministic),
                        "created_at": _iso(r.created_at),
                        "expires_at": _iso(r.expires_at),
                    }
                    for r in conn.execute(
                        sa.select(
                            tokens.c.kind,
                            tokens.c.purpose,
                            tokens.c.scope,
                            tokens.c.deterministic,
                            tokens.c.created_at,
                            tokens.c.expires_at,
                        ).where(tokens.c.subject_ref == ref)
                    )
                ]
                audit = [
                    {
                        "seq": int(r.seq),
                        "at": _iso(r.at),
                        "event": str(r.event),
                        "request_id": r.request_id,
                        "hash": str(r.hash),
                    }
                    for r in conn.execute(
                        sa.select(
                            audit_events.c.seq,
                            audit_events.c.at,
                            audit_events.c.event,
                            audit_events.c.request_id,
                            audit_events.c.hash,
                        )
                        .where(audit_events.c.subject_ref == ref)
                        .order_by(audit_events.c.seq)
                    )
                ]
                high = conn.execute(sa.select(sa.func.max(audit_events.c.seq))).scalar()
                exported = ks.checkpoints.exported(conn, ref)
        finally:
            conn.close()
    memories = []
    for r in sorted(rows, key=lambda r: (r.namespace, r.key)):
        kind, producer, version = kinds.get(r.memory_id, ("memory", None, None))
        memories.append(
            {
                "memory_id": r.memory_id,
                "namespace": list(r.namespace),
                "key": r.key,
                "value": json.loads(r.value),
                "scope": r.scope,
                "purpose": r.purpose,
                "category": r.category,
                "kind": kind,
                "producer": producer,
                "producer_version": version,
                "sources": list(r.sources),
                # Who else the memory is about (subject_refs): provenance, kept.
                "mentions": list(r.mentions),
                "created_at": _iso(datetime.fromtimestamp(r.created_us / 1e6, UTC)),
                "updated_at": _iso(datetime.fromtimestamp(r.updated_us / 1e6, UTC)),
                "retain_until": _iso(datetime.fromtimestamp(r.retain_us / 1e6, UTC)),
            }
        )
    consents = [
        {
            "purpose": c.purpose,
            "category": c.category,
            "actions": list(c.actions),
            "start_at": _iso(c.start_at),
            "end_at": _iso(c.end_at),
            "policy_version": c.policy_version,
            "status": c.status,
            "revoked_at": _iso(c.revoked_at),
        }
        for c in ks.catalog.consents(ref)
    ]
    thread_files = _threads(exported)
    counts = {
        "memories": len(memories),
        "derived": sum(1 for m in memories if str(m["kind"]).startswith("derived:")),
        "mentions_by_others": len(mentions),
        "tokens": len(token_rows),
        "consents": len(consents),
        "audit_events": len(audit),
        "threads": len(thread_files),
        "checkpoints": sum(len(t["checkpoints"]) for t in thread_files),
    }
    files["manifest.json"] = {
        "format": "keyshred-export/1",
        "export_id": export_id,
        "subject_ref": ref,
        "snapshot_at": now.isoformat(),
        "audit_seq_high_water": high,
        "expires_at": expires_at.isoformat(),
        "stores_read": [
            "memories",
            "catalog.assets",
            "catalog.tokens",
            "catalog.consents",
            "catalog.audit",
            "catalog.checkpoints",
        ],
        "counts": counts,
    }
    files["memories.json"] = memories
    files["threads.json"] = thread_files
    files["mentions.json"] = mentions
    files["tokens.json"] = token_rows
    files["consents.json"] = consents
    files["audit.json"] = audit
    content = io.BytesIO()
    with zipfile.ZipFile(content, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, _json_bytes(data))
    scope = f"~export:{export_id}"
    # Every subject an exported memory or checkpoint is about owns the package's
    # key: read from the owner sets of the rows' keys (the holder's own rows have
    # none).
    row_keys = {k for k in (row_key_id(r) for r in rows) if k is not None}
    row_keys.update(kid for t in exported for kid in t.key_ids)
    owners = sorted({o for others in ks.keyring.owners_of(row_keys).values() for o in others})
    subject_key = ks.keyring.data_key(ref, scope, owners=owners).derive(_LABEL)
    package = seal_package(
        content.getvalue(),
        export_id=export_id,
        subject_ref=ref,
        key_scope=scope,
        subject_key=subject_key,
        expires_at=expires_at,
        passphrase=passphrase,
        recipient_public_key=recipient_public_key,
    )
    out = Path(dest)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise InvalidInput(f"{out} exists: an export never overwrites a file") from None
    with os.fdopen(fd, "wb") as f:
        f.write(package)
    ks.catalog.register(
        [
            AssetRow(
                asset_id=export_id,
                subject_ref=ref,
                scope=scope,
                kind=EXPORT_KIND,
                storage_system="file",
                storage_key="export-package",
                purpose="subject-access",
                category="export",
                created_at=now,
                retain_until=expires_at,
            )
        ],
        replace=False,
    )
    ks.audit.record(
        "subject.exported", subject_ref=ref, export_id=export_id, memories=counts["memories"]
    )
    return ExportResult(export_id, str(out), expires_at, counts)


def open_export(
    ks: Keyshred,
    package: bytes,
    *,
    passphrase: str | None = None,
    private_key: str | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The package's files (name -> parsed JSON). Refused after the expiry
    (``TokenExpired``), for an erased subject (``SubjectErased``/``SubjectSuppressed``),
    or if anything was altered (``IntegrityError``)."""
    head = read_header(package)
    if (now or datetime.now(UTC)) >= head.expires_at:
        raise TokenExpired(f"export {head.export_id} expired at {head.expires_at.isoformat()}")
    if not head.key_scope.startswith("~export:"):
        raise IntegrityError("the package names a key that is not an export key")
    ks.catalog.check_guard(head.subject_ref)
    gone = SubjectErased(f"export {head.export_id} can no longer be opened")
    # The export's one key, whatever its owner set (the package does not name it).
    records = ks.keyring.store.for_subject(head.subject_ref, head.key_scope)
    if not records:
        # Issued here (still catalogued: its key went with a co-owner's erasure), or
        # its key destroyed by the subject's erasure or its expiry: gone. Else never ours.
        if ks.catalog.asset(head.export_id) is not None or ks.keyring.store.is_tombstoned(
            head.subject_ref, head.key_scope
        ):
            raise gone
        raise KeyNotFound(f"no key for export {head.export_id}")
    try:
        key = ks.keyring.data_key_by_id(records[0].key_id)
    except SubjectErased:
        raise gone from None
    content = open_package(
        package,
        subject_key=key.derive(_LABEL),
        passphrase=passphrase,
        private_key=private_key,
    )
    with zipfile.ZipFile(io.BytesIO(content)) as zf:
        return {name: json.loads(zf.read(name)) for name in zf.namelist()}


def expire_exports(ks: Keyshred, now: datetime) -> int:
    """Destroy the keys of exports past their expiry (the retention run calls it)."""
    n = 0
    for ref, ids in ks.catalog.expired(EXPORT_KIND, now).items():
        for export_id in ids:
            ks.keyring.destroy(ref, f"~export:{export_id}")
            n += 1
        ks.catalog.delete(ids)
    return n


class ExportStore:
    """Issued export packages as an erasable store (``keyshred.storage.erasable``).

    The packages themselves are with their recipients: what makes every copy
    unreadable is the export DEK (key scope ``~export:<id>``), destroyed with the
    subject's keys, and the registered ``export`` asset leaves with the subject's
    other catalog rows. ``erase`` counts the packages so made unreadable (the
    receipt says how many); ``verify`` checks that no export key or record is
    left. A scope erasure leaves exports alone (a package is of the whole subject:
    its key is co-owned by every subject its memories are about)."""

    name = "exports"
    phase: Phase = DROP

    def __init__(self, catalog: Catalog, keyring: Keyring) -> None:
        self._catalog = catalog
        self._keyring = keyring

    def erase(self, target: ErasureTarget) -> StoreErasure:
        n = 0
        if target.whole_subject:
            kinds = self._catalog.asset_kinds(target.subject_ref)
            n = sum(1 for kind in kinds.values() if kind == EXPORT_KIND)
        faults.reached("erase.exports")
        return StoreErasure(self.name, "packages-unreadable", n, datetime.now(UTC), found=n > 0)

    def verify(self, target: ErasureTarget) -> list[StoreCheck]:
        if not target.whole_subject:
            return []
        ref = target.subject_ref
        keys = [r for r in self._keyring.store.for_subject(ref) if r.scope.startswith("~export:")]
        records = self._catalog.assets(ref, kind=EXPORT_KIND)
        return [
            StoreCheck(
                "export packages unreadable",
                not keys and not records,
                f"{len(keys)} export keys, {len(records)} export records left",
            )
        ]

    def evict(self, subject_ref: str) -> None:
        """Nothing to drop: no package or export key is kept in this process (the
        keyring's cache is cleared by the key destruction)."""
        del subject_ref
