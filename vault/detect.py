"""Detection of personal data in free text: pluggable recognizers, one result type.

Built-in recognizers (``default_recognizers``): email, phone (mainland China mobile
``1[3-9]`` and nine digits, recognized by its shape in context; international E.164,
validated with ``phonenumbers``), mainland resident ID (18 digits, ISO 7064 MOD 11-2
check digit, trailing ``X``), bank and credit cards (13–19 digits, Luhn; UnionPay
included), IBAN (ISO 13616 mod-97) and IPv4/IPv6 (validated with ``ipaddress``).

Full-width digits and letters (``１３８１２３４５６７８``, typed in a Chinese input
method's full-width mode) are read as their ASCII forms; values are reported as
written.

Boundaries are explicit ASCII lookarounds, not ``\\b``: in Python's Unicode regexes
Chinese characters are word characters, so ``\\b`` would miss ``电话13812345678谢谢``.
Overlapping candidates are resolved by validation strength (a checksummed ID beats a
Luhn-valid card of the same digits), then by length.

A ``Finding``'s repr never shows the value.

Why one module of ~650 lines: it holds the built-in recognizers (each a pattern plus
its checksum or validator) beside the ``detect``/``redact`` engine they plug into, so
that a recognizer's pattern and its context rules are read next to each other.
"""

from __future__ import annotations

import functools
import ipaddress
import operator
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, Protocol

__all__ = [
    "KINDS",
    "Finding",
    "Recognizer",
    "RegexRecognizer",
    "default_recognizers",
    "default_spans",
    "detect",
    "from_presidio",
    "iban_valid",
    "luhn_valid",
    "redact",
    "redact_findings",
    "resident_id_valid",
]

KINDS = ("EMAIL", "PHONE", "CN_ID", "CARD", "IBAN", "IP")
_PRIORITY = {"CN_ID": 0, "IBAN": 1, "EMAIL": 2, "CARD": 3, "PHONE": 4, "IP": 5}


class Finding(NamedTuple):
    """One detected value. Immutable; a named tuple because detection builds one
    per value on the hot path (half the cost of a frozen dataclass). Its repr
    never shows the value."""

    kind: str
    start: int
    end: int
    value: str
    score: float = 1.0

    def __repr__(self) -> str:
        return f"Finding(kind={self.kind!r}, start={self.start}, end={self.end})"

    def __str__(self) -> str:
        return self.__repr__()


class Recognizer(Protocol):
    kind: str

    def find(self, text: str) -> Iterable[Finding]: ...


# Luhn without a Python loop: digits in odd places from the right are summed as
# they are, those in even places through a table of their doubled digit sums.
_DOUBLED = bytes.maketrans(b"0123456789", bytes((0, 2, 4, 6, 8, 1, 3, 5, 7, 9)))
_PLAIN = bytes.maketrans(b"0123456789", bytes(range(10)))


def luhn_valid(digits: str) -> bool:
    if not digits.isdigit() or not digits.isascii():
        return False
    raw = digits.encode("ascii")
    return (sum(raw[-1::-2].translate(_PLAIN)) + sum(raw[-2::-2].translate(_DOUBLED))) % 10 == 0


_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"


def resident_id_valid(value: str) -> bool:
    value = value.upper()
    head = value[:17]
    if len(value) != 18 or not head.isdigit() or not head.isascii():
        return False
    total = sum(map(operator.mul, head.encode("ascii").translate(_PLAIN), _ID_WEIGHTS))
    return _ID_CHECK[total % 11] == value[17]


def iban_valid(value: str) -> bool:
    compact = value.replace(" ", "").upper()
    if not 15 <= len(compact) <= 34 or not compact[:2].isalpha() or not compact[2:4].isdigit():
        return False
    rearranged = (compact[4:] + compact[:4]).translate(_IBAN_LETTERS)
    if not rearranged.isdigit() or not rearranged.isascii():
        return False
    return int(rearranged) % 97 == 1


# ISO 13616: letters count as two-digit numbers, A = 10 … Z = 35.
_IBAN_LETTERS = {ord(c): str(ord(c) - 55) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"}


class RegexRecognizer:
    """A pattern plus an optional validator; the building block for custom kinds."""

    def __init__(
        self,
        kind: str,
        pattern: str,
        validate: Any = None,
        *,
        flags: int = 0,
        normalize: Any = None,
        needs: str | None = None,
    ) -> None:
        self.kind = kind
        self._needs = needs  # a character the value cannot lack: skip texts without it
        self._re = re.compile(pattern, flags)
        self._validate = validate
        self._normalize = normalize

    def find(self, text: str) -> Iterable[Finding]:
        if self._needs is not None and self._needs not in text:
            return
        for m in self._re.finditer(text):
            value = m.group(0)
            candidate = self._normalize(value) if self._normalize else value
            if self._validate is None or self._validate(candidate):
                yield Finding(self.kind, m.start(), m.end(), value)


_SEPARATORS = str.maketrans("", "", " -")


def _digits(value: str) -> str:
    return value.translate(_SEPARATORS)


def _phone_validator() -> Any:
    """E.164 candidates (``+`` and digits). Fast path: country codes are prefix-free,
    so the first 1-3 digits that name one split the number, and the number is built
    directly; only a number that fails there goes through ``phonenumbers.parse``
    (which also accepts a trunk prefix after the country code). Same answers as
    ``parse`` alone on 60,000 random candidates and every region's examples."""
    import phonenumbers
    from phonenumbers import COUNTRY_CODE_TO_REGION_CODE

    def slow(value: str) -> bool:
        try:
            number = phonenumbers.parse(value, "CN")
        except phonenumbers.NumberParseException:
            return False
        return bool(phonenumbers.is_valid_number(number))

    def fast(value: str) -> bool:
        digits = value[1:]
        if not value.startswith("+") or not digits.isdigit() or not digits.isascii():
            return False
        for n in (1, 2, 3):
            code = int(digits[:n])
            regions = COUNTRY_CODE_TO_REGION_CODE.get(code)
            if regions:
                national = digits[n:]
                if not national:
                    return False
                if regions[0] != "001" and national[0] != "0":
                    # Geographic regions, no leading zero: their compiled patterns
                    # decide, as ``is_valid_number`` does (``_region_rules``).
                    for leading, general, types in _region_rules(code, len(national)):
                        if leading is not None:
                            if leading.match(national):
                                return bool(
                                    general.fullmatch(national) and types.fullmatch(national)
                                )
                        elif general.fullmatch(national) and types.fullmatch(national):
                            return True
                    return False
                number = phonenumbers.PhoneNumber(country_code=code, national_number=int(national))
                zeros = len(national) - len(national.lstrip("0"))
                if zeros:
                    number.italian_leading_zero = True
                    if zeros > 1:
                        number.number_of_leading_zeros = zeros
                return bool(phonenumbers.is_valid_number(number))
        return False

    def valid(value: str) -> bool:
        return fast(value) or slow(value)

    return valid


@functools.lru_cache(maxsize=4096)
def _region_rules(
    code: int, length: int
) -> tuple[tuple[re.Pattern[str] | None, re.Pattern[str], re.Pattern[str]], ...]:
    """How ``phonenumbers`` picks the region of a number of calling code ``code``
    with ``length`` national digits, compiled: regions in order; one with leading
    digits is picked if they match the number's start, one without if the number
    is of a known type there; the number is valid if it is a known type of the
    region picked (general pattern, then the alternation of the types)."""
    from phonenumbers import COUNTRY_CODE_TO_REGION_CODE, PhoneMetadata

    rules = []
    for region in COUNTRY_CODE_TO_REGION_CODE.get(code, ()):
        md: Any = PhoneMetadata.metadata_for_region(region)
        if md is None:
            continue
        leading = re.compile(md.leading_digits) if md.leading_digits is not None else None
        rules.append((leading, *_region_patterns(region, length)))
    return tuple(rules)


@functools.lru_cache(maxsize=1024)
def _region_patterns(region: str, length: int) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The general pattern of ``region`` and the alternation of its number types
    that admit national numbers of ``length`` digits (``phonenumbers`` metadata)."""
    from phonenumbers import PhoneMetadata

    md: Any = PhoneMetadata.metadata_for_region(region)
    never = re.compile(r"(?!)")
    if md is None:
        return never, never

    def admits(desc: Any) -> bool:
        return (
            desc is not None
            and bool(desc.national_number_pattern)
            and (not desc.possible_length or length in desc.possible_length)
        )

    general = (
        re.compile(md.general_desc.national_number_pattern) if admits(md.general_desc) else never
    )
    descs = (
        md.premium_rate,
        md.toll_free,
        md.shared_cost,
        md.voip,
        md.personal_number,
        md.pager,
        md.uan,
        md.voicemail,
        md.fixed_line,
        md.mobile,
    )
    alternatives = [f"(?:{d.national_number_pattern})" for d in descs if admits(d)]
    types = re.compile("|".join(alternatives)) if alternatives else never
    return general, types


class _IPv6Recognizer:
    """IPv6 needs trimming rather than lookarounds: in ``Contact:2001:db8::1`` the
    candidate run of hex digits and colons starts at the label's colon."""

    kind = "IP"
    _run = re.compile(r"[0-9A-Fa-f:]{2,41}")

    def find(self, text: str) -> Iterable[Finding]:
        for start, end, value in self.spans(text):
            yield Finding(self.kind, start, end, value)

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """``(start, end, value)`` of every address (``find`` without ``Finding``s)."""
        at, last = text.find(":"), text.rfind(":")
        if at == last:
            return []  # fewer than two colons: no address
        # Only runs that hold colons can hold an address: start with the run that
        # holds the first colon (from its own start: a run longer than 41 characters
        # is cut in pieces counted from there), stop after the one holding the last.
        # Before the first colon only hex digits can belong to that run.
        while at > 0 and text[at - 1] in _HEX_DIGITS:
            at -= 1
        return self.scan(text, at, last)

    def scan(self, text: str, at: int, last: int) -> list[tuple[int, int, str]]:
        """The addresses in the runs that start from ``at`` (a run's start) up to
        ``last``; ``scan(text, 0, len(text))`` looks at every run."""
        out: list[tuple[int, int, str]] = []
        for m in self._run.finditer(text, at):
            if m.start() > last:
                break
            if m.group().count(":") < 2:
                continue  # a time, a label: no address has fewer than two colons
            start, end = m.start(), m.end()
            if text[start] == ":" and not text.startswith("::", start):
                start += 1
            if text[end - 1] == ":" and text[end - 2 : end] != "::":
                end -= 1
            if start > 0 and text[start - 1].isascii() and text[start - 1].isalnum():
                continue  # glued to a word such as "af12:..." inside a longer token
            value = text[start:end]
            if _ipv6_valid(value):
                out.append((start, end, value))
        return out


_HEX_DIGITS = frozenset("0123456789ABCDEFabcdef")
_H = r"[0-9A-Fa-f]{1,4}"
# What ``ipaddress.IPv6Address`` accepts among strings of hex digits and colons
# (eight groups, or fewer around one "::"), without its per-call parsing; a test
# compares the two on a million random strings.
_IPV6_HEX = re.compile(
    rf"(?:{_H}:){{7}}{_H}"
    rf"|(?:{_H}:){{1,7}}:"
    rf"|(?:{_H}:){{1,6}}:{_H}"
    rf"|(?:{_H}:){{1,5}}(?::{_H}){{1,2}}"
    rf"|(?:{_H}:){{1,4}}(?::{_H}){{1,3}}"
    rf"|(?:{_H}:){{1,3}}(?::{_H}){{1,4}}"
    rf"|(?:{_H}:){{1,2}}(?::{_H}){{1,5}}"
    rf"|{_H}:(?::{_H}){{1,6}}"
    rf"|:(?:(?::{_H}){{1,7}}|:)"
)
_HEX_COLON = re.compile(r"[0-9A-Fa-f:]*")


def _ipv6_valid(value: str) -> bool:
    if value.count(":") < 2 or not value.strip(":0"):
        return False  # "::" and "::0" name no host
    if _HEX_COLON.fullmatch(value):
        return _IPV6_HEX.fullmatch(value) is not None
    try:
        ipaddress.IPv6Address(value)
    except ValueError:
        return False
    return True


_EMAIL = (
    r"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9][A-Za-z0-9._%+\-]{0,63}@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}"
    r"(?![A-Za-z0-9\-])"
)
_CN_ID = (
    r"(?<![0-9A-Za-z])[1-9]\d{5}(?:18|19|20)\d{2}(?:0[1-9]|1[0-2])"
    r"(?:0[1-9]|[12]\d|3[01])\d{3}[\dXx](?![0-9A-Za-z])"
)
# No card number starts with 0 (ISO/IEC 7812: industry identifier 0 is not issued to
# card issuers); a digit run that does is a mobile after its ``0086`` prefix, or a
# serial, not a card that would take the mobile's place.
_CARD = r"(?<![0-9A-Za-z+\-])[1-9](?:[ \-]?\d){12,18}(?![0-9A-Za-z])"
# A mainland mobile is ``1[3-9]`` and nine digits by the numbering plan, whatever
# prefix is allocated today: no ``phonenumbers`` metadata check (a number of a prefix
# allocated after the metadata was published, or mistyped, is still someone's
# number). Precision comes from the context instead: the digits stand alone, not
# inside a longer run, a longer alphanumeric token, a dash-joined chain of digit
# groups (``2026-13812345678``, ``138-1234-5678-0002``: unless the neighbour is a
# whole mobile, ``13812345678-13912345678`` is a list), before a decimal part
# (``13812345678.00``), after a currency sign (``¥13800138000``) or ``0.`` (a
# fraction). Another digit and a dot before do not refuse it: ``1.13812345678``
# numbers a list more often than it is a decimal of eleven places. ``86`` before it
# is a country code even without ``+`` when a space or a dash follows. ASCII digits
# only. Past the end of a match, only digits, a dash and the two characters after
# them are looked at (``_DefaultDetector`` relies on it).
_CN_MOBILE = (
    r"(?<![0-9A-Za-z+¥￥$€£])(?<!0\.)(?:(?<![0-9]-)|(?<=1[3-9][0-9]{9}-))"
    r"(?:(?:\+|00)86[ \-]?|86[ \-])?1[3-9][0-9](?:[ \-]?[0-9]){8}"
    r"(?![0-9A-Za-z]|\.[0-9]|-(?!1[3-9][0-9]{9}(?![0-9A-Za-z]))[0-9])"
)
_E164 = r"(?<![0-9A-Za-z+])\+[1-9](?:[ \-]?\d){6,14}(?![0-9A-Za-z])"
# The first letter comes before the lookbehind (same language; the regex engine can
# then skip to candidate letters instead of testing the lookbehind everywhere).
_IBAN = r"[A-Z](?<![A-Za-z0-9][A-Z])[A-Z]\d{2}(?: ?[A-Z0-9]){11,30}(?![A-Za-z0-9])"
_IPV4 = (
    r"(?<![0-9.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}"
    r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![0-9]|\.\d)"
)


def _card_valid(digits: str) -> bool:
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


def default_recognizers() -> list[Recognizer]:
    phone_ok = _phone_validator()
    return [
        RegexRecognizer("EMAIL", _EMAIL, needs="@"),
        RegexRecognizer("CN_ID", _CN_ID, resident_id_valid),
        RegexRecognizer("CARD", _CARD, _card_valid, normalize=_digits),
        RegexRecognizer("PHONE", _CN_MOBILE),
        RegexRecognizer("PHONE", _E164, phone_ok, normalize=_digits, needs="+"),
        RegexRecognizer("IBAN", _IBAN, iban_valid),
        RegexRecognizer("IP", _IPV4, needs="."),
        _IPv6Recognizer(),
    ]


class _DefaultDetector:
    """The default recognizers in one function: same patterns, validators and
    overlap rule as running ``default_recognizers()`` one by one (a test compares
    both on the corpus and on random glued text), for about two thirds of the cost.

    Where the time goes otherwise is Python, not the regex engine: a generator and
    a ``Finding`` per candidate and recognizer, eight full scans. Here the four
    digit kinds (resident ID, card, mainland mobile, E.164) scan only the runs of
    ``[+0-9 -Xx]`` found by one pass, and candidates are plain tuples until the
    overlap rule has picked the winners. Scanning a run ``[s, e)`` with
    ``endpos = e + 2`` is exact: lookbehinds see the real text before ``s``, the
    lookaheads see the real run and the two characters after it (the mobile's
    refuses ``.5``), and no match can use them (the character at ``e`` is outside
    every digit pattern's alphabet).
    """

    _RUN = re.compile(r"[+0-9][0-9 \-+Xx]{6,}")

    def __init__(self) -> None:
        self._email = re.compile(_EMAIL)
        self._cn_id = re.compile(_CN_ID)
        self._card = re.compile(_CARD)
        self._mobile = re.compile(_CN_MOBILE)
        self._e164 = re.compile(_E164)
        self._iban = re.compile(_IBAN)
        self._ipv4 = re.compile(_IPV4)
        # Where an IPv4 address can start: a digit after no digit or dot, then up to
        # two digits, a dot and a digit. The digit comes before the lookbehind, so the
        # engine skips to digits instead of testing the lookbehind (and the octet
        # alternation) at every position; the full pattern runs only there.
        self._ipv4_start = re.compile(r"\d(?<![0-9.]\d)\d{0,2}\.\d")
        self._ipv6 = _IPv6Recognizer()
        # Two colons with only hex digits between: a candidate IPv6 run needs it
        # (times such as "10:30" and labels such as "Note:" do not pass).
        self._two_colons = re.compile(r":[0-9A-Fa-f]*:")
        self._phone_ok = _phone_validator()

    def winners(self, text: str) -> list[tuple[int, int, int, int, str, str]]:
        """The findings as ``(priority, -length, start, end, kind, value)`` tuples,
        non-overlapping, in text order (``redact`` needs no ``Finding``); full-width
        digits and letters read as ASCII, values as written."""
        narrow = _narrow(text)
        if narrow is text:
            return self._winners(text)
        return [(*c[:5], text[c[2] : c[3]]) for c in self._winners(narrow)]

    def _winners(self, text: str) -> list[tuple[int, int, int, int, str, str]]:
        cands: list[tuple[int, int, int, int, str, str]] = []
        add = cands.append
        if "@" in text:
            for m in self._email.finditer(text):
                s, e = m.span()
                add((2, s - e, s, e, "EMAIL", m.group()))
        for run in self._RUN.finditer(text):
            lo, hi = run.span()
            size = hi - lo  # shorter runs cannot hold the longer kinds
            hi += 2
            g = run.group()
            if g.isdigit():
                # Only digits: every digit pattern's lookbehind refuses a digit, so
                # a match can only start at the run's start: one attempt each.
                # The checksums are cheaper than a regex attempt: they go first.
                if (
                    size == 18
                    and resident_id_valid(g)
                    and self._cn_id.match(text, lo, hi) is not None
                ):
                    add((0, -18, lo, lo + 18, "CN_ID", g))
                if 13 <= size <= 19 and luhn_valid(g) and self._card.match(text, lo, hi):
                    add((3, -size, lo, lo + size, "CARD", g))
                if (
                    (size == 11 and g[0] == "1") or (size == 15 and g[:5] == "00861")
                ) and self._mobile.match(text, lo, hi) is not None:
                    add((4, -size, lo, lo + size, "PHONE", g))
                continue
            digits = size - g.count(" ") - g.count("-") - g.count("+")
            if size >= 18 and digits >= 17:
                for m in self._cn_id.finditer(text, lo, hi):
                    v = m.group()
                    if resident_id_valid(v):
                        s, e = m.span()
                        add((0, s - e, s, e, "CN_ID", v))
            if digits >= 13:
                for m in self._card.finditer(text, lo, hi):
                    v = m.group()
                    d = v.translate(_SEPARATORS)
                    if 13 <= len(d) <= 19 and luhn_valid(d):
                        s, e = m.span()
                        add((3, s - e, s, e, "CARD", v))
            if digits >= 11:
                for m in self._mobile.finditer(text, lo, hi):
                    s, e = m.span()
                    add((4, s - e, s, e, "PHONE", m.group()))
            if "+" in g:
                for m in self._e164.finditer(text, lo, hi):
                    v = m.group()
                    if self._phone_ok(v.translate(_SEPARATORS)):
                        s, e = m.span()
                        add((4, s - e, s, e, "PHONE", v))
        for m in self._iban.finditer(text):
            v = m.group()
            if iban_valid(v):
                s, e = m.span()
                add((1, s - e, s, e, "IBAN", v))
        if "." in text:
            for hit in self._ipv4_start.finditer(text):
                ip = self._ipv4.match(text, hit.start())
                if ip is not None:
                    s, e = ip.span()
                    add((5, s - e, s, e, "IP", ip.group()))
        if text.count(":") > 1 and self._two_colons.search(text) is not None:
            for s, e, v in self._ipv6.spans(text):
                add((5, s - e, s, e, "IP", v))
        if len(cands) < 2:
            return cands
        cands.sort()
        taken: list[tuple[int, int, int, int, str, str]] = []
        for c in cands:
            start, end = c[2], c[3]
            for t in taken:
                if start < t[3] and end > t[2]:
                    break  # overlaps a stronger finding
            else:
                taken.append(c)
        taken.sort(key=_start_of)
        return taken

    def __call__(self, text: str) -> list[Finding]:
        new = tuple.__new__  # a Finding without its Python-level __new__ frame
        return [new(Finding, (c[4], c[2], c[3], c[5], 1.0)) for c in self.winners(text)]


def _start_of(c: tuple[int, int, int, int, str, str]) -> int:
    return c[2]


_DEFAULT: _DefaultDetector | None = None


def _default() -> _DefaultDetector:
    global _DEFAULT  # noqa: PLW0603 - built once, lazily (phonenumbers is slow to import)
    if _DEFAULT is None:
        _DEFAULT = _DefaultDetector()
    return _DEFAULT


# A Chinese input method's full-width mode types digits and Latin letters as their
# full-width forms (``１３８１２３４５６７８``): the same number to every reader. Detection
# reads them as ASCII, one code point for one so that spans do not move, and reports
# the values as written. Full-width punctuation (``，：（）``) is not touched: it is in
# most Chinese texts and is no part of any value. The ideographic space (U+3000, the
# space that mode types between digit groups) and the no-break space (a paste) read
# as a space: a separator to every reader.
_NARROW = {0xFF10 + i: 0x30 + i for i in range(10)}
_NARROW |= {0xFF21 + i: 0x41 + i for i in range(26)}
_NARROW |= {0xFF41 + i: 0x61 + i for i in range(26)}
_NARROW |= {0xFF0B: ord("+"), 0xFF0D: ord("-"), 0xFF0E: ord("."), 0xFF20: ord("@")}
_NARROW |= {0x3000: ord(" "), 0x00A0: ord(" ")}
_WIDE = re.compile("[\u00a0\u3000\uff0b\uff0d\uff0e\uff10-\uff19\uff20-\uff3a\uff41-\uff5a]")


def _narrow(text: str) -> str:
    """``text`` with full-width digits, letters, ``＋－．＠`` and the U+3000/U+00A0
    spaces as ASCII; ``text`` itself (the same object) when it has none."""
    if text.isascii() or _WIDE.search(text) is None:
        return text
    return text.translate(_NARROW)


def detect(text: str, recognizers: Sequence[Recognizer] | None = None) -> list[Finding]:
    """Non-overlapping findings in ``text``, in order: of ``recognizers``, or of
    the default set (the same answers as ``default_recognizers()``, faster).
    Full-width digits and letters are read as ASCII; values are as written."""
    if recognizers is None:
        return (_DEFAULT or _default())(text)
    narrow = _narrow(text)
    found = [f for r in recognizers for f in r.find(narrow)]
    if narrow is not text:
        found = [f._replace(value=text[f.start : f.end]) for f in found]
    found.sort(key=lambda f: (_PRIORITY.get(f.kind, 9), -(f.end - f.start), f.start))
    taken: list[Finding] = []
    for f in found:
        if all(f.end <= t.start or f.start >= t.end for t in taken):
            taken.append(f)
    taken.sort(key=lambda f: f.start)
    return taken


def default_spans(text: str) -> list[tuple[int, int, int, int, str, str]]:
    """The default recognizers' findings as ``(priority, -length, start, end, kind,
    value)`` tuples, in text order: ``detect`` without a ``Finding`` per value (the
    vault's and ``redact``'s hot path)."""
    return (_DEFAULT or _default()).winners(text)


def redact(text: str, recognizers: Sequence[Recognizer] | None = None) -> str:
    """``text`` with every detected value replaced by ``<KIND>`` (no vault, no
    tokens: for logs and traces that must not keep values at all)."""
    if recognizers is None:  # the default detector's tuples, no Finding built
        winners = default_spans(text)
        if not winners:
            return text
        out: list[str] = []
        last = 0
        for c in winners:
            out.append(text[last : c[2]])
            out.append(_MARKS.get(c[4]) or f"<{c[4]}>")
            last = c[3]
        out.append(text[last:])
        return "".join(out)
    return redact_findings(text, detect(text, recognizers))


_MARKS = {kind: f"<{kind}>" for kind in KINDS}


def redact_findings(text: str, found: Sequence[Finding]) -> str:
    """``text`` with the (non-overlapping, ordered) ``found`` values replaced by
    ``<KIND>``."""
    if not found:
        return text
    out: list[str] = []
    last = 0
    for f in found:
        out.append(text[last : f.start])
        out.append(f"<{f.kind}>")
        last = f.end
    out.append(text[last:])
    return "".join(out)


_PRESIDIO_KINDS = {
    "EMAIL_ADDRESS": "EMAIL",
    "PHONE_NUMBER": "PHONE",
    "CREDIT_CARD": "CARD",
    "IBAN_CODE": "IBAN",
    "IP_ADDRESS": "IP",
}


def from_presidio(text: str, results: Iterable[Any]) -> list[Finding]:
    """Accept Presidio ``RecognizerResult``s (``keyshred[presidio]`` callers who
    already run Presidio): entity types are mapped to keyshred kinds, unknown ones
    kept under their Presidio name."""
    out = []
    for r in results:
        kind = _PRESIDIO_KINDS.get(r.entity_type, r.entity_type)
        out.append(Finding(kind, int(r.start), int(r.end), text[r.start : r.end], float(r.score)))
    out.sort(key=lambda f: f.start)
    return out
