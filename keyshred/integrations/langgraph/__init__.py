"""LangGraph backends: ``KeyshredStore`` (a ``BaseStore``) and ``KeyshredSaver`` (a
``BaseCheckpointSaver``), both encrypted per subject and erasable
(``pip install 'keyshred[langgraph]'``).

The store keeps each item as a memory of the subject its namespace names (by
default the first label; ``subject_from=1`` for ``("memories", user_id)``), so the
item's namespace, key, value and vectors are ciphertext under that subject's keys
and go with the subject's erasure. What LangGraph's stores lack: ``delete_prefix``
(a whole namespace prefix in one call) and ``erase_subject`` (the erasure
coordinator, with a signed receipt).

The saver keeps each thread under the subject named by
``config["configurable"]["subject_id"]`` (or a ``subject`` resolver), recorded at
the thread's first write; see ``keyshred.storage.checkpoints``. Sync methods are the
single source of truth; the async twins run them in a worker thread.
"""

from __future__ import annotations

from keyshred.integrations.langgraph.saver import KeyshredSaver
from keyshred.integrations.langgraph.store import KeyshredStore

__all__ = ["KeyshredSaver", "KeyshredStore"]
