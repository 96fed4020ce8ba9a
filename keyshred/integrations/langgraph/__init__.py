"""LangGraph backends: ``KeyshredStore`` (a ``BaseStore``) and ``KeyshredSaver`` (a
``BaseCheckpointSaver``), both encrypted per subject and erasable
(``pip install 'keyshred[langgraph]'``).

The store keeps each item as a memory of the subject its namespace names (by
default the first label; ``subject_from=1`` for ``("memories", user_id)``), so the
item's namespace, key, value and vectors are ciphertext under that subject's keys
and go with the subject's erasure. What LangGraph's stores lack: ``delete_prefix``
(a whole namespace prefix in one call) and ``erase_subject`` (the erasure
coordinator, with a signed receipt). Its ``index`` is LangGraph's ``IndexConfig``
(``dims``, ``embed``, ``fields``), honoured as ``InMemoryStore`` honours it, in an
embedding space of the store's own (``keyshred.integrations.langgraph.embed``).

The saver keeps each thread under the user its config names (``subject_id``, then
``user_id``, then LangGraph auth's user; or a ``subject`` resolver), recorded at the
thread's first write; a thread that names no user is its own subject
(``thread_subject``). See ``keyshred.storage.checkpoints``. Sync methods are the
single source of truth; the async twins run them in a worker thread, and the
``Async…`` classes are the same classes under the names LangGraph's async users look
for. ``from_conn_string`` and ``setup`` take what LangGraph's PostgreSQL classes take
(``keyshred.integrations.langgraph.connect``).
"""

from __future__ import annotations

from keyshred.integrations.langgraph.saver import (
    AsyncKeyshredSaver,
    KeyshredSaver,
    default_subject,
    thread_subject,
)
from keyshred.integrations.langgraph.store import AsyncKeyshredStore, KeyshredStore

__all__ = [
    "AsyncKeyshredSaver",
    "AsyncKeyshredStore",
    "KeyshredSaver",
    "KeyshredStore",
    "default_subject",
    "thread_subject",
]
