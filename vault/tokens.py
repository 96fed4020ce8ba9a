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

A token's 10 hex digits are its row number enciphered with FF1 under a keyring
secret (``keyshred.keyring.tokenid``). Numbers come from blocks of 1,024 that each
process takes from the catalog, so two tokens never share an id and nothing has to be
looked up before a token goes out; ids show no order and are as hard to guess as
random ones; resolution deciphers the id and reads the row by primary key, and a row
whose token differs (the same digits under another kind) is a forgery. A
deterministic token is found by ``lookup``: the value's HMAC under a key derived from
the subject's DEK and the purpose.

Group commit (``tokens.group_commit_ms > 0``): ``sanitize`` returns as soon as the
values are sealed; the token rows are written many texts per transaction, within that
many milliseconds (by the caller that finds the interval over, or by a background
flusher when calls stop). They resolve at once in this process
(from the pending buffer), and another process that meets one before the flush
waits for it, up to the interval (``ks_token_blocks`` records each block's interval;
a number whose block's next stored number is older than that cannot be pending, and
a forged one or one issued per call is refused without waiting). The flush re-checks
each subject's guard in its transaction, so a subject suppressed meanwhile has its
pending tokens dropped, never stored; an erasure drops them too. A crash before the
flush loses those tokens' values (their texts keep the tokens, which resolve for
nobody): the trade a hot-path sanitizer (log filters, prompt guards) usually wants.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from keyshred.errors import (
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
from keyshred.keyring.envelope import Place, PlaceTemplate
from keyshred.keyring.keyring import Keyring
from keyshred.storage.catalog import TOKEN_BLOCK, TOKEN_COLUMNS, Catalog, tokens, utc
from keyshred.vault.detect import Finding, Recognizer, detect

__all__ = ["TOKEN_RE", "Sanitized", "TokenVault"]


class _Row:
    """A pending token row with the attribute access of a result row."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


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


def _start(f: Finding) -> int:
    return f.start


@functools.lru_cache(maxsize=4096)
def _templates(subject_ref: str, scope: str) -> PlaceTemplate:
    return PlaceTemplate(subject_ref, scope, "tokens", "value")


@dataclass(frozen=True, slots=True)
class Sanitized:
    """The sanitized text and the tokens it carries (never the values)."""

    text: str
    tokens: tuple[str, ...]

    def __repr__(self) -> str:
        return f"Sanitized(tokens={len(self.tokens)})"


_ZERO = timedelta(0)
# Beyond another process's group-commit interval: the time its flush may take.
_PENDING_SLACK = 0.5
_valid_purposes: set[str] = set()  # purposes checked once already (a hot-path cache)


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
        # (subject_ref, scope, purpose, lookup) -> token of pending deterministic rows
        self._pending_lookups: dict[tuple[str, str, str, bytes], str] = {}
        catalog.token_number = self.number_of
        self._free: list[tuple[int, str]] = []  # (number, id), taken from the end
        self._own_blocks: set[int] = set()  # blocks of numbers this vault took
        self._numbers_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._flushed_at = self._issued_at = time.monotonic()

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
        if type(purpose) is not str or purpose not in _valid_purposes:
            _check_purpose(purpose)
            if len(_valid_purposes) < 1024:
                _valid_purposes.add(purpose)
        if ttl <= _ZERO:
            raise InvalidInput("a token's ttl must be positive")
        if findings is None:
            recognizers = self._recognizers
            findings = [detect(t, recognizers) for t in texts]
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
            sealed = key.seal_rows([(t, v[2]) for t, v in fresh.items()], template)
            time_param = self._catalog.time_param
            created, expires = time_param(now), time_param(now + ttl)
            rows = [
                (n, token, ref, scope, kind, purpose, deterministic, lookup, created, expires, ct)
                for (token, (n, kind, _, lookup)), ct in zip(fresh.items(), sealed, strict=True)
            ]
            if self._group:
                # Ids are unique by construction (enciphered unique numbers), so the
                # text may go out before its rows are stored.
                with self._pending_lock:
                    pending = self._pending
                    for row in rows:
                        pending[row[1]] = (epoch, row)
                        if row[7] is not None:
                            self._pending_lookups[(ref, scope, purpose, row[7])] = row[1]
                self._issued_at = now_mono = time.monotonic()
                if now_mono - self._flushed_at >= self._group:
                    # Busy: the caller flushes, once per interval. A background
                    # thread flushing while callers run would trade the GIL back
                    # and forth on every row the database steps through.
                    self.flush()
                elif self._flusher is None:
                    self._start_flusher()
            else:
                # One transaction that re-checks the guard (and the epoch read
                # above): no token of a suppressed subject is ever stored. (Issuing
                # is not audited; every resolution and refusal is.)
                self._catalog.insert_tokens(rows, [(ref, scope, epoch)])
        return results

    def _numbers(self, count: int) -> list[tuple[int, str]]:
        """``count`` fresh (number, id) pairs: numbers from this process's blocks,
        ids enciphered a block at a time."""
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
            taken = free[-count:]
            del free[-count:]
        return taken

    def _random(
        self, entries: list[list[tuple[Finding, str, bytes]]]
    ) -> tuple[dict[Any, str], dict[str, tuple[int, str, bytes, bytes | None]]]:
        """A fresh token per finding: (finding id -> token, token -> (number, kind,
        value, lookup) to store)."""
        numbers = self._numbers(sum(map(len, entries)))
        token_of: dict[Any, str] = {}
        fresh: dict[str, tuple[int, str, bytes, bytes | None]] = {}
        k = len(numbers)
        for found in entries:
            for f, kind, value in found:
                k -= 1
                n, hex_id = numbers[k]
                token = f"<{kind}_{hex_id}>"
                token_of[id(f)] = token
                fresh[token] = (n, kind, value, None)
        return token_of, fresh

    def _deterministic(
        self,
        key: DataKey,
        ref: str,
        scope: str,
        purpose: str,
        entries: list[list[tuple[Finding, str, bytes]]],
    ) -> tuple[dict[Any, str], dict[str, tuple[int, str, bytes, bytes | None]]]:
        """The same token for the same (kind, value), subject, scope and purpose:
        ``((kind, value) -> token, token -> (number, kind, value, lookup) to
        store)``. A value's lookup is its HMAC under a key derived from the
        subject's DEK and the purpose; a value seen before gets its stored (or
        pending) token, a new one a fresh number."""
        det_key = key.derive(b"token:" + purpose.encode())
        wanted = {(kind, value) for found in entries for _, kind, value in found}
        lookup_of = {
            kv: prim.hmac_sha256(det_key, kv[0].encode() + b"\x00" + kv[1])[:16] for kv in wanted
        }
        known: dict[bytes, str] = {}
        with self._pending_lock:
            for lookup in lookup_of.values():
                token = self._pending_lookups.get((ref, scope, purpose, lookup))
                if token is not None:
                    known[lookup] = token
        rest = [lookup for lookup in lookup_of.values() if lookup not in known]
        if rest:
            known.update(self._catalog.token_lookups(ref, scope, purpose, rest))
        new = [kv for kv, lookup in lookup_of.items() if lookup not in known]
        numbers = self._numbers(len(new))
        token_of: dict[Any, str] = {
            kv: known[lookup] for kv, lookup in lookup_of.items() if lookup in known
        }
        fresh: dict[str, tuple[int, str, bytes, bytes | None]] = {}
        for (kind, value), (n, hex_id) in zip(new, numbers, strict=True):
            token = f"<{kind}_{hex_id}>"
            token_of[(kind, value)] = token
            fresh[token] = (n, kind, value, lookup_of[(kind, value)])
        return token_of, fresh

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
            if not self._pending or now - self._flushed_at < self._group:
                continue
            if now - self._issued_at < self._group / 2 and now - self._flushed_at < 2 * self._group:
                continue  # callers are busy: the next one flushes inline
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
        stored = self._store_group(batch)
        with self._pending_lock:
            for _, row in batch:
                self._pending.pop(row[1], None)
                if row[7] is not None:
                    self._pending_lookups.pop((row[2], row[3], row[5], row[7]), None)
        return stored

    def _store_group(self, batch: list[tuple[int, tuple[Any, ...]]]) -> int:
        groups: dict[tuple[str, str, int], list[tuple[Any, ...]]] = {}
        for epoch, row in batch:
            groups.setdefault((row[2], row[3], epoch), []).append(row)
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
        number = self.number_of(token)
        if number is None:
            raise UnknownToken("not a keyshred token")
        with self._pending_lock:
            pending = self._pending.get(token)
        row: Any
        if pending is not None:
            row = _Row(dict(zip(TOKEN_COLUMNS, pending[1], strict=True)))
        else:
            row = self._stored(number)
            window = 0.0
            if row is None and number // TOKEN_BLOCK not in self._own_blocks:
                window = self._catalog.token_pending_window(number, _PENDING_SLACK, self._clock())
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

    def _stored(self, number: int) -> Any:
        with self._catalog.engine.connect() as conn:
            return conn.execute(sa.select(tokens).where(tokens.c.number == number)).first()

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
                if row[2] == subject_ref and (scope is None or row[3] == scope):
                    del self._pending[token]
                    if row[7] is not None:
                        self._pending_lookups.pop((row[2], row[3], row[5], row[7]), None)
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
