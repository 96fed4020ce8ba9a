"""No key material in any log, whatever the application's logging configuration.

Every KEK provider runs a workload with the root logger and every library logger
at DEBUG, with handlers added (and ``dictConfig`` run) *after* the provider was
built, as an application that configures logging late does. The captured log must
hold none of the DEKs in raw, hex or base64 form, and it must hold the libraries'
own DEBUG records (so the scan cannot pass because nothing was logged).
"""

from __future__ import annotations

import base64
import io
import logging
import logging.config
from collections.abc import Iterator

import pytest

from keyshred.keyring import _primitives as prim
from keyshred.keyring.epochs import epoch_key_context
from keyshred.keyring.kek import KekProvider, WrappedKey
from keyshred.keyring.keyring import Keyring, _dek_context, _secret_context
from keyshred.keyring.keystore import SQLiteKeyStore
from tests.keyring.conftest import KekFactory

_LIBRARIES = ("botocore", "boto3", "urllib3", "requests", "hvac")


def _forms(key: bytes) -> list[bytes]:
    """Every way a key could appear in a log line."""
    b64 = base64.b64encode(key)
    return [
        key,
        repr(key)[2:-1].encode("ascii"),
        key.hex().encode(),
        key.hex().upper().encode(),
        b64,
        b64.rstrip(b"="),
        base64.urlsafe_b64encode(key).rstrip(b"="),
    ]


class Capture:
    """A stream every record goes to, and the loggers it set to DEBUG (restored)."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.touched: list[tuple[logging.Logger, int, bool, list[logging.Handler]]] = []

    def all_debug(self) -> None:
        """Every logger that exists now at DEBUG, enabled and propagating."""
        for name in [*_LIBRARIES, *logging.Logger.manager.loggerDict]:
            logger = logging.getLogger(name)
            self.touched.append((logger, logger.level, logger.propagate, list(logger.handlers)))
            logger.setLevel(logging.DEBUG)
            logger.propagate = True
            logger.disabled = False

    def restore(self) -> None:
        for logger, level, propagate, handlers in reversed(self.touched):
            logger.setLevel(level)
            logger.propagate = propagate
            logger.handlers[:] = handlers


@pytest.fixture
def captured() -> Iterator[Capture]:
    """Everything logged at DEBUG anywhere, restoring the logging state after."""
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    capture = Capture()
    handler = logging.StreamHandler(capture.stream)
    handler.setLevel(logging.DEBUG)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    capture.all_debug()
    yield capture
    capture.restore()
    root.handlers[:] = saved[1]
    root.setLevel(saved[0])


def _reconfigure_late(capture: Capture) -> None:
    """What an application may do after keyshred started: new handlers straight on
    the library loggers, a dictConfig that sets them to DEBUG, every logger to DEBUG."""
    logging.config.dictConfig(
        {
            "version": 1,
            "incremental": False,
            "disable_existing_loggers": False,
            "handlers": {"late": {"class": "logging.StreamHandler", "stream": capture.stream}},
            "loggers": {
                name: {"level": "DEBUG", "handlers": ["late"], "propagate": True}
                for name in ("botocore", "botocore.endpoint", "botocore.parsers", "urllib3")
            },
        }
    )
    for name in ("botocore.hooks", "hvac", "urllib3.connectionpool"):
        logging.getLogger(name).addHandler(logging.StreamHandler(capture.stream))
    capture.all_debug()


def _workload(kek: KekProvider, tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Wrap, unwrap, batch, rewrap and a keyring's own DEKs; returns every key seen."""
    keys = [prim.random_key() for _ in range(4)]
    contexts = [{"keyshred:key_id": f"k{i}", "keyshred:scope": "default"} for i in range(4)]
    single = kek.wrap(keys[0], contexts[0])
    seen = [kek.unwrap(single, contexts[0])]
    wrapped = kek.wrap_many(list(zip(keys, contexts, strict=True)))
    seen += kek.unwrap_many(list(zip(wrapped, contexts, strict=True)))
    kek.rewrap_many(list(zip(wrapped, contexts, strict=True)))
    kek.epochs()  # a metadata call: its library records are not dropped
    store = SQLiteKeyStore(tmp_path_factory.mktemp("ks") / "keystore.db")
    keyring = Keyring(store, kek)
    for i in range(3):
        keyring.data_key(f"ref{i}", "default")
    keyring.cache.clear()
    keyring.data_key("ref0", "default")  # unwrapped again
    keyring.signer()
    deks = []
    for epoch_key in store.epoch_keys("live"):  # the epoch key the provider wrapped
        deks.append(
            kek.unwrap(
                WrappedKey(epoch_key.provider_epoch, epoch_key.wrapped),
                epoch_key_context("live", epoch_key.epoch),
            )
        )
    for i in range(3):  # the raw DEKs the keyring created and wrapped
        record = store.find(f"ref{i}", "default")
        assert record is not None
        context = _dek_context(record.key_id, record.tenant, record.subject_ref, record.scope)
        deks.append(
            keyring._unwrap_one(record.kek_provider, record.kek_epoch, record.wrapped, context)
        )
    for secret in store.secrets():  # subject-ref key, receipt signing key
        context = _secret_context(secret.name)
        deks.append(
            keyring._unwrap_one(secret.kek_provider, secret.kek_epoch, secret.wrapped, context)
        )
    store.close()
    assert seen[: len(keys) + 1] == [keys[0], *keys]
    return [*keys, *seen, *deks]


def test_no_key_material_in_any_log(
    kek_factory: KekFactory,
    captured: Capture,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    kek = kek_factory()
    try:
        _reconfigure_late(captured)
        keys = _workload(kek, tmp_path_factory)
    finally:
        kek.close()
    log = captured.stream.getvalue().encode("utf-8", "backslashreplace")
    for key in keys:
        for form in _forms(key):
            assert form not in log, f"{kek.name}: a key reached the log"
    if kek.name == "aws":
        assert b"ListAliases" in log or b"DescribeKey" in log  # botocore did log at DEBUG
    if kek.name == "vault":
        assert b"/v1/transit/keys/" in log  # urllib3 did log at DEBUG
