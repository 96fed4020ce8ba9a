"""Hypothesis settings shared by the stateful model tests (``RuleBasedStateMachine``).

Without the ``explain`` phase: after a failure Hypothesis would re-run the shrunk
sequence under ``sys.settrace`` (Python < 3.12), ten times slower on a store that
runs thousands of lines per step; in CI that ran past pytest-timeout and the
failing sequence was never printed. Modules using it also raise their timeout
(``MODEL_TIMEOUT``): shrinking alone may take Hypothesis's five minutes.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

__all__ = ["MODEL_TIMEOUT", "model_settings"]

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
