"""The README's Python tour runs as written (so the documentation cannot rot)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def test_five_minute_tour_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sentence_transformers", reason="the tour indexes with the real model")
    text = README.read_text("utf-8")
    block = text.split("## Five-minute tour (Python)")[1].split("```python")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert scope["req"].state == "completed"  # type: ignore[attr-defined]
    assert (tmp_path / "data" / "keyshred.toml").exists()
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # the model was loaded offline
