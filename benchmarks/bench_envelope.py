"""Envelope and DEK-unwrap benchmark: keyshred against raw pyca AESGCM, same run.

Prints seal/open throughput of the keyshred envelope (header, place-bound AAD, key
id check) against raw ``AESGCM.encrypt/decrypt`` with a random nonce, at 1 KiB,
64 KiB and 4 MiB (median of repeated runs), then DEK unwrap latency: cache hit,
local-KEK miss, OpenBao Transit single and batched (100), on a dev server this script
starts on loopback. Run: ``.venv/bin/python benchmarks/bench_envelope.py``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from keyshred.keyring.datakey import DataKey
from keyshred.keyring.envelope import OVERHEAD_BYTES, Place
from keyshred.keyring.kek import WrappedKey
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.kek.vault import VaultKek
from keyshred.keyring.keyring import Keyring
from keyshred.keyring.keystore import SQLiteKeyStore
from tests.servers import openbao_dev_server

SIZES = [("1 KiB", 1024, 20_000), ("64 KiB", 64 * 1024, 2_000), ("4 MiB", 4 * 1024 * 1024, 40)]
REPEATS = 9


def paired_rates(raw: Callable[[], None], ours: Callable[[], None], n: int) -> tuple[float, ...]:
    """Median raw ops/s, median keyshred ops/s and the median of per-round ratios.

    Raw and keyshred alternate round by round, so drift on a shared machine hits
    both alike; the ratio is taken per round before the median.
    """
    raw_rates, our_rates, ratios = [], [], []
    for _ in range(REPEATS):
        rates = []
        for fn in (raw, ours):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            rates.append(n / (time.perf_counter() - start))
        raw_rates.append(rates[0])
        our_rates.append(rates[1])
        ratios.append(rates[1] / rates[0])
    return (
        statistics.median(raw_rates),
        statistics.median(our_rates),
        statistics.median(ratios),
    )


def bench_envelope() -> None:
    raw_key = os.urandom(32)
    key = DataKey(os.urandom(16), "benchsubjectref00000000000", "default", raw_key)
    place = Place("benchsubjectref00000000000", "default", "memories", "m-000001", "value")
    aead = AESGCM(raw_key)
    print("seal/open throughput (median of 9 alternating rounds); ratio = keyshred / raw AESGCM")
    print(f"{'size':>7} {'op':>12} {'raw MB/s':>10} {'keyshred MB/s':>14} {'ratio':>6}")
    for label, size, n in SIZES:
        data = os.urandom(size)
        ct = key.seal(data, place)
        raw_nonce = os.urandom(12)
        raw_body = aead.encrypt(raw_nonce, data, None)

        def raw_seal() -> None:
            aead.encrypt(os.urandom(12), data, None)

        def raw_open() -> None:
            # The strictest baseline: nonce and body already apart, no framing at all.
            aead.decrypt(raw_nonce, raw_body, None)

        def ks_seal() -> None:
            key.seal(data, place)

        def ks_open() -> None:
            key.open(ct, place)

        def ks_seal_into() -> None:
            # A fresh buffer per call, as a caller would have: the same allocation
            # the bytes path makes, without its second copy.
            key.seal(data, place, into=memoryview(bytearray(size + OVERHEAD_BYTES)))

        aad = key._aad + place.encoded

        view = memoryview(ct)

        def raw_open_aad() -> None:
            aead.decrypt(view[20:32], view[32:], aad)

        for op, raw_fn, ks_fn in (
            ("seal", raw_seal, ks_seal),
            ("seal(into=)", raw_seal, ks_seal_into),
            ("open", raw_open, ks_open),
            # Same AES-GCM work (with the place-bound AAD): what the format costs alone.
            ("open vs aad", raw_open_aad, ks_open),
        ):
            raw_rate, ks_rate, ratio = paired_rates(raw_fn, ks_fn, n)
            mb = size / 1e6
            print(f"{label:>7} {op:>12} {raw_rate * mb:>10.1f} {ks_rate * mb:>14.1f} {ratio:>6.2f}")


def latency(fn: Callable[[], object], n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


def bench_unwrap() -> None:
    print("\nDEK unwrap")
    with tempfile.TemporaryDirectory() as tmp:
        ring = Keyring(SQLiteKeyStore(Path(tmp) / "ks.db"), LocalKek(Path(tmp) / "k", create=True))
        refs = [ring.subject_ref(f"s{i}") for i in range(2000)]
        ids = [ring.data_key(r, "default").key_id for r in refs]
        hit = latency(lambda: ring.data_key_by_id(ids[0]), 20_000)
        print(f"  cache hit                 p50 {hit[0]:8.2f} us   p99 {hit[1]:8.2f} us")

        it = iter(ids * 10)

        def miss() -> None:
            ring.cache.clear()
            ring.data_key_by_id(next(it))

        m = latency(miss, 5000)
        print(f"  local KEK miss (store+unwrap) p50 {m[0]:8.2f} us   p99 {m[1]:8.2f} us")
        ring.close()

    with openbao_dev_server() as server:
        kek = VaultKek(server.url, server.token, key_name="bench", batch_size=100, workers=4)
        ctx = {"keyshred:key_id": "00", "keyshred:subject_ref": "r", "keyshred:scope": "default"}
        wrapped: list[WrappedKey] = kek.wrap_many([(os.urandom(32), ctx) for _ in range(2000)])
        items = [(w, ctx) for w in wrapped]
        single = latency(lambda: kek.unwrap(wrapped[0], ctx), 300)
        print(
            f"  OpenBao single unwrap     p50 {single[0]:8.1f} us   p99 {single[1]:8.1f} us"
            f"   ({1e6 / single[0]:,.0f} DEKs/s sequential)"
        )
        b = latency(lambda: kek.unwrap_many(items[:100]), 100)
        print(
            f"  OpenBao batch of 100      p50 {b[0] / 1000:8.2f} ms   p99 {b[1] / 1000:8.2f} ms"
            f"   ({100e6 / b[0]:,.0f} DEKs/s, one request at a time)"
        )
        for workers in (2, 4):
            chunks = [items[i : i + 100] for i in range(0, 2000, 100)]
            rates = []
            with ThreadPoolExecutor(workers) as pool:
                for _ in range(5):
                    start = time.perf_counter()
                    list(pool.map(kek.unwrap_many, chunks))
                    rates.append(2000 / (time.perf_counter() - start))
            print(
                f"  OpenBao batches of 100, {workers} in flight: "
                f"{statistics.median(rates):,.0f} DEKs/s (median of 5 x 2000)"
            )
        whole = []
        for _ in range(5):
            start = time.perf_counter()
            kek.unwrap_many(items)
            whole.append(2000 / (time.perf_counter() - start))
        print(
            f"  OpenBao unwrap_many(2000) (chunks of 100, provider pool): "
            f"{statistics.median(whole):,.0f} DEKs/s"
        )
        kek.close()


if __name__ == "__main__":
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores")
    bench_envelope()
    bench_unwrap()
