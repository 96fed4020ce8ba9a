"""``keyshred serve`` refuses what it cannot serve safely: several processes on the
embedded SQLite profile, a non-loopback address without --allow-remote, a bad
settings file; and the app factory names the extra when it is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from keyshred import Keyshred
from keyshred.api.settings import load_settings
from keyshred.errors import ConfigError
from tests import zygote


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return zygote.run(
        [sys.executable, "-m", "keyshred.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("serve") / "data"
    Keyshred.init(data, embeddings=lambda texts: [[1.0, 0.0] for _ in texts]).close()
    return data


def test_several_workers_need_the_shared_profile(folder: Path) -> None:
    done = _serve("--path", str(folder), "--workers", "2", "--port", "1")
    assert done.returncode == 2
    assert "shared profile" in done.stderr and "Traceback" not in done.stderr


def test_a_remote_address_needs_allow_remote(folder: Path) -> None:
    done = _serve("--path", str(folder), "--host", "192.0.2.10", "--port", "1")
    assert done.returncode == 2
    assert "--allow-remote" in done.stderr


def test_bad_settings_are_a_config_error_naming_the_setting(tmp_path: Path) -> None:
    bad = tmp_path / "api.toml"
    bad.write_text('[[api_keys]]\nname = "x"\nsha256 = "secret-not-hex"\nrole = "operator"\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(bad)
    assert "api_keys.0.sha256" in str(caught.value)
    assert "secret-not-hex" not in str(caught.value)
    bad.write_text('[[api_keys]]\nname = "x"\nsha256 = "' + "a" * 64 + '"\nrole = "root"\n')
    with pytest.raises(ConfigError, match="role"):
        load_settings(bad)
    done = _serve("--path", str(tmp_path), "--api-config", str(bad))
    assert done.returncode == 2
    assert "API settings" in done.stderr and "Traceback" not in done.stderr


def test_the_app_names_the_api_extra_when_starlette_is_missing() -> None:
    code = (
        "import sys; sys.modules['starlette'] = None\n"
        "from keyshred.errors import MissingExtraError\n"
        "try:\n"
        "    from keyshred.api import create_app\n"
        "except MissingExtraError as exc:\n"
        "    print(exc.extra)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "api"
