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

Group commit (``tokens.group_commit_ms > 0``): ``sanitize`` returns as soon as the
values are sealed; the token rows are written by a background flusher, many texts per
transaction, within that many milliseconds. They resolve at once in this process
(from the pending buffer) and in every process after the flush. The flush re-checks
each subject's guard in its transaction, so a subject suppressed meanwhile has its
pending tokens dropped, never stored; an erasure drops them too. A crash before the
flush loses those tokens' values (their texts keep the tokens, which resolve for
nobody): the trade a hot-path sanitizer (log filters, prompt guards) usually wants.
"""

from __future__ import annotations

import os
import re
import threading
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
from keyshred.keyring.envelope import Place
from keyshred.keyring.keyring import Keyring
from keyshred.storage.catalog import AssetRow, Catalog, tokens, utc
from keyshred.vault.detect import Finding, Recognizer, detect

__all__ = ["TOKEN_RE", "Sanitized", "TokenVault"]


class _Row:
    """A pending token row with the attribute access of a result row."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


TOKEN_RE = re.compile(r"<([A-Z][A-Z0-9_]{0,30})_([0-9a-f]{10})>")
_PURPOSE = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
TOKEN_KIND = "token"  # noqa: S105 - an asset kind, not a secret


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
    ) -> None:
        self._catalog = catalog
        self._keyring = keyring
        self._ref = subject_ref
        self._audit = audit
        self._recognizers = recognizers
        self._clock = clock
        self._group = max(0.0, group_commit_ms) / 1000.0
        self._pending: dict[str, tuple[AssetRow, dict[str, Any]]] = {}
        self._pending_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None

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
        ref = self._ref(subject)
        self._catalog.check_guard(ref, scope=scope)
        if findings is None:
            findings = [detect(t, self._recognizers) for t in texts]
        if not any(findings):
            return [Sanitized(t, ()) for t in texts]
        now = self._clock()
        expires = now + ttl
        key = self._keyring.data_key(ref, scope)
        det_key = key.derive(b"token:" + purpose.encode()) if deterministic else b""
        results: list[Sanitized] = []
        new_rows: dict[str, dict[str, Any]] = {}
        for text, found in zip(texts, findings, strict=True):
            out: list[str] = []
            issued: list[str] = []
            last = 0
            for f in sorted(found, key=lambda f: f.start):
                value = text[f.start : f.end]
                kind = re.sub(r"[^A-Z0-9_]", "_", f.kind.upper())[:30] or "PII"
                if deterministic:
                    mac = prim.hmac_sha256(det_key, kind.encode() + b"\x00" + value.encode())
                    token = f"<{kind}_{mac[:5].hex()}>"
                else:
                    token = f"<{kind}_{os.urandom(5).hex()}>"
                out += [text[last : f.start], token]
                last = f.end
                issued.append(token)
                if token in new_rows or (deterministic and self._exists(token)):
                    continue
                new_rows[token] = {
                    "token": token,
                    "subject_ref": ref,
                    "scope": scope,
                    "kind": kind,
                    "purpose": purpose,
                    "deterministic": deterministic,
                    "created_at": now,
                    "expires_at": expires,
                    "value": key.seal(
                        value.encode("utf-8"), Place(ref, scope, "tokens", token, "value")
                    ),
                }
            out.append(text[last:])
            results.append(Sanitized("".join(out), tuple(issued)))
        if new_rows:
            assets = [
                AssetRow(
                    asset_id=token,
                    subject_ref=ref,
                    scope=scope,
                    kind=TOKEN_KIND,
                    storage_system="catalog",
                    storage_key="ks_tokens",
                    purpose=purpose,
                    category="token",
                    created_at=now,
                    retain_until=expires,
                )
                for token in new_rows
            ]
            if self._group:
                with self._pending_lock:
                    for asset in assets:
                        self._pending[asset.asset_id] = (asset, new_rows[asset.asset_id])
                self._start_flusher()
            else:
                # Assets and token rows in one transaction that re-checks the guard:
                # no token of a suppressed subject is ever stored. (Issuing is not
                # audited; every resolution and refusal is.)
                self._catalog.register(assets, replace=False, token_rows=list(new_rows.values()))
        return results

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
        while not self._stop.is_set():
            self._stop.wait(self._group)
            try:
                self.flush()
            except Exception:  # noqa: BLE001, S112 - retried next interval; never kills the flusher
                continue

    def flush(self) -> int:
        """Write every pending token now (group commit); returns how many were
        stored. A subject suppressed meanwhile has its pending tokens dropped."""
        with self._flush_lock:  # one flush at a time: a batch is written once
            return self._flush()

    def _flush(self) -> int:
        with self._pending_lock:
            batch = list(self._pending.values())
        if not batch:
            return 0
        by_ref: dict[str, list[tuple[AssetRow, dict[str, Any]]]] = {}
        for asset, row in batch:
            by_ref.setdefault(asset.subject_ref, []).append((asset, row))
        stored = 0
        try:
            self._catalog.register(
                [a for a, _ in batch], replace=False, token_rows=[r for _, r in batch]
            )
            stored = len(batch)
        except SubjectSuppressed:
            # One subject went under suppression meanwhile: write the others one by
            # one; the suppressed subject's tokens are never stored.
            for rows in by_ref.values():
                try:
                    self._catalog.register(
                        [a for a, _ in rows], replace=False, token_rows=[r for _, r in rows]
                    )
                    stored += len(rows)
                except SubjectSuppressed:
                    continue
        with self._pending_lock:
            for asset, _ in batch:
                self._pending.pop(asset.asset_id, None)
        return stored

    def close(self) -> None:
        """Stop the flusher and write what is pending."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=10)
            self._flusher = None
        self.flush()

    def _exists(self, token: str) -> bool:
        with self._catalog.engine.connect() as conn:
            return (
                conn.execute(sa.select(tokens.c.token).where(tokens.c.token == token)).first()
                is not None
            )

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
            row = _Row(pending[1])  # issued here, not flushed yet
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

    def restore(self, text: str, purpose: str, caller: str) -> str:
        """Replace the tokens in ``text`` that resolve for ``purpose``; tokens that
        do not (other purpose, expired, erased, forged) stay as they are."""

        def one(m: re.Match[str]) -> str:
            try:
                return self.detokenize(m.group(0), purpose, caller)
            except (TokenError, SubjectSuppressed, SubjectErased):
                return m.group(0)

        return TOKEN_RE.sub(one, text)

    # -- erasure -------------------------------------------------------------------

    def drop_subject(self, subject_ref: str, scope: str | None = None) -> int:
        """Delete the subject's (scope's) token rows physically (pending ones too)."""
        with self._pending_lock:
            for token, (asset, _) in list(self._pending.items()):
                if asset.subject_ref == subject_ref and (scope is None or asset.scope == scope):
                    del self._pending[token]
        where = tokens.c.subject_ref == subject_ref
        if scope is not None:
            where = sa.and_(where, tokens.c.scope == scope)
        with self._catalog.transaction() as conn:
            return int(conn.execute(tokens.delete().where(where)).rowcount)

    def count(self, subject_ref: str) -> int:
        with self._catalog.engine.connect() as conn:
            return int(
                conn.execute(
                    sa.select(sa.func.count())
                    .select_from(tokens)
                    .where(tokens.c.subject_ref == subject_ref)
                ).scalar_one()
            )
