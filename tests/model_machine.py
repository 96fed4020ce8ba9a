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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine

from keyshred import Keyshred

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


class StoreMachine(RuleBasedStateMachine):
    """A store at ``self.path`` (opened by the subclass's ``initialize`` rule into
    ``self.ks``), closed and removed at teardown; fresh values ``TOKEN`` numbered
    by step."""

    TOKEN = "v{}"

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.dir = Path(tempfile.mkdtemp(prefix="ks-model-"))
        self.path = self.dir / "data"
        self.ks: Keyshred | None = None

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
