"""``keyshred.erasure``: the erasure coordinator and derived assets.

- ``requests``: ``ErasureRequest``, ``Hold``, the states and ``STEPS``;
- ``coordinator``: ``ErasureCoordinator`` (``ks.erasure``), wired with the stores
  (``keyshred.storage.erasable.Erasable``), the catalog and the keyring;
- ``extent``: how subject, scope, retention and replay requests differ;
- ``holds``: legal holds and re-admission;
- ``derived``: ``ks.derived`` and the derived assets' erasure (``DerivedStore``),
  with the rebuild functions' registry (``register_rebuilder``, entry points
  ``keyshred.rebuilders``);
- ``receipt``: the receipt built from what the stores returned;
- ``callbacks``: completion webhooks, written with the state they announce and
  delivered as ``webhook`` jobs.
"""

from __future__ import annotations

from keyshred.erasure.coordinator import ErasureCoordinator
from keyshred.erasure.derived import (
    ENTRY_POINT_GROUP,
    DerivedApi,
    DerivedStore,
    register_rebuilder,
)
from keyshred.erasure.requests import (
    STEPS,
    ErasureRequest,
    ExternalAnswer,
    ExternalProcessor,
    Hold,
    ProducerUnknown,
    RebuildFailed,
    VerificationFailed,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "STEPS",
    "DerivedApi",
    "DerivedStore",
    "ErasureCoordinator",
    "ErasureRequest",
    "ExternalAnswer",
    "ExternalProcessor",
    "Hold",
    "ProducerUnknown",
    "RebuildFailed",
    "VerificationFailed",
    "register_rebuilder",
]
