"""The README's HTTP API section matches the API: its settings example is valid
``ApiSettings`` and every route its curl examples and table name is served."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from keyshred.api.settings import ApiSettings

ROOT = Path(__file__).parents[2]
SECTION = (ROOT / "README.md").read_text("utf-8").split("## HTTP API")[1].split("\n## ")[0]


def _served(method: str, path: str) -> bool:
    doc = json.loads((ROOT / "docs" / "openapi.json").read_text())
    for template, methods in doc["paths"].items():
        pattern = "^" + re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path) and method.lower() in methods:
            return True
    return False


def test_the_settings_example_is_valid() -> None:
    block = SECTION.split("```toml")[1].split("```")[0].replace('"…"', '"' + "ab" * 32 + '"')
    settings = ApiSettings.model_validate(tomllib.loads(block))
    assert settings.api_keys[0].role == "operator" and settings.oidc is not None


def test_every_curl_example_names_a_served_route() -> None:
    block = SECTION.split("```bash")[1].split("```")[0]
    calls = re.findall(r"curl -sS (?:-X (\w+) )?http://127\.0\.0\.1:8080(\S+)", block)
    assert len(calls) == 4
    for method, path in calls:
        assert _served(method or "GET", path.replace("$ID", "abc123")), path


def test_every_route_in_the_table_is_served() -> None:
    rows = re.findall(r"`(GET|POST) (/[^`?]+)", SECTION)
    assert len(rows) >= 15
    for method, path in rows:
        assert _served(method, path.replace("{id}", "abc123")), (method, path)
