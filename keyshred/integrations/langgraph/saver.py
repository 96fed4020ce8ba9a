"""``KeyshredSaver``: LangGraph's ``BaseCheckpointSaver`` on keyshred checkpoints (see
the package docstring, ``keyshred.integrations.langgraph``).

Whose thread is it? The default resolver (``default_subject``) reads, in order,
``config["configurable"]["subject_id"]``, ``["user_id"]`` (what LangGraph apps
already carry) and the identity of LangGraph auth's user (``langgraph_auth_user``,
or ``langgraph_auth_user_id``). A thread created without any of them is its own data
subject, ``thread_subject(thread_id)``: erasing that subject (``ks.erase``) deletes
the thread, key included, with a signed receipt. A thread keeps the subject of its
first write; later calls that name no one use it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from keyshred._extras import require
from keyshred._validate import check_text
from keyshred.errors import InvalidInput
from keyshred.storage.checkpoints import CheckpointRow, WriteRow, pack, unpack

require("langgraph.store.base", extra="langgraph", package="langgraph")

from langchain_core.runnables import RunnableConfig  # noqa: E402
from langgraph.checkpoint.base import (  # noqa: E402
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)

if TYPE_CHECKING:
    from keyshred.config import Config
    from keyshred.facade import Keyshred

__all__ = ["AsyncKeyshredSaver", "KeyshredSaver", "default_subject", "thread_subject"]

# -- whose thread ------------------------------------------------------------------

THREAD_SUBJECT_PREFIX = "langgraph-thread:"
_USER_KEYS = ("subject_id", "user_id")


def thread_subject(thread_id: str | int | uuid.UUID) -> str:
    """The subject id of a thread that names no user: the thread itself. Erase it
    (``ks.erase(thread_subject(tid), …)``) to delete the thread with a receipt."""
    return THREAD_SUBJECT_PREFIX + str(thread_id)


def _identity(user: Any) -> Any:
    """LangGraph auth's user: a mapping or an object with ``identity``."""
    if isinstance(user, Mapping):
        return user.get("identity")
    return getattr(user, "identity", None)


def default_subject(config: RunnableConfig) -> str | None:
    """The user a config names: ``subject_id``, else ``user_id``, else LangGraph
    auth's user identity; None if it names none (a new thread is then its own
    subject). Numbers are taken as their decimal strings."""
    return _subject_in(_configurable(config))


def _subject_in(conf: Mapping[str, Any]) -> str | None:
    """``default_subject`` of a config whose ``configurable`` is read already."""
    for name in _USER_KEYS:  # (read lazily: every saver call resolves)
        value = conf.get(name)
        if value is not None and value != "":
            return _user_id(value)
    for value in (_identity(conf.get("langgraph_auth_user")), conf.get("langgraph_auth_user_id")):
        if value is not None and value != "":
            return _user_id(value)
    return None


def _user_id(value: Any) -> str:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    return check_text(text, "the config's user id")


_THREAD_IDS_KEPT = 20_000  # thread ids a saver keeps from listings across threads

_IDS = ("thread_id", "checkpoint_ns", "checkpoint_id", "subject_id")


def _id(value: Any, what: str) -> str:
    """An id stored as a plaintext column (checkpoint, task, channel, run): a string
    of valid Unicode without NUL, which PostgreSQL's text cannot hold."""
    if type(value) is not str or "\x00" in value:
        check_text(value, what)
        raise InvalidInput(f"{what} holds a NUL character")
    return check_text(value, what)


def _configurable(config: Any) -> dict[str, Any]:
    """``config["configurable"]``, with the ids keyshred reads typed (strings; a
    thread id may be a number or UUID, as LangGraph allows)."""
    if not isinstance(config, Mapping):
        raise InvalidInput("a config is a dict with a 'configurable' dict")
    conf = config.get("configurable") or {}
    if not isinstance(conf, Mapping):
        raise InvalidInput("config['configurable'] is a dict")
    for name in _IDS:
        value = conf.get(name)
        # Every saver call passes here: ASCII ids skip the call (and its message).
        if value is None or (type(value) is str and value.isascii() and "\x00" not in value):
            continue
        if name == "thread_id" and isinstance(value, int | uuid.UUID | str):
            check_text(str(value), "config['configurable']['thread_id']")  # hashed only
            continue
        _id(value, f"config['configurable'][{name!r}]")
    return dict(conf)


class KeyshredSaver(BaseCheckpointSaver[Any]):
    """A LangGraph checkpoint saver encrypted per subject; see the module docstring."""

    def __init__(
        self,
        ks: Keyshred,
        *,
        subject: Callable[[RunnableConfig], str | None] = default_subject,
        scope: str = "default",
        serde: Any = None,
    ) -> None:
        super().__init__(serde=serde)
        # A declared scope only (``UnknownScope`` otherwise), as for memories: a
        # thread in a scope no erasure can name would outlive every scope erasure.
        ks.policy.scope(scope)
        self._ks = ks
        self._store = ks.checkpoints
        self._resolve = subject
        self._scope = scope
        self._thread_ids: dict[str, str] = {}

    @classmethod
    @contextlib.contextmanager
    def from_conn_string(
        cls,
        conn_string: str | os.PathLike[str],
        *,
        path: str | os.PathLike[str] | None = None,
        config: Config | None = None,
        **kwargs: Any,
    ) -> Iterator[KeyshredSaver]:
        """A saver on a keyshred handle of its own, closed on exit, as LangGraph's
        ``PostgresSaver.from_conn_string``: ``conn_string`` is a PostgreSQL URL (the
        catalog and key store; the local folder from ``path`` or ``$KEYSHRED_PATH``)
        or a data folder (``keyshred.integrations.langgraph.connect``). ``kwargs``
        go to the saver (``subject``, ``scope``, ``serde``)."""
        from keyshred.integrations.langgraph.connect import open_conn_string

        ks = open_conn_string(conn_string, path=path, config=config)
        try:
            yield cls(ks, **kwargs)
        finally:
            ks.close()

    def setup(self) -> None:
        """LangGraph's setup: nothing left to do (opening the folder created or
        migrated every table); kept so that code written for ``PostgresSaver`` runs."""

    async def asetup(self) -> None:
        """``setup`` (nothing to do)."""

    # -- helpers -------------------------------------------------------------------

    @staticmethod
    def _conf(config: RunnableConfig) -> dict[str, Any]:
        conf = _configurable(config)
        if "thread_id" not in conf:
            raise InvalidInput("config['configurable']['thread_id'] is required")
        return conf

    def _subject_ref(
        self, config: RunnableConfig, conf: Mapping[str, Any] | None = None
    ) -> str | None:
        if conf is not None and self._resolve is default_subject:
            subject = _subject_in(conf)  # the config is read once a call
        else:
            subject = self._resolve(config)
        return None if subject is None else self._ks.subject_ref(subject)

    def _thread(self, config: RunnableConfig, conf: Mapping[str, Any], thread_id: str) -> Any:
        """The thread a write goes to, created at its first write for the subject the
        config names, or for the thread itself if it names none."""
        ref = self._subject_ref(config, conf)
        own = self._ks.subject_ref(thread_subject(thread_id)) if ref is None else None
        # The write's transaction reads the guard before anything is stored.
        return self._store.ensure_thread(
            thread_id, ref, self._scope, new_subject_ref=own, check=False
        )

    def _tuple(
        self, thread_id: str, row: CheckpointRow, writes: Sequence[WriteRow]
    ) -> CheckpointTuple:
        t1, d1, t2, d2 = unpack(row.data)
        checkpoint = self.serde.loads_typed((t1.decode(), d1))
        metadata = self.serde.loads_typed((t2.decode(), d2))
        config: RunnableConfig = {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": row.checkpoint_ns,
                "checkpoint_id": row.checkpoint_id,
            }
        }
        parent: RunnableConfig | None = None
        if row.parent_checkpoint_id is not None:
            parent = {
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": row.checkpoint_ns,
                    "checkpoint_id": row.parent_checkpoint_id,
                }
            }
        pending = []
        for w in writes:
            wt, wd = unpack(w.data)
            pending.append((w.task_id, w.channel, self.serde.loads_typed((wt.decode(), wd))))
        return CheckpointTuple(config, checkpoint, metadata, parent, pending)

    # -- sync ----------------------------------------------------------------------

    def _check(self, config: RunnableConfig, conf: Mapping[str, Any] | None = None) -> None:
        """A read naming a subject fails early if that subject is suppressed or
        erased (even when its threads are already gone)."""
        ref = self._subject_ref(config, conf)
        if ref is not None:
            self._ks.catalog.check_guard(ref)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        conf = self._conf(config)
        self._check(config, conf)
        thread_id = str(conf["thread_id"])
        th = self._store.thread(thread_id, check=False)  # get() reads the guard
        if th is None:
            return None
        got = self._store.get(th, str(conf.get("checkpoint_ns", "")), get_checkpoint_id(config))
        if got is None:
            return None
        return self._tuple(thread_id, *got)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        th = None
        ns = None
        cid = None
        thread_id: str | None = None
        if config is not None:
            conf = _configurable(config)
            if "thread_id" in conf:
                self._check(config)
                thread_id = str(conf["thread_id"])
                th = self._store.thread(thread_id)
                if th is None:
                    return
            ns = conf.get("checkpoint_ns")
            cid = conf.get("checkpoint_id")
        before_id = get_checkpoint_id(before) if before else None
        if before_id is not None:
            before_id = _id(before_id, "before's checkpoint_id")
        n = 0
        for ref, row, writes in self._store.checkpoints(
            th, checkpoint_ns=ns, checkpoint_id=cid, before=before_id
        ):
            tid = thread_id or self._thread_id(ref)
            tup = self._tuple(tid, row, writes)
            if filter and not all(tup.metadata.get(k) == v for k, v in filter.items()):
                continue
            yield tup
            n += 1
            if limit is not None and n >= limit:
                return

    def _thread_id(self, ref: str) -> str:
        tid = self._thread_ids.get(ref)
        if tid is None:
            if len(self._thread_ids) >= _THREAD_IDS_KEPT:
                self._thread_ids = {}  # bounded: a listing over many threads starts over
            tid = self._thread_ids[ref] = self._store.thread_id(ref)
        return tid

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        conf = self._conf(config)
        thread_id = str(conf["thread_id"])
        ns = str(conf.get("checkpoint_ns", ""))
        checkpoint_id = _id(checkpoint.get("id"), "the checkpoint's id")
        md = get_serializable_checkpoint_metadata(config, metadata)
        run_id = md.get("run_id")
        run = None if run_id is None else _id(str(run_id), "the metadata's run_id")
        th = self._thread(config, conf, thread_id)
        t1, d1 = self.serde.dumps_typed(checkpoint)
        t2, d2 = self.serde.dumps_typed(md)
        row = CheckpointRow(
            thread_id,
            ns,
            checkpoint_id,
            conf.get("checkpoint_id"),
            pack(t1.encode(), d1, t2.encode(), d2),
        )
        self._store.put_checkpoint(th, row, run)
        return {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint_id,
            }
        }

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        conf = self._conf(config)
        thread_id = str(conf["thread_id"])
        _id(task_id, "the task id")
        _id(task_path, "the task path")
        for channel, _ in writes:
            _id(channel, "a write's channel")
        th = self._thread(config, conf, thread_id)
        rows = []
        for idx, (channel, value) in enumerate(writes):
            t, d = self.serde.dumps_typed(value)
            rows.append(
                WriteRow(
                    task_id,
                    WRITES_IDX_MAP.get(channel, idx),
                    channel,
                    task_path,
                    pack(t.encode(), d),
                )
            )
        replace = all(w[0] in WRITES_IDX_MAP for w in writes)
        ns = str(conf.get("checkpoint_ns", ""))
        self._store.put_writes(th, ns, str(conf["checkpoint_id"]), rows, replace=replace)

    def delete_thread(self, thread_id: str) -> None:
        """Delete the thread's checkpoints and writes and destroy its key: the
        bytes are gone, and any copy left anywhere is unreadable."""
        self._store.drop_thread(str(thread_id))
        self._thread_ids = {k: v for k, v in self._thread_ids.items() if v != thread_id}

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        by_thread: dict[str, list[tuple[str, str]]] = {}
        runs = [_id(str(r), "a run id") for r in run_ids]
        for ref, ns, cid in self._store.run_checkpoints(runs):
            by_thread.setdefault(ref, []).append((ns, cid))
        for ref, keys in by_thread.items():
            th = self._store._find(ref)
            if th is not None:
                self._store.delete_checkpoints(th, keys)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        src = self._store.thread(str(source_thread_id))
        if src is None:
            return
        dst = self._store.ensure_thread(str(target_thread_id), src.subject_ref, src.scope)
        for _, row, writes in reversed(list(self._store.checkpoints(src))):
            self._store.put_checkpoint(dst, row, None)
            by_task: dict[tuple[str, str], list[WriteRow]] = {}
            for w in writes:
                by_task.setdefault((w.task_id, w.task_path), []).append(w)
            for ws in by_task.values():
                self._store.put_writes(dst, row.checkpoint_ns, row.checkpoint_id, ws, replace=True)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: only the newest checkpoint per namespace stays (with its
        writes); ``delete``: the whole thread goes, key included. Not aware of
        ``DeltaChannel`` history (see LangGraph's caveat): do not prune threads of
        graphs that use it."""
        if strategy not in ("keep_latest", "delete"):
            raise InvalidInput(f"unknown prune strategy {strategy!r}")
        for thread_id in thread_ids:
            if strategy == "delete":
                self.delete_thread(str(thread_id))
                continue
            th = self._store.thread(str(thread_id))
            if th is None:
                continue
            seen: set[str] = set()
            doomed = []
            for _, row, _ in self._store.checkpoints(th):
                if row.checkpoint_ns in seen:
                    doomed.append((row.checkpoint_ns, row.checkpoint_id))
                seen.add(row.checkpoint_ns)
            self._store.delete_checkpoints(th, doomed)

    # -- async twins (one source of truth: the sync methods, in a worker thread) ---

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        items = await asyncio.to_thread(
            lambda: list(self.list(config, filter=filter, before=before, limit=limit))
        )
        for item in items:
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)


class AsyncKeyshredSaver(KeyshredSaver):
    """``KeyshredSaver`` under the name LangGraph's async users look for
    (``AsyncPostgresSaver``, ``AsyncSqliteSaver``): the same saver, whose async
    methods run the sync ones in a worker thread, and an async ``from_conn_string``."""

    @classmethod
    @contextlib.asynccontextmanager
    async def from_conn_string(  # type: ignore[override]
        cls,
        conn_string: str | os.PathLike[str],
        *,
        path: str | os.PathLike[str] | None = None,
        config: Config | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AsyncKeyshredSaver]:
        """``KeyshredSaver.from_conn_string`` as an async context manager."""
        from keyshred.integrations.langgraph.connect import open_conn_string

        ks = await asyncio.to_thread(open_conn_string, conn_string, path=path, config=config)
        try:
            yield cls(ks, **kwargs)
        finally:
            await asyncio.to_thread(ks.close)
