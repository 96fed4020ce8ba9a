"""Detection against the labelled corpus (tests/data/pii_corpus.jsonl) and edge cases."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from keyshred.vault.detect import (
    KINDS,
    detect,
    from_presidio,
    iban_valid,
    luhn_valid,
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
    assert value not in repr(finding)


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
