"""What the stateful model tests (Hypothesis ``RuleBasedStateMachine``) share: their
settings and a base machine holding a store in a temporary folder.

The settings leave out the ``explain`` phase: after a failure Hypothesis re-ran the
shrunk sequence under ``sys.settrace`` (Python < 3.12), ten times slower on a store
that runs thousands of lines per step; in CI that ran past pytest-timeout and the
failing sequence was never printed. Modules using them also raise their timeout
(``MODEL_TIMEOUT``): shrinking alone may take Hypothesis's five minutes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize

from keyshred import Keyshred
from keyshred.errors import SubjectSuppressed
from tests.storage.conftest import make_config

__all__ = ["MODEL_TIMEOUT", "StoreMachine", "model_settings"]

MODEL_TIMEOUT = 900


def model_settings(max_examples: int, stateful_step_count: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=stateful_step_count,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        print_blob=True,
    )


class _Valued(Protocol):
    @property
    def value(self) -> str: ...


class _Modelled(_Valued, Protocol):
    @property
    def scope(self) -> str: ...

    @property
    def mentions(self) -> frozenset[str]: ...


class StoreMachine(RuleBasedStateMachine):
    """An embedded store at ``self.path`` (``self.ks``, its config ``self.cfg``:
    flushing every 2 or 3 records, so partitions compact all the time; the
    ``EMBEDDINGS`` function), closed and removed at teardown; ``opened`` runs once
    it is made. Fresh values ``TOKEN`` numbered by step."""

    TOKEN = "v{}"
    EMBEDDINGS: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.dir = Path(tempfile.mkdtemp(prefix="ks-model-"))
        self.path = self.dir / "data"
        self.ks: Keyshred | None = None

    @initialize(flush_records=st.sampled_from([2, 3]))
    def open_store(self, flush_records: int) -> None:
        self.cfg = make_config(None, flush_records=flush_records)
        self.ks = Keyshred.init(self.path, self.cfg, embeddings=self.EMBEDDINGS)
        self.opened()

    def opened(self) -> None:
        """What the subclass does first on its new store."""

    def teardown(self) -> None:
        try:
            if self.ks is not None:
                self.ks.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def store(self) -> Keyshred:
        assert self.ks is not None
        return self.ks

    def token(self) -> str:
        self.step += 1
        return self.TOKEN.format(self.step)

    def check_history(
        self,
        namespace: tuple[str, ...],
        current: Mapping[tuple[str, str], _Valued],
        history: Mapping[tuple[str, str], Sequence[_Valued]],
    ) -> None:
        """Each (subject, key) with versions: its history is the versions, oldest
        first, then the current value."""
        if self.ks is None:
            return
        for (subject, key), versions in history.items():
            now = current.get((subject, key))
            want = [v.value for v in versions] + ([now.value] if now else [])
            got = [h["value"] for h in self.store.memories.history(subject, namespace, key)]
            assert got == want, (subject, key)

    def check_reads(
        self,
        namespace: tuple[str, ...],
        subjects: Sequence[str],
        keys: Sequence[str],
        *,
        current: Mapping[tuple[str, str], _Modelled],
        erased: Collection[str],
        count: Callable[[str], int],
        dead: Collection[str] = (),
    ) -> None:
        """Each of ``subjects``: an erased one is refused;
        another reads at each key what ``current`` holds (value, scope, the subjects
        it mentions), no value holding a ``dead`` text, and counts ``count``."""
        if self.ks is None:
            return
        memories = self.store.memories
        for subject in subjects:
            if subject in erased:
                with pytest.raises(SubjectSuppressed):
                    memories.get(subject, namespace, keys[0])
                continue
            for key in keys:
                want = current.get((subject, key))
                got = memories.get(subject, namespace, key)
                where = (subject, key)
                if got is not None:
                    assert not any(t in got.value for t in dead), (where, "erased text")
                if want is None:
                    assert got is None, (where, got.value if got else None)
                    continue
                assert got is not None, (where, "lost", want.value)
                assert (got.value, got.scope) == (want.value, want.scope), where
                refs = {self.store.subject_ref(s) for s in want.mentions}
                assert set(got.mentions) == refs, (where, want.mentions)
            assert memories.count(subject) == count(subject), subject
