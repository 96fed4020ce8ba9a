"""What the OpenTelemetry hooks cost (keyshred.tracing), same run, paired rounds.

A warm ``memories.get`` (one row, cached key and partition) called through the
traced class (``keyshred.tracing.traced_class``, as the facade builds the store)
against the same method called on the class without the wrapper, in three fresh
interpreters: OpenTelemetry absent (every import of it fails), imported but no
tracer provider configured, and an SDK provider exporting to memory. Then one
erasure with the SDK provider: its span count. Run:
``.venv/bin/python benchmarks/bench_tracing.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CALLS = 20_000
ROUNDS = 9
MODES = ("absent", "unconfigured", "sdk")


class _NoOtel:
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".", maxsplit=1)[0] == "opentelemetry":
            raise ImportError(name)


def _setup(mode: str) -> Any:
    if mode == "absent":
        sys.meta_path.insert(0, _NoOtel())  # type: ignore[arg-type]
        return None
    from opentelemetry import trace

    if mode == "sdk":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        return exporter
    return None


def child(mode: str) -> dict[str, Any]:
    exporter = _setup(mode)
    from keyshred import Keyshred
    from keyshred.storage.memories import MemoryStore
    from tests.storage.test_vectors import bag_of_words

    out: dict[str, Any] = {"mode": mode}
    with (
        tempfile.TemporaryDirectory() as tmp,
        Keyshred.init(Path(tmp) / "d", embeddings=bag_of_words) as ks,
    ):
        store: Any = ks._memories
        ks.memories.put("ann", ("m",), "k", {"text": "a value"})
        ks.memories.flush()
        plain = MemoryStore.get  # the method the traced class wraps

        def traced_round() -> float:
            start = time.perf_counter()
            for _ in range(CALLS):
                store.get("ann", ("m",), "k")
            return (time.perf_counter() - start) / CALLS

        def plain_round() -> float:
            start = time.perf_counter()
            for _ in range(CALLS):
                plain(store, "ann", ("m",), "k")
            return (time.perf_counter() - start) / CALLS

        pairs = []
        for i in range(ROUNDS):
            if exporter is not None:
                exporter.clear()
            # Alternate which side goes first: drift on a shared machine hits both.
            if i % 2:
                t, p = traced_round(), plain_round()
            else:
                p, t = plain_round(), traced_round()
            pairs.append((p, t))
        out["plain_us"] = statistics.median(p for p, _ in pairs) * 1e6
        out["traced_us"] = statistics.median(t for _, t in pairs) * 1e6
        out["ratio"] = statistics.median(t / p for p, t in pairs)
        if exporter is not None:
            exporter.clear()
            ks.memories.put("bob", ("m",), "k", "v")
            ks.erase("bob", requested_by="bench", reason="bench")
            out["erasure_spans"] = len(exporter.get_finished_spans())
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return
    print(f"warm memories.get, {CALLS} calls x {ROUNDS} paired rounds (medians)")
    print(f"{'OpenTelemetry':<14} {'plain µs':>9} {'traced µs':>10} {'ratio':>6}  spans/erasure")
    for mode in MODES:
        run = subprocess.run(
            [sys.executable, __file__, "--child", mode],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        r = json.loads(run.stdout.strip().splitlines()[-1])
        spans = r.get("erasure_spans", "-")
        print(
            f"{mode:<14} {r['plain_us']:>9.1f} {r['traced_us']:>10.1f} {r['ratio']:>6.2f}  {spans}"
        )


if __name__ == "__main__":
    main()
