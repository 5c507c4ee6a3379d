"""GGUF files (llama.cpp): every tensor read in slices and kept quantized.

The header (`gguf_header.py`) gives the metadata and where each tensor is; the
weights are lazy placeholders until the loader reads each rank's slices through
`ckpt.sources` (`gguf_reader.py`), converting the blocks to MLX affine
quantization (`gguf_quants.py`: exact for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K,
requantized for Q6_K/Q3_K/Q2_K; MXFP4, gpt-oss's experts, held in MLX's mxfp4 mode as
stored). Types MLX cannot hold (the IQ family, TQ, ...) are refused with one line naming
them and their tensors.
llama.cpp's converter permutes q/k rows for interleaved rotary embeddings, so
GGUF models use the interleaved ("traditional") RoPE layout.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..model_args import ModelArgs, layer_values
from ..models.registry import GGUF_ARCHITECTURES, GGUF_FAMILIES, checkpoint_names, unsupported
from . import gguf_gpt_oss as gpt_oss
from . import gguf_quants as gq
from . import gguf_routed as routed
from .base import Checkpoint, CheckpointError
from .experts import check_experts
from .gated_delta import SKIPPED, from_gguf, kda_gguf, say_once
from .gguf_gemma import ARCHITECTURES as _GEMMA
from .gguf_gemma import gemma_gguf
from .gguf_header import GGUFHeader, read_header
from .gguf_mamba import ARCHITECTURES as _MAMBA
from .gguf_mamba import mamba_gguf
from .gguf_reader import _MX, GGUFFile
from .gguf_rope import llama3_scaling
from .kimi_k3 import k3_gguf
from .latent import split_kv_b

# llama.cpp rotates the halves of each head (NEOX) in these: their q/k rows are not
# permuted for interleaved pairs as the llama converter does (registry rows)
_NEOX = tuple(arch for arch, row in GGUF_FAMILIES.items() if row.neox)
# GGUF architecture -> the family's model_type (llama with experts: Mixtral)
_MODEL_TYPES = {arch: row.model_type for arch, row in GGUF_FAMILIES.items()}
# Gated DeltaNet hybrids; llama.cpp tiles the value heads of the Qwen3.5 ones
_HYBRID = ("qwen35", "qwen35moe", "qwen3next")
_TILED = ("qwen35", "qwen35moe")

# llama.cpp's tensor names -> the model's: the model's own, then every kind's
# (`models.registry.checkpoint_names`: each mixer kind declares its names)
_MODEL_NAMES = [
    (r"^token_embd\.", "tok_embeddings."),
    (r"^output_norm\.", "norm."),
    (r"^output\.", "output."),
    # Gemma 4's per-layer inputs (`models/gemma.py`)
    (r"^per_layer_token_embd\.", "per_layer_embeddings."),
    (r"^per_layer_model_proj\.", "per_layer_projection."),
    (r"^per_layer_proj_norm\.", "per_layer_norm."),
    (r"^output_res_score\.weight$", "output_attn_res_score"),  # Kimi K3's
]


def _layer_rename(src: str, dst: str) -> tuple[str, str]:
    """A kind's (GGUF name under `blk.N.`, model path) as a regex and replacement."""
    if src.endswith("$"):
        return rf"^blk\.(\d+)\.{re.escape(src[:-1])}$", rf"layers.\1.{dst}"
    return rf"^blk\.(\d+)\.{re.escape(src)}\.", rf"layers.\1.{dst}."


_BY_ARCH: dict[str | None, list[tuple[re.Pattern, str]]] = {}


def _renames(arch: str | None = None) -> list[tuple[re.Pattern, str]]:
    """The model's names, then every kind's (the family's own first: `GgufFamily.kinds`)."""
    if arch not in _BY_ARCH:
        pairs = checkpoint_names("gguf", _MODEL_TYPES.get(arch) if arch else None)
        renames = _MODEL_NAMES + [_layer_rename(a, b) for a, b in pairs]
        _BY_ARCH[arch] = [(re.compile(a), b) for a, b in renames]
    return _BY_ARCH[arch]


def to_model_name(name: str, arch: str | None = None) -> str:
    for pattern, repl in _renames(arch):
        new, n = pattern.subn(repl, name)
        if n:
            return new
    return name


def _experts(arch: str, get, weights: dict[str, mx.array], n_layers: int) -> dict:
    """The mixture-of-experts and qk-norm fields of ModelArgs from the metadata: the
    experts' widths, and which layers have them, from the tensors themselves."""
    n_experts = get("expert_count") or 0
    sparse = sorted(
        int(k.split(".")[1]) for k in weights if k.endswith("switch_mlp.gate_proj.weight")
    )
    model_type = _MODEL_TYPES[arch] if arch != "llama" or not n_experts else "mixtral"
    out: dict = {"model_type": model_type, "qk_norm": "layers.0.attention.q_norm.weight" in weights}
    if not sparse and (not n_experts or arch in (*_MAMBA, *_GEMMA)):  # their fields' own
        return out
    gate = weights.get(f"layers.{sparse[0]}.feed_forward.switch_mlp.gate_proj.weight")
    shared = weights.get(f"layers.{sparse[0]}.feed_forward.shared_expert.w1.weight")
    return out | {
        "n_experts": n_experts,
        "n_experts_per_tok": get("expert_used_count") or 0,
        "moe_hidden_dim": get("expert_feed_forward_length")
        or (gate.shape[1] if gate is not None else 0),
        "shared_expert_dim": get("expert_shared_feed_forward_length")
        or (shared.shape[0] if shared is not None else 0),
        # llama.cpp renormalises the top-k weights of Mixtral and Qwen3-MoE, not Qwen2-MoE's
        "norm_topk_prob": bool(get("expert_weights_norm", arch != "qwen2moe")),
        "router": "topk_softmax" if model_type == "mixtral" else "softmax_topk",
        "sparse_layers": None if len(sparse) == n_layers else sparse,
    }


def args_from_metadata(meta: dict, weights: dict[str, mx.array], path: Path) -> ModelArgs:
    """ModelArgs from the `{arch}.*` metadata (the vocabulary size from the embedding
    if the metadata lacks it)."""
    arch = meta["general.architecture"]  # one of GGUF_ARCHITECTURES: `read` checked it

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    if n_heads is None or dim is None or get("block_count") is None:
        raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.* head/size entries")
    vocab = get("vocab_size") or weights["tok_embeddings.weight"].shape[0]
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"type": "linear", "factor": get("rope.scaling.factor", 1.0)}
    n_layers = routed.main_layers(arch, get)  # less the multi-token prediction layers
    experts = _experts(arch, get, weights, n_layers)
    if arch in routed.ARCHITECTURES:
        experts |= routed.fields(arch, get, path)
    elif arch in gpt_oss.ARCHITECTURES:
        experts |= gpt_oss.fields(arch, get, path)
    elif GGUF_FAMILIES[arch].fields is not None:  # a family whose kinds read their own
        try:
            experts |= GGUF_FAMILIES[arch].fields(get)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
    scaling = experts.pop("rope_scaling", scaling)
    try:
        return ModelArgs(
            dim=dim,
            n_layers=n_layers,
            # per-layer head counts (Step-3.5's): the family's fields say which are n_heads'
            n_heads=experts.pop("n_heads", n_heads),
            n_kv_heads=experts.pop("n_kv_heads", None)
            or _most(get("attention.head_count_kv"))
            or n_heads,
            # Without dense layers (Qwen3-MoE files may say 0): the experts' width
            hidden_dim=experts.pop("hidden_dim", 0)  # a family's fields' own
            or _most(get("feed_forward_length"))
            or experts.get("moe_hidden_dim", 0),
            vocab_size=vocab,
            # Gemma 4's: its sliding layers' heads (key_length is the global ones')
            head_dim=experts.pop("head_dim", None) or get("attention.key_length") or dim // n_heads,
            norm_eps=experts.pop("norm_eps", None) or get("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=get("rope.freq_base", 10000.0),
            rope_traditional=arch not in _NEOX,
            rope_scaling=scaling,
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings="output.weight" not in weights,
            qkv_bias="layers.0.attention.wq.bias" in weights,
            **experts,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _most(count):
    """A KV head count or feed-forward width, or the largest of a per-layer array's
    (Kimi-Linear's, Nemotron-H's: 0 in a layer without)."""
    return max(int(c) for c in count) if hasattr(count, "__len__") else count


def check_types(header: GGUFHeader, path: Path) -> None:
    """Refuse, in one line naming the tensors, types this reader cannot hold."""
    unknown = [(n, t.type_name) for n, t in header.tensors.items() if t.nbytes is None]
    if unknown:
        name, kind = unknown[0]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(
            f"{path}: tensor {name!r} has unknown ggml type id {kind.split()[-1]}{more}: "
            "damaged, or newer than this reader"
        )
    bad: dict[str, list[str]] = {}
    for name, t in header.tensors.items():
        if t.type_name not in (*_MX, *gq.BLOCKS, gq.MXFP4):
            bad.setdefault(t.type_name, []).append(name)
    if bad:
        kinds = "; ".join(
            f"{k} ({names[0]}" + (f", +{len(names) - 1} more)" if len(names) > 1 else ")")
            for k, names in sorted(bad.items())
        )
        raise CheckpointError(
            f"{path}: tensor types MLX cannot hold quantized: {kinds}; supported: "
            f"{', '.join([*_MX, *gq.BLOCKS, gq.MXFP4])}"
        )


def describe(file: GGUFFile) -> list[str]:
    """One line per GGUF type: what it became, e.g. `Q6_K -> 8-bit (requantized), 1 tensor`."""
    counts = Counter(t.type_name for t in file.gguf.values())
    stored = {t.type_name for n, t in file.gguf.items() if file.block_type(n)}
    out = []
    for kind, n in sorted(counts.items()):
        what = "as it is" if kind in _MX else f"MLX {gq.mlx_bits(kind)}-bit, group {gq.GROUP}"
        if kind == gq.MXFP4:
            what = "MLX mxfp4 (as stored, nibbles reordered)"
        elif kind in stored:
            what = "as stored (native kernels)"
        elif kind in gq.REQUANT_BITS:
            what += " (requantized)"
        elif kind in gq.EXACT_BITS:
            what += " (exact)"
        out.append(f"{kind} -> {what}: {n} tensor{'s' * (n > 1)}")
    return out


class _Row:
    """A vector source read as a (1, n) matrix (the shared expert's gate)."""

    def __init__(self, file: GGUFFile, stored: str):
        self.file = file

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0):
        if axis == 0:
            return self.file.read(name).reshape(1, -1)
        return self.file.read(name, None if axis is None else 0, start, stop).reshape(1, -1)


_DOWN = ("ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def ffn_block(file: GGUFFile) -> int | None:
    """Values per GGUF block along the down projections' rows (the feed-forward and
    expert split axis), as one unit for every layer (256 for K-quants); None when no
    down projection is quantized."""
    blocks = [
        t.block[0]
        for n, t in file.gguf.items()
        if n.endswith(_DOWN) and t.type_name in (*gq.BLOCKS, gq.MXFP4)
    ]
    return math.lcm(*blocks) if blocks else None


def split_notes(ckpt: Checkpoint, plan) -> list[str]:
    """How a partition plan meets the file's blocks (for `llama_tp.plan`)."""
    file = next(iter(ckpt.sources.values()))[0]
    out = []
    if ckpt.ffn_block and plan.n > 1 and plan.hidden_dim:  # a dense feed-forward to split
        if plan.group_size and plan.group_size % ckpt.ffn_block == 0:
            out.append(
                f"feed-forward columns split in units of {plan.group_size}: whole GGUF blocks "
                f"of ffn_down ({ckpt.ffn_block} values)"
            )
        else:
            out.append(
                f"feed-forward columns split in units of {plan.group_size}: ffn_down's GGUF "
                f"blocks of {ckpt.ffn_block} values do not split over {plan.n} ranks, so a "
                "boundary block is read by both neighbours (each keeps its own 32-value groups)"
            )
    straddled = sorted(
        {
            t.type_name
            for n, t in file.gguf.items()
            if n.endswith("attn_output.weight")
            and t.block[0] > gq.GROUP
            and any(p.q_heads.start * plan.head_dim % t.block[0] for p in plan.parts)
        }
    )
    if straddled:
        out.append(
            f"attn_output ({', '.join(straddled)}): query-head boundaries fall inside GGUF "
            "blocks; both neighbours read the boundary block (each keeps its own 32-value groups)"
        )
    if plan.n > 1 and plan.experts and any(t.type_name == gq.MXFP4 for t in file.gguf.values()):
        out.append("expert columns split by tensor in whole MXFP4 blocks of 32 values")
    if plan.n > 1:
        out.append("vocabulary rows split anywhere: GGUF blocks lie within rows")
    return out


def _latent(weights: dict, sources: dict, args: ModelArgs, path: Path) -> None:
    """An older deepseek2 conversion's `attn_kv_b` read per head as embed_q / unembed_out
    (`latent.py`); a newer one's `attn_k_b` / `attn_v_b` are them already."""
    quantized = sorted(k for k in weights if k.endswith("kv_b_proj.scales"))
    if quantized:
        file, stored = sources[quantized[0].replace(".scales", ".weight")]
        raise CheckpointError(
            f"{path}: {stored} is {file.gguf[stored].type_name}: a quantized attn_kv_b cannot "
            "be split per head; llama.cpp's newer conversions store attn_k_b and attn_v_b"
        )
    split_kv_b(weights, sources, args, str(path))


def _rope_freqs(args: ModelArgs, file: GGUFFile, stored: str, path: Path) -> None:
    """Llama 3's scaling (mlx-lm's `rope_scaling`) from llama.cpp's per-frequency factors
    (`gguf_rope.py`), or a warning when no llama3 scaling gives them."""
    t = file.gguf[stored]  # a few float32 values read as metadata (not counted as weights)
    n = math.prod(t.shape)
    scaling = None
    if t.type_name == "F32":
        values = np.fromfile(path, np.float32, count=n, offset=t.offset)
        scaling = llama3_scaling(values, args.rope_theta, args.rope_dims or args.head_dim)
    if scaling is None:
        warnings.warn(
            f"{path.name}: per-frequency RoPE factors (rope_freqs) that no llama3 scaling "
            "gives are not applied; long-context outputs may differ",
            stacklevel=3,
        )
    args.rope_scaling = scaling


def _check_layers(header: GGUFHeader, weights: dict, path: Path) -> None:
    """Refuse a file whose `blk.N` tensors are not layers 0 .. block_count - 1 (less the
    multi-token prediction layers, dropped before)."""
    arch = header.architecture
    count = header.metadata.get(f"{arch}.block_count")
    if not isinstance(count, int):
        return  # args_from_metadata names what is missing
    n = count - (header.metadata.get(f"{arch}.nextn_predict_layers") or 0)
    found = sorted({int(m.group(1)) for k in weights if (m := re.match(r"^layers\.(\d+)\.", k))})
    if found != list(range(n)):
        held = f"blk.{found[0]} to blk.{found[-1]}" if found else "none"
        raise CheckpointError(
            f"{path}: {arch}.block_count says {n} layers but the file has tensors of "
            f"{len(found)} ({held})"
        )


def read(path: Path, blocks: bool = False) -> Checkpoint:
    """The checkpoint of a GGUF file; with `blocks`, its quantized tensors stay as stored
    (for the native kernels: `ckpt.blocks` maps their model names to GGUF types)."""
    try:
        header = read_header(path)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if header.architecture not in GGUF_ARCHITECTURES:
        kind = "GGUF architecture"
        raise CheckpointError(
            f"{path}: {unsupported(kind, header.architecture, GGUF_ARCHITECTURES)}"
        )
    check_types(header, path)
    if header.metadata.get(f"{header.architecture}.expert_count"):
        blocks = False  # a mixture of experts is converted (its experts take gather_qmm)
    file = GGUFFile(path, header, blocks)
    arch = header.architecture
    meta = header.metadata
    if arch in _TILED and meta.get(f"{arch}.ssm.group_count") != meta.get(
        f"{arch}.ssm.time_step_rank"
    ):  # ssm_out's columns are read in value heads' runs narrower than K-quant blocks
        for stored in [n for n in file.gguf if n.endswith(".ssm_out.weight")]:
            file.unblock(stored)
    weights, sources, kept = {}, {}, {}
    for stored in file.tensors:
        name = to_model_name(stored, arch)
        weights[name] = file.placeholder(stored)
        sources[name] = (file, stored)
        if file.block_type(stored):
            kept[name] = file.block_type(stored)
    for name in [k for k in weights if k.endswith("shared_expert_gate.weight")]:
        if weights[name].ndim == 1:  # llama.cpp stores the (1, dim) gate as a vector
            weights[name] = weights[name].reshape(1, -1)
            sources[name] = (_Row(*sources[name]), sources[name][1])
    get = lambda key, default=None: header.metadata.get(f"{arch}.{key}", default)  # noqa: E731
    if get("nextn_predict_layers"):  # multi-token prediction layers: dropped, as mlx-lm does
        routed.drop_extra_layers(weights, sources, routed.main_layers(arch, get))
        for name in [k for k in kept if k not in weights]:
            del kept[name]
        if arch in _HYBRID:
            say_once(str(path), SKIPPED["mtp"])
    _check_layers(header, weights, path)
    args = args_from_metadata(header.metadata, weights, path)
    if arch in _HYBRID:  # llama.cpp's turns of the linear-attention tensors, undone
        from_gguf(weights, sources, args, tiled=arch in _TILED)
    if "kda_layers" in args.extra:  # Kimi-Linear: llama.cpp's conv and ssm_a, undone
        kda_gguf(weights, sources, args)
    if arch == "kimi-k3":  # its KDA layers' q/k/v joined, its gates from the tensors
        k3_gguf(weights, sources, args, str(path))
    if arch in _MAMBA:  # Nemotron-H: llama.cpp's Mamba tensors undone, the pattern checked
        mamba_gguf(weights, sources, args)
    if arch in _GEMMA:  # Gemma 4: the experts' gate and up apart, keys = values, RoPE
        kv = get("attention.head_count_kv")
        kv = layer_values(kv, args.n_layers)
        try:
            gemma_gguf(weights, sources, args, kv, str(path))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    if args.kv_lora_rank:
        _latent(weights, sources, args, path)
    check_experts(
        args,
        {k: tuple(v.shape) for k, v in weights.items()},
        str(path),
        {k: stored for k, (_, stored) in sources.items()},
        f"{header.architecture}.expert_count",
    )
    if "rope_freqs.weight" in weights and args.rope_scaling is None and arch not in _GEMMA:
        _rope_freqs(args, *sources["rope_freqs.weight"], path)
    for name in [k for k in weights if k.startswith("rope_freqs.")]:
        del weights[name], sources[name]
    ckpt = Checkpoint(path, "gguf", args, weights, header.metadata, [path], sources)
    ckpt.ffn_block = ffn_block(file)
    ckpt.blocks = kept
    ckpt.notes = describe(file)
    return ckpt
