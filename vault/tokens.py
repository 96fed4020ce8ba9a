"""Tokens: personal values replaced by purpose-bound, expiring references.

``sanitize(text, subject, purpose, ttl)`` replaces every detected value with a token
such as ``<PHONE_7f3a12c9ab>``. The value is sealed under the subject's scope key and
bound to the token (a ciphertext moved to another token fails), the token is an
asset in the catalog, and it resolves only

- with the purpose it was issued for,
- before it expires,
- while its subject is neither suppressed nor erased.

Every resolution and every refusal is an audit event that names the token, the
purpose, the caller and the outcome, never the value. Deterministic mode (same value,
subject and purpose → same token, keyed by a key derived from the subject's DEK)
allows joins across texts; random mode is the default. Erasure removes a subject's
tokens and their keys, so they resolve for nobody again.

A value that is a registered identifier of other subjects (``ks.subjects``, found by
``keyshred.storage.mentions``) is sealed instead under the key the subject shares
with them (``keyring.data_key(subject, scope, owners=...)``), as a memory or an agent
thread about them is: the erasure of any of them destroys that key, and the token
then resolves for nobody (``UnknownToken``). Resolution reads the key id from the
ciphertext, so nothing else changes for live owners. A deterministic value of a
shared key has its lookup under that key, so it never reuses the scope key's token
of the same value. A text holding an identifier of a subject being erased is
refused (``SubjectSuppressed``) like a memory about them.

Token rows are the token assets: ``ks_tokens`` holds every field an asset has
(subject_ref, scope, purpose, expiry as retain-until; tokens derive from nothing), and
the catalog lists them as assets of kind ``token``; there is no second row per token.

A token's 10 hex digits are its row number enciphered with FF1 under a keyring
secret (``keyshred.keyring.tokenid``). Numbers come from blocks of 1,024 that each
process takes from the catalog, so two tokens never share an id and nothing has to be
looked up before a token goes out; ids show no order and are as hard to guess as
random ones; resolution deciphers the id and reads the row by primary key, and a row
whose token differs (the same digits under another kind) is a forgery. A
deterministic token is found by ``lookup``: the value's HMAC under a key derived from
the subject's DEK and the purpose.

Group commit (``tokens.group_commit_ms > 0``, the embedded default): ``sanitize``
journals its sealed rows (``keyshred.vault.journal``: a copy into a file of this
process mapped into memory, which a crash of the process does not lose) and returns;
the rows are written many texts per transaction within that many milliseconds (by
the caller that finds the interval over, or by a background flusher when calls
stop). They resolve at once in this process (from the held rows), and another
process that meets one before the flush waits for it, up to the interval
(``ks_token_blocks`` records each block's interval; a number whose block's next
stored number is older than that cannot be pending, and a forged one or one issued
per call is refused without waiting). The flush re-checks each subject's guard in
its transaction, so a subject suppressed meanwhile has its held tokens dropped,
never stored; an erasure drops them too. The journal of a process that died is
replayed by the next vault that opens the folder (``recover``), under the same
guard rules.

A background flush that fails is retried at the next interval (the rows stay held
and journaled); each failure is counted (``on_flush_failure``: the metrics counter),
logged with the exception's type only (a message could quote a row), audited once
per run of failures, and shown by ``status()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa

from keyshred._validate import check_text, check_text_size
from keyshred.errors import (
    IntegrityError,
    InvalidInput,
    KeyNotFound,
    SubjectErased,
    SubjectSuppressed,
    TokenError,
    TokenExpired,
    TokenPurposeMismatch,
    TokenSubjectMismatch,
    UnknownToken,
)
from keyshred.keyring import _primitives as prim
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import Place, PlaceTemplate, key_id_of
from keyshred.keyring.keyring import Keyring
from keyshred.storage import faults
from keyshred.storage.catalog import TOKEN_BLOCK, TOKEN_COLUMNS, Catalog, micros, tokens
from keyshred.storage.erasable import DROP, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.vault.detect import KINDS, Finding, Recognizer, default_spans, detect
from keyshred.vault.journal import Segment, TokenJournal, encode

if TYPE_CHECKING:  # storage.mentions imports the vault's detector
    from keyshred.storage.mentions import MentionFinder

__all__ = ["TOKEN_RE", "Sanitized", "TokenVault", "VaultStatus"]


@dataclass(frozen=True, slots=True)
class _Value:
    """A token's value as the mention finder reads an item (``scope=None``: no
    declared scope, always looked up)."""

    value: str
    scope: None = None
    namespace: tuple[str, ...] = ()
    key: str = ""


class _Row:
    """A pending token row with the attribute access of a result row."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


class _Held:
    """Token rows held for group commit: one generation. The vault fills one while
    a flush stores the one before, and both resolve; a flush takes a generation
    whole, so nothing is done row by row on the way out."""

    __slots__ = ("epochs", "guards", "lookups", "rows", "tokens")

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []  # in issue order (ks_tokens columns)
        self.epochs: list[int] = []  # each row's guard epoch when it was issued
        self.guards: set[tuple[str, str, int]] = set()  # (subject_ref, scope, epoch)
        self.tokens: dict[str, tuple[Any, ...]] = {}  # token -> row
        # (subject_ref, scope, purpose, lookup) -> token, of deterministic rows
        self.lookups: dict[tuple[str, str, str, bytes], str] = {}

    def add(self, epoch: int, rows: list[tuple[Any, ...]]) -> None:
        """The rows of one call (one subject, scope, purpose and mode)."""
        first = rows[0]
        self.rows += rows
        self.epochs += [epoch] * len(rows)
        self.guards.add((first[2], first[3], epoch))
        tokens = self.tokens
        for row in rows:
            tokens[row[1]] = row
        if first[6]:
            for row in rows:
                self.lookups[(row[2], row[3], row[5], row[7])] = row[1]

    def extend(self, later: _Held) -> None:
        """Append a later generation (a failed flush's rows go back in front)."""
        self.rows += later.rows
        self.epochs += later.epochs
        self.guards |= later.guards
        self.tokens.update(later.tokens)
        self.lookups.update(later.lookups)

    def drop(self, subject_ref: str, scope: str | None) -> int:
        """Forget the rows of a subject (or one scope of it); returns how many."""
        kept = [
            (epoch, row)
            for epoch, row in zip(self.epochs, self.rows, strict=True)
            if row[2] != subject_ref or (scope is not None and row[3] != scope)
        ]
        dropped = len(self.rows) - len(kept)
        if dropped:
            self.rows = [row for _, row in kept]
            self.epochs = [epoch for epoch, _ in kept]
            self.guards = {(row[2], row[3], epoch) for epoch, row in kept}
            self.tokens = {row[1]: row for row in self.rows}
            self.lookups = {k: t for k, t in self.lookups.items() if t in self.tokens}
        return dropped


TOKEN_RE = re.compile(r"<([A-Z][A-Z0-9_]{0,30})_([0-9a-f]{10})>")
_PURPOSE = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
# ``_sanitize`` builds token rows as tuples in the catalog's column order.
_ROW = (
    "number",
    "token",
    "subject_ref",
    "scope",
    "kind",
    "purpose",
    "deterministic",
    "lookup",
    "created_at",
    "expires_at",
    "value",
)
if _ROW != TOKEN_COLUMNS:  # pragma: no cover - a schema edit
    raise ImportError("keyshred.vault.tokens does not match the ks_tokens columns")


@functools.lru_cache(maxsize=1024)
def _kind_name(kind: str) -> str:
    """A finding's kind as it appears in a token (``<PHONE_…>``)."""
    return re.sub(r"[^A-Z0-9_]", "_", kind.upper())[:30] or "PII"


def _start(span: tuple[Any, ...]) -> int:
    return int(span[2])


_KIND_NAMES = {kind: kind for kind in KINDS}  # the default kinds are token-ready


@functools.lru_cache(maxsize=4096)
def _templates(subject_ref: str, scope: str) -> PlaceTemplate:
    return PlaceTemplate(subject_ref, scope, "tokens", "value")


def _seal(
    key: DataKey,
    keys: list[DataKey] | None,
    items: list[tuple[str, bytes]],
    template: PlaceTemplate,
) -> list[bytes]:
    """Seal ``items`` under ``key``, or each under its own of ``keys`` (one
    ``seal_rows`` per key, results in the items' order)."""
    if keys is None:
        return key.seal_rows(items, template)
    groups: dict[bytes, tuple[DataKey, list[int]]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k.key_id, (k, []))[1].append(i)
    out: list[bytes] = [b""] * len(items)
    for k, at in groups.values():
        for i, ct in zip(at, k.seal_rows([items[i] for i in at], template), strict=True):
            out[i] = ct
    return out


class Sanitized(NamedTuple):
    """The sanitized text and the tokens it carries (never the values)."""

    text: str
    tokens: tuple[str, ...]

    def __repr__(self) -> str:
        return f"Sanitized(tokens={len(self.tokens)})"


def _sanitized(fields: tuple[str, tuple[str, ...]]) -> Sanitized:
    # Without the named tuple's Python-level __new__ (one per sanitized text).
    return tuple.__new__(Sanitized, fields)


def _utcnow() -> datetime:
    return datetime.now(UTC)


_ZERO = timedelta(0)
_TEXT_LIMIT = "tokens.max_text_bytes"
_MICROSECOND = timedelta(microseconds=1)
# Beyond another process's group-commit interval: the time its flush may take.
_PENDING_SLACK = 0.5
_valid_purposes: set[str] = set()  # purposes checked once already (a hot-path cache)
_VAULTS: weakref.WeakSet[TokenVault] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for vault in list(_VAULTS):
        vault._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


_log = logging.getLogger("keyshred.vault")


@dataclass(frozen=True)
class VaultStatus:
    """``ks.vault.status()``: group commit's state in this process."""

    group_commit_ms: float
    pending: int  # rows issued, not stored yet
    flush_failures: int  # background flushes that failed (each retried)
    consecutive_failures: int  # since the last flush that succeeded
    last_failure_at: datetime | None
    last_failure: str | None  # the exception's type name, never its message

    def as_dict(self) -> dict[str, Any]:
        return {
            k: v.isoformat() if isinstance(v, datetime) else v for k, v in self.__dict__.items()
        }


def _check_resolve(text: Any, purpose: Any) -> None:
    """``detokenize``/``restore`` arguments: a token or a text, and a purpose (one
    that matches no token is refused and audited later, like any mismatch)."""
    check_text(text, "a token or text")
    check_text(purpose, "a purpose")


def _check_purpose(purpose: str) -> str:
    if not isinstance(purpose, str) or not _PURPOSE.fullmatch(purpose):
        raise InvalidInput("a purpose is 1-128 characters of letters, digits and ._:/-")
    return purpose


class TokenVault:
    """``ks.vault``."""

    def __init__(
        self,
        catalog: Catalog,
        keyring: Keyring,
        subject_ref: Callable[[Any], str],
        audit: Any,
        *,
        recognizers: Sequence[Recognizer] | None = None,
        clock: Callable[[], datetime] = _utcnow,
        group_commit_ms: float = 0.0,
        journal: Path | None = None,
        first_key: Callable[[str, str, str | None], DataKey],
        on_flush_failure: Callable[[], None] | None = None,
        max_text_bytes: int = 1024 * 1024,
        mentions: MentionFinder | None = None,
    ) -> None:
        self._max_text = max_text_bytes
        # A value that is another subject's registered identifier is sealed under
        # the key the holder shares with that subject, so the token dies with either.
        self._mentions = mentions
        self._catalog = catalog
        # Makes a subject's first key safely against a racing erasure
        # (``MemoryStore.first_key``).
        self._first_key = first_key
        self._keyring = keyring
        self._ref = subject_ref
        self._audit = audit
        self._recognizers = recognizers
        self._clock = clock
        self._group = max(0.0, group_commit_ms) / 1000.0
        # Group commit: the rows being held, and the ones a flush is storing.
        self._held = _Held()
        self._storing = _Held()
        catalog.token_number = self.number_of
        catalog.flush_tokens = self.flush
        self._free: list[tuple[int, str]] = []  # (number, id), taken from the end
        self._own_blocks: set[int] = set()  # blocks of numbers this vault took
        self._numbers_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._flushed_at = self._issued_at = time.monotonic()
        self._on_flush_failure = on_flush_failure
        self._failures = self._failing = 0
        self._failed_at: datetime | None = None
        self._failure: str | None = None
        # Group commit journals every held row (``keyshred.vault.journal``); the
        # folder also holds what dead processes left, stored here and now.
        self._journal = None if journal is None else TokenJournal(journal)
        self._detached: list[Segment] = []  # segments whose rows a flush has taken
        _VAULTS.add(self)
        self._recover_quietly()

    # -- issuing -------------------------------------------------------------------

    def sanitize(
        self,
        text: str,
        subject: Any,
        purpose: str,
        ttl: timedelta,
        *,
        scope: str = "default",
        deterministic: bool = False,
        findings: Iterable[Finding] | None = None,
    ) -> Sanitized:
        """Replace every personal value in ``text`` with a token of ``subject``."""
        found = None if findings is None else [list(findings)]
        return self._sanitize(
            [text], subject, purpose, ttl, scope=scope, deterministic=deterministic, findings=found
        )[0]

    def sanitize_many(
        self,
        texts: Sequence[str],
        subject: Any,
        purpose: str,
        ttl: timedelta,
        *,
        scope: str = "default",
        deterministic: bool = False,
    ) -> list[Sanitized]:
        """``sanitize`` for several texts of one subject (a conversation, a batch of
        log lines): every token is stored in one transaction."""
        if isinstance(texts, str) or not isinstance(texts, Iterable):
            raise InvalidInput("sanitize_many takes a list of strings")
        return self._sanitize(
            list(texts), subject, purpose, ttl, scope=scope, deterministic=deterministic
        )

    def _sanitize(
        self,
        texts: list[str],
        subject: Any,
        purpose: str,
        ttl: timedelta,
        *,
        scope: str,
        deterministic: bool,
        findings: list[list[Finding]] | None = None,
    ) -> list[Sanitized]:
        for text in texts:
            check_text_size(check_text(text, "a text to sanitize"), self._max_text, _TEXT_LIMIT)
        if type(purpose) is not str or purpose not in _valid_purposes:
            _check_purpose(purpose)
            if len(_valid_purposes) < 1024:
                _valid_purposes.add(purpose)
        if not isinstance(ttl, timedelta) or ttl <= _ZERO:
            raise InvalidInput("a token's ttl is a positive timedelta")
        check_text(scope, "a scope")
        # Per text, its findings as (_, _, start, end, kind, value) tuples in text
        # order: the default detector's own (no Finding built), or converted.
        if findings is None and self._recognizers is None:
            spans = [default_spans(text) for text in texts]
        else:
            if findings is None:
                findings = [detect(text, self._recognizers) for text in texts]
            spans = [
                [(0, 0, f.start, f.end, f.kind, text[f.start : f.end]) for f in found]
                for text, found in zip(texts, findings, strict=True)
            ]
            for found in spans:
                found.sort(key=_start)
        ref = self._ref(subject)
        epoch = self._catalog.check_guard(ref, scope=scope)
        count = sum(map(len, spans))
        if not count:
            return [Sanitized(text, ()) for text in texts]
        clock = self._clock
        created = time.time_ns() // 1000 if clock is _utcnow else micros(clock())
        expires = created + ttl // _MICROSECOND
        key = self._key(ref, scope)
        # Per finding (flat), its sealing key when some value is another subject's
        # registered identifier; None (the usual case) when every one is the scope key.
        keys = self._value_keys(ref, scope, key, spans)
        names = _KIND_NAMES
        issued: list[str] | None = None  # deterministic: every finding's token, given
        fresh: list[tuple[int, int, bytes | None]] = []  # (finding, number, lookup) to store
        if deterministic:
            kinds = [names.get(c[4]) or _kind_name(c[4]) for found in spans for c in found]
            values = [c[5].encode() for found in spans for c in found]
            issued, fresh = self._deterministic(
                key, ref, scope, purpose, kinds=kinds, values=values, keys=keys
            )
        else:
            numbers = self._numbers(count)
        # One pass over the findings: the texts, and (random mode) the new tokens.
        results: list[Sanitized] = []
        items: list[tuple[str, bytes]] = []  # (token, value) to seal, random mode
        meta: list[tuple[int, str]] = []  # (number, kind) of each of those
        k = 0
        for text, found in zip(texts, spans, strict=True):
            out: list[str] = []
            toks: list[str] = []
            at = 0
            for c in found:
                if issued is None:
                    kind = names.get(c[4]) or _kind_name(c[4])
                    n, hex_id = numbers[k]
                    token = f"<{kind}_{hex_id}>"
                    items.append((token, c[5].encode()))
                    meta.append((n, kind))
                else:
                    token = issued[k]
                out.append(text[at : c[2]])
                out.append(token)
                toks.append(token)
                at = c[3]
                k += 1
            out.append(text[at:])
            results.append(_sanitized(("".join(out), tuple(toks))))
        template = _templates(ref, scope)
        rows: list[tuple[Any, ...]]
        if issued is None:
            sealed = _seal(key, keys, items, template)
            rows = [
                (n, token, ref, scope, kind, purpose, False, None, created, expires, ct)
                for (n, kind), (token, _), ct in zip(meta, items, sealed, strict=True)
            ]
        elif fresh:
            fresh_keys = None if keys is None else [keys[i] for i, _, _ in fresh]
            sealed = _seal(key, fresh_keys, [(issued[i], values[i]) for i, _, _ in fresh], template)
            rows = [
                (n, issued[i], ref, scope, kinds[i], purpose, True, lookup, created, expires, ct)
                for (i, n, lookup), ct in zip(fresh, sealed, strict=True)
            ]
        else:
            return results  # every value had its token already
        if self._group:
            record = None
            if self._journal is not None:
                record = encode(epoch, rows)
            self._hold(epoch, rows, record)
        else:
            # One transaction that re-checks the guard (and the epoch read above):
            # no token of a suppressed subject is ever stored. (Issuing is not
            # audited; every resolution and refusal is.)
            self._catalog.insert_tokens(rows, [(ref, scope, epoch)])
        return results

    def _hold(self, epoch: int, rows: list[tuple[Any, ...]], record: bytes | None) -> None:
        """Group commit: journal the rows (``record``) and keep them pending until a
        flush. Ids are unique by construction (enciphered unique numbers), so the
        text may go out before its rows are stored."""
        with self._pending_lock:
            if record is not None:
                self._journal.append(record)  # type: ignore[union-attr]
            self._held.add(epoch, rows)
        self._issued_at = now = time.monotonic()
        if now - self._flushed_at >= self._group:
            # Busy: the caller flushes, once per interval. A background thread
            # flushing while callers run would trade the GIL back and forth on
            # every row the database steps through.
            self.flush()
        elif self._flusher is None:
            self._start_flusher()

    def _numbers(self, count: int) -> list[tuple[int, str]]:
        """``count`` fresh (number, id) pairs, numbers rising: from this process's
        blocks, ids enciphered a block at a time."""
        if count == 0:
            return []
        with self._numbers_lock:
            free = self._free
            while len(free) < count:
                start = self._catalog.token_block(self._group * 1000.0)
                self._own_blocks.add(start // TOKEN_BLOCK)
                block = range(start, start + TOKEN_BLOCK)
                # Handed out from the end: reversed, so numbers rise within a block.
                free[:0] = list(
                    zip(block, self._keyring.token_ids().encode_many(block), strict=True)
                )[::-1]
            if count == 1:
                return [free.pop()]
            taken = free[-count:]
            del free[-count:]
        return taken[::-1]  # rising

    def _deterministic(
        self,
        key: DataKey,
        ref: str,
        scope: str,
        purpose: str,
        *,
        kinds: list[str],
        values: list[bytes],
        keys: list[DataKey] | None = None,
    ) -> tuple[list[str], list[tuple[int, int, bytes | None]]]:
        """The same token for the same (kind, value), subject, scope and purpose:
        ``(token per finding, (index, number, lookup) of each new one)``. A value's
        lookup is its HMAC under a key derived from the subject's DEK and the
        purpose; a value seen before gets its stored (or pending) token, a new one a
        fresh number. A value sealed under a shared key (``keys``) has its lookup
        under a key derived from that one: it never finds the scope key's token of
        the same value, nor one of an earlier shared key (destroyed by an erasure)."""
        derived: dict[bytes, bytes] = {}  # key id -> its lookup key for the purpose
        lookup_of: dict[tuple[str, bytes], bytes] = {}
        for i, kv in enumerate(zip(kinds, values, strict=True)):
            if kv not in lookup_of:
                sealing = key if keys is None else keys[i]
                det_key = derived.get(sealing.key_id)
                if det_key is None:
                    det_key = derived[sealing.key_id] = sealing.derive(b"token:" + purpose.encode())
                lookup_of[kv] = prim.hmac_sha256(det_key, kv[0].encode() + b"\x00" + kv[1])[:16]
        known: dict[bytes, str] = {}
        with self._pending_lock:
            for held in (self._held, self._storing):
                for lookup in lookup_of.values():
                    token = held.lookups.get((ref, scope, purpose, lookup))
                    if token is not None:
                        known[lookup] = token
        rest = [lookup for lookup in lookup_of.values() if lookup not in known]
        if rest:
            known.update(self._catalog.token_lookups(ref, scope, purpose, rest))
        new: dict[tuple[str, bytes], int] = {}  # (kind, value) -> its first finding
        for i, kv in enumerate(zip(kinds, values, strict=True)):
            if lookup_of[kv] not in known:
                new.setdefault(kv, i)
        numbers = iter(self._numbers(len(new)))
        fresh: list[tuple[int, int, bytes | None]] = []
        for kv, i in new.items():
            n, hex_id = next(numbers)
            known[lookup_of[kv]] = f"<{kv[0]}_{hex_id}>"
            fresh.append((i, n, lookup_of[kv]))
        return [known[lookup_of[kv]] for kv in zip(kinds, values, strict=True)], fresh

    def _value_keys(
        self, ref: str, scope: str, key: DataKey, spans: list[list[tuple[Any, ...]]]
    ) -> list[DataKey] | None:
        """Each finding's sealing key: ``key`` (the holder's scope key), or, for a
        value that is a registered identifier of other subjects, the key shared by
        (holder, scope, those subjects), which the erasure of any of them destroys.
        None when no value is one (nothing registered: no work beyond the finder's
        cached kinds). The co-owners' guards are read before the shared key is
        fetched or made and again after: a key made before a suppression is one that
        erasure destroys, one made after is refused here, before anything is sealed
        under it. A co-owner being erased refuses the whole call
        (``SubjectSuppressed``), as a memory or a checkpoint about them is refused."""
        finder = self._mentions
        if finder is None or not finder.kinds():
            return None
        found = finder.find(ref, [_Value(c[5]) for found in spans for c in found])
        if not any(found):
            return None
        wanted = {tuple(sorted(owners)) for owners in found if owners}
        checked = sorted({owner for owners in wanted for owner in owners})
        self._check_owners(checked)
        shared = {owners: self._keyring.data_key(ref, scope, owners=owners) for owners in wanted}
        self._check_owners(checked)
        return [shared[tuple(sorted(owners))] if owners else key for owners in found]

    def _check_owners(self, owners: Iterable[str]) -> None:
        for owner in owners:
            try:
                self._catalog.check_guard(owner)
            except SubjectSuppressed:
                raise SubjectSuppressed(
                    f"the text holds a registered identifier of subject_ref {owner}, which "
                    "is being erased or was erased"
                ) from None

    def number_of(self, token: str) -> int | None:
        """The row number a well-formed token's id enciphers (None otherwise)."""
        m = TOKEN_RE.fullmatch(token) if isinstance(token, str) else None
        return None if m is None else self._keyring.token_ids().decode(m.group(2))

    def _key(self, ref: str, scope: str) -> DataKey:
        """The subject's scope key. The usual case, a key that exists, needs no lock:
        if an erasure destroys it meanwhile, the tokens sealed under it are refused by
        the guard when they are stored. A first key (or the first of a subject back
        after an erasure) is created under the partition lock with the guard read
        again, so that no key is ever created for a subject being erased."""
        try:
            return self._keyring.data_key(ref, scope, create=False)
        except (KeyNotFound, SubjectErased):
            pass
        return self._first_key(ref, scope, scope)

    # -- group commit ----------------------------------------------------------------

    def _start_flusher(self) -> None:
        if self._flusher is not None and self._flusher.is_alive():
            return
        with self._pending_lock:
            if self._flusher is not None and self._flusher.is_alive():
                return
            self._stop.clear()
            self._flusher = threading.Thread(
                target=self._flush_loop, name="keyshred-token-flusher", daemon=True
            )
            self._flusher.start()

    def _flush_loop(self) -> None:
        # Idle: what callers left pending is written within the interval.
        while not self._stop.is_set():
            self._stop.wait(self._group)
            now = time.monotonic()
            if not self._held.rows or now - self._flushed_at < self._group:
                continue
            if now - self._issued_at < self._group / 2 and now - self._flushed_at < 2 * self._group:
                continue  # callers are busy: the next one flushes inline
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - retried next interval; never kills the flusher
                self._flush_failed(exc)

    def _flush_failed(self, exc: Exception) -> None:
        """Count, log and (first of a run) audit a failed background flush. Only the
        exception's type: a database error's message can quote the rows. A run of
        failures is logged at its 1st, 2nd, 4th, 8th... failure (the counter and
        ``status()`` have every one)."""
        kind = type(exc).__name__
        self._failures += 1
        self._failing += 1
        self._failed_at, self._failure = self._clock(), kind
        if self._on_flush_failure is not None:
            self._on_flush_failure()
        if self._failing & (self._failing - 1) == 0:  # a power of two: no flood
            _log.warning(
                "token flush failed (%s, %d in a row); the tokens stay held and "
                "journaled, retried in %.0f ms",
                kind,
                self._failing,
                self._group * 1000,
            )
        if self._failing == 1:
            # The catalog may be what fails: then so does this, and the log stands.
            with contextlib.suppress(Exception):
                self._audit.record("vault.flush_failed", error=kind)

    def status(self) -> VaultStatus:
        """Group commit in this process: pending rows and background flush failures."""
        with self._pending_lock:
            pending = len(self._held.rows) + len(self._storing.rows)
        return VaultStatus(
            self._group * 1000,
            pending,
            self._failures,
            self._failing,
            self._failed_at,
            self._failure,
        )

    def flush(self) -> int:
        """Write every pending token now (group commit); returns how many were
        stored. A subject suppressed (or erased and re-admitted) meanwhile has its
        pending tokens dropped."""
        with self._flush_lock:  # one flush at a time: a batch is written once
            try:
                stored = self._flush()
            finally:
                self._flushed_at = time.monotonic()
            self._failing = 0  # a run of background failures ends here
            return stored

    def _flush(self) -> int:
        with self._pending_lock:
            batch = self._storing = self._held
            self._held = _Held()
            # The segments that journaled these rows leave with them (appends hold
            # the same lock): they are emptied once the rows are stored.
            if self._journal is not None:
                self._detached += self._journal.detach()
        try:
            stored = self._store_group(batch.rows, batch.epochs, batch.guards)
        except BaseException:
            with self._pending_lock:  # held again, in front of what came meanwhile
                batch.extend(self._held)
                self._held, self._storing = batch, _Held()
            raise
        with self._pending_lock:
            self._storing = _Held()
        if self._detached and self._journal is not None:
            # Every row of these segments was in this batch or an earlier one, or
            # was dropped with its erased subject.
            self._journal.release(self._detached)
            self._detached = []
        return stored

    def _store_group(
        self,
        rows: list[tuple[Any, ...]],
        epochs: list[int],
        guards: set[tuple[str, str, int]],
        *,
        existing_ok: bool = False,
    ) -> int:
        if not rows:
            return 0
        insert = self._catalog.insert_tokens
        try:
            insert(rows, guards, existing_ok=existing_ok)
            return len(rows)
        except SubjectSuppressed:
            pass
        # A subject went under suppression meanwhile: write the others group by
        # group; the suppressed subject's tokens are never stored.
        groups: dict[tuple[str, str, int], list[tuple[Any, ...]]] = {}
        for epoch, row in zip(epochs, rows, strict=True):
            groups.setdefault((row[2], row[3], epoch), []).append(row)
        stored = 0
        for guard, group in groups.items():
            try:
                insert(group, [guard], existing_ok=existing_ok)
                stored += len(group)
            except SubjectSuppressed:
                continue
        return stored

    def recover(self) -> int:
        """Store what processes that died with group commit left in their journals
        (``keyshred.vault.journal``); returns how many rows were stored. Rows already
        stored are skipped; rows of a subject suppressed or erased since (its
        deletion epoch moved) and expired rows are dropped. Runs when a vault opens,
        before an erasure drops tokens and when a token cannot be found. A segment
        that fails its checks is set aside as ``*.corrupt``, audited, and reported
        with ``IntegrityError`` once the others are done."""
        journal = self._journal
        if journal is None:
            return 0
        stored, corrupt = 0, 0
        for segment in journal.orphans():
            try:
                records = segment.read()
            except IntegrityError:
                corrupt += 1
                with contextlib.suppress(OSError):
                    segment.path.rename(segment.path.with_suffix(".corrupt"))
                journal.retire([segment])
                self._audit.record("vault.journal_corrupt", segment=segment.path.stem)
                continue
            now = micros(self._clock())
            live = [(epoch, row) for epoch, row in records if row[9] > now]
            rows = [row for _, row in live]
            epochs = [epoch for epoch, _ in live]
            guards = {(row[2], row[3], epoch) for epoch, row in live}
            stored += self._store_group(rows, epochs, guards, existing_ok=True)
            journal.retire([segment])
        if corrupt:
            raise IntegrityError(f"{corrupt} token journal segment(s) failed their checks")
        return stored

    def _recover_quietly(self) -> None:
        # A corrupt segment is already audited and set aside; a segment that cannot
        # be read or deleted now stays for the next try.
        with contextlib.suppress(IntegrityError, SubjectSuppressed, OSError):
            self.recover()

    def close(self) -> None:
        """Stop the flusher and write what is pending (its journal then goes)."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=10)
            self._flusher = None
        self.flush()
        if self._journal is not None:
            self._journal.close()

    def _forked(self) -> None:
        """In a forked child: what is pending, the free numbers and the journal are
        the parent's (the child would store the parent's rows twice and issue its
        numbers again); locks may have been held by a thread that is not here."""
        self._numbers_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher = None
        self._held = _Held()
        self._storing = _Held()
        self._free = []
        self._own_blocks = set()
        self._detached = []
        if self._journal is not None:
            self._journal.forget()

    # -- resolving -----------------------------------------------------------------

    def detokenize(self, token: str, purpose: str, caller: str, *, subject: Any = None) -> str:
        """The value behind ``token``, or a ``TokenError``/``SubjectSuppressed``/
        ``SubjectErased``; every outcome is audited (without the value)."""
        _check_resolve(token, purpose)
        try:
            value, ref = self._resolve(token, purpose, subject)
        except (TokenError, SubjectSuppressed, SubjectErased) as exc:
            self._audit.record(
                "vault.refused",
                token=token if TOKEN_RE.fullmatch(token or "") else "<malformed>",
                purpose=str(purpose)[:128],
                caller=str(caller)[:128],
                reason=type(exc).__name__,
            )
            raise
        self._audit.record(
            "vault.resolved",
            subject_ref=ref,
            token=token,
            purpose=purpose,
            caller=str(caller)[:128],
        )
        return value

    def _resolve(self, token: str, purpose: str, subject: Any) -> tuple[str, str]:
        number = self.number_of(token)
        if number is None:
            raise UnknownToken("not a keyshred token")
        with self._pending_lock:
            held = self._held.tokens.get(token) or self._storing.tokens.get(token)
        row: Any
        if held is not None:
            row = _Row(dict(zip(TOKEN_COLUMNS, held, strict=True)))
        else:
            row = self._stored(number)
            window = 0.0
            if row is None and number // TOKEN_BLOCK not in self._own_blocks:
                # Issued by a process that died before its flush: in its journal.
                if self._journal is not None:
                    self._recover_quietly()
                    row = self._stored(number)
                if row is None:
                    window = self._catalog.token_pending_window(
                        number, _PENDING_SLACK, self._clock()
                    )
            if window:
                # Issued by another process with group commit and not written yet:
                # wait for its flush rather than refuse a token that exists.
                deadline = time.monotonic() + window
                while row is None and time.monotonic() < deadline:
                    time.sleep(0.002)
                    row = self._stored(number)
            if row is not None and row.token != token:
                row = None  # the number of another token (another kind): forged
        if row is None:
            raise UnknownToken("no such token (forged, or erased with its subject)")
        # Decide before decrypting: subject, purpose, expiry, guard.
        if subject is not None and self._ref(subject) != row.subject_ref:
            raise TokenSubjectMismatch("the token belongs to another subject")
        if row.purpose != purpose:
            raise TokenPurposeMismatch("the token was issued for another purpose")
        expires = row.expires_at  # microseconds while pending, a datetime once read
        if micros(self._clock()) >= (expires if isinstance(expires, int) else micros(expires)):
            raise TokenExpired("the token has expired")
        self._catalog.check_guard(row.subject_ref, scope=row.scope)
        try:
            key = self._keyring.data_key(row.subject_ref, row.scope, create=False)
        except KeyNotFound:
            raise UnknownToken("the token's key is gone") from None
        value = bytes(row.value)
        key_id = key_id_of(value)
        if key_id != key.key_id:
            # Sealed under a key shared with the subjects the value identifies: gone
            # with the erasure of any of them, and then the token resolves no more.
            try:
                key = self._keyring.data_key_by_id(key_id)
            except (KeyNotFound, SubjectErased):
                raise UnknownToken("the token's key is gone") from None
            if key.subject_ref != row.subject_ref or key.scope != row.scope:
                raise IntegrityError("the token's value is sealed under another subject's key")
        place = Place(row.subject_ref, row.scope, "tokens", token, "value")
        return key.open(value, place).decode("utf-8"), row.subject_ref

    def _stored(self, number: int) -> Any:
        with self._catalog.engine.connect() as conn:
            return conn.execute(sa.select(tokens).where(tokens.c.number == number)).first()

    def restore(self, text: str, purpose: str, caller: str, *, subject: Any = None) -> str:
        """Replace the tokens in ``text`` that resolve for ``purpose`` (and, given
        ``subject``, belong to that subject); tokens that do not (other purpose or
        subject, expired, erased, forged) stay as they are."""
        _check_resolve(text, purpose)

        def one(m: re.Match[str]) -> str:
            try:
                return self.detokenize(m.group(0), purpose, caller, subject=subject)
            except (TokenError, SubjectSuppressed, SubjectErased):
                return m.group(0)

        return TOKEN_RE.sub(one, text)

    # -- erasure -------------------------------------------------------------------

    def drop_subject(self, subject_ref: str, scope: str | None = None) -> int:
        """Delete the subject's (scope's) token rows physically (pending ones too, and
        what dead processes' journals hold: the subject is suppressed by now, so
        recovery drops its rows and deletes the segments). Returns how many tokens
        went, held ones included."""
        self._recover_quietly()
        with self._pending_lock:
            dropped = self._held.drop(subject_ref, scope)
            # A flush storing this generation re-checks the guard in its transaction.
            self._storing.drop(subject_ref, scope)
        # Store what else is held and zero the journal segments that still hold the
        # dropped rows (sealed under keys destroyed by now, but gone all the same).
        self.flush()
        where = self._catalog.subject_filter(subject_ref, scope, tokens)
        with self._catalog.transaction() as conn:
            return dropped + int(conn.execute(tokens.delete().where(where)).rowcount)

    def count(self, subject_ref: str, scope: str | None = None) -> int:
        """Stored tokens of the subject (or of one of its scopes)."""
        where = self._catalog.subject_filter(subject_ref, scope, tokens)
        with self._catalog.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(tokens).where(where)
                ).scalar_one()
            )

    # -- Erasable (keyshred.storage.erasable) ---------------------------------------

    name = "vault"
    phase: Phase = DROP

    def erase(self, target: ErasureTarget) -> StoreErasure:
        """The subject's (scope's) tokens, pending ones included; listed memories
        leave tokens alone (tokens are not memories: their own expiry removes them)."""
        n = 0 if target.assets is not None else self.drop_subject(target.subject_ref, target.scope)
        faults.reached("erase.vault")
        return StoreErasure(self.name, "tokens-deleted", n, datetime.now(UTC), found=n > 0)

    def verify(self, target: ErasureTarget) -> list[StoreCheck]:
        if target.assets is not None:
            return []
        left = self.count(target.subject_ref, target.scope)
        return [StoreCheck("tokens unresolvable and removed", not left, f"{left} tokens left")]

    def evict(self, subject_ref: str) -> None:
        """Store the tokens this process holds for group commit: before the
        suppression they are then erased and counted with the rest; after it a
        flush drops the suppressed subject's pending ones."""
        del subject_ref  # a flush stores every subject's pending tokens at once
        self.flush()
