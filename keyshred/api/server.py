"""Running the app under uvicorn: ``keyshred serve``.

With ``--workers N`` uvicorn starts N processes, each building the app from the
environment (``app_from_env``: ``KEYSHRED_PATH`` and ``KEYSHRED_API_CONFIG``) and
opening its own handle on the store: the shared profile (PostgreSQL catalog) takes
several; the embedded profile (SQLite catalog) is served by one process.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

from keyshred._extras import require
from keyshred.api.settings import load_settings
from keyshred.config import load_config
from keyshred.errors import ConfigError

__all__ = ["ENV_CONFIG", "ENV_PATH", "KEEP_ALIVE_SECONDS", "app_from_env", "serve"]

# How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals
# httpx's and is below most proxies' (nginx, load balancers: 60 s): a client that
# reuses a connection the server is closing at that moment gets no answer (a reset),
# which bench_api.py saw as lost POSTs under 200 concurrent clients. The server's
# timeout must be the longer one, so the client (or proxy) always closes first.
KEEP_ALIVE_SECONDS = 75
ENV_PATH = "KEYSHRED_PATH"
ENV_CONFIG = "KEYSHRED_API_CONFIG"


def app_from_env() -> Any:
    """The app for the data folder and API settings the environment names (what
    each uvicorn worker process calls)."""
    from keyshred.api.app import create_app

    path = os.environ.get(ENV_PATH)
    if not path:
        raise ConfigError(f"{ENV_PATH} names no data folder")
    return create_app(Path(path), load_settings(os.environ.get(ENV_CONFIG)))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    path: Path,
    *,
    config: Path | None,
    host: str,
    port: int,
    workers: int,
    allow_remote: bool = False,
    access_log: bool = True,
) -> None:
    """Serve until stopped (SIGTERM, SIGINT). Refuses an address that is not a
    loopback one without ``allow_remote`` (bearer tokens over plain HTTP: put a
    TLS-terminating proxy in front), and several workers on an SQLite catalog."""
    uvicorn = require("uvicorn", extra="api")
    if not _loopback(host) and not allow_remote:
        raise ConfigError(
            f"{host} is not a loopback address: serve behind a TLS proxy and pass --allow-remote"
        )
    load_settings(config)  # checked first: a bad file fails before any worker starts
    store = load_config(path)
    if workers > 1 and not (store.storage.catalog_url or "").startswith("postgresql"):
        raise ConfigError(
            "several --workers need the shared profile (a PostgreSQL catalog); "
            "the embedded SQLite profile is served by one process"
        )
    os.environ[ENV_PATH] = str(path.resolve())
    if config is not None:
        os.environ[ENV_CONFIG] = str(config.resolve())
    uvicorn.run(
        "keyshred.api.server:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        access_log=access_log,
        log_level="info",
        proxy_headers=False,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
