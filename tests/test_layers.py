"""Importing a component loads only what it uses (issue #20): the package
``__init__``s re-export lazily (PEP 562), so a light module does not drag in the
storage stack. Each check runs in a fresh interpreter (``sys.modules`` is
process-wide). The import contracts themselves are ``lint-imports`` in ``make lint``
([tool.importlinter] in pyproject.toml)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("pyarrow", "sqlalchemy", "numpy", "lancedb", "duckdb", "torch", "cryptography")


def loaded_after(statement: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after running ``statement`` alone."""
    code = (
        "import json, sys\n"
        f"{statement}\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "statement",
    [
        "import keyshred",
        "import keyshred.vault.detect",
        "from keyshred.vault import detect, redact",
        "import keyshred.errors",
        "from keyshred import KeyshredError, Subject",
        "import keyshred.storage.policy",
    ],
)
def test_a_light_import_loads_no_storage_stack(statement: str) -> None:
    heavy = loaded_after(statement) & set(HEAVY)
    assert not heavy, f"{statement!r} loaded {sorted(heavy)}"


def test_a_light_import_loads_no_other_keyshred_module() -> None:
    code = (
        "import json, sys\n"
        "import keyshred.vault.detect\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('keyshred'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout) == ["keyshred", "keyshred.vault", "keyshred.vault.detect"]


def test_a_lazy_name_resolves_to_the_defining_module() -> None:
    # The re-exports are the real objects, loaded on first access.
    import keyshred
    import keyshred.backup
    import keyshred.keyring
    import keyshred.storage
    import keyshred.vault
    from keyshred.backup.manager import BackupManager
    from keyshred.keyring.keyring import Keyring
    from keyshred.storage.memories import MemoryStore
    from keyshred.vault.detect import detect

    assert keyshred.backup.BackupManager is BackupManager
    assert keyshred.keyring.Keyring is Keyring
    assert keyshred.storage.MemoryStore is MemoryStore
    assert keyshred.vault.detect is detect  # the function, not the submodule
    for package in (keyshred, keyshred.backup, keyshred.keyring, keyshred.storage, keyshred.vault):
        assert set(package.__all__) <= set(dir(package))
        with pytest.raises(AttributeError):
            _ = package.NoSuchName  # type: ignore[attr-defined]


def test_the_heavy_stack_loads_when_a_component_needs_it() -> None:
    # The check above is not vacuous: the facade does load the storage stack.
    assert {"pyarrow", "sqlalchemy"} <= loaded_after("from keyshred import Keyshred")
