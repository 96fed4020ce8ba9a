"""The vault's tables: ``ks_tokens`` and ``ks_token_blocks``.

They live in the catalog's database and its ``MetaData`` (so the catalog's
``create_all`` and its backup snapshot take them like every other table), but the
vault owns them: only ``keyshred.vault`` writes them.

Each ``ks_tokens`` row is a token asset in full (subject_ref, scope, purpose,
retain-until = expires_at, storage = this table; tokens derive from nothing), so
tokens get no second row in ``ks_assets``: the catalog's ``assets()`` and
``asset_kinds()`` list them with kind ``token`` through the vault's hook
(``keyshred.vault.store``). One row per token halves what a sanitize writes. The key
is the token's number, which its id enciphers (``keyshred.keyring.tokenid``):
numbers come in blocks per process, so rows append, and a token finds its row by
primary key; no index of random ids takes random inserts. ``lookup`` (deterministic
tokens only) is the HMAC of the value under a key derived from the subject's DEK.

``ks_token_blocks`` has one row per block of numbers handed to a process (with that
process's group-commit interval) and is never emptied, so a number is never issued
twice, even after its token was deleted (an old token in a log must not resolve to a
new token's value).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from keyshred.db import Micros
from keyshred.errors import ConfigError
from keyshred.storage.schema import metadata

__all__ = ["TOKEN_BLOCK", "TOKEN_COLUMNS", "TOKEN_KIND", "create", "token_blocks", "tokens"]

TOKEN_KIND = "token"  # noqa: S105 - an asset kind, not a secret
TOKEN_BLOCK = 1024  # numbers a process takes at a time

tokens = sa.Table(
    "ks_tokens",
    metadata,
    # INTEGER PRIMARY KEY on SQLite: the rowid itself.
    sa.Column(
        "number",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=False,
    ),
    sa.Column("token", sa.String(64), nullable=False),
    sa.Column("subject_ref", sa.String(64), nullable=False),
    sa.Column("scope", sa.String(128), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("purpose", sa.String(128), nullable=False),
    sa.Column("deterministic", sa.Boolean, nullable=False),
    sa.Column("lookup", sa.LargeBinary(32), nullable=True),
    # Microseconds since 1970 UTC (``Micros``): bound as integers on the hot path.
    sa.Column("created_at", Micros, nullable=False),
    sa.Column("expires_at", Micros, nullable=False),
    sa.Column("value", sa.LargeBinary, nullable=False),  # envelope ciphertext
    sa.Index("ks_tokens_subject", "subject_ref", "scope"),
)
sa.Index(
    "ks_tokens_lookup",
    tokens.c.lookup,
    sqlite_where=tokens.c.lookup.is_not(None),
    postgresql_where=tokens.c.lookup.is_not(None),
)
# Block b holds numbers b * TOKEN_BLOCK .. b * TOKEN_BLOCK + 1023.
token_blocks = sa.Table(
    "ks_token_blocks",
    metadata,
    sa.Column("block", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
    # The taking process's group-commit interval: how long its tokens may wait in its
    # memory (and journal) before they are written; 0: written before they are handed
    # out. Another process that meets a number of the block without a row waits that
    # long for it (``TokenStore.pending_window``) instead of refusing a real token.
    sa.Column("group_commit_ms", sa.Float, nullable=False, server_default="0"),
    sqlite_autoincrement=True,
)
TOKEN_COLUMNS = tuple(c.name for c in tokens.columns)


def create(engine: Engine) -> None:
    """Create the vault's tables if they are missing, and refuse a ``ks_tokens``
    from before token numbers: ``create_all`` leaves an existing table as it is, and
    such a table would fail on the first sanitize instead."""
    metadata.create_all(engine, tables=[tokens, token_blocks])
    columns = {c["name"]: c["type"] for c in sa.inspect(engine).get_columns("ks_tokens")}
    if "number" not in columns or not isinstance(columns.get("created_at"), sa.Integer):
        raise ConfigError(
            "this catalog's ks_tokens table predates token numbers and integer "
            "times (keyshred 0.1 development builds); export what you need and "
            "start a new folder"
        )
