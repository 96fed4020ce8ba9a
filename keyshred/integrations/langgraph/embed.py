"""LangGraph's ``index`` config (``dims``, ``embed``, ``fields``) as a keyshred
embedding space, for ``KeyshredStore``.

``embed`` is what LangGraph's ``ensure_embeddings`` accepts: a function on a list of
texts (sync or async), a LangChain ``Embeddings``, or a ``"provider:model"`` string
(through langchain's ``init_embeddings``). The store embeds with it, in an embedding
space of its own (``keyshred.storage.vectors``): its vectors are searched only with
its queries, never beside those of the handle's embedder or of another store's. The
space is named ``embedding_space`` if the store was given one, else after the
function (the provider string; the ``Embeddings`` class and its model; the
function's module and qualified name, and for a lambda or a nested function its
line), with ``dims`` part of its identity. An ``embed`` that is the very function
the ``Keyshred`` was opened with (``embeddings=``) is the handle's default space,
so vectors written before stores had spaces of their own stay searchable.

The texts of a value are LangGraph's (``get_text_at_path``: ``"$"`` is the value as
sorted JSON, ``"a.b"``, ``"a[0]"``, ``"a[*].b"``, ``"{a,b}"``; a path that finds
nothing gives no vector, one that finds several gives one each), so a store with a
given ``index`` ranks as ``InMemoryStore`` with the same ``index`` does.

Async: the store's async methods run its sync ones in a worker thread. ``abatch``
first awaits the embeddings of the batch's texts and queries on the caller's loop
(``aembed_documents``/``aembed_query``, as ``InMemoryStore.abatch``) and hands them
to that thread (``precomputed``); what is embedded later (a repair of stale vectors)
calls the sync form, or for an async-only function runs it on a private loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from langchain_core.embeddings import Embeddings
from langgraph.store.base import IndexConfig
from langgraph.store.base.embed import (
    EmbeddingsLambda,
    ensure_embeddings,
    get_text_at_path,
    tokenize_path,
)

from keyshred.errors import InvalidInput, KeyshredError
from keyshred.storage.embeddings import Embedder

if TYPE_CHECKING:
    from keyshred.facade import Keyshred

__all__ = ["StoreIndex", "langgraph_texts", "precomputed", "space_name", "store_index"]

T = TypeVar("T")

# Embeddings computed ahead on the caller's event loop (``abatch``), keyed by
# ("d", text) for documents and ("q", text) for queries; read in the worker thread
# (``asyncio.to_thread`` copies the context).
_AHEAD: contextvars.ContextVar[dict[tuple[str, str], Any] | None] = contextvars.ContextVar(
    "keyshred_langgraph_embeddings", default=None
)


@dataclass(frozen=True, slots=True)
class StoreIndex:
    """What a store's ``index`` config resolves to."""

    fields: tuple[str, ...]
    dims: int
    # The space's embedder; None: the handle's own (the config named no ``embed``).
    embedder: Embedder | None
    embeddings: Embeddings | None
    space: str | None  # the space's name (None: the handle's default space)


def langgraph_texts(value: Any, path: str) -> list[str]:
    """The texts LangGraph's stores embed for one path of a value."""
    return get_text_at_path(value, path if path == "$" else tokenize_path(path))


def space_name(embed: Any) -> str:
    """The embedding space an ``embed`` is named after when the store is given no
    ``embedding_space``: a name of configuration (the model or the function), never
    data. Two different functions may not share one (the memory store refuses a
    second function under a name already in use on the handle)."""
    if isinstance(embed, str):
        return embed
    target = embed
    if isinstance(embed, EmbeddingsLambda):
        target = getattr(embed, "func", None) or getattr(embed, "afunc", None)
    if isinstance(target, Embeddings):
        cls = type(target)
        name = f"{cls.__module__}.{cls.__qualname__}"
        for attr in ("model", "model_name", "model_id", "deployment"):
            model = getattr(target, attr, None)
            if isinstance(model, str) and model:
                return f"{name}:{model}"
        return name
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    name = f"{module}.{qualname}"
    code = getattr(target, "__code__", None)
    if "<" in qualname and code is not None:
        # ``<lambda>`` and ``<locals>``: many functions share such a name in a module.
        name += f":{code.co_firstlineno}"
    return name


def store_index(
    ks: Keyshred, index: IndexConfig | None, *, embedding_space: str | None = None
) -> StoreIndex | None:
    """Check a store's ``index`` config and build its embedder (``InvalidInput``
    for a config LangGraph would not run with)."""
    if index is None:
        return None
    if not isinstance(index, dict):
        raise InvalidInput("index is LangGraph's IndexConfig: {'dims': N, 'embed': ..., ...}")
    dims = index.get("dims")
    if isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0:
        raise InvalidInput("index['dims'] is the embeddings' number of dimensions")
    fields = index.get("fields")
    if fields is None:
        paths: tuple[str, ...] = ("$",)
    elif isinstance(fields, str) or not isinstance(fields, list | tuple):
        raise InvalidInput("index['fields'] is a list of JSON paths")
    else:
        paths = tuple(fields)
        if not all(isinstance(p, str) and p for p in paths):
            raise InvalidInput("index['fields'] are non-empty JSON paths")
    if embedding_space is not None and not (isinstance(embedding_space, str) and embedding_space):
        raise InvalidInput("embedding_space is a non-empty name")
    embed = index.get("embed")
    if embed is None:
        # No function: the handle's own, as before stores had spaces.
        return StoreIndex(paths, dims, None, None, None)
    if not isinstance(embed, str | Embeddings) and not callable(embed):
        raise InvalidInput(
            "index['embed'] is an embedding function, a LangChain Embeddings "
            "or a 'provider:model' string"
        )
    embeddings = _ensure(embed)
    space = embedding_space or (
        "" if embedding_space is None and _is_handles(ks, embed) else space_name(embed)
    )
    embedder = Embedder(
        lambda texts: _documents(embeddings, texts),
        lambda text: _query(embeddings, text),
        dims=dims,
        name=space or "handle",
        space=space,
        source=_handle_source(ks) if space == "" else embed,
        texts=langgraph_texts,
    )
    return StoreIndex(paths, dims, embedder, embeddings, space or None)


def _ensure(embed: Any) -> Embeddings:
    """LangGraph's ``ensure_embeddings``, its errors as ``InvalidInput`` (a provider
    string needs langchain and the provider's package; the message says so)."""
    try:
        return ensure_embeddings(embed)
    except (ValueError, ImportError, TypeError) as exc:
        label = embed if isinstance(embed, str) else type(embed).__name__
        raise InvalidInput(f"index['embed'] {label!r} cannot be loaded: {exc}") from None


def _handle_source(ks: Keyshred) -> Any:
    try:
        return ks.memories.embedder.source
    except KeyshredError:  # a handle opened without any embedding function
        return None


def _is_handles(ks: Keyshred, embed: Any) -> bool:
    """Whether ``embed`` is the function the handle was opened with (its space is
    the handle's default space)."""
    source = _handle_source(ks)
    return source is not None and source is embed


# -- calling the embeddings ------------------------------------------------------------


def _documents(embeddings: Embeddings, texts: list[str]) -> list[Any]:
    ahead = _AHEAD.get()
    todo = [t for t in dict.fromkeys(texts) if ahead is None or ("d", t) not in ahead]
    done: dict[str, Any] = {}
    if todo:
        if _async_only(embeddings):
            vectors = _run(embeddings.aembed_documents(todo))
        else:
            vectors = embeddings.embed_documents(todo)
        if not isinstance(vectors, Sequence) or len(vectors) != len(todo):
            raise InvalidInput("the embedding function returned the wrong number of vectors")
        done = dict(zip(todo, vectors, strict=True))
    return [done[t] if t in done else ahead[("d", t)] for t in texts]  # type: ignore[index]


def _query(embeddings: Embeddings, text: str) -> Any:
    ahead = _AHEAD.get()
    if ahead is not None and ("q", text) in ahead:
        return ahead[("q", text)]
    if _async_only(embeddings):
        return _run(embeddings.aembed_query(text))
    return embeddings.embed_query(text)


def _async_only(embeddings: Embeddings) -> bool:
    return isinstance(embeddings, EmbeddingsLambda) and getattr(embeddings, "func", None) is None


def _run(coro: Awaitable[T]) -> T:
    """Run a coroutine to its end from sync code: on a private loop, in a thread of
    its own when this thread already runs a loop."""

    async def wrap() -> T:
        return await coro

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wrap())
    with ThreadPoolExecutor(1, thread_name_prefix="keyshred-embed") as pool:
        return pool.submit(asyncio.run, wrap()).result()


async def embed_ahead(
    embeddings: Embeddings, texts: Sequence[str], queries: Sequence[str]
) -> dict[tuple[str, str], Any]:
    """Embeddings of ``texts`` and ``queries`` awaited on the caller's loop."""
    out: dict[tuple[str, str], Any] = {}
    unique = list(dict.fromkeys(texts))
    if unique:
        vectors = await embeddings.aembed_documents(unique)
        if len(vectors) != len(unique):
            raise InvalidInput("the embedding function returned the wrong number of vectors")
        out.update({("d", t): v for t, v in zip(unique, vectors, strict=True)})
    asked = list(dict.fromkeys(queries))
    answers = await asyncio.gather(*(embeddings.aembed_query(q) for q in asked))
    out.update({("q", q): v for q, v in zip(asked, answers, strict=True)})
    return out


@contextlib.contextmanager
def precomputed(vectors: dict[tuple[str, str], Any]) -> Iterator[None]:
    """Use embeddings computed ahead (``embed_ahead``) in this context."""
    token = _AHEAD.set(vectors)
    try:
        yield
    finally:
        _AHEAD.reset(token)
