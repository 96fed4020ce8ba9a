"""Generate the two phone corpora beside this script, deterministic (seeded); run from
the repository root: ``.venv/bin/python tests/data/make_phone_corpus.py``. Every value
is synthetic.

``mobile_corpus.jsonl``: 1,200 labelled messages (the ``pii_corpus.jsonl`` format,
half Chinese, half English), each with one to three mainland mobiles of every prefix
``130``-``199`` in every shape a user types (bare, ``+86``/``0086`` with or without a
space or dash, ``138 1234 5678``, ``138-1234-5678``, in lists), glued to the text.
Many of them are of prefixes that ``phonenumbers``' metadata does not know
(``192``, ``196``, ``141``, ``144``...): allocated after it was published, or
unallocated and typed by users all the same; a sanitizer must not let them through.

``phone_negatives.jsonl``: 1,400 messages holding no phone number and no other
personal value, only the digit runs a chat or a log is full of: order numbers (18-20
digits, bare or labelled), unix timestamps (10-digit seconds, 13-digit milliseconds:
a millisecond time such as ``1733059200000`` holds 11-digit runs that look like
mobiles), amounts, parcel tracking numbers, mobile-shaped digits inside a longer
alphanumeric token, a dash-joined id or a decimal fraction. ``category`` names the
generator. Some order, timestamp and tracking numbers pass the Luhn check by chance:
detected as cards by design (no detector can tell), they are counted per category by
``benchmarks/eval_detect.py``, never as phones.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

rng = random.Random(20261201)

# Every second digit 3-9 and third digit: allocated, recently allocated, unallocated.
PREFIXES = [f"1{a}{b}" for a in "3456789" for b in "0123456789"]
# Prefixes the issue names; drawn more often so that each is certainly present.
NEW_PREFIXES = ["192", "196", "197", "199", "162", "165", "167", "141", "144"]


def digits(n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def mobile_number() -> str:
    prefix = rng.choice(NEW_PREFIXES) if rng.random() < 0.3 else rng.choice(PREFIXES)
    return prefix + digits(8)


def shaped(number: str) -> str:
    """``number`` written as users write it."""
    a, b, c = number[:3], number[3:7], number[7:]
    return rng.choice(
        [
            number,
            number,
            "+86" + number,
            "+86 " + number,
            "+86-" + number,
            "0086" + number,
            "0086 " + number,
            f"{a} {b} {c}",
            f"{a}-{b}-{c}",
            f"+86 {a} {b} {c}",
            f"+86-{a}-{b}-{c}",
            f"{a}{b} {c}",
        ]
    )


ZH_FRAMES = [
    ("请联系我", "谢谢"),
    ("我的手机号是", "，方便时回电"),
    ("电话：", "。"),
    ("新号码", "，旧号停用了"),
    ("【", "】"),
    ("（", "）"),
    ("备注:", ";"),
    ("手机 ", " 微信同号"),
]
EN_FRAMES = [
    ("Please call me at ", " tomorrow."),
    ("mobile: ", ", thanks!"),
    ("(", ")"),
    ("[", "]"),
    ("tel=", "&x=1"),
    ("Contact:", ";"),
    ('"', '"'),
    ("new number ", "."),
]
LIST_SEPARATORS = [",", "，", "、", " ", " / ", ";"]


def mobile_message(lang: str) -> dict[str, object]:
    frames = ZH_FRAMES if lang == "zh" else EN_FRAMES
    text = rng.choice(["好的", "收到", "没问题"] if lang == "zh" else ["ok", "noted", "hi"])
    text += "，" if lang == "zh" else " "
    labels: list[dict[str, object]] = []

    def put(number: str) -> None:
        nonlocal text
        value = shaped(number)
        labels.append({"kind": "PHONE", "start": len(text), "end": len(text) + len(value)})
        text += value

    for n in range(rng.randint(1, 3)):
        before, after = rng.choice(frames)
        if lang == "en" and n:
            text += " "
        text += before
        put(mobile_number())
        if rng.random() < 0.2:  # a list: the numbers touch only through a separator
            text += rng.choice(LIST_SEPARATORS)
            put(mobile_number())
        text += after
    return {"lang": lang, "text": text, "labels": labels}


def unix_seconds() -> int:
    return rng.randint(1_000_000_000, 1_999_999_999)  # 2001-09 to 2033-05


def unix_millis() -> int:
    return unix_seconds() * 1000 + rng.randint(0, 999)


def grouped(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


def order() -> str:
    day = f"20{rng.randint(20, 30)}{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}"
    number = rng.choice([day + digits(rng.randint(10, 12)), "1" + digits(rng.randint(17, 19))])
    label = rng.choice(["订单号 ", "订单号：", "订单", "Order #", "order no. ", "单号:", ""])
    return label + number


def timestamp() -> str:
    value = str(unix_millis() if rng.random() < 0.6 else unix_seconds())
    label = rng.choice(["ts=", "时间戳", "created_at: ", "@", "time ", ""])
    return label + value + rng.choice(["", "ms", " ", "Z"])


def amount() -> str:
    whole = rng.randint(10_000_000_000, 199_999_999_999)
    cents = f"{rng.randint(0, 99):02d}"
    return rng.choice(
        [
            f"¥{grouped(whole, ',')}.{cents}",
            f"￥{grouped(whole, ',')}",
            f"{grouped(whole, ',')}.{cents}元",
            f"${whole}.{cents}",
            f"¥{whole}",
            f"€{whole}",
            f"{whole}.{cents}",
            f"RMB {whole}.{cents}",
            f"合计{grouped(whole, ',')}元",
        ]
    )


def tracking() -> str:
    shapes: list[Callable[[], str]] = [
        lambda: "SF" + rng.choice("13") + digits(rng.randint(11, 12)),
        lambda: "YT" + rng.choice("13") + digits(12),
        lambda: "JD" + rng.choice(["00", "VA", "VB"]) + digits(rng.randint(11, 13)),
        lambda: "JT" + rng.choice("13") + digits(12),
        lambda: "E" + rng.choice("ACLMR") + digits(9) + "CN",
        lambda: rng.choice("13") + digits(rng.randint(12, 14)),
        lambda: "运单号" + rng.choice("137") + digits(rng.randint(12, 14)),
    ]
    return rng.choice(shapes)()


def mobile_shaped_serial() -> str:
    """Mobile-shaped digits inside a longer alphanumeric token or a dash-joined id,
    or after a decimal point: the token, not the digits, is the value."""
    inner = mobile_number()
    a, b, c = inner[:3], inner[3:7], inner[7:]
    return rng.choice(
        [
            f"SN{inner}",
            f"sn{inner}A",
            f"{inner}X{digits(2)}",
            f"IMG{inner}.jpg",
            f"v{inner}b",
            f"batch {digits(8)}-{inner}-{digits(2)}",
            f"{digits(4)}-{inner}",
            f"{inner}-{digits(4)}",
            f"{a}-{b}-{c}-{digits(4)}",
            f"{digits(3)}-{a}-{b}-{c}",
            f"ratio 0.{inner}",
            f"{inner}.{digits(2)}",
            f"hash {rng.choice('abcdef')}{inner}{rng.choice('abcdef')}",
        ]
    )


CATEGORIES: dict[str, Callable[[], str]] = {
    "order": order,
    "timestamp": timestamp,
    "amount": amount,
    "tracking": tracking,
    "serial": mobile_shaped_serial,
}
NEG_ZH = [("好的，", "请查收"), ("收到", "，谢谢"), ("备注:", ";"), ("【", "】"), ("", "")]
NEG_EN = [("ok ", " thanks"), ("see ", "."), ("(", ")"), ("ref ", " on file"), ("", "")]


def negative_message(lang: str, category: str) -> dict[str, object]:
    before, after = rng.choice(NEG_ZH if lang == "zh" else NEG_EN)
    text = before + CATEGORIES[category]() + after
    if rng.random() < 0.3:  # two values in one message
        text += (" " if lang == "en" else "") + CATEGORIES[rng.choice(list(CATEGORIES))]()
    return {"lang": lang, "category": category, "text": text}


def write(name: str, rows: list[dict[str, object]]) -> None:
    lines = [json.dumps(row, ensure_ascii=False) for row in rows]
    Path(__file__).with_name(name).write_text("\n".join(lines) + "\n", "utf-8")


def main() -> None:
    write("mobile_corpus.jsonl", [mobile_message("zh" if i % 2 else "en") for i in range(1200)])
    categories = list(CATEGORIES)
    write(
        "phone_negatives.jsonl",
        [
            negative_message("zh" if i % 2 else "en", categories[i // 2 % len(categories)])
            for i in range(1400)
        ],
    )


if __name__ == "__main__":
    main()
