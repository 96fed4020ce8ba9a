"""The README's Python tour runs as written (so the documentation cannot rot)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def test_five_minute_tour_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sentence_transformers", reason="the tour indexes with the real model")
    text = README.read_text("utf-8")
    tour = text.split("## Five-minute tour (Python)")[1]
    blocks = [part.split("```")[0] for part in tour.split("```python")[1:7]]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    for block in blocks[:2]:  # the tour, then the tokens example
        exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - our own documentation
    assert scope["req"].state == "completed"  # type: ignore[attr-defined]
    vault = scope["ks"].vault  # type: ignore[attr-defined]
    sanitized = scope["s"].text  # type: ignore[attr-defined]
    assert "13812345678" not in sanitized
    restored = vault.restore(sanitized, purpose="support-reply", caller="t")
    assert restored == "call 13812345678 or mail bob@example.com"
    assert vault.restore(sanitized, purpose="analytics", caller="t") == sanitized
    assert (tmp_path / "data" / "keyshred.toml").exists()
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # the model was loaded offline
    exec(compile(blocks[2], "README.md", "exec"), scope)  # noqa: S102 - the backup example
    assert scope["req"].state == "completed"  # type: ignore[attr-defined]
    assert len(scope["report"].replayed) == 1  # type: ignore[attr-defined]
    assert (tmp_path / "restored" / "RESTORE.json").exists()
    exec(compile(blocks[3], "README.md", "exec"), scope)  # noqa: S102 - the lifecycle example
    assert scope["files"]["manifest.json"]["counts"]["memories"] == 2  # type: ignore[index]
    exec(compile(blocks[4], "README.md", "exec"), scope)  # noqa: S102 - the LangGraph example
    assert scope["gone"].state == "completed"  # type: ignore[attr-defined]
    # The one-line switch runs on its own, in a fresh namespace.
    switch: dict[str, object] = {}
    exec(compile(blocks[5], "README.md", "exec"), switch)  # noqa: S102 - the switch example
    assert (tmp_path / "agent-data" / "keyshred.toml").exists()


def test_profile_example_is_a_valid_configuration() -> None:
    import tomllib

    from keyshred.config import Config

    text = README.read_text("utf-8").split("## Configuration")[1]
    block = text.split("```toml")[1].split("```")[0]
    config = Config.model_validate(tomllib.loads(block))
    assert config.profile == "distributed"
    assert config.kek.provider == "vault" and config.backup.target == "s3://keyshred-backups/prod"
