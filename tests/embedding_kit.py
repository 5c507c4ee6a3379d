"""What the embedding tests share: sentence-transformers' files declaring a pooling, the
oracle (mlx-lm's own model class on the same folder, its hidden states pooled by hand),
and the `ollama` client of a server (`serving` and `openai_client`: serve_client.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import ollama
from serve_client import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
# sentence-transformers' flag of each pooling (1_Pooling/config.json)
ST_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
            "last": "pooling_mode_lasttoken"}  # fmt: skip


def declare(folder: Path, pooling: str, *, dense: bool = False, **config) -> Path:
    """`folder` with sentence-transformers' modules.json and 1_Pooling/config.json declaring
    `pooling` (a sentence-transformers flag name, or ours), as a release ships them (a Dense
    module after the pooling with `dense`); `config`: keys added to its config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    if dense:
        kinds.insert(2, ("2_Dense", "Dense"))
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    flag = ST_FLAGS.get(pooling, pooling)
    flags = {f: f == flag for f in (*ST_FLAGS.values(), "pooling_mode_max_tokens")}
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **flags, "include_prompt": True})
    )
    if config:
        path = folder / "config.json"
        whole = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**whole, **config}))
    return folder


def model_copy(tiny_dir: Path, folder: Path, **config) -> Path:
    """The tiny model's folder copied, `config` keys changed in its config.json."""
    shutil.copytree(tiny_dir, folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


class Oracle:
    """mlx-lm's own model class on the folder (`mlx_lm.utils.load`): each input alone,
    its final hidden states (`model.model`) pooled by hand and L2-normalized."""

    def __init__(self, folder: Path):
        from mlx_lm.utils import load

        self.model, self.tokenizer = load(str(folder))

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def vector(self, item: str | list[int], pooling: str) -> np.ndarray:
        ids = self.ids(item) if isinstance(item, str) else item
        h = self.model.model(mx.array([ids])).astype(mx.float32)[0]
        v = np.array({"mean": h.mean(axis=0), "cls": h[0], "last": h[-1]}[pooling])
        return v / np.linalg.norm(v)


def ollama_client(base: str) -> ollama.Client:
    return ollama.Client(host=base, headers=AUTH, timeout=60)


def vectors(response) -> np.ndarray:
    """(N, D) of an openai `embeddings.create` answer, in `index` order."""
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)])
