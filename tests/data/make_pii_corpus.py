"""Generate ``pii_corpus.jsonl``: 2,000 labelled synthetic messages, half Chinese and
half English, with values glued to the surrounding text and distractors that must
not be detected. Deterministic (seeded); run from the repository root:
``.venv/bin/python tests/data/make_pii_corpus.py``. Every value is synthetic.
"""

from __future__ import annotations

import ipaddress
import json
import random
from pathlib import Path

import phonenumbers

rng = random.Random(20261130)

ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
ID_CHECK = "10X98765432"
REGIONS = ["110105", "310101", "440305", "510104", "330106", "420102", "610113", "120101"]


def cn_id(valid: bool = True) -> str:
    year = rng.randint(1950, 2005)
    body = f"{rng.choice(REGIONS)}{year}{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}"
    body += f"{rng.randint(0, 999):03d}"
    check = ID_CHECK[sum(int(c) * w for c, w in zip(body, ID_WEIGHTS, strict=True)) % 11]
    if not valid:
        check = rng.choice([c for c in ID_CHECK if c != check])
    return body + check


def luhn_digit(partial: str) -> str:
    for d in "0123456789":
        digits = partial + d
        total, double = 0, False
        for ch in reversed(digits):
            v = int(ch)
            if double:
                v = v * 2 - 9 if v > 4 else v * 2
            total += v
            double = not double
        if total % 10 == 0:
            return d
    raise AssertionError


def card(valid: bool = True) -> str:
    prefix, length = rng.choice(
        [
            ("4", 16),
            ("51", 16),
            ("55", 16),
            ("34", 15),
            ("37", 15),
            ("62", 16),
            ("62", 19),
            ("6011", 16),
            ("4", 13),
        ]
    )
    partial = prefix + "".join(str(rng.randint(0, 9)) for _ in range(length - len(prefix) - 1))
    digit = luhn_digit(partial)
    if not valid:
        digit = str((int(digit) + rng.randint(1, 9)) % 10)
    number = partial + digit
    style = rng.random()
    if style < 0.3 and length == 16:
        return " ".join(number[i : i + 4] for i in range(0, 16, 4))
    if style < 0.45 and length == 16:
        return "-".join(number[i : i + 4] for i in range(0, 16, 4))
    return number


MOBILE_PREFIXES = [f"13{d}" for d in range(10)] + [
    "150",
    "151",
    "152",
    "153",
    "155",
    "156",
    "157",
    "158",
    "159",
    "166",
    "176",
    "177",
    "178",
    "180",
    "181",
    "182",
    "183",
    "184",
    "185",
    "186",
    "187",
    "188",
    "189",
    "198",
    "199",
]


def cn_mobile() -> str:
    while True:
        number = rng.choice(MOBILE_PREFIXES) + "".join(str(rng.randint(0, 9)) for _ in range(8))
        if phonenumbers.is_valid_number(phonenumbers.parse(number, "CN")):
            break
    style = rng.random()
    if style < 0.15:
        return "+86" + number
    if style < 0.25:
        return f"+86 {number[:3]} {number[3:7]} {number[7:]}"
    return number


def intl_phone() -> str:
    while True:
        region = rng.choice(["US", "GB", "DE", "FR", "JP", "IN", "BR", "AU", "SG", "CA"])
        example = phonenumbers.example_number_for_type(region, phonenumbers.PhoneNumberType.MOBILE)
        e164 = phonenumbers.format_number(example, phonenumbers.PhoneNumberFormat.E164)
        candidate = e164[:-2] + f"{rng.randint(0, 99):02d}"
        if phonenumbers.is_valid_number(phonenumbers.parse(candidate)):
            return candidate


def iban() -> str:
    country, bban = rng.choice(
        [
            ("DE", lambda: "".join(str(rng.randint(0, 9)) for _ in range(18))),
            ("GB", lambda: "NWBK" + "".join(str(rng.randint(0, 9)) for _ in range(14))),
            ("FR", lambda: "".join(str(rng.randint(0, 9)) for _ in range(23))),
            ("NL", lambda: "ABNA" + "".join(str(rng.randint(0, 9)) for _ in range(10))),
        ]
    )
    body = bban()
    rearranged = body + country + "00"
    check = 98 - int("".join(str(int(c, 36)) for c in rearranged)) % 97
    value = f"{country}{check:02d}{body}"
    if rng.random() < 0.3:
        value = " ".join(value[i : i + 4] for i in range(0, len(value), 4))
    return value


FIRST = ["alice", "bob", "wei", "li.na", "zhang_san", "maria", "j.smith", "chen", "yuki", "omar"]
DOMAINS = ["example.com", "mail.example.org", "corp.example.cn", "test.example.net", "qq.example"]


def email() -> str:
    return f"{rng.choice(FIRST)}{rng.randint(1, 999)}@{rng.choice(DOMAINS)}"


def ip() -> str:
    if rng.random() < 0.6:
        return str(ipaddress.IPv4Address(rng.randint(0x01000000, 0xDFFFFFFF)))
    return str(ipaddress.IPv6Address(rng.getrandbits(128) & ~(0xFFFF << 64) | (0x2001 << 112)))


GENERATORS = {
    "CN_ID": cn_id,
    "CARD": card,
    "PHONE": lambda: cn_mobile() if rng.random() < 0.6 else intl_phone(),
    "EMAIL": email,
    "IBAN": iban,
    "IP": ip,
}


def luhn_ok(number: str) -> bool:
    return luhn_digit(number[:-1]) == number[-1]


def bad_id() -> str:
    # An ID-shaped number with a wrong check digit, and not a Luhn-valid card number
    # either (an 18-digit Luhn-valid number is a plausible card: not a distractor).
    while True:
        value = cn_id(valid=False)
        if not luhn_ok(value.replace("X", "0")):
            return value


def distractor() -> str:
    return rng.choice(
        [
            bad_id,
            lambda: card(valid=False),
            # 12 digits: no phone (11), card (13-19) or ID (18) has this length.
            lambda: f"订单{rng.randint(10**11, 10**12 - 1)}",
            lambda: f"order #{rng.randint(10**11, 10**12 - 1)}",
            lambda: f"{rng.randint(2000, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            lambda: f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}",
            lambda: f"¥{rng.randint(1, 99999)}.{rng.randint(0, 99):02d}",
            lambda: f"v{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 99)}",
            lambda: f"12{rng.randint(100000000, 999999999)}",
            lambda: f"{rng.randint(256, 999)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.1",
        ]
    )()


ZH = [
    ("请联系我", "谢谢"),
    ("我的号码是", "，方便时回电"),
    ("卡号：", "。"),
    ("邮箱", "已更新"),
    ("身份证号", "请核对"),
    ("转账到", "就好"),
    ("服务器地址是", "，请勿外传"),
    ("他说", "是他的"),
    ("【", "】"),
    ("（", "）"),
    ("备注:", ";"),
]
EN = [
    ("Please call me at ", " tomorrow."),
    ("My card is ", ", thanks!"),
    ("Email: ", "."),
    ("ID ", " on file"),
    ("Wire it to ", " please"),
    ("Server at ", " is down."),
    ("(", ")"),
    ("[", "]"),
    ("ref=", "&x=1"),
    ("Contact:", ";"),
    ('"', '"'),
]


def message(lang: str) -> dict[str, object]:
    frames = ZH if lang == "zh" else EN
    filler = ["好的", "明天见", "收到", "没问题"] if lang == "zh" else ["ok", "see you", "noted"]
    text = rng.choice(filler) + (" " if lang == "en" else "，")
    labels = []
    for n in range(rng.randint(1, 3)):
        before, after = rng.choice(frames)
        if lang == "en" and n:
            text += " "  # English sentences are spaced; Chinese ones are not
        if rng.random() < 0.25:
            value, kind = distractor(), None
        else:
            kind = rng.choice(list(GENERATORS))
            value = GENERATORS[kind]()
        text += before
        if kind is not None:
            labels.append({"kind": kind, "start": len(text), "end": len(text) + len(value)})
        text += value + after
    return {"lang": lang, "text": text, "labels": labels}


def main() -> None:
    out = Path(__file__).with_name("pii_corpus.jsonl")
    lines = [json.dumps(message("zh" if i % 2 else "en"), ensure_ascii=False) for i in range(2000)]
    out.write_text("\n".join(lines) + "\n", "utf-8")


if __name__ == "__main__":
    main()
