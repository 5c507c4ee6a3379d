"""The embedding a checkpoint declares: how its hidden states pool into one vector, and
the shorter vectors it allows.

    spec = embedding_spec(path)          # a folder or a GGUF file
    spec.pooling                         # "mean", "cls" or "last"
    spec.dimensions_refusal(256)         # None, or why 256 values cannot be asked for

Where it is read from, first found first:

- sentence-transformers' files in a folder: `modules.json` naming a
  `sentence_transformers.models.Pooling` module, whose `config.json` sets one of
  `pooling_mode_mean_tokens`, `pooling_mode_cls_token`, `pooling_mode_lasttoken` (as
  Qwen3-Embedding declares it) or the newer `pooling_mode` string. Another mode (max,
  weighted mean) or a `Dense` module after the pooling (a projection llama_tp does not
  run) makes the checkpoint's embeddings refused (`problem`), rather than served wrong;
- a GGUF's `{arch}.pooling_type` (llama.cpp's enum: 1 mean, 2 CLS, 3 last; 0 "none" and
  an absent key are undeclared; 4, a reranker's head, is refused);
- undeclared: the last token (`DEFAULT`). A decoder-only LM attends causally, so only
  its last position has seen the whole input; the embedding models built on such LMs
  (Qwen3-Embedding, e5-mistral, gte-Qwen2) pool it, and vLLM pools a causal LM served for
  embeddings the same way. A mean would weigh the first tokens, which see least, as much
  as the last.

Shorter vectors (OpenAI's and Ollama's `dimensions`) are allowed only where the model
was trained for them (Matryoshka), as vLLM reads it from `config.json`: `is_matryoshka`
true allows any size up to the full one, `matryoshka_dimensions` only the sizes listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLINGS = ("mean", "cls", "last")
DEFAULT = "last"

# sentence-transformers' Pooling flags (and `pooling_mode` names) -> ours
_ST_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_OTHER = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
             "pooling_mode_weightedmean_tokens")  # fmt: skip
_GGUF = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_*


@dataclass(frozen=True)
class EmbeddingSpec:
    """A checkpoint's embedding: its pooling and where that was read, its Matryoshka sizes."""

    pooling: str = DEFAULT
    source: str | None = None  # the file the pooling was read from (None: the default)
    matryoshka: bool = False  # any size up to the full one may be asked for
    dimensions: tuple[int, ...] = ()  # or only these (Matryoshka's listed sizes)
    problem: str | None = None  # why this checkpoint's embeddings are refused

    def dimensions_refusal(self, n: int, full: int) -> str | None:
        """Why a vector of `n` values cannot be asked of this model (its full size `full`),
        or None."""
        if n < 1:
            return f"must be at least 1, got {n}"
        if n > full:
            return f"must be at most {full} (the model's hidden size), got {n}"
        if self.dimensions:
            if n not in self.dimensions and n != full:
                sizes = ", ".join(map(str, self.dimensions))
                return f"must be one of the model's Matryoshka sizes ({sizes}), got {n}"
            return None
        if not self.matryoshka and n != full:
            return (
                "not supported by this model: it declares no Matryoshka sizes (config.json's "
                "is_matryoshka or matryoshka_dimensions), and its vectors cut short would lose "
                "what they mean"
            )
        return None


def embedding_spec(path: str | Path, metadata: dict[str, Any] | None = None) -> EmbeddingSpec:
    """The embedding the checkpoint at `path` declares (a folder, or a GGUF file, whose
    header's `metadata` may be given); the default where it declares none."""
    path = Path(path)
    if metadata and "general.architecture" in metadata:  # a GGUF's, read already
        return _gguf(metadata)
    if path.is_file():
        from .gguf_header import read_header

        return _gguf(read_header(path).metadata)
    config = _json(path / "config.json") or {}
    sizes = config.get("matryoshka_dimensions") or ()
    matryoshka = bool(config.get("is_matryoshka")) or bool(sizes)
    pooling, source, problem = _sentence_transformers(path)
    return EmbeddingSpec(pooling, source, matryoshka, tuple(int(d) for d in sizes), problem)


def _sentence_transformers(folder: Path) -> tuple[str, str | None, str | None]:
    """(pooling, the file it came from, a problem) from sentence-transformers' files."""
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return DEFAULT, None, None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = kinds.get("Pooling")
    if pooling is None:
        return DEFAULT, None, None
    where = folder / str(pooling.get("path", "")) / "config.json"
    source = str(where.relative_to(folder))
    config = _json(where)
    if not isinstance(config, dict):
        return DEFAULT, source, f"{source} (named by modules.json) is missing or not JSON"
    problem = None
    if "Dense" in kinds:
        problem = (
            "modules.json has a Dense module after the pooling (a projection llama_tp does "
            "not run): its vectors would not be the model's"
        )
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        found = [_ST_MODES[mode]] if mode in _ST_MODES else []
        other = [] if found else [mode]
    else:
        found = [ours for flag, ours in _ST_FLAGS.items() if config.get(flag)]
        other = [flag for flag in _ST_OTHER if config.get(flag)]
    if other or len(found) != 1:
        named = ", ".join(other + found) or "none"
        why = f"{source} declares pooling {named}; llama_tp pools by one of mean, CLS, last token"
        return DEFAULT, source, problem or why
    return found[0], source, problem


def _gguf(metadata: dict[str, Any]) -> EmbeddingSpec:
    arch = metadata.get("general.architecture")
    key = f"{arch}.pooling_type"
    kind = metadata.get(key)
    if kind is None or int(kind) == 0:
        return EmbeddingSpec()
    if int(kind) in _GGUF:
        return EmbeddingSpec(_GGUF[int(kind)], key)
    return EmbeddingSpec(
        problem=f"the GGUF's {key} is {int(kind)} (a reranker's head), not a pooling of "
        "mean, CLS or last token"
    )


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
