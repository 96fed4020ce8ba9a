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
process takes from the catalog (``ks_token_blocks``), so two tokens never share an
id, no number is ever issued twice (a deleted token's neither) and nothing has to be
looked up before a token goes out; ids show no order and are as hard to guess as
random ones; resolution deciphers the id and reads the row by primary key, and a row
whose token differs (the same digits under another kind) is a forgery. A
deterministic token is found by ``lookup``: the value's HMAC under a key derived from
the subject's DEK and the purpose.

Storing: with ``tokens.group_commit_ms = 0`` (the PostgreSQL default) each call's
rows are stored in one catalog transaction (one multi-row INSERT) that re-reads the
subject's guard, before ``sanitize`` returns (``keyshred.vault.store``). With an
interval (the embedded default, 50 ms) they are journaled and written many calls per
transaction within it (``keyshred.vault.group``): they resolve at once in this
process, another process waits for them up to the interval, a suppression meanwhile
drops them, and a dead process's journal is replayed by the next vault to open.

Why one module of ~650 lines: issuing (sanitize, numbers, deterministic lookups,
the keys of values that identify other subjects) and resolving (held, stored, a dead
process's or another process's pending rows) share the row format, the number
blocks and the guard rules, and are reviewed together; the row format, the storage,
group commit and its journal are modules of their own.
"""

from __future__ import annotations

import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keyshred import db
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
from keyshred.keyring.envelope import Place, key_id_of
from keyshred.keyring.keyring import Keyring
from keyshred.storage import faults
from keyshred.storage.catalog import AssetRow, Catalog, micros
from keyshred.storage.erasable import DROP, ErasureTarget, Phase, StoreCheck, StoreErasure
from keyshred.vault.detect import Finding, Recognizer, default_spans, detect
from keyshred.vault.group import GroupCommit, VaultStatus
from keyshred.vault.rows import (
    KIND_NAMES,
    TOKEN_RE,
    MentionValue,
    Sanitized,
    check_purpose,
    check_resolve,
    kind_name,
    place_template,
    sanitized,
    seal_values,
    span_start,
)
from keyshred.vault.schema import TOKEN_BLOCK, TOKEN_COLUMNS
from keyshred.vault.store import TokenStore

if TYPE_CHECKING:  # storage.mentions imports the vault's detector
    from keyshred.storage.mentions import MentionFinder

__all__ = ["TOKEN_RE", "Sanitized", "TokenVault", "VaultStatus"]


def _utcnow() -> datetime:
    return datetime.now(UTC)


class _Wait:
    """How long one call may still wait for rows held by other processes."""

    __slots__ = ("deadline",)

    def __init__(self) -> None:
        self.deadline: float | None = None  # monotonic; set by the first wait


class _HeldRow:
    """A held token row with the attribute access of a stored one."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


_ZERO = timedelta(0)
_TEXT_LIMIT = "tokens.max_text_bytes"
_MICROSECOND = timedelta(microseconds=1)
_MAX_TTL = timedelta(days=36_525)  # expiries stay far inside 64-bit microseconds
# Beyond another process's group-commit interval: the time its flush may take.
_PENDING_SLACK = 0.5
_valid_purposes: set[str] = set()  # purposes checked once already (a hot-path cache)
_VAULTS: weakref.WeakSet[TokenVault] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for vault in list(_VAULTS):
        vault._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


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
        first_key: Callable[[str, str, str | None], DataKey],
        group_commit_ms: float = 0.0,
        journal: Path | None = None,
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
        # The token rows, in the catalog's database; it lists them as assets. Its
        # migrations made the tables (and refused a table from before token numbers)
        # when they ran: checking again cost every open a reflection (14 ms on PostgreSQL).
        self._store = TokenStore(catalog, self.number_of, create_tables=not catalog.migrated)
        # Reads of token assets first store what this process holds (read-your-writes).
        catalog.token_assets = self._assets
        catalog.token_asset = self._asset
        self._group_ms = max(0.0, group_commit_ms)
        # Held rows and the journal. Without group commit nothing is ever held, but
        # the journals that processes with group commit left when they died are
        # still replayed here (a process may open a folder with another setting).
        self._group = GroupCommit(
            self._store,
            self._group_ms,
            journal,
            clock=clock,
            audit=audit,
            on_flush_failure=on_flush_failure,
        )
        self._free: list[tuple[int, str]] = []  # (number, id), taken from the end
        self._own_blocks: set[int] = set()  # blocks of numbers this vault took
        self._numbers_lock = threading.Lock()
        _VAULTS.add(self)
        self._group.recover_quietly()

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
            check_purpose(purpose)
            if len(_valid_purposes) < 1024:
                _valid_purposes.add(purpose)
        if not isinstance(ttl, timedelta) or ttl <= _ZERO or ttl > _MAX_TTL:
            raise InvalidInput("a token's ttl is a positive timedelta of at most 100 years")
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
                found.sort(key=span_start)
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
        names = KIND_NAMES
        issued: list[str] | None = None  # deterministic: every finding's token, given
        fresh: list[tuple[int, int, bytes | None]] = []  # (finding, number, lookup) to store
        if deterministic:
            kinds = [names.get(c[4]) or kind_name(c[4]) for found in spans for c in found]
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
                    kind = names.get(c[4]) or kind_name(c[4])
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
            results.append(sanitized(("".join(out), tuple(toks))))
        template = place_template(ref, scope)
        rows: list[tuple[Any, ...]]
        if issued is None:
            sealed = seal_values(key, keys, items, template)
            rows = [
                (n, token, ref, scope, kind, purpose, False, None, created, expires, ct)
                for (n, kind), (token, _), ct in zip(meta, items, sealed, strict=True)
            ]
        elif fresh:
            fresh_keys = None if keys is None else [keys[i] for i, _, _ in fresh]
            sealed = seal_values(
                key, fresh_keys, [(issued[i], values[i]) for i, _, _ in fresh], template
            )
            rows = [
                (n, issued[i], ref, scope, kinds[i], purpose, True, lookup, created, expires, ct)
                for (i, n, lookup), ct in zip(fresh, sealed, strict=True)
            ]
        else:
            return results  # every value had its token already
        if self._group_ms:
            self._group.hold(epoch, rows)
        else:
            # One transaction that re-checks the guard (and the epoch read above): no
            # token of a suppressed subject is ever stored, and a token handed out is
            # committed. (Issuing is not audited; every resolution and refusal is.)
            self._store.insert(rows, [(ref, scope, epoch)])
        return results

    def _numbers(self, count: int) -> list[tuple[int, str]]:
        """``count`` fresh (number, id) pairs, numbers rising: from this process's
        blocks, ids enciphered a block at a time."""
        if count == 0:
            return []
        with self._numbers_lock:
            free = self._free
            while len(free) < count:
                start = self._store.block(self._group_ms)
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
        purpose; a value seen before gets its stored (or held) token, a new one a
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
        wanted = list(set(lookup_of.values()))
        known = self._group.lookups(ref, scope, purpose, wanted)
        rest = [lookup for lookup in wanted if lookup not in known]
        if rest:
            known.update(self._store.lookups(ref, scope, purpose, rest))
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
        found = finder.find(ref, [MentionValue(c[5]) for found in spans for c in found])
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

    # -- group commit (``keyshred.vault.group``) ------------------------------------

    def flush(self) -> int:
        """Write every held token now (group commit); returns how many were stored
        (0 without group commit: every call stored its own). A subject suppressed
        (or erased and re-admitted) meanwhile has its held tokens dropped."""
        return self._group.flush()

    def recover(self) -> int:
        """Store what processes that died with group commit left in their journals;
        returns how many rows were stored (``GroupCommit.recover``). Runs when a
        vault opens, before an erasure drops tokens and when a token cannot be found."""
        return self._group.recover()

    def status(self) -> VaultStatus:
        """Group commit in this process: held rows and background flush failures."""
        return self._group.status()

    def close(self) -> None:
        """Stop the flusher and write what is held, then return the store's kept
        connection (also when that write fails: the database may be gone)."""
        try:
            self._group.close()
        finally:
            self._store.close()

    def _forked(self) -> None:
        """In a forked child: what is held, the free numbers and the journal are the
        parent's (the child would store the parent's rows twice and issue its
        numbers again); locks may have been held by a thread that is not here."""
        self._numbers_lock = threading.Lock()
        self._free = []
        self._own_blocks = set()
        self._store.forked()
        self._group.forked()

    def _assets(self, subject_ref: str, scope: str | None = None) -> list[AssetRow]:
        """The catalog's hook: the subject's tokens as assets, held ones stored first."""
        self.flush()
        return self._store.assets(subject_ref, scope)

    def _asset(self, token: str) -> AssetRow | None:
        self.flush()
        return self._store.asset(token)

    # -- resolving -----------------------------------------------------------------

    def detokenize(self, token: str, purpose: str, caller: str, *, subject: Any = None) -> str:
        """The value behind ``token``, or a ``TokenError``/``SubjectSuppressed``/
        ``SubjectErased``; every outcome is audited (without the value)."""
        check_resolve(token, purpose)
        return self._detokenize(token, purpose, caller, subject, _Wait())

    def _detokenize(self, token: str, purpose: str, caller: str, subject: Any, wait: _Wait) -> str:
        try:
            value, ref = self._resolve(token, purpose, subject, wait)
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

    def _resolve(self, token: str, purpose: str, subject: Any, wait: _Wait) -> tuple[str, str]:
        number = self.number_of(token)
        if number is None:
            raise UnknownToken("not a keyshred token")
        row = self._row(token, number, wait)
        if row is None:
            raise UnknownToken("no such token (forged, or erased with its subject)")
        # Decide before decrypting: subject, purpose, expiry, guard.
        if subject is not None and self._ref(subject) != row.subject_ref:
            raise TokenSubjectMismatch("the token belongs to another subject")
        if row.purpose != purpose:
            raise TokenPurposeMismatch("the token was issued for another purpose")
        expires = row.expires_at  # microseconds while held, a datetime once read
        if micros(self._clock()) >= (expires if isinstance(expires, int) else micros(expires)):
            raise TokenExpired("the token has expired")
        self._catalog.check_guard(row.subject_ref, scope=row.scope)
        try:
            key = self._keyring.data_key(row.subject_ref, row.scope, create=False)
        except KeyNotFound:
            raise UnknownToken("the token's key is gone") from None
        value = db.blob(row.value)
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

    def _row(self, token: str, number: int, wait: _Wait) -> Any:
        """The token's row: held here, stored, left in a dead process's journal, or
        (waited for) held by another process's group commit; None if there is none
        or the number's row is another token's (the same digits under another kind:
        forged). ``wait`` bounds the waiting of a whole call: a text of many tokens
        whose rows are gone (erased, say) waits one window in all, not one each."""
        group = self._group
        held = group.row(token)
        if held is not None:
            return _HeldRow(dict(zip(TOKEN_COLUMNS, held, strict=True)))
        row = self._store.row(number)
        if row is None and number // TOKEN_BLOCK not in self._own_blocks:
            # Issued by a process that died before its flush: in its journal.
            group.recover_quietly()
            row = self._store.row(number)
            window = 0.0
            if row is None:
                window = self._store.pending_window(number, _PENDING_SLACK, self._clock())
            if window:
                # Issued by another process with group commit and not written yet:
                # wait for its flush rather than refuse a token that exists.
                if wait.deadline is None:
                    wait.deadline = time.monotonic() + window
                while row is None and time.monotonic() < wait.deadline:
                    time.sleep(0.002)
                    row = self._store.row(number)
        if row is not None and row.token != token:
            return None
        return row

    def restore(self, text: str, purpose: str, caller: str, *, subject: Any = None) -> str:
        """Replace the tokens in ``text`` that resolve for ``purpose`` (and, given
        ``subject``, belong to that subject); tokens that do not (other purpose or
        subject, expired, erased, forged) stay as they are."""
        check_resolve(text, purpose)
        wait = _Wait()

        def one(m: re.Match[str]) -> str:
            try:
                return self._detokenize(m.group(0), purpose, caller, subject, wait)
            except (TokenError, SubjectSuppressed, SubjectErased):
                return m.group(0)

        return TOKEN_RE.sub(one, text)

    # -- erasure -------------------------------------------------------------------

    def block_mark(self) -> int:
        """The highest block of token numbers handed out from this catalog so far."""
        return self._store.block_mark()

    def skip_blocks(self, through: int) -> None:
        """Hand out no block of token numbers up to ``through`` (a restored catalog
        takes the live one's mark: no number is issued twice)."""
        self._store.skip_blocks(through)

    def drop_subject(self, subject_ref: str, scope: str | None = None) -> int:
        """Delete the subject's (scope's) token rows physically, held ones and what
        dead processes' journals hold included (the subject is suppressed by now, so
        recovery drops its rows and deletes the segments); returns how many went."""
        self._group.recover_quietly()
        dropped = self._group.drop(subject_ref, scope)
        return dropped + self._store.delete_subject(subject_ref, scope)

    def count(self, subject_ref: str, scope: str | None = None) -> int:
        """Stored tokens of the subject (or of one of its scopes)."""
        return self._store.count(subject_ref, scope)

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
        suppression they are then erased and counted with the rest; after it a flush
        drops the suppressed subject's held ones. (The subject's keys live in the
        keyring's cache, which the keyring evicts when it destroys them.)"""
        del subject_ref  # a flush stores every subject's held tokens at once
        self.flush()
