"""``Keyshred``: the one object an application opens.

Today it holds the keyring (per-subject keys, crypto-erasure); the memory store,
vectors, erasure coordinator, vault and backups attach here as they are built.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from keyshred._backends import KEYS_DIR, make_kek, make_keystore
from keyshred.config import CONFIG_FILE, Config, load_config, save_config
from keyshred.errors import ConfigError
from keyshred.ids import Subject, SubjectLike, as_subject
from keyshred.keyring.keyring import Keyring

__all__ = ["Keyshred"]


class Keyshred:
    """An open keyshred data folder."""

    def __init__(self, path: Path, config: Config, keyring: Keyring) -> None:
        self.path = path
        self.config = config
        self.keyring = keyring

    @classmethod
    def init(
        cls,
        path: str | os.PathLike[str],
        config: Config | None = None,
        *,
        exist_ok: bool = False,
    ) -> Keyshred:
        """Create a data folder: configuration, key folder (0700), KEK, key store."""
        root = Path(path)
        if (root / CONFIG_FILE).exists():
            if not exist_ok:
                raise ConfigError(f"{root} is already a keyshred folder")
            return cls.open(root, config)
        config = config or Config()
        root.mkdir(parents=True, exist_ok=True)
        (root / KEYS_DIR).mkdir(mode=0o700, exist_ok=True)
        ks = cls._assemble(root, config, create=True)
        save_config(root, config)
        return ks

    @classmethod
    def open(cls, path: str | os.PathLike[str], config: Config | None = None) -> Keyshred:
        """Open an existing data folder (``ConfigError`` if it is not one)."""
        root = Path(path)
        if not (root / CONFIG_FILE).exists():
            raise ConfigError(f"{root} is not a keyshred folder; run 'keyshred init {root}'")
        return cls._assemble(root, config or load_config(root), create=False)

    @classmethod
    def _assemble(cls, root: Path, config: Config, *, create: bool) -> Keyshred:
        kek = make_kek(config, root, create=create)
        keyring = Keyring(
            make_keystore(config, root),
            kek,
            tenant=config.tenant,
            cache_max_entries=config.keyring.cache_max_entries,
            cache_ttl_seconds=config.keyring.cache_ttl_seconds,
        )
        return cls(root, config, keyring)

    def subject_ref(self, subject: SubjectLike) -> str:
        """The pseudonymous reference that stands for ``subject`` everywhere."""
        s: Subject = as_subject(subject, self.config.tenant)
        return self.keyring.subject_ref(s.id, s.tenant)

    def close(self) -> None:
        self.keyring.close()

    def __enter__(self) -> Keyshred:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Keyshred(path={str(self.path)!r}, profile={self.config.profile!r})"
