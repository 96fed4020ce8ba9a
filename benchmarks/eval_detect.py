"""Detection quality per entity type: recall and precision of the default detector on
the labelled corpora and its false findings on the negative corpus.

- ``tests/data/pii_corpus.jsonl``: 2,000 labelled messages, every kind;
- ``tests/data/mobile_corpus.jsonl``: 1,200 messages of mainland mobiles of every
  prefix ``130``-``199`` in every written shape; PHONE is split by whether
  ``phonenumbers``' metadata (the installed version) knows the number;
- ``tests/data/phone_negatives.jsonl``: 1,400 messages of order numbers, timestamps,
  amounts, tracking numbers and mobile-shaped serials: every finding is false.

A finding counts when kind, start and end equal a label's. ``--detect PATH`` evaluates
another ``detect.py`` (it needs only the standard library and ``phonenumbers``), e.g.
the base commit's: ``git show ee60792:vault/detect.py > /tmp/detect_base.py``.

Run: ``.venv/bin/python benchmarks/eval_detect.py [--detect /tmp/detect_base.py]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import phonenumbers

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
Detect = Callable[[str], list[Any]]
Span = tuple[str, int, int]


def load_detect(path: str | None) -> Detect:
    if path is None:
        from keyshred.vault.detect import detect

        return detect
    spec = importlib.util.spec_from_file_location("detect_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.detect  # type: ignore[no-any-return]


def rows(name: str) -> Iterator[dict[str, Any]]:
    for line in (DATA / name).read_text("utf-8").splitlines():
        if line:
            yield json.loads(line)


def known_to_phonenumbers(value: str) -> bool:
    national = "".join(c for c in value if c.isdigit())[-11:]
    number = phonenumbers.PhoneNumber(country_code=86, national_number=int(national))
    return bool(phonenumbers.is_valid_number(number))


def score(detect: Detect, name: str, split_phone: bool) -> dict[str, Counter[str]]:
    """True positives, false negatives and false positives per kind."""
    tp: Counter[str] = Counter()
    fn: Counter[str] = Counter()
    fp: Counter[str] = Counter()
    for row in rows(name):
        text = row["text"]
        truth = {(lab["kind"], lab["start"], lab["end"]) for lab in row["labels"]}
        found = {(f.kind, f.start, f.end) for f in detect(text)}

        def key(span: Span) -> str:
            kind, start, end = span
            if split_phone and kind == "PHONE":
                known = known_to_phonenumbers(text[start:end])
                return "PHONE (known prefix)" if known else "PHONE (unknown prefix)"
            return kind

        tp.update(key(s) for s in found & truth)
        fn.update(key(s) for s in truth - found)
        fp.update(s[0] for s in found - truth)
    return {"tp": tp, "fn": fn, "fp": fp}


def ratio(num: int, den: int) -> str:
    return f"{num / den:.4f}" if den else "-"


def print_labelled(title: str, counts: dict[str, Counter[str]]) -> None:
    tp, fn, fp = counts["tp"], counts["fn"], counts["fp"]
    print(f"\n{title}")
    print(f"| {'type':<24} | labels |   TP |   FN |   FP | recall | precision |")
    print(f"|{'-' * 26}|-------:|-----:|-----:|-----:|-------:|----------:|")
    for kind in sorted(set(tp) | set(fn) | set(fp)):
        labels = tp[kind] + fn[kind]
        print(
            f"| {kind:<24} | {labels:>6} | {tp[kind]:>4} | {fn[kind]:>4} | {fp[kind]:>4} "
            f"| {ratio(tp[kind], labels):>6} | {ratio(tp[kind], tp[kind] + fp[kind]):>9} |"
        )


def print_negatives(detect: Detect, name: str) -> Counter[str]:
    by_category: dict[str, Counter[str]] = {}
    messages: Counter[str] = Counter()
    for row in rows(name):
        messages[row["category"]] += 1
        found = by_category.setdefault(row["category"], Counter())
        found.update(f.kind for f in detect(row["text"]))
    total: Counter[str] = Counter()
    print(f"\n{name}: false findings per category (every finding is false)")
    print("| category  | messages | PHONE | other findings |")
    print("|-----------|---------:|------:|----------------|")
    for category, found in by_category.items():
        total.update(found)
        other = ", ".join(f"{k} {n}" for k, n in sorted(found.items()) if k != "PHONE") or "-"
        print(f"| {category:<9} | {messages[category]:>8} | {found['PHONE']:>5} | {other:<14} |")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--detect", help="path of a detect.py to evaluate instead")
    args = parser.parse_args()
    detect = load_detect(args.detect)
    pii = score(detect, "pii_corpus.jsonl", split_phone=False)
    print_labelled("pii_corpus.jsonl (positive, every kind)", pii)
    mobile = score(detect, "mobile_corpus.jsonl", split_phone=True)
    print_labelled("mobile_corpus.jsonl (positive, mainland mobiles of every prefix)", mobile)
    false = print_negatives(detect, "phone_negatives.jsonl")
    # Precision once the negatives' false findings join the two labelled corpora's.
    tp = pii["tp"] + Counter({"PHONE": mobile["tp"].total()})
    fp = pii["fp"] + mobile["fp"] + false
    print("\nall three corpora: precision per type")
    print("| type  |    TP |  FP | precision |")
    print("|-------|------:|----:|----------:|")
    for kind in sorted(set(tp) | set(fp)):
        precision = ratio(tp[kind], tp[kind] + fp[kind])
        print(f"| {kind:<5} | {tp[kind]:>5} | {fp[kind]:>3} | {precision:>9} |")


if __name__ == "__main__":
    main()
