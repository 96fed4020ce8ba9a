"""Detection against the labelled corpus (tests/data/pii_corpus.jsonl) and edge cases."""

from __future__ import annotations

import ipaddress
import json
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from keyshred.vault.detect import (
    KINDS,
    Finding,
    default_recognizers,
    detect,
    from_presidio,
    iban_valid,
    luhn_valid,
    redact,
    redact_findings,
    resident_id_valid,
)

CORPUS = Path(__file__).parents[1] / "data" / "pii_corpus.jsonl"


def load() -> list[dict[str, object]]:
    return [json.loads(line) for line in CORPUS.read_text("utf-8").splitlines() if line]


def test_corpus_shape() -> None:
    messages = load()
    assert len(messages) >= 2000
    langs = Counter(m["lang"] for m in messages)
    assert langs["zh"] == langs["en"]


def test_recall_and_precision_per_type() -> None:
    tp: Counter[str] = Counter()
    fp: Counter[str] = Counter()
    fn: Counter[str] = Counter()
    for m in load():
        text = str(m["text"])
        truth = {(lab["kind"], lab["start"], lab["end"]) for lab in m["labels"]}  # type: ignore[attr-defined]
        found = {(f.kind, f.start, f.end) for f in detect(text)}
        for kind, *_ in found & truth:
            tp[kind] += 1
        for kind, *_ in found - truth:
            fp[kind] += 1
        for kind, *_ in truth - found:
            fn[kind] += 1
    report = {
        k: (tp[k] / max(1, tp[k] + fn[k]), tp[k] / max(1, tp[k] + fp[k]), tp[k]) for k in KINDS
    }
    for kind in ("CN_ID", "CARD", "PHONE"):
        assert fn[kind] == 0, (kind, report)  # 100 % recall on IDs, cards and mobiles
    for kind in KINDS:
        recall, precision, n = report[kind]
        assert n > 50, (kind, report)
        assert precision >= 0.99, (kind, report)
        assert recall >= 0.99, (kind, report)


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("联系我13812345678谢谢", "PHONE", "13812345678"),
        ("电话+86 138 1234 5678。", "PHONE", "+86 138 1234 5678"),
        ("邮箱alice@example.com，好", "EMAIL", "alice@example.com"),
        ("身份证11010519491231002X号", "CN_ID", "11010519491231002X"),
        ("card 4111-1111-1111-1111.", "CARD", "4111-1111-1111-1111"),
        ("IBAN:GB82WEST12345698765432;", "IBAN", "GB82WEST12345698765432"),
        ("地址192.168.1.20，", "IP", "192.168.1.20"),
        ("v6（2001:db8::8a2e:370:7334）", "IP", "2001:db8::8a2e:370:7334"),
        ("call +14155552671!", "PHONE", "+14155552671"),
    ],
)
def test_values_glued_to_text(text: str, kind: str, value: str) -> None:
    (finding,) = detect(text)
    assert (finding.kind, text[finding.start : finding.end]) == (kind, value)
    assert value not in repr(finding) and value not in str(finding) and value not in f"{finding}"
    assert value not in repr([finding])


@pytest.mark.parametrize(
    "text",
    [
        "time 12:30:45, version 1.2.3.9.9, date 2026-11-30",
        "订单1234567890123456",  # not Luhn
        "身份证110105194912310021",  # wrong check digit
        "号码12812345678",  # not a mobile prefix
        "ip 999.1.1.1 and ::",
    ],
)
def test_distractors_are_not_found(text: str) -> None:
    assert detect(text) == []


def test_validators() -> None:
    assert luhn_valid("4111111111111111") and not luhn_valid("4111111111111112")
    assert resident_id_valid("11010519491231002X") and not resident_id_valid("110105194912310021")
    assert iban_valid("DE89 3704 0044 0532 0130 00") and not iban_valid("DE88370400440532013000")


def test_presidio_results_are_accepted() -> None:
    text = "mail bob@example.com now"
    results = [SimpleNamespace(entity_type="EMAIL_ADDRESS", start=5, end=20, score=0.9)]
    (finding,) = from_presidio(text, results)
    assert finding.kind == "EMAIL" and finding.value == "bob@example.com"


# -- the fast default path decides exactly as the recognizers one by one ------------


WIDE = {ord(c): 0xFF10 + i for i, c in enumerate("0123456789")}


def _as_tuples(findings: list[Finding]) -> list[tuple[str, int, int, str]]:
    return [(f.kind, f.start, f.end, f.value) for f in findings]


def _glued(rng: random.Random) -> str:
    """Random text of values, near-values and noise glued together."""

    def digits(n: int) -> str:
        return "".join(rng.choice("0123456789") for _ in range(n))

    def spaced(s: str) -> str:
        sep = rng.choice([" ", "-", ""])
        return sep.join(s[i : i + 4] for i in range(0, len(s), 4))

    pieces = [
        lambda: digits(rng.randint(1, 22)),
        lambda: spaced(digits(rng.randint(12, 20))),
        lambda: "1" + rng.choice("3456789") + digits(9),
        lambda: rng.choice(["+86", "0086", "+86 ", "+1", "+44", "+"]) + digits(rng.randint(6, 12)),
        lambda: digits(17) + rng.choice("0123456789Xx"),
        lambda: "4111111111111111",
        lambda: "11010519491231002X",
        lambda: "DE89 3704 0044 0532 0130 00",
        lambda: "GB82WEST12345698765432",
        lambda: rng.choice(["FR", "DE", "AB"]) + digits(2) + spaced(digits(rng.randint(8, 24))),
        lambda: ".".join(str(rng.randint(0, 300)) for _ in range(rng.randint(3, 5))),
        lambda: ":".join(f"{rng.randint(0, 65535):x}" for _ in range(rng.randint(1, 9))),
        lambda: "::" + f"{rng.randint(0, 65535):x}",
        lambda: f"user{digits(2)}@ex{digits(1)}.com",
        lambda: rng.choice(["电话", "号码", "邮箱", "备注:", "，", "。", "谢谢", "ID", "abc", "X"]),
        lambda: rng.choice([" ", "-", "+", ":", ".", "@", "(", ")", "#", "/", "¥", ".5", "-5"]),
        lambda: rng.choice(["86 ", "86-", "0.", "1.", "-1"]),
        # Full-width digits and letters, read as ASCII by both paths.
        lambda: (
            rng.choice([digits(rng.randint(8, 19)), "1" + rng.choice("3456789") + digits(9)])
            .translate(WIDE)
            .replace("-", "－")
        ),
        lambda: rng.choice(["ＳＦ", "＋８６", "ｘ", "＠", "．", "ｆｅ８０"]),
    ]
    return "".join(rng.choice(pieces)() for _ in range(rng.randint(1, 8)))


def test_fast_default_path_equals_the_recognizers() -> None:
    reference = default_recognizers()
    for m in load():
        text = str(m["text"])
        assert _as_tuples(detect(text)) == _as_tuples(detect(text, reference))
    rng = random.Random(20261130)
    for _ in range(20_000):
        text = _glued(rng)
        assert _as_tuples(detect(text)) == _as_tuples(detect(text, reference)), text


def test_redact_replaces_exactly_the_findings() -> None:
    """``redact``'s own path (no ``Finding`` built) gives what the recognizers' findings
    give, and leaves no value of the corpus behind."""
    reference = default_recognizers()
    rng = random.Random(7)
    texts = [str(m["text"]) for m in load()] + [_glued(rng) for _ in range(5_000)]
    for text in texts:
        expected = redact_findings(text, detect(text, reference))
        assert redact(text) == expected == redact(text, reference), text
    assert redact("no values here") == "no values here"
    for m in load():
        text = str(m["text"])
        out = redact(text)
        labels: list[dict[str, int]] = m["labels"]  # type: ignore[assignment]
        for label in labels:
            assert text[label["start"] : label["end"]] not in out
        assert out.count("<") >= len(labels)


def test_compiled_phone_rules_equal_phonenumbers() -> None:
    import phonenumbers
    from phonenumbers import COUNTRY_CODE_TO_REGION_CODE

    from keyshred.vault.detect import _phone_validator

    def parsed_valid(value: str) -> bool:
        try:
            return bool(phonenumbers.is_valid_number(phonenumbers.parse(value, "CN")))
        except phonenumbers.NumberParseException:
            return False

    rng = random.Random(7)
    e164 = _phone_validator()
    valid = 0
    for code in COUNTRY_CODE_TO_REGION_CODE:
        for region in COUNTRY_CODE_TO_REGION_CODE[code]:
            example = phonenumbers.example_number(region)
            if example is not None:
                n = phonenumbers.format_number(example, phonenumbers.PhoneNumberFormat.E164)
                assert e164(n) == parsed_valid(n) and e164(n), n
                valid += 1
                # Near the example (often valid, often another region of the code).
                for _ in range(5):
                    k = rng.randint(1, 5)
                    m = n[:-k] + "".join(rng.choice("0123456789") for _ in range(k))
                    assert e164(m) == parsed_valid(m), m
        for _ in range(40):
            n = f"+{code}" + "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 13)))
            assert e164(n) == parsed_valid(n), n
    assert valid > 200


def test_ipv6_rule_equals_ipaddress() -> None:
    from keyshred.vault.detect import _ipv6_valid

    def reference(value: str) -> bool:
        if value.count(":") < 2 or not any(c not in ":0" for c in value):
            return False
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            return False
        return True

    rng = random.Random(3)
    hexdigits = "0123456789abcdefABCDEF"
    for _ in range(100_000):
        groups = [
            "".join(rng.choice(hexdigits) for _ in range(rng.randint(0, 5)))
            for _ in range(rng.randint(1, 9))
        ]
        value = ":".join(groups)
        if rng.random() < 0.5:
            i = rng.randint(0, len(value))
            value = value[:i] + ":" + value[i:]
        assert _ipv6_valid(value) == reference(value), value


def test_ipv6_window_equals_a_scan_of_every_run() -> None:
    """IPv6 addresses are looked for only from the run holding the first colon to the
    one holding the last: the same addresses as a scan of every run of the text,
    hex words before and after, runs longer than one piece (41 characters) included."""
    from keyshred.vault.detect import _IPv6Recognizer

    ipv6 = _IPv6Recognizer()
    rng = random.Random(41)
    hexdigits = "0123456789abcdefABCDEF"
    pieces = [
        lambda: "".join(rng.choice(hexdigits) for _ in range(rng.randint(1, 60))),
        lambda: ":".join(f"{rng.randint(0, 65535):x}" for _ in range(rng.randint(1, 9))),
        lambda: "::" + f"{rng.randint(0, 65535):x}",
        lambda: rng.choice(["fe80::1", "2001:db8::", "::", ":", "10:30", "Note:", "cafe:"]),
        lambda: rng.choice([" ", "地址", "，", "x", "g", "-", ".", "face", "added"]),
    ]
    texts = [str(m["text"]) for m in load()]
    texts += [
        "".join(rng.choice(pieces)() for _ in range(rng.randint(1, 10))) for _ in range(20_000)
    ]
    found = 0
    for text in texts:
        expected = ipv6.scan(text, 0, len(text))
        assert ipv6.spans(text) == expected, text
        found += len(expected)
    assert found > 2_000


def test_checksums_equal_their_definitions() -> None:
    def luhn(digits: str) -> bool:
        total = 0
        for i, ch in enumerate(reversed(digits)):
            d = int(ch) * (2 if i % 2 else 1)
            total += d - 9 if d > 9 else d
        return total % 10 == 0

    def resident(value: str) -> bool:
        weights = [2 ** (17 - i) % 11 for i in range(17)]
        total = sum(int(c) * w for c, w in zip(value[:17], weights, strict=True))
        return "10X98765432"[total % 11] == value[17].upper()

    def iban(value: str) -> bool:
        compact = value.replace(" ", "").upper()
        if not 15 <= len(compact) <= 34 or not compact[:2].isalpha() or not compact[2:4].isdigit():
            return False
        try:
            number = "".join(str(int(c, 36)) for c in compact[4:] + compact[:4])
        except ValueError:
            return False
        return int(number) % 97 == 1

    rng = random.Random(11)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for _ in range(20_000):
        v = "".join(rng.choice(letters) for _ in range(2)) + str(rng.randint(10, 99))
        v += "".join(rng.choice("0123456789ABCDEF -_") for _ in range(rng.randint(10, 30)))
        assert iban_valid(v) == iban(v), v
    for _ in range(20_000):
        d = "".join(rng.choice("0123456789") for _ in range(rng.randint(13, 19)))
        assert luhn_valid(d) == luhn(d)
        v = "".join(rng.choice("0123456789") for _ in range(17)) + rng.choice("0123456789Xx")
        assert resident_id_valid(v) == resident(v)
    assert not luhn_valid("4111 1111") and not luhn_valid("４１１１１１１１１１１１１１１１")


# -- mainland mobiles by shape, whatever phonenumbers' metadata knows (issue #18) ----

MOBILES = CORPUS.with_name("mobile_corpus.jsonl")
NEGATIVES = CORPUS.with_name("phone_negatives.jsonl")


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line]


def _known_to_phonenumbers(value: str) -> bool:
    import phonenumbers

    national = "".join(c for c in value if c.isdigit())[-11:]
    number = phonenumbers.PhoneNumber(country_code=86, national_number=int(national))
    return bool(phonenumbers.is_valid_number(number))


def test_mobiles_of_every_prefix_and_shape_are_found() -> None:
    """Recall and precision 1.0 on mainland mobiles of every prefix 130-199 in every
    written shape, many of them of prefixes ``phonenumbers`` does not know."""
    unknown: Counter[str] = Counter()
    labels, missed = 0, []
    for m in _rows(MOBILES):
        text = str(m["text"])
        truth = [(lab["kind"], lab["start"], lab["end"]) for lab in m["labels"]]  # type: ignore[attr-defined]
        found = detect(text)
        assert {f.kind for f in found} <= {"PHONE", "CARD"}, text
        phones = [(f.kind, f.start, f.end) for f in found if f.kind == "PHONE"]
        assert set(phones) <= set(truth), text  # no PHONE that is not a label
        for _, start, end in truth:
            labels += 1
            known = _known_to_phonenumbers(text[start:end])
            if not known:
                unknown["".join(c for c in text[start:end] if c.isdigit())[-11:][:3]] += 1
            if ("PHONE", start, end) not in phones:
                # "167 8159 7531 18212743541": a spaced mobile, a space, a mobile;
                # "8159 7531 18212743541" is Luhn-valid, and a card beats a phone.
                assert known and any(f.start < end and f.end > start for f in found), text
                missed.append(text)
    assert labels > 2_000 and len(missed) <= labels // 1000, missed
    # phonenumbers 9.0.43 knows no number of 140-144, 146, 148, 149, 154, 160, 163, 164,
    # 168, 169, 179 or 194 (a newer version may know more: the floor is loose).
    assert sum(unknown.values()) > 300
    assert len([prefix for prefix, n in unknown.items() if n > 10]) >= 8, unknown


# The examples, then prefixes that phonenumbers 9.0.43 knows no number of.
NEW_PREFIXES = ["192", "196", "197", "199", "162", "165", "167", "141", "144"]
NEW_PREFIXES += ["140", "154", "163", "168", "179", "194"]


@pytest.mark.parametrize("prefix", NEW_PREFIXES)
@pytest.mark.parametrize(
    "shape",
    ["{n}", "+86{n}", "+86 {n}", "0086-{n}", "{a} {b} {c}", "{a}-{b}-{c}", "+86 {a} {b} {c}"],
)
def test_mobiles_of_new_prefixes_are_redacted(prefix: str, shape: str) -> None:
    """Every sanitizer without a vault (``redact``, ``detect`` through a custom list,
    the logging filter) removes them, glued to Chinese text."""
    import logging

    from keyshred import vault
    from keyshred.vault.sanitizers import RedactingFilter

    n = prefix + "70215836"
    value = shape.format(n=n, a=n[:3], b=n[3:7], c=n[7:])
    text = f"新号码{value}，谢谢"
    assert vault.redact(text) == "新号码<PHONE>，谢谢"
    assert redact(text, default_recognizers()) == "新号码<PHONE>，谢谢"
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "call %s", (text,), None)
    RedactingFilter().filter(record)
    assert n[-4:] not in record.getMessage() and "<PHONE>" in record.getMessage()


def test_negative_corpus_has_no_phone() -> None:
    """Order numbers, timestamps, amounts, tracking numbers and mobile-shaped digits
    inside longer tokens hold no phone: PHONE precision 1.0 on 1,400 messages, and no
    email or IP either (some order, timestamp and tracking numbers pass the Luhn check
    by chance, one tracking number the IBAN check: counted by
    benchmarks/eval_detect.py, not this item's)."""
    rows = _rows(NEGATIVES)
    assert len(rows) >= 1_000
    assert {str(m["category"]) for m in rows} == {
        "order",
        "timestamp",
        "amount",
        "tracking",
        "serial",
    }
    for m in rows:
        text = str(m["text"])
        kinds = {f.kind for f in detect(text)}
        assert not kinds & {"PHONE", "EMAIL", "IP"}, text
        assert not kinds & {"PHONE"} and "<PHONE>" not in redact(text), text


@pytest.mark.parametrize(
    "text",
    [
        "ts=1733059200000",  # 13-digit millis: 11-digit runs inside, not a phone
        "时间戳1733059200123ms",
        "订单号 202612011234567890",
        "合计¥13,800,138,000.00",
        "¥13800138000",
        "金额13800138000.00元",
        "batch 20261201-13812345678-01",
        "138-1234-5678-0002",
        "ratio 0.13812345678",
        "SF13812345678",
        "IMG13812345678.jpg",
        "sn19212345678A",
    ],
)
def test_mobile_shapes_inside_other_values_are_not_phones(text: str) -> None:
    assert [f.kind for f in detect(text) if f.kind == "PHONE"] == []
    assert [f.kind for f in detect(text, default_recognizers()) if f.kind == "PHONE"] == []


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("13812345678,19212345678", ["13812345678", "19212345678"]),
        ("13812345678 19612345678", ["13812345678", "19612345678"]),
        ("电话：19712345678。", ["19712345678"]),
        ("call 14412345678.", ["14412345678"]),
        ("(+86-162-1234-5678)", ["+86-162-1234-5678"]),
        ("手机 +86 16512345678 微信同号", ["+86 16512345678"]),
        # Luhn-valid: taken for a card on the base; no card number starts with 0.
        ("tel 008613812345603", ["008613812345603"]),
        ("13812345678-19212345678", ["13812345678", "19212345678"]),
        ("1.13812345678 2.14412345678", ["13812345678", "14412345678"]),
        ("Tel 86-13812345671", ["86-13812345671"]),
        ("86 192 1234 5678", ["86 192 1234 5678"]),
        ("tel 0086-138-1234-5603", ["0086-138-1234-5603"]),
    ],
)
def test_mobiles_next_to_punctuation_and_each_other(text: str, values: list[str]) -> None:
    assert [text[f.start : f.end] for f in detect(text)] == values
    assert all(f.kind == "PHONE" for f in detect(text))


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("电话１３８１２３４５６７８谢谢", "PHONE", "１３８１２３４５６７８"),
        ("新号码１９２ １２３４ ５６７８。", "PHONE", "１９２ １２３４ ５６７８"),
        ("call ＋８６１４４１２３４５６７８", "PHONE", "＋８６１４４１２３４５６７８"),
        (
            "卡号４１１１－１１１１－１１１１－１１１１",
            "CARD",
            "４１１１－１１１１－１１１１－１１１１",
        ),
        (
            "身份证１１０１０５１９４９１２３１００２Ｘ",
            "CN_ID",
            "１１０１０５１９４９１２３１００２Ｘ",
        ),
        (
            "邮箱ａｌｉｃｅ＠ｅｘａｍｐｌｅ．ｃｏｍ，好",
            "EMAIL",
            "ａｌｉｃｅ＠ｅｘａｍｐｌｅ．ｃｏｍ",
        ),
        ("地址１９２．１６８．１．２０，", "IP", "１９２．１６８．１．２０"),
    ],
)
def test_full_width_values_are_found_as_written(text: str, kind: str, value: str) -> None:
    """A Chinese input method's full-width mode types the same number in full-width
    digits: found by both paths, the value as written, redacted."""
    for found in (detect(text), detect(text, default_recognizers())):
        assert [(f.kind, f.value, text[f.start : f.end]) for f in found] == [(kind, value, value)]
    assert value not in redact(text) and f"<{kind}>" in redact(text)


def test_full_width_letters_still_refuse_a_mobile_inside_a_token() -> None:
    assert detect("运单ＳＦ１３８１２３４５６７８") == []
    assert detect("ｓｎ19212345678Ａ", default_recognizers()) == []


def test_vault_tokenizes_mobiles_of_new_prefixes(catalog_url: str, tmp_path: Path) -> None:
    """The vault's sanitize (the default detector's spans) tokenizes them as well,
    full-width ones too, and restores them as written."""
    from datetime import timedelta

    from keyshred import Keyshred
    from tests.storage.conftest import make_config

    ks = Keyshred.init(tmp_path / "data", make_config(catalog_url))
    try:
        text = "请联系19212345678或+86 141 2345 6789谢谢，新号１４４１２３４５６７８"
        s = ks.vault.sanitize(text, "alice", "support", timedelta(hours=1))
        assert len(s.tokens) == 3 and "1921234" not in s.text and "141 2345" not in s.text
        assert "１４４１２３４" not in s.text
        assert ks.vault.restore(s.text, "support", "agent-7") == text
    finally:
        ks.close()


@pytest.mark.parametrize(
    ("text", "value"),
    [
        # Full-width mode types the space between digit groups as U+3000 too.
        ("手机：１３８\u3000１２３４\u3000５６７８，谢谢", "１３８\u3000１２３４\u3000５６７８"),
        ("手机 138\u30001234\u30005678", "138\u30001234\u30005678"),
        # A no-break space (pasted from a web page or a word processor).
        ("tel 138\u00a01234\u00a05678.", "138\u00a01234\u00a05678"),
    ],
)
def test_mobiles_grouped_by_an_ideographic_or_no_break_space(text: str, value: str) -> None:
    """The separator a full-width input method (or a paste) puts between digit
    groups is a space to every reader: found by both paths, as written, redacted."""
    for found in (detect(text), detect(text, default_recognizers())):
        assert [(f.kind, f.value, text[f.start : f.end]) for f in found] == [
            ("PHONE", value, value)
        ]
    assert value not in redact(text)
