"""``from_conn_string``: a keyshred handle from what a LangGraph app passes its saver or
store, so that moving from ``PostgresSaver``/``SqliteSaver`` is an import and a class
name.

The string says where the catalog lives:

- ``postgresql://…`` (or ``postgresql+psycopg://…``): the catalog and the key store on
  that PostgreSQL (the shared profile's database); the local data folder (keys of the
  local KEK provider, caches) is ``path``, else ``$KEYSHRED_PATH``, else
  ``./keyshred-data``;
- anything else is the data folder itself (the embedded profile: SQLite catalog and
  key store inside it), as ``SqliteSaver.from_conn_string`` takes a file.

The rest of the configuration comes from the folder's ``keyshred.toml`` and the
environment (``KEYSHRED_*``), as for ``Keyshred.open``; ``config`` replaces both. The
folder is created on first use (``Keyshred.init(exist_ok=True)``), which also creates
or migrates the catalog's and key store's tables: ``setup()`` has nothing left to do
and is there because LangGraph code calls it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keyshred.config import Config, load_config
from keyshred.errors import InvalidInput

if TYPE_CHECKING:
    from keyshred.facade import Keyshred

__all__ = ["DEFAULT_FOLDER", "open_conn_string"]

DEFAULT_FOLDER = "keyshred-data"
_DATABASE_SCHEMES = ("postgresql://", "postgresql+psycopg://", "postgres://")


def open_conn_string(
    conn_string: str | os.PathLike[str],
    *,
    path: str | os.PathLike[str] | None = None,
    config: Config | None = None,
    embeddings: Any = None,
) -> Keyshred:
    """An open ``Keyshred`` for ``conn_string`` (see the module docstring); the caller
    closes it."""
    from keyshred.facade import Keyshred

    if isinstance(conn_string, os.PathLike):
        conn_string = os.fspath(conn_string)
    if not isinstance(conn_string, str) or not conn_string.strip():
        raise InvalidInput("a connection string is a PostgreSQL URL or a data folder path")
    url = ""
    if conn_string.startswith(_DATABASE_SCHEMES):
        url = conn_string
        if url.startswith("postgres://"):
            url = "postgresql://" + url.removeprefix("postgres://")
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        folder = Path(path or os.environ.get("KEYSHRED_PATH") or DEFAULT_FOLDER)
        overrides: dict[str, Any] = {
            "storage": {"catalog_url": url},
            "keyring": {"store_url": url},
        }
    else:
        if path is not None:
            raise InvalidInput("a data folder path is the connection string itself: no path=")
        folder = Path(conn_string)
        overrides = {}
    if config is None:
        config = load_config(folder, overrides=overrides)
    elif overrides:
        config = config.model_copy(
            update={
                "storage": config.storage.model_copy(update={"catalog_url": url}),
                "keyring": config.keyring.model_copy(update={"store_url": url}),
            }
        )
    return Keyshred.init(folder, config, exist_ok=True, embeddings=embeddings)
