"""Vault benchmark: keyshred sanitize against Presidio (regex recognizers only, no NLP
model) and a plain ``re`` substitution lower bound, on the labelled corpus
(tests/data/pii_corpus.jsonl, 2,000 messages, half Chinese, half English).

keyshred ``sanitize`` detects, validates (checksums, phonenumbers), seals each value
and stores each token with its catalog asset. Two designs on the embedded catalog
(SQLite WAL, ``synchronous=FULL`` under the default ``storage.durability = "fsync"``);
``--fsyncs`` measures 1 fsync per call for a commit per call and 1 per group (0.05 per
call in its probe) for group commit, whose calls return once their rows are in the
journal, a shared mapping (they survive the death of the process, not a power cut,
until the group's commit). Presidio stores nothing, so it has no durability to match:

- the default, group commit (``tokens.group_commit_ms = 50``): each call journals its
  sealed rows and returns, many calls' rows go in one transaction; timed until the
  last row is stored (a ``flush`` inside the clock);
- the best simple design, a commit per call (``group_commit_ms = 0``): every call's
  tokens in one catalog transaction (one multi-row INSERT under the subject's guard)
  before it returns.

Issue 20's rule keeps the journal only while group commit is at least 1.5x the
commit per call in the same run; the script prints that ratio per round. When
PostgreSQL answers on 127.0.0.1:5432 (database ``test``, or ``KEYSHRED_BENCH_PG``) a
commit per call runs there too (its default). ``sanitize_many`` stores a batch of 100
texts in one transaction. ``detect+redact`` is keyshred's
detection alone, replacing values with ``<KIND>``. Presidio runs AnalyzerEngine with
its Email, Phone, CreditCard, Iban and Ip recognizers on a no-op NLP engine, plus
AnonymizerEngine. The ``re`` bound is one alternation of unvalidated patterns.

Every engine runs once per round, five rounds, Presidio included, the order of the
engines reversed every other round, so that all meet the same machine; each rate is
the median of the rounds, each ratio the median (and range) of the rounds' own
ratios (issue #25 item 5: not the best rounds). ``--fsyncs`` counts keyshred's
fsync/fdatasync calls per ``sanitize`` with strace (Presidio writes nothing).

Run: ``.venv/bin/python benchmarks/bench_vault.py`` (needs ``keyshred[presidio]``).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tldextract
from _common import PgSchema, count_ops, median_of, strace_syncs, uptime

# Presidio's email recognizer asks tldextract, which fetches the public suffix list
# over the network by default; use the snapshot bundled with the package instead.
tldextract.extract = tldextract.TLDExtract(suffix_list_urls=())
tldextract.tldextract.TLD_EXTRACTOR = tldextract.extract

import os  # noqa: E402
import uuid  # noqa: E402

from presidio_analyzer import AnalyzerEngine, RecognizerRegistry  # noqa: E402
from presidio_analyzer.nlp_engine import NlpArtifacts, NlpEngine  # noqa: E402
from presidio_analyzer.predefined_recognizers import (  # noqa: E402
    CreditCardRecognizer,
    EmailRecognizer,
    IbanRecognizer,
    IpRecognizer,
    PhoneRecognizer,
)
from presidio_anonymizer import AnonymizerEngine  # noqa: E402

from keyshred import Config, Keyshred  # noqa: E402
from keyshred.vault.detect import redact  # noqa: E402

SANITIZE = "keyshred sanitize (SQLite, group commit)"
PER_CALL = "keyshred sanitize (SQLite, commit per call)"
ON_PG = "keyshred sanitize (PostgreSQL)"
MANY = "keyshred sanitize_many, 100 per call"
REDACT = "keyshred detect+redact"
PLAIN_NAME = "plain re substitution (bound)"
PRESIDIO = "Presidio analyzer+anonymizer (regex)"
ROUNDS = 5
CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "pii_corpus.jsonl"


class NoNlp(NlpEngine):  # type: ignore[misc]
    """Presidio without a language model: regex recognizers only."""

    def load(self) -> None: ...
    def is_loaded(self) -> bool:
        return True

    def process_text(self, text: str, language: str) -> NlpArtifacts:
        return NlpArtifacts(
            entities=[], tokens=[], tokens_indices=[], lemmas=[], nlp_engine=self, language=language
        )

    def process_batch(self, texts, language, batch_size=1, n_process=1, **kwargs):  # type: ignore[no-untyped-def]
        for text in texts:
            yield text, self.process_text(text, language)

    def is_stopword(self, word: str, language: str) -> bool:
        return False

    def is_punct(self, word: str, language: str) -> bool:
        return False

    def get_supported_entities(self) -> list[str]:
        return []

    def get_supported_languages(self) -> list[str]:
        return ["en"]


PLAIN = re.compile(
    r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}"
    r"|\+?\d[\d \-]{9,22}\d"
    r"|[A-Z]{2}\d{2}[A-Z0-9 ]{11,30}"
    r"|(?:\d{1,3}\.){3}\d{1,3}"
    r"|[0-9a-fA-F]{1,4}(?::[0-9a-fA-F]{0,4}){2,7}"
)


def rate(fn, texts: list[str], repeat: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        for t in texts:
            fn(t)
        best = max(best, len(texts) / (time.perf_counter() - start))
    return best


def postgres_schema() -> PgSchema | None:
    """A fresh schema on the benchmark's PostgreSQL, or None."""
    try:
        import psycopg
    except ImportError:
        return None
    try:
        return PgSchema()
    except psycopg.OperationalError:  # no PostgreSQL here: the SQLite numbers only
        return None


def fsync_probe() -> None:
    """keyshred's ``sanitize`` between strace markers: both designs, 20 calls each,
    the group commit's last flush inside the markers."""
    texts = [json.loads(line)["text"] for line in CORPUS.read_text("utf-8").splitlines() if line]
    day = timedelta(days=1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in (("sanitize (group commit)", {}), (PER_CALL, {"group_commit_ms": 0})):
            ks = Keyshred.init(Path(tmp) / uuid.uuid4().hex, Config.model_validate({"tokens": cfg}))
            for n in range(10):
                ks.vault.sanitize(texts[n], f"s{n}", "bench", day)
            ks.vault.flush()

            def op(j: int, ks: Keyshred = ks) -> None:
                ks.vault.sanitize(texts[j], f"s{j % 10}", "bench", day)
                if j == 19:
                    ks.vault.flush()

            count_ops(name, 20, op)
            ks.close()


def main() -> None:
    if "--fsync-probe" in sys.argv:
        fsync_probe()
        return
    if "--fsyncs" in sys.argv:
        counts = strace_syncs([sys.executable, __file__, "--fsync-probe"], dict(os.environ))
        print(f"fsync/fdatasync calls per call (strace -f, 20 calls): {json.dumps(counts)}")
        return
    print(f"uptime: {uptime()}")
    texts = [json.loads(line)["text"] for line in CORPUS.read_text("utf-8").splitlines() if line]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    registry = RecognizerRegistry(supported_languages=["en"])
    for r in (
        EmailRecognizer(),
        PhoneRecognizer(),
        CreditCardRecognizer(),
        IbanRecognizer(),
        IpRecognizer(),
    ):
        registry.add_recognizer(r)
    analyzer = AnalyzerEngine(registry=registry, nlp_engine=NoNlp(), supported_languages=["en"])
    anonymizer = AnonymizerEngine()

    def presidio(text: str) -> str:
        results = analyzer.analyze(text, language="en")
        return anonymizer.anonymize(text=text, analyzer_results=results).text

    def plain(text: str) -> str:
        return PLAIN.sub("<PII>", text)

    with tempfile.TemporaryDirectory() as tmp:
        day = timedelta(days=1)
        ks = Keyshred.init(Path(tmp) / "data")
        per_call = Keyshred.init(
            Path(tmp) / "per-call", Config.model_validate({"tokens": {"group_commit_ms": 0}})
        )
        pg = postgres_schema()
        on_pg = None
        if pg is not None:
            on_pg = Keyshred.init(
                Path(tmp) / "pg", Config.model_validate({"storage": {"catalog_url": pg.url}})
            )
        stores = [ks, per_call] if on_pg is None else [ks, per_call, on_pg]
        # Steady state: the 100 subjects (and the 20 of the batches) have their keys
        # already. A subject's first token also creates its DEK (one key-store
        # commit), timed on its own below.
        for store in stores:
            for n in range(100):
                store.vault.sanitize(texts[n], f"s{n}", "bench", day)
            for n in range(20):
                store.vault.sanitize(texts[n], f"b{n}", "bench", day)
        batches = [texts[i : i + 100] for i in range(0, len(texts), 100)]

        def one_by_one(store: Keyshred) -> float:
            # Every call's tokens are stored when it returns.
            start = time.perf_counter()
            for n, text in enumerate(texts):
                store.vault.sanitize(text, f"s{n % 100}", "bench", day)
            store.vault.flush()  # group commit: timed until the last row is stored
            return len(texts) / (time.perf_counter() - start)

        def sanitize_batches() -> float:
            start = time.perf_counter()
            for n, batch in enumerate(batches):
                ks.vault.sanitize_many(batch, f"b{n}", "bench", day)
            return len(texts) / (time.perf_counter() - start)

        def first_touch() -> float:
            start = time.perf_counter()
            for n in range(200):
                ks.vault.sanitize(texts[n], f"new-{time.monotonic_ns()}-{n}", "bench", day)
            return 200 / (time.perf_counter() - start)

        # Alternating rounds, Presidio included, so that every engine meets the same
        # machine; best of each engine, and each round's own ratios.
        engines = [
            (SANITIZE, lambda: one_by_one(ks)),
            (PER_CALL, lambda: one_by_one(per_call)),
            (MANY, sanitize_batches),
            (REDACT, lambda: rate(redact, texts, 1)),
            (PLAIN_NAME, lambda: rate(plain, texts, 1)),
            (PRESIDIO, lambda: rate(presidio, texts, 1)),
        ]
        if on_pg is not None:
            engines.insert(1, (ON_PG, lambda: one_by_one(on_pg)))
        rounds: list[dict[str, float]] = []
        for i in range(ROUNDS):
            # The order of the engines reversed every other round.
            order = engines if i % 2 == 0 else list(reversed(engines))
            rounds.append({name: fn() for name, fn in order})
        results = median_of(rounds)
        results["keyshred sanitize, subject's first token"] = first_touch()
        ks.close()
        per_call.close()
        if on_pg is not None and pg is not None:
            on_pg.close()
            pg.close()
    print(f"{len(texts)} messages, {mb:.2f} MB")
    print(f"uptime: {uptime()}")
    print(f"medians of {ROUNDS} rounds\n{'engine':<42}{'texts/s':>12}{'MB/s':>10}")
    for name, r in results.items():
        print(f"{name:<42}{r:>12,.0f}{r * mb / len(texts):>10.2f}")

    def ratio(name: str, base: str) -> str:
        per_round = sorted(r[name] / r[base] for r in rounds)
        digits = 1 if base == PRESIDIO else 2
        return (
            f"{statistics.median(per_round):.{digits}f}x median of the rounds' ratios "
            f"({per_round[0]:.{digits}f}x-{per_round[-1]:.{digits}f}x); "
            f"{results[name] / results[base]:.{digits}f}x of the medians"
        )

    print(f"\n{ROUNDS} interleaved rounds (engine order reversed every other round)")
    print(f"keyshred sanitize / Presidio = {ratio(SANITIZE, PRESIDIO)}")
    print(f"keyshred sanitize, commit per call / Presidio = {ratio(PER_CALL, PRESIDIO)}")
    print(f"group commit / commit per call (rule: >= 1.5x) = {ratio(SANITIZE, PER_CALL)}")
    print(f"keyshred sanitize / plain re = {ratio(SANITIZE, PLAIN_NAME)}")
    if ON_PG in results:
        print(f"keyshred sanitize on PostgreSQL / Presidio = {ratio(ON_PG, PRESIDIO)}")
    print(f"keyshred sanitize_many / Presidio = {ratio(MANY, PRESIDIO)}")
    print(f"keyshred detect+redact / Presidio = {ratio(REDACT, PRESIDIO)}")
    print(f"keyshred detect+redact / plain re = {ratio(REDACT, PLAIN_NAME)}")
    print("\nper round (texts/s)")
    for i, this in enumerate(rounds, 1):
        print(f"round {i}: " + ", ".join(f"{k} {v:,.0f}" for k, v in this.items()))


if __name__ == "__main__":
    main()
