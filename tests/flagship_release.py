"""Kimi K3's release layouts of a flagship fixture's folder (flagship_fixtures.py): the
names and tensors its release ships (`release_k3`), and its routed experts packed as
compressed-tensors' mxfp4-pack-quantized (`packed_k3`)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx


def release_k3(src: Path, out: Path) -> Path:
    """Kimi K3's release layout of mlx-lm's float32 folder `src` (what mlx-lm's sanitize
    undoes): the names at the top (not under `language_model.`), per-expert w1/w2/w3 under
    `block_sparse_moe` with the routing bias in its gate, q/k/v projections and convs
    (C, 1, K) apart, A_log 3 values longer than the heads, the latent's `kv_b_proj`, the
    residual queries as `*_res.proj_weight` / `*_res.norm_weight`."""
    import shutil

    config = json.loads((src / "config.json").read_text())
    first = config["first_k_dense_replace"]
    names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    rel = {}
    for k, v in mx.load(str(src / "model.safetensors")).items():
        k = k.removeprefix("language_model.")
        layer = int(k.split(".")[2]) if k.startswith("model.layers.") else -1
        if layer >= first:
            k = k.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
            k = k.replace(".mlp.", ".block_sparse_moe.")
        if ".switch_mlp." in k:
            proj = k.split(".")[-2]
            for e in range(v.shape[0]):
                expert = k.replace("switch_mlp", f"experts.{e}").replace(proj, names[proj])
                rel[expert] = v[e]
            continue
        if ".qkv_proj." in k or ".qkv_conv." in k:
            for c, part in zip("qkv", mx.split(v, 3), strict=True):
                if ".qkv_proj." in k:
                    rel[k.replace("qkv_proj", f"{c}_proj")] = part
                else:  # (C, K, 1) -> the release's (C, 1, K)
                    rel[k.replace("qkv_conv.conv", f"{c}_conv1d")] = part.swapaxes(1, 2)
            continue
        if k.endswith("A_log"):
            v = mx.concatenate([v, mx.zeros((3,), v.dtype)])
        if k.endswith("embed_q.weight") and "unembed" not in k:  # (H, rank, nope)
            up = mx.load(str(src / "model.safetensors"))[
                "language_model." + k.replace("embed_q", "unembed_out")
            ]  # (H, v, rank)
            k, v = (
                k.replace("embed_q", "kv_b_proj"),
                mx.concatenate([v.swapaxes(1, 2), up], axis=1).reshape(-1, v.shape[1]),
            )
        elif k.endswith("unembed_out.weight"):
            continue
        for r in ("self_attention_res", "mlp_res", "output_attn_res"):
            for x in ("proj", "norm"):
                k = k.replace(f"{r}_{x}.weight", f"{r}.{x}_weight")
        rel[k] = v
    shutil.copytree(src, out)
    mx.save_safetensors(str(out / "model.safetensors"), rel)
    return out


def packed_k3(release: Path, out: Path, stored: bool = True, e8m0: bool = False) -> Path:
    """`release_k3`'s folder with its routed experts as the K3 release ships them
    (compressed-tensors' `mxfp4-pack-quantized`): each expert's w1/w2/w3 quantized by
    `mx.quantize(mode="mxfp4")`, its bytes as `weight_packed` (rows, cols / 2) uint8 and
    its E8M0 exponents as `weight_scale` (rows, cols / 32) uint8, the config's
    `quantization_config` saying so; `stored=False`: those values dequantized, float32
    under the float names (the reference); `e8m0`: the scales typed F8_E8M0 in the
    header (torch's float8_e8m0fnu) rather than U8."""
    import shutil

    rel = {}
    for k, v in mx.load(str(release / "model.safetensors")).items():
        if ".block_sparse_moe.experts." not in k:
            rel[k] = v
            continue
        w, scales = mx.quantize(v, 32, 4, mode="mxfp4")
        if not stored:
            rel[k] = mx.dequantize(w, scales, None, 32, 4, mode="mxfp4")
            continue
        base = k.removesuffix(".weight")
        rel[f"{base}.weight_packed"] = w.view(mx.uint8).reshape(v.shape[0], v.shape[1] // 2)
        rel[f"{base}.weight_scale"] = scales
    shutil.copytree(release, out)
    mx.save_safetensors(str(out / "model.safetensors"), rel)
    if stored and e8m0:  # the scales' dtype F8_E8M0 in the header (the same bytes)
        import struct

        data = (out / "model.safetensors").read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + n])
        for k, t in header.items():
            if k.endswith(".weight_scale"):
                t["dtype"] = "F8_E8M0"
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        (out / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    if stored:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
        }
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
