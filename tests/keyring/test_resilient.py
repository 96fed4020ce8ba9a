"""``ResilientKek``: retries with full jitter, the circuit breaker, the counters.

Fast unit tests with an in-process provider that fails on command (a real local
provider underneath) and a fake clock: nothing here sleeps or measures time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from keyshred.errors import (
    IntegrityError,
    KekCircuitOpen,
    KekEpochDestroyed,
    KekError,
    KekUnavailable,
    KeyshredError,
)
from keyshred.keyring.kek import Context, DestroyedEpoch, EpochInfo, KekProvider, WrappedKey
from keyshred.keyring.kek.local import LocalKek
from keyshred.keyring.kek.resilient import ResilientKek

CTX = {"keyshred:kind": "test"}


class Flaky(KekProvider):
    """Forwards to a real provider; raises ``fail`` (an exception) for the next
    ``failures`` calls, counting every call that arrives."""

    def __init__(self, inner: KekProvider) -> None:
        self.inner = inner
        self.name = inner.name
        self.failures = 0
        self.fail: Exception = KekUnavailable("cannot reach the test KEK")
        self.arrived = 0

    def _gate(self) -> None:
        self.arrived += 1
        if self.failures:
            self.failures -= 1
            raise self.fail

    def current_epoch(self) -> int:
        self._gate()
        return self.inner.current_epoch()

    def epochs(self) -> list[EpochInfo]:
        self._gate()
        return self.inner.epochs()

    def wrap(self, key: bytes, context: Context) -> WrappedKey:
        self._gate()
        return self.inner.wrap(key, context)

    def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
        self._gate()
        return self.inner.unwrap(wrapped, context)

    def unwrap_many(self, items: Sequence[tuple[WrappedKey, Context]]) -> list[bytes]:
        self._gate()
        return self.inner.unwrap_many(items)

    def rotate(self) -> int:
        self._gate()
        return self.inner.rotate()

    def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
        self._gate()
        return self.inner.destroy_epochs_before(epoch)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def flaky(tmp_path: Path) -> Flaky:
    return Flaky(LocalKek(tmp_path / "kek.json", create=True))


def resilient(flaky: Flaky, clock: Clock, **kw: object) -> ResilientKek:
    settings: dict[str, object] = {
        "retries": 3,
        "retry_max_seconds": 60.0,
        "retry_initial_seconds": 0.1,
        "retry_cap_seconds": 2.0,
        "circuit_failures": 5,
        "circuit_reset_seconds": 10.0,
        **kw,
    }
    return ResilientKek(flaky, clock=clock, sleep=clock.sleep, **settings)  # type: ignore[arg-type]


def test_a_transient_failure_is_retried_and_counted(flaky: Flaky) -> None:
    clock = Clock()
    seen: list[tuple[str, str]] = []
    kek = resilient(flaky, clock, on_call=lambda op, outcome: seen.append((op, outcome)))
    wrapped = kek.wrap(b"k" * 32, CTX)
    flaky.failures = 2
    assert kek.unwrap(wrapped, CTX) == b"k" * 32
    assert flaky.arrived == 4  # one wrap, three unwrap attempts
    assert len(clock.slept) == 2
    counts = kek.counts()
    assert (counts["unwrap"].calls, counts["unwrap"].retries, counts["unwrap"].errors) == (3, 2, 0)
    assert counts["wrap"].calls == 1
    assert seen == [("wrap", "ok"), ("unwrap", "retry"), ("unwrap", "retry"), ("unwrap", "ok")]
    assert kek.circuit.state == "closed"


def test_waits_are_full_jitter_within_the_exponential_bound(flaky: Flaky) -> None:
    """Each wait is uniform in [0, min(cap, initial * 2**(n-1))]: never above the
    bound, and not a fixed schedule (many runs give many different waits)."""
    clock = Clock()
    kek = resilient(flaky, clock, retries=6, circuit_failures=10_000)
    for _ in range(40):
        flaky.failures = 6
        kek.current_epoch()
    assert len(clock.slept) == 240
    for i, wait in enumerate(clock.slept):
        attempt = i % 6 + 1
        assert 0.0 <= wait <= min(2.0, 0.1 * 2 ** (attempt - 1)) + 1e-9
    sixth = [w for i, w in enumerate(clock.slept) if i % 6 == 5]
    assert len(set(sixth)) > 30  # jitter: the waits differ
    assert max(sixth) > 1.0  # and reach up the bound (2.0 s for the 6th)


def test_retries_stop_at_their_count_and_raise_the_transient_error(flaky: Flaky) -> None:
    clock = Clock()
    kek = resilient(flaky, clock, retries=2, circuit_failures=100)
    flaky.failures = 10
    with pytest.raises(KekUnavailable) as info:
        kek.current_epoch()
    assert not isinstance(info.value, KekCircuitOpen)
    assert flaky.arrived == 3
    c = kek.counts()["current_epoch"]
    assert (c.calls, c.retries, c.errors) == (3, 2, 1)


def test_retries_never_wait_past_the_time_budget(flaky: Flaky) -> None:
    clock = Clock()
    kek = resilient(
        flaky,
        clock,
        retries=100,
        retry_max_seconds=3.0,
        retry_cap_seconds=1.0,
        circuit_failures=1000,
    )
    start = clock.now
    flaky.failures = 1000
    with pytest.raises(KekUnavailable):
        kek.current_epoch()
    assert clock.now - start <= 3.0
    assert flaky.arrived > 3  # it did retry within the budget


@pytest.mark.parametrize(
    "error",
    [
        IntegrityError("wrapped key failed authentication"),
        KekEpochDestroyed("KEK epoch 1 is destroyed"),
        KekError("Transit refused to wrap the batch"),
    ],
    ids=["integrity", "destroyed", "refused"],
)
def test_answers_are_not_retried_and_do_not_trip_the_circuit(
    flaky: Flaky, error: KeyshredError
) -> None:
    clock = Clock()
    kek = resilient(flaky, clock, circuit_failures=2)
    for _ in range(5):
        flaky.failures, flaky.fail = 1, error
        with pytest.raises(type(error)):
            kek.current_epoch()
    assert flaky.arrived == 5 and clock.slept == []
    assert kek.circuit.state == "closed" and kek.circuit_opened == 0
    assert kek.counts()["current_epoch"].errors == 5


def test_the_circuit_opens_fails_fast_then_lets_one_trial_through(flaky: Flaky) -> None:
    clock = Clock()
    seen: list[tuple[str, str]] = []
    kek = resilient(
        flaky,
        clock,
        retries=0,
        circuit_failures=3,
        circuit_reset_seconds=10.0,
        on_call=lambda op, outcome: seen.append((op, outcome)),
    )
    flaky.failures = 1000
    for _ in range(3):
        with pytest.raises(KekUnavailable):
            kek.current_epoch()
    assert kek.circuit.state == "open" and kek.circuit_opened == 1
    arrived = flaky.arrived
    with pytest.raises(KekCircuitOpen, match=r"KEK service \(local\) is down") as info:
        kek.unwrap(WrappedKey(1, b"x"), CTX)
    assert "tried again at" in str(info.value) and "in 10.0 s" in str(info.value)
    assert info.value.retry_at is not None
    assert flaky.arrived == arrived  # failed fast: nothing reached the provider
    assert kek.counts()["unwrap"].open == 1 and ("unwrap", "open") in seen

    # After the cool-down: one trial; it fails, so the circuit opens again.
    clock.now += 10.0
    assert kek.circuit.state == "half-open"
    with pytest.raises(KekUnavailable):
        kek.current_epoch()
    assert flaky.arrived == arrived + 1 and kek.circuit.state == "open"
    assert kek.circuit_opened == 2
    with pytest.raises(KekCircuitOpen):
        kek.current_epoch()

    # The service is back: the next trial succeeds and closes the circuit.
    clock.now += 10.0
    flaky.failures = 0
    assert kek.current_epoch() == 1
    assert kek.circuit.state == "closed"
    assert kek.current_epoch() == 1


def test_a_trial_in_flight_makes_the_others_fail_fast(flaky: Flaky) -> None:
    """Half-open lets exactly one call through: the trial holds the slot until
    it ends, so a second caller meanwhile fails fast."""
    clock = Clock()
    kek = resilient(flaky, clock, retries=0, circuit_failures=1, circuit_reset_seconds=5.0)
    flaky.failures = 1
    with pytest.raises(KekUnavailable):
        kek.current_epoch()
    clock.now += 5.0
    inside: list[BaseException] = []

    class Probe(KekProvider):
        name = "local"

        def current_epoch(self) -> int:
            try:
                kek.epochs()  # another caller while the trial is in flight
            except KekCircuitOpen as exc:
                inside.append(exc)
            return 7

        def epochs(self) -> list[EpochInfo]:
            raise AssertionError("reached the provider during the trial")

        def wrap(self, key: bytes, context: Context) -> WrappedKey:
            raise AssertionError

        def unwrap(self, wrapped: WrappedKey, context: Context) -> bytes:
            raise AssertionError

        def rotate(self) -> int:
            raise AssertionError

        def destroy_epochs_before(self, epoch: int) -> list[DestroyedEpoch]:
            raise AssertionError

    kek.inner = Probe()
    assert kek.current_epoch() == 7
    assert len(inside) == 1 and kek.circuit.state == "closed"


def test_the_wrapper_is_a_provider_with_the_inner_name(flaky: Flaky) -> None:
    kek = resilient(flaky, Clock())
    assert kek.name == "local"
    wrapped = kek.wrap_many([(b"a" * 32, CTX), (b"b" * 32, CTX)])
    assert kek.unwrap_many([(w, CTX) for w in wrapped]) == [b"a" * 32, b"b" * 32]
    assert [w.epoch for w in kek.rewrap_many([(w, CTX) for w in wrapped])] == [1, 1]
    assert set(kek.counts()) == {"wrap_many", "unwrap_many", "rewrap_many"}
    assert "ResilientKek(" in repr(kek) and "closed" in repr(kek)


def test_the_configuration_puts_every_provider_behind_the_wrapper(tmp_path: Path) -> None:
    from keyshred._backends import make_archive_kek, make_kek
    from keyshred.config import Config

    config = Config.model_validate(
        {"keyring": {"kek_retries": 1, "kek_circuit_failures": 2, "kek_circuit_reset_seconds": 30}}
    )
    live = make_kek(config, tmp_path, create=True)
    archive = make_archive_kek(config, tmp_path)
    assert isinstance(live, ResilientKek) and isinstance(archive, ResilientKek)
    assert isinstance(live.inner, LocalKek) and live.name == "local"
    flaky = Flaky(live.inner)
    live.inner = flaky
    flaky.failures = 100
    with pytest.raises(KekUnavailable):
        live.current_epoch()
    assert flaky.arrived == 2  # one retry
    with pytest.raises(KekUnavailable):
        live.current_epoch()
    with pytest.raises(KekCircuitOpen, match=r"in (29|30)\.\d s"):
        live.current_epoch()


def test_vault_and_kms_providers_make_no_call_when_built() -> None:
    """Built against a port nobody listens on, neither provider fails: the first
    call does, with KekUnavailable, so a process opens while its KEK is down."""
    from keyshred.keyring.kek.aws import AwsKmsKek
    from keyshred.keyring.kek.vault import VaultKek
    from tests.servers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    vault = VaultKek(dead, "token", timeout=2)
    kms = AwsKmsKek(alias_prefix="alias/ks-test", region="us-east-1", endpoint_url=dead)
    for provider in (vault, kms):
        with pytest.raises(KekUnavailable):
            provider.current_epoch()
        provider.close()
