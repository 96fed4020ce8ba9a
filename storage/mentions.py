"""Mentions found, not only declared (``ks.subjects``, and every memory write).

A subject (or the application for it) registers identifiers: e-mail addresses,
phone numbers, resident ids and names. Each is normalised and stored in the catalog
only as a keyed lookup hash (``HMAC-SHA256`` under the keyring's ``identifier-key``
system secret, truncated to 128 bits), never in clear. Every value written under
another subject is then scanned: e-mails, phones and resident ids by the vault's
detector (``keyshred.vault.detect``), names as the word n-grams (1-4 words) of the
text; the candidates are normalised the same way, hashed, looked up in one catalog
query per batch, and the subjects they belong to become mentions of the memory
(so erasing one of them reaches it, like a declared mention).

Normal forms (registration and detection use the same functions):

- e-mail: Unicode NFKC, trimmed, casefolded;
- phone: E.164 (``+`` and digits) as ``phonenumbers`` parses it, numbers without a
  country code read in ``PHONE_REGION`` (the detector's region: mainland mobiles);
- resident id: NFKC, separators (anything not a letter or digit) removed, upper case;
- name: NFKC, casefolded, its words joined by one space (punctuation between words
  and runs of whitespace do not count; a number is no word of a name); CJK
  ideographs are words of one character each, joined without a space, so ``张伟``
  matches inside ``电话给张伟了``.

Each registered normal form is also kept sealed under the subject's own key (the
internal scope ``~identifiers``), next to its hash: erasing the subject destroys
that key, so its sealed values die with it. The identifier key is not re-wrapped
like other system secrets but replaced at every live KEK rotation
(``Keyring.rotate_kek``, ``maintain_live``): a new version under the new epoch,
every row re-hashed from its sealed value in one catalog transaction (rows whose
subject's key is gone deleted), then the old version's secret row deleted. It was
only ever wrapped under older epochs, so once those are destroyed the hashes left
in dead tuples, WAL, replicas and archives can no longer be recomputed, and
low-entropy identifiers (phones, resident ids) cannot be enumerated from them.
Rows from before sealed values (a migrated catalog) cannot be re-hashed: they are
kept, matching nothing after the first rotation, until the subject registers the
identifier again. The re-hash reads the whole table in one transaction (fine for
the table sizes seen so far; a very large one would need batching with both
versions looked up meanwhile).

The catalog records which version its hashes are under. A registration hashed
under another version is refused in its transaction and redone; detection reads
the version at most once per ``KINDS_TTL`` (one small query), so a process whose
key another process rotated misses matches for at most that long (the window a
registration from another process has anyway).

Registration is not retroactive: values written before an identifier was
registered are not scanned again.

Which kinds were ever registered (names by their number of words) is cached per
process (``KINDS_TTL``): a kind, once seen, stays (the catalog never deletes that
row); while a kind is unseen the catalog is asked again at most once per
``KINDS_TTL`` seconds, and a registration in this process is seen at once. So a
deployment that registers nothing pays no detection and no query, one without names
generates no n-grams, and one whose names all have two words generates only pairs
of words; a registration made by another process is applied by this one at most
``KINDS_TTL`` later (a window that exists anyway between a registration and a
concurrent write).
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from keyshred.errors import InvalidInput, KeyNotFound, KeyshredError, SubjectErased
from keyshred.keyring import _primitives as prim
from keyshred.keyring.envelope import Place
from keyshred.keyring.keyring import Keyring
from keyshred.storage.catalog import Catalog
from keyshred.storage.policy import Policy
from keyshred.vault.detect import default_spans

__all__ = [
    "EMAIL",
    "KINDS",
    "KINDS_TTL",
    "NAME",
    "PHONE",
    "PHONE_REGION",
    "RESIDENT_ID",
    "MentionFinder",
    "SubjectsApi",
    "name_grams",
    "normalize",
    "walk_texts",
]

EMAIL = "email"
PHONE = "phone"
RESIDENT_ID = "resident_id"
NAME = "name"
KINDS = (EMAIL, PHONE, RESIDENT_ID, NAME)
PHONE_REGION = "CN"
KINDS_TTL = 1.0  # seconds an unseen kind is believed absent (see the module doc)
MAX_NAME_WORDS = 4
# A registered name has at least two words (two ideographs: 张伟): a one-word name
# ("May", "Will") matches every text that uses the word, and each match makes that
# text co-owned by the subject, so its erasure would destroy other people's data.
MIN_NAME_WORDS = 2
MAX_IDENTIFIER_CHARS = 1024
_DOMAIN = b"keyshred/identifier\x00"
# The internal key scope a subject's registered identifiers are sealed under (its
# erasure destroys it with every other key of the subject).
IDENTIFIER_SCOPE = "~identifiers"
_HASH_BYTES = 16
# The detector's kinds and the identifier kinds they are matched against.
_DETECTED = {"EMAIL": EMAIL, "PHONE": PHONE, "CN_ID": RESIDENT_ID}
_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
# A word: letters and digits, with inner apostrophes or hyphens (o'brien, jean-luc),
# or one CJK ideograph (Chinese writes no space between words).
_WORD = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+(?:['\-][^\W_{_CJK}]+)*")
_NOT_ALNUM = re.compile(r"[\W_]+")
_MAX_DEPTH = 512  # deeper values are refused by the store (storage.max_value_depth)
_BIG = 10**20  # integers below this many digits are read as text (phones, ids)


class _Item(Protocol):
    """What the finder reads of a ``PutItem``."""

    @property
    def namespace(self) -> Any: ...
    @property
    def key(self) -> Any: ...
    @property
    def value(self) -> Any: ...
    @property
    def scope(self) -> Any: ...


def _mark(kind: str, normal: str) -> str:
    """What the catalog's kinds table records of a registration: the kind, and for a
    name its number of words (only n-grams of registered lengths are looked up)."""
    return f"{NAME}:{len(_words(normal))}" if kind == NAME else kind


_ALL_MARKS = frozenset(
    {EMAIL, PHONE, RESIDENT_ID} | {f"{NAME}:{n}" for n in range(1, MAX_NAME_WORDS + 1)}
)


def _fold(text: str) -> str:
    # The typographic apostrophe is the ASCII one in a name (O’Brien, O'Brien).
    return unicodedata.normalize("NFKC", text).casefold().replace("’", "'")


def _words(text: str) -> list[str]:
    return _WORD.findall(_fold(text))


def _join(words: Sequence[str]) -> str:
    # Ideographs join without a space (张伟), other words with one; a mixed name
    # keeps a space only between words that are not both ideographs.
    if len(words) == 1:
        return words[0]
    out = [words[0]]
    for prev, word in itertools.pairwise(words):
        if not (_is_cjk(prev) and _is_cjk(word)):
            out.append(" ")
        out.append(word)
    return "".join(out)


_CJK_RE = re.compile(rf"[{_CJK}]")
_ALL_LENGTHS = tuple(range(1, MAX_NAME_WORDS + 1))
_DIGIT = re.compile(r"\d")


def _is_cjk(char: str) -> bool:
    return len(char) == 1 and _CJK_RE.fullmatch(char) is not None


def name_grams(text: str, lengths: Iterable[int] = _ALL_LENGTHS) -> list[str]:
    """The normal forms of every run of 1-4 words (of ``lengths`` words) of
    ``text``, shorter runs first; a number (a word of digits only) is no part of a
    name. The write path's hottest loop: list comprehensions, no generator."""
    normal = _fold(text)
    words = _WORD.findall(normal)
    wanted = sorted(set(lengths))
    if not words or not wanted:
        return []
    # Most texts hold no ideograph: their names are words joined by a space.
    join = _join if _CJK_RE.search(normal) is not None else " ".join
    runs = [words]
    if _DIGIT.search(normal) is not None and any(w.isdigit() for w in words):
        runs = [[]]
        for w in words:
            if w.isdigit():
                runs.append([])
            else:
                runs[-1].append(w)
    out: list[str] = []
    for n in wanted:
        for run in runs:
            if n == 1:
                out += run
            else:
                out += [join(run[i : i + n]) for i in range(len(run) - n + 1)]
    return out


_MOBILE = re.compile(r"(?:\+?(?:00)?86)?(1[3-9]\d{9})")
_PHONE_SEPARATORS = re.compile(r"[\s\-]+")
_E164 = re.compile(r"\+[1-9][0-9]{6,14}")


def _phone(value: str) -> str | None:
    # Two shapes ``phonenumbers`` formats as they are, answered without its parse
    # (a tenth of a millisecond a number): a mainland mobile (the detector's
    # commonest phone), and ``+`` and digits of a country code whose regions strip
    # no national prefix, or only a trunk ``0`` that this number does not have.
    compact = _PHONE_SEPARATORS.sub("", value)
    mobile = _MOBILE.fullmatch(compact)
    if mobile is not None:
        return "+86" + mobile.group(1)
    import phonenumbers

    if _E164.fullmatch(compact) is not None:
        for n in (1, 2, 3):
            prefix = _trunk_prefix(int(compact[1 : 1 + n]))
            if prefix is not None:
                if prefix == "" or compact[1 + n] != "0":
                    return compact
                break

    try:
        number = phonenumbers.parse(value, PHONE_REGION)
    except phonenumbers.NumberParseException:
        return None
    if not phonenumbers.is_possible_number(number):
        return None
    return str(phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164))


@functools.lru_cache(maxsize=1024)
def _trunk_prefix(code: int) -> str | None:
    """For a country calling code whose regions all parse a national number
    unchanged (``""``) or drop only a leading ``0`` (``"0"``), that; otherwise (an
    unknown code, carrier codes, transform rules) None: ask ``phonenumbers``."""
    from phonenumbers import COUNTRY_CODE_TO_REGION_CODE, PhoneMetadata

    regions = COUNTRY_CODE_TO_REGION_CODE.get(code)
    if not regions:
        return None
    prefixes = set()
    for region in regions:
        md: Any = (
            PhoneMetadata.metadata_for_nongeo_region(code)
            if region == "001"
            else PhoneMetadata.metadata_for_region(region)
        )
        if md is None or md.national_prefix_transform_rule is not None:
            return None
        prefixes.add(md.national_prefix_for_parsing or "")
    if prefixes <= {"", "0"}:
        return "0" if "0" in prefixes else ""
    return None


def normalize(kind: str, value: str) -> str | None:
    """``value``'s normal form as an identifier of ``kind``, or None if it cannot be
    one (an e-mail without ``@``, an unparsable phone, a name of no or too many
    words)."""
    text = unicodedata.normalize("NFKC", value)
    if kind == EMAIL:
        text = text.strip().casefold()
        local, at, domain = text.partition("@")
        return text if at and local and domain and not any(c.isspace() for c in text) else None
    if kind == PHONE:
        return _phone(text)
    if kind == RESIDENT_ID:
        text = _NOT_ALNUM.sub("", text).upper()
        return text or None
    if kind == NAME:
        words = _words(text)
        if not 0 < len(words) <= MAX_NAME_WORDS or any(w.isdigit() for w in words):
            return None
        return _join(words)
    raise InvalidInput(f"unknown identifier kind {kind!r}")


def _digest(key: bytes, kind: str, normal: str) -> str:
    message = _DOMAIN + kind.encode("ascii") + b"\x00" + normal.encode("utf-8", "surrogatepass")
    return prim.hmac_sha256(key, message)[:_HASH_BYTES].hex()


class MentionFinder:
    """Registered identifiers: their hashes in the catalog, and the search for them
    in values written under other subjects (``MemoryStore._put_rows``)."""

    def __init__(
        self,
        catalog: Catalog,
        keyring: Keyring,
        policy: Policy,
        *,
        max_chars: int = 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._catalog = catalog
        self._keyring = keyring
        self._policy = policy
        self._max_chars = max_chars  # a longer value is refused by the store anyway
        self._clock = clock
        self._key: bytes | None = None
        self._version = 0  # of ``_key``
        self._version_read = float("-inf")
        keyring.identifier_rehash = self.rehash
        self._kinds: frozenset[str] = frozenset()
        self._kinds_read = float("-inf")
        self._lock = threading.Lock()

    # -- hashing -------------------------------------------------------------------

    def _refresh_key(self, *, force: bool = False) -> None:
        """Follow the catalog's identifier key version (a rotation in another
        process), read at most once per ``KINDS_TTL`` unless ``force``."""
        now = self._clock()
        if not force and self._key is not None and now - self._version_read < KINDS_TTL:
            return
        version = self._catalog.identifier_version()
        if version != self._version or self._key is None:
            key = self._keyring.identifier_key(version)
            with self._lock:
                self._key, self._version = key, version
        self._version_read = now

    def _hash(self, kind: str, normal: str) -> str:
        key = self._key
        if key is None:
            self._refresh_key(force=True)
            key = self._key
            assert key is not None  # noqa: S101 - just set
        return _digest(key, kind, normal)

    # -- registration --------------------------------------------------------------

    def register(self, subject_ref: str, identifiers: Iterable[tuple[str, str]]) -> int:
        """Store the hashes of ``(kind, value)`` identifiers of a subject (refused
        for a suppressed or erased subject); returns how many were new."""
        pairs: dict[tuple[str, str], None] = {}
        marks: set[str] = set()
        for kind, value in identifiers:
            if not isinstance(value, str) or not value or len(value) > MAX_IDENTIFIER_CHARS:
                raise InvalidInput(
                    f"{kind} identifiers are non-empty strings of at most "
                    f"{MAX_IDENTIFIER_CHARS} characters"
                )
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidInput(f"{kind} identifiers are valid Unicode text") from None
            normal = normalize(kind, value)
            if normal is None:
                # The message names the kind, never the value.
                extra = f" ({MIN_NAME_WORDS}-{MAX_NAME_WORDS} words)" if kind == NAME else ""
                raise InvalidInput(f"a value to register is not a valid {kind}{extra}")
            if kind == NAME and len(_words(normal)) < MIN_NAME_WORDS:
                raise InvalidInput(
                    f"a name to register has {MIN_NAME_WORDS}-{MAX_NAME_WORDS} words: one word "
                    "would match every text using it, and erasing the subject would destroy "
                    "those texts (declare such mentions with mentions= instead)"
                )
            pairs[(kind, normal)] = None
            marks.add(_mark(kind, normal))
        if not pairs:
            return 0
        # The guard before sealing: no key is made for a suppressed or erased
        # subject (the catalog re-checks it in the transaction that stores rows).
        self._catalog.check_guard(subject_ref)
        self._refresh_key()
        for _ in range(3):
            version = self._version
            rows = {self._hash(kind, normal): (kind, normal) for kind, normal in pairs}
            added = self._catalog.add_identifiers(
                subject_ref,
                [(h, k, self._seal(subject_ref, k, n)) for h, (k, n) in rows.items()],
                marks,
                version,
            )
            if added is not None:
                break
            self._refresh_key(force=True)  # re-hashed under a new version meanwhile
        else:
            raise KeyshredError("the identifier key kept changing during a registration")
        with self._lock:
            self._kinds = self._kinds | marks
        return added

    @staticmethod
    def _place(subject_ref: str, kind: str) -> Place:
        # Bound to the subject and kind, not to the hash (it changes at a rotation).
        return Place(subject_ref, IDENTIFIER_SCOPE, "ks_identifiers", kind, "sealed")

    def _seal(self, subject_ref: str, kind: str, normal: str) -> bytes:
        return self._keyring.seal(normal.encode("utf-8"), self._place(subject_ref, kind))

    def rehash(self, version: int, key: bytes) -> tuple[int, int, int]:
        """Re-hash every registered identifier under identifier key ``version`` from
        its sealed normal form (``Keyring.rotate_kek`` calls it, see
        ``Catalog.rehash_identifiers``): one catalog transaction; a row whose
        subject's key was destroyed is deleted. Returns (re-hashed, deleted, kept)."""

        def one(subject_ref: str, kind: str, sealed: bytes) -> str | None:
            try:
                normal = self._keyring.open(sealed, self._place(subject_ref, kind)).decode()
            except (SubjectErased, KeyNotFound):
                return None
            return _digest(key, kind, normal)

        result = self._catalog.rehash_identifiers(version, one)
        with self._lock:
            self._key, self._version = key, version
            self._version_read = self._clock()
        return result

    def forget(self, subject_ref: str) -> int:
        return self._catalog.delete_identifiers(subject_ref)

    def kinds(self) -> frozenset[str]:
        """The kinds registered so far, names as ``name:<words>`` (see the module
        doc for the caching)."""
        kinds = self._kinds
        if kinds >= _ALL_MARKS:
            return kinds
        now = self._clock()
        if now - self._kinds_read < KINDS_TTL:
            return kinds
        fresh = self._catalog.identifier_kinds()
        with self._lock:
            self._kinds = kinds = self._kinds | fresh
            self._kinds_read = now
        return kinds

    # -- detection -----------------------------------------------------------------

    def find(self, holder_ref: str, items: Sequence[_Item]) -> list[frozenset[str]]:
        """Per item, the subjects (refs, never the holder) whose registered
        identifiers appear in its namespace, key or any string of its value; one
        catalog query for the batch, none when nothing could match."""
        none: frozenset[str] = frozenset()
        kinds = self.kinds()
        if not kinds:
            return [none] * len(items)
        self._refresh_key()
        per_item = self._candidates(items, kinds)
        wanted = set().union(*per_item) if per_item else set()
        if not wanted:
            return [none] * len(items)
        owners: dict[str, set[str]] = {}
        for digest, ref in self._catalog.identifier_subjects(wanted):
            if ref != holder_ref:
                owners.setdefault(digest, set()).add(ref)
        if not owners:
            return [none] * len(items)
        return [
            frozenset(r for h in hashes if h in owners for r in owners[h]) for hashes in per_item
        ]

    def _candidates(self, items: Sequence[_Item], kinds: frozenset[str]) -> list[set[str]]:
        lengths = [n for n in _ALL_LENGTHS if f"{NAME}:{n}" in kinds]
        detected = {k: v for k, v in _DETECTED.items() if v in kinds}
        normals: dict[tuple[str, str], str | None] = {}  # per batch: values repeat
        enabled: dict[str, bool] = {}  # scope -> detect_mentions
        hashes: dict[tuple[str, str], str] = {}  # (kind, normal form) -> hash, per batch
        names: dict[str, str] = {}  # name n-gram -> hash, per batch
        out: list[set[str]] = []
        for item in items:
            found: set[str] = set()
            out.append(found)
            scope = item.scope
            detect = enabled.get(scope) if isinstance(scope, str) else None
            if detect is None and scope is None:
                # A vault token's value: vault scopes are no declared scopes, and a
                # value that is a registered identifier is always looked up.
                detect = True
            if detect is None:
                # An unknown scope or a scope that is not a name raises here as it
                # would a line later in the store.
                detect = enabled[scope] = self._policy.scope(scope).detect_mentions
            if not detect:
                continue
            texts = _texts(item, self._max_chars)
            if texts is None:
                continue  # too large: the store refuses it (ValueTooLarge)
            pairs: set[tuple[str, str]] = set()
            grams: set[str] = set()
            if detected:
                joined = "\n".join(texts)  # no detector pattern spans a line break
                for span in default_spans(joined):
                    kind = detected.get(span[4])
                    if kind is not None:
                        normal = normals.get((kind, span[5]), "")
                        if normal == "":
                            normal = normals[(kind, span[5])] = normalize(kind, span[5])
                        if normal is not None:
                            pairs.add((kind, normal))
            if lengths:
                for text in texts:
                    grams.update(name_grams(text, lengths))
            for pair in pairs:
                digest = hashes.get(pair)
                if digest is None:
                    digest = hashes[pair] = self._hash(*pair)
                found.add(digest)
            for gram in grams:
                digest = names.get(gram)
                if digest is None:
                    digest = names[gram] = self._hash(NAME, gram)
                found.add(digest)
        return out


def walk_texts(*roots: Any) -> Iterator[str]:
    """Every string in JSON-like values (keys of mappings included), and every
    integer of fewer than 20 digits as its digits (a phone or an id kept as a
    number). Iterative, each container once, no deeper than the store allows: a
    value that nests too deeply or refers to itself is refused by the store, not
    here."""
    stack: list[tuple[Any, int]] = [(root, 0) for root in roots]
    seen: set[int] = set()
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            yield node
        elif type(node) is int and -_BIG < node < _BIG:
            yield str(node)
        elif isinstance(node, Mapping | list | tuple) and depth < _MAX_DEPTH:
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, Mapping):
                stack.extend((k, depth + 1) for k in node)
                stack.extend((v, depth + 1) for v in node.values())
            else:
                stack.extend((v, depth + 1) for v in node)


def _texts(item: _Item, max_chars: int) -> list[str] | None:
    """Every text of the item (``walk_texts``): namespace labels, key, the value's
    strings, object keys and integers; None past ``max_chars``."""
    out: list[str] = []
    size = 0
    for text in walk_texts(item.value, item.key, item.namespace):
        size += len(text)
        if size > max_chars:
            return None
        out.append(text)
    return out


class SubjectsApi:
    """``ks.subjects``: identifiers of a subject, so that values written under other
    subjects that contain them count as mentioning it."""

    def __init__(
        self, finder: MentionFinder, subject_ref: Callable[[Any], str], audit: Any = None
    ) -> None:
        self._finder = finder
        self._ref = subject_ref
        self._audit = audit

    def register_identifiers(
        self,
        subject: Any,
        *,
        emails: Iterable[str] = (),
        phones: Iterable[str] = (),
        resident_ids: Iterable[str] = (),
        names: Iterable[str] = (),
    ) -> int:
        """Register identifiers of ``subject`` (stored only as keyed lookup hashes);
        returns how many were new. From now on a value written under another subject
        that contains one mentions ``subject`` (scopes with ``detect_mentions``).
        ``SubjectSuppressed`` for a suppressed or erased subject; ``InvalidInput``
        for a value that is not an identifier of its kind (the message never shows
        it). Names are 2-4 words (``MIN_NAME_WORDS``; two ideographs for CJK): a
        one-word name would make every text using the word co-owned by the subject."""
        pairs: list[tuple[str, str]] = []
        for kind, values in (
            (EMAIL, emails),
            (PHONE, phones),
            (RESIDENT_ID, resident_ids),
            (NAME, names),
        ):
            if isinstance(values, str | bytes) or not isinstance(values, Iterable):
                raise InvalidInput(f"{kind}s is a list of strings")
            pairs += [(kind, v) for v in values]
        ref = self._ref(subject)
        added = self._finder.register(ref, pairs)
        if self._audit is not None and added:
            self._audit.record("subject.identifiers_registered", subject_ref=ref, added=added)
        return added

    def forget_identifiers(self, subject: Any) -> int:
        """Delete every registered identifier of ``subject``; returns how many. Later
        writes no longer find it; mentions found before stay."""
        ref = self._ref(subject)
        removed = self._finder.forget(ref)
        if self._audit is not None and removed:
            self._audit.record("subject.identifiers_forgotten", subject_ref=ref, removed=removed)
        return removed
