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

Token rows are the token assets: ``ks_tokens`` holds every field an asset has
(subject_ref, scope, purpose, expiry as retain-until; tokens derive from nothing), and
the catalog lists them as assets of kind ``token``; there is no second row per token.

Group commit (``tokens.group_commit_ms > 0``): ``sanitize`` returns as soon as the
values are sealed; the token rows are written many texts per transaction, within that
many milliseconds (by the caller that finds the interval over, or by a background
flusher when calls stop). They resolve at once in this process
(from the pending buffer) and in every process after the flush. The flush re-checks
each subject's guard in its transaction, so a subject suppressed meanwhile has its
pending tokens dropped, never stored; an erasure drops them too. A crash before the
flush loses those tokens' values (their texts keep the tokens, which resolve for
nobody): the trade a hot-path sanitizer (log filters, prompt guards) usually wants.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa

from keyshred.errors import (
    InvalidInput,
    KeyNotFound,
    SubjectErased,
    SubjectSuppressed,
    TokenCollision,
    TokenError,
    TokenExpired,
    TokenPurposeMismatch,
    TokenSubjectMismatch,
    UnknownToken,
)
from keyshred.keyring import _primitives as prim
from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import Place, PlaceTemplate
from keyshred.keyring.keyring import Keyring
from keyshred.storage.catalog import TOKEN_COLUMNS, Catalog, tokens, utc
from keyshred.vault.detect import Finding, Recognizer, detect

__all__ = ["TOKEN_RE", "Sanitized", "TokenVault"]


class _Row:
    """A pending token row with the attribute access of a result row."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


_ATTEMPTS = 4  # ids drawn for one call before a collision is given up on
TOKEN_RE = re.compile(r"<([A-Z][A-Z0-9_]{0,30})_([0-9a-f]{10})>")
_PURPOSE = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
# ``_sanitize`` builds token rows as tuples in the catalog's column order.
_ROW = (
    "token",
    "subject_ref",
    "scope",
    "kind",
    "purpose",
    "deterministic",
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


def _start(f: Finding) -> int:
    return f.start


@functools.lru_cache(maxsize=4096)
def _templates(subject_ref: str, scope: str) -> PlaceTemplate:
    return PlaceTemplate(subject_ref, scope, "tokens", "value")


class _Call(NamedTuple):
    """One sanitize call, validated, as its attempts share it."""

    texts: list[str]
    subject: Any
    purpose: str
    ttl: timedelta
    scope: str
    deterministic: bool
    findings: list[list[Finding]]


@dataclass(frozen=True, slots=True)
class Sanitized:
    """The sanitized text and the tokens it carries (never the values)."""

    text: str
    tokens: tuple[str, ...]

    def __repr__(self) -> str:
        return f"Sanitized(tokens={len(self.tokens)})"


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
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        group_commit_ms: float = 0.0,
        first_key: Callable[[str, str, str | None], DataKey],
    ) -> None:
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
        # token -> (guard epoch at issue, row in the catalog's token_columns order)
        self._pending: dict[str, tuple[int, tuple[Any, ...]]] = {}
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._flushed_at = time.monotonic()

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
        if not all(isinstance(t, str) for t in texts):
            raise InvalidInput("sanitize takes strings")
        _check_purpose(purpose)
        if ttl <= timedelta(0):
            raise InvalidInput("a token's ttl must be positive")
        if findings is None:
            recognizers = self._recognizers
            findings = [detect(t, recognizers) for t in texts]
        # Token ids are 40 bits: at scale a new random id is sometimes taken. Nothing
        # is stored or returned until the ids are settled, so a collision is retried
        # with fresh ids (deterministic ones move to their next derived id).
        call = _Call(texts, subject, purpose, ttl, scope, deterministic, findings)
        for attempt in range(_ATTEMPTS):
            try:
                return self._sanitize_once(call)
            except TokenCollision:
                if attempt == _ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _sanitize_once(self, call: _Call) -> list[Sanitized]:
        texts, subject, purpose, ttl, scope, deterministic, findings = call
        ref = self._ref(subject)
        epoch = self._catalog.check_guard(ref, scope=scope)
        if not any(findings):
            return [Sanitized(t, ()) for t in texts]
        now = self._clock()
        key = self._key(ref, scope)
        # (finding, kind, value) per text, in text order.
        entries = [
            [
                (f, _kind_name(f.kind), text[f.start : f.end].encode())
                for f in (sorted(found, key=_start) if len(found) > 1 else found)
            ]
            for text, found in zip(texts, findings, strict=True)
        ]
        if deterministic:
            token_of, fresh = self._deterministic(key, ref, scope, purpose, entries)
        else:
            token_of, fresh = self._random(entries)
        results: list[Sanitized] = []
        for text, found in zip(texts, entries, strict=True):
            out: list[str] = []
            issued: list[str] = []
            last = 0
            for f, kind, value in found:
                token = token_of[(kind, value)] if deterministic else token_of[id(f)]
                out.append(text[last : f.start])
                out.append(token)
                last = f.end
                issued.append(token)
            out.append(text[last:])
            results.append(Sanitized("".join(out), tuple(issued)))
        if fresh:
            template = _templates(ref, scope)
            sealed = key.seal_rows([(t, v) for t, (_, v) in fresh.items()], template)
            time_param = self._catalog.time_param
            created, expires = time_param(now), time_param(now + ttl)
            rows = [
                (token, ref, scope, kind, purpose, deterministic, created, expires, ct)
                for (token, (kind, _)), ct in zip(fresh.items(), sealed, strict=True)
            ]
            if self._group:
                # The text goes out before the row is stored: an id taken in the
                # database now would make this token resolve to another token's
                # value. Checked here (one indexed read); the flush drops the rare id
                # that another process stores in between.
                if not deterministic and self._catalog.existing_tokens(list(fresh)):
                    raise TokenCollision("a new token id is taken")
                with self._pending_lock:
                    if not fresh.keys().isdisjoint(self._pending):
                        raise TokenCollision("a token id is pending already")
                    for row in rows:
                        self._pending[row[0]] = (epoch, row)
                if time.monotonic() - self._flushed_at >= self._group:
                    # Busy: the caller flushes, once per interval. A background
                    # thread flushing while callers run would trade the GIL back
                    # and forth on every row the database steps through.
                    self.flush()
                else:
                    self._start_flusher()
            else:
                # One transaction that re-checks the guard (and the epoch read
                # above): no token of a suppressed subject is ever stored. (Issuing
                # is not audited; every resolution and refusal is.)
                self._catalog.insert_tokens(rows, [(ref, scope, epoch)])
        return results

    @staticmethod
    def _random(
        entries: list[list[tuple[Finding, str, bytes]]],
    ) -> tuple[dict[Any, str], dict[str, tuple[str, bytes]]]:
        """A fresh random token per finding: (finding id -> token, token -> (kind,
        value) to store). Every id of the call comes from one system call."""
        ids = os.urandom(5 * sum(map(len, entries))).hex()
        n = 0
        token_of: dict[Any, str] = {}
        fresh: dict[str, tuple[str, bytes]] = {}
        for found in entries:
            for f, kind, value in found:
                token = f"<{kind}_{ids[n : n + 10]}>"
                n += 10
                if token in fresh:
                    raise TokenCollision("two new token ids of one call are equal")
                token_of[id(f)] = token
                fresh[token] = (kind, value)
        return token_of, fresh

    def _deterministic(
        self,
        key: DataKey,
        ref: str,
        scope: str,
        purpose: str,
        entries: list[list[tuple[Finding, str, bytes]]],
    ) -> tuple[dict[Any, str], dict[str, tuple[str, bytes]]]:
        """The same token for the same (kind, value), subject, scope and purpose:
        ``((kind, value) -> token, token -> (kind, value) to store)``. A token that
        exists already and is ours is reused; one that belongs to another subject,
        scope or purpose (a 40-bit collision) moves this value to its next derived
        id, so a token never resolves to someone else's value."""
        det_key = key.derive(b"token:" + purpose.encode())
        wanted = {(kind, value) for found in entries for _, kind, value in found}

        def token(kind: str, value: bytes, counter: int) -> str:
            salt = b"" if counter == 0 else b"\x00" + str(counter).encode()
            mac = prim.hmac_sha256(det_key, kind.encode() + b"\x00" + value + salt)
            return f"<{kind}_{mac[:5].hex()}>"

        ours = (ref, scope, purpose, True)
        # Every value's first id, and whose they are, in one read.
        first = {(kind, value): token(kind, value, 0) for kind, value in wanted}
        owners = self._owners(list(first.values()))
        token_of: dict[Any, str] = {}
        fresh: dict[str, tuple[str, bytes]] = {}
        for (kind, value), natural in first.items():
            candidate = natural
            for counter in range(_ATTEMPTS):
                if counter:  # the rare collision: the next derived id, read on its own
                    candidate = token(kind, value, counter)
                    owners.update(self._owners([candidate]))
                owner = owners.get(candidate)
                if owner == ours:
                    break  # issued before: the same token, stored once
                if owner is None and candidate not in fresh:
                    fresh[candidate] = (kind, value)
                    break
            else:
                raise TokenCollision("no free deterministic token id for a value")
            token_of[(kind, value)] = candidate
        return token_of, fresh

    def _owners(self, candidates: list[str]) -> dict[str, tuple[str, str, str, bool]]:
        """(subject_ref, scope, purpose, deterministic) of the pending or stored ones."""
        with self._pending_lock:
            pending = [(t, self._pending[t][1]) for t in candidates if t in self._pending]
        out = {t: (row[1], row[2], row[4], bool(row[5])) for t, row in pending}
        rest = [t for t in candidates if t not in out]
        if rest:
            out.update(self._catalog.existing_tokens(rest))
        return out

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
            if not self._pending or time.monotonic() - self._flushed_at < self._group:
                continue
            try:
                self.flush()
            except Exception:  # noqa: BLE001, S112 - retried next interval; never kills the flusher
                continue

    def flush(self) -> int:
        """Write every pending token now (group commit); returns how many were
        stored. A subject suppressed (or erased and re-admitted) meanwhile has its
        pending tokens dropped."""
        with self._flush_lock:  # one flush at a time: a batch is written once
            try:
                return self._flush()
            finally:
                self._flushed_at = time.monotonic()

    def _flush(self) -> int:
        with self._pending_lock:
            batch = list(self._pending.values())
        if not batch:
            return 0
        rows = [row for _, row in batch]
        try:
            stored = self._store_group(batch)
        except TokenCollision:
            # A pending token's id was taken in the database meanwhile (another
            # process, 40-bit ids): its text already went out, so it cannot get a
            # new id. It is dropped, unresolvable like a token lost in a crash, and
            # never resolves to the other token's value; the rest is stored.
            taken = set(self._catalog.existing_tokens([row[0] for row in rows]))
            self._audit.record("vault.collision", tokens=len(taken))
            stored = self._store_group([(e, r) for e, r in batch if r[0] not in taken])
        with self._pending_lock:
            for row in rows:
                self._pending.pop(row[0], None)
        return stored

    def _store_group(self, batch: list[tuple[int, tuple[Any, ...]]]) -> int:
        groups: dict[tuple[str, str, int], list[tuple[Any, ...]]] = {}
        for epoch, row in batch:
            groups.setdefault((row[1], row[2], epoch), []).append(row)
        try:
            self._catalog.insert_tokens([row for _, row in batch], list(groups))
            return len(batch)
        except SubjectSuppressed:
            pass
        # A subject went under suppression meanwhile: write the others group by
        # group; the suppressed subject's tokens are never stored.
        stored = 0
        for guard, rows in groups.items():
            try:
                self._catalog.insert_tokens(rows, [guard])
                stored += len(rows)
            except SubjectSuppressed:
                continue
        return stored

    def close(self) -> None:
        """Stop the flusher and write what is pending."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=10)
            self._flusher = None
        self.flush()

    # -- resolving -----------------------------------------------------------------

    def detokenize(self, token: str, purpose: str, caller: str, *, subject: Any = None) -> str:
        """The value behind ``token``, or a ``TokenError``/``SubjectSuppressed``/
        ``SubjectErased``; every outcome is audited (without the value)."""
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
        if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):
            raise UnknownToken("not a keyshred token")
        with self._pending_lock:
            pending = self._pending.get(token)
        row: Any
        if pending is not None:
            row = _Row(dict(zip(TOKEN_COLUMNS, pending[1], strict=True)))
        else:
            with self._catalog.engine.connect() as conn:
                row = conn.execute(sa.select(tokens).where(tokens.c.token == token)).first()
        if row is None:
            raise UnknownToken("no such token (forged, or erased with its subject)")
        # Decide before decrypting: subject, purpose, expiry, guard.
        if subject is not None and self._ref(subject) != row.subject_ref:
            raise TokenSubjectMismatch("the token belongs to another subject")
        if row.purpose != purpose:
            raise TokenPurposeMismatch("the token was issued for another purpose")
        expires = utc(row.expires_at)
        if expires is not None and self._clock() >= expires:
            raise TokenExpired("the token has expired")
        self._catalog.check_guard(row.subject_ref, scope=row.scope)
        try:
            key = self._keyring.data_key(row.subject_ref, row.scope, create=False)
        except KeyNotFound:
            raise UnknownToken("the token's key is gone") from None
        place = Place(row.subject_ref, row.scope, "tokens", token, "value")
        return key.open(bytes(row.value), place).decode("utf-8"), row.subject_ref

    def restore(self, text: str, purpose: str, caller: str, *, subject: Any = None) -> str:
        """Replace the tokens in ``text`` that resolve for ``purpose`` (and, given
        ``subject``, belong to that subject); tokens that do not (other purpose or
        subject, expired, erased, forged) stay as they are."""

        def one(m: re.Match[str]) -> str:
            try:
                return self.detokenize(m.group(0), purpose, caller, subject=subject)
            except (TokenError, SubjectSuppressed, SubjectErased):
                return m.group(0)

        return TOKEN_RE.sub(one, text)

    # -- erasure -------------------------------------------------------------------

    def drop_subject(self, subject_ref: str, scope: str | None = None) -> int:
        """Delete the subject's (scope's) token rows physically (pending ones too)."""
        with self._pending_lock:
            for token, (_, row) in list(self._pending.items()):
                if row[1] == subject_ref and (scope is None or row[2] == scope):
                    del self._pending[token]
        where = self._catalog.subject_filter(subject_ref, scope, tokens)
        with self._catalog.transaction() as conn:
            return int(conn.execute(tokens.delete().where(where)).rowcount)

    def count(self, subject_ref: str, scope: str | None = None) -> int:
        """Stored tokens of the subject (or of one of its scopes)."""
        where = self._catalog.subject_filter(subject_ref, scope, tokens)
        with self._catalog.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count()).select_from(tokens).where(where)
                ).scalar_one()
            )
