"""Split tables (parallel/splits.py): the read slices, styles, cache bytes and unit splits
that every mixer kind's one table gives. Pure Python but for the styles' last test."""

from __future__ import annotations

from fractions import Fraction

import pytest

from llama_tp.parallel.partition import Experts, make_plan, tensor_slice, weight_bytes
from llama_tp.parallel.splits import (
    CHANNELS,
    COLUMNS,
    NOT_HELD,
    VECTOR,
    CacheSpec,
    LayerSpec,
    Segment,
    SplitTable,
    TensorSplit,
    Unit,
    cache_values,
    held_bytes,
    llama_layer,
    slices_of,
    split_extra_units,
)

DK, DV = 4, 6  # a gated-delta-like kind: key / value head widths


def linear_attention(nk: int = 5, nv: int = 10) -> SplitTable:
    """A fused q|k|v projection by key and value heads, its depthwise conv's channels
    following the same heads, A_log per value head, out_proj by value heads' columns."""
    qkv = (Segment("lin_k", DK), Segment("lin_k", DK), Segment("lin_v", DV))
    return SplitTable(
        "linear attention",
        {
            "in_proj_qkv": TensorSplit(segments=qkv),
            "conv1d": TensorSplit(segments=qkv, dim=CHANNELS),
            "A_log": TensorSplit("lin_v", VECTOR),
            "out_proj": TensorSplit("lin_v", COLUMNS, DV),
        },
        module="units",
        units=(
            Unit("lin_k", nk, "linear-attention key heads"),
            Unit("lin_v", nv, "linear-attention value heads", follows="lin_k"),
        ),
        local={
            "num_k_heads": (("lin_k", 1),),
            "num_v_heads": (("lin_v", 1),),
            "conv1d.groups": (("lin_k", 2 * DK), ("lin_v", DV)),
        },
    )


def hybrid_plan(n: int, weights=None):
    """Layer 0 linear attention + feed-forward, layer 1 the Llama layer."""
    lin = linear_attention()
    layers = [
        LayerSpec({"attention": lin, "feed_forward": llama_layer(8).tables["feed_forward"]}),
        llama_layer(8),
    ]
    return make_plan(8, 2, 8, 32, 64, n, weights=weights, layers=layers, units=lin.units)


def test_the_llama_tables_give_the_rules_of_old():
    """Rows of wq/wk/wv/w1/w3 and columns of wo/w2 by heads and columns, packed or not;
    norms, biases of column splits and unknown tensors whole."""
    p = make_plan(14, 2, 64, 896, 4864, 3)
    part = p.parts[1]  # q 5-9, kv 0-1, ffn 1622-3243
    assert tensor_slice(p, part, "layers.0.attention.wq.weight", (896, 896)) == (0, 320, 640)
    assert tensor_slice(p, part, "layers.0.attention.wk.weight", (128, 896)) is None  # both
    assert tensor_slice(p, part, "layers.0.attention.wo.weight", (896, 896)) == (1, 320, 640)
    assert tensor_slice(p, part, "layers.0.attention.wo.scales", (896, 28)) == (1, 10, 20)
    assert tensor_slice(p, part, "layers.0.attention.wo.bias", (896,)) is None
    assert tensor_slice(p, part, "layers.0.feed_forward.w2.weight", (896, 4864)) == (
        1, 1622, 3243,
    )  # fmt: skip
    assert tensor_slice(p, part, "layers.0.feed_forward.w1.weight", (4864, 112)) == (
        0, 1622, 3243,
    )  # fmt: skip
    for whole in ("layers.0.attention_norm.weight", "layers.0.attention.q_norm.weight", "norm.x"):
        assert tensor_slice(p, part, whole, (896,)) is None


def test_fused_tensors_slice_every_segment():
    """q | k | v rows of one projection: each rank keeps its key heads' rows of q and of k
    and its value heads' rows of v (two value heads per key head); the conv's channels
    alike; every segment's rows held once over the ranks, and the bytes sum exactly."""
    p = hybrid_plan(3)  # 5 key heads: 2 / 2 / 1
    rows = 2 * 5 * DK + 10 * DV
    got = [tensor_slice(p, q, "layers.0.attention.in_proj_qkv.weight", (rows, 32)) for q in p.parts]
    assert got[0] == ((0, 0, 8), (0, 20, 28), (0, 40, 64))
    assert got[2] == ((0, 16, 20), (0, 36, 40), (0, 88, 100))
    kept = sorted(r for s in got for _, a, b in s for r in range(a, b))
    assert kept == list(range(rows))
    conv = [tensor_slice(p, q, "layers.0.attention.conv1d.weight", (rows, 4, 1)) for q in p.parts]
    assert conv == got
    assert [q.unit("lin_v") for q in p.parts] == [range(0, 4), range(4, 8), range(8, 10)]
    assert tensor_slice(p, p.parts[1], "layers.0.attention.A_log", (10,)) == (0, 4, 8)
    out = tensor_slice(p, p.parts[1], "layers.0.attention.out_proj.weight", (32, 60))
    assert out == (1, 24, 48)
    # packed 4-bit rows: proportional all the same; bytes of a partition sum exactly
    nbytes = rows * 4 * 4
    assert sum(held_bytes((rows, 4), nbytes, s) for s in got) == nbytes
    # layer 1 is the Llama layer: its own table
    assert tensor_slice(p, p.parts[1], "layers.1.attention.wq.weight", (64, 32)) == (0, 24, 48)


def test_kind_units_split_balanced_weighted_and_following():
    assert split_extra_units([Unit("a", 16, "heads")], 3) == [
        {"a": range(0, 6)}, {"a": range(6, 11)}, {"a": range(11, 16)},
    ]  # fmt: skip
    weighted = split_extra_units(
        [Unit("a", 16, "heads"), Unit("b", 48, "values", follows="a")], 2, (3, 1)
    )
    assert weighted == [
        {"a": range(0, 12), "b": range(0, 36)},
        {"a": range(12, 16), "b": range(36, 48)},
    ]
    assert split_extra_units([Unit("c", 256, "columns", step=64)], 3)[2] == {"c": range(192, 256)}
    with pytest.raises(ValueError, match="cannot split 2 heads over 3 ranks: at most 2 ranks"):
        split_extra_units([Unit("a", 2, "heads")], 3)
    with pytest.raises(ValueError, match="7 values cannot follow 2 heads"):
        split_extra_units([Unit("a", 2, "heads"), Unit("b", 7, "values", follows="a")], 2)
    assert hybrid_plan(2, (3, 1)).parts[1].unit("lin_k") == range(4, 5)


def test_stacked_experts_by_tensor_or_by_expert_and_the_bias_once():
    down = TensorSplit("expert_ffn", COLUMNS, stacked=True, in_place=True)
    ranges = {"expert_ffn": (range(32, 64), 64), "experts": (range(2, 4), 4)}

    def units(name):
        return ranges[name]

    assert slices_of(down, "weight", (4, 16, 64), units) == (2, 32, 64)
    assert slices_of(down, "bias", (4, 16), units) == NOT_HELD  # added by the first rank
    assert slices_of(down, "weight", (4, 16, 64), units, by_expert=True) == (0, 2, 4)
    assert slices_of(down, "bias", (4, 16), units, by_expert=True) == (0, 2, 4)
    e = Experts(4, 64, "tensor", shared_dim=32)
    p = make_plan(8, 2, 8, 32, 0, 2, experts=e)
    assert p.parts[0].unit("shared_ffn") == range(0, 16)


def rewinds(spec: CacheSpec) -> bool:
    """Whether the cache of the kind `spec` declares can step back (the cache answers)."""
    from llama_tp.models.caches import make_layer_cache, why_not_rewind

    return why_not_rewind(make_layer_cache(spec)) is None


def test_cache_values_by_kind():
    def units(name):
        return {"kv_heads": (range(1, 3), 4), "lin_v": (range(0, 5), 10)}[name]

    kv = CacheSpec("kv", (("kv_heads", 2 * 8),))
    assert cache_values(kv, units, 100) == 100 * 2 * 16
    window = CacheSpec("rotating", (("kv_heads", 16),), window=32, mask="window")
    assert cache_values(window, units, 100) == 32 * 2 * 16
    latent = CacheSpec("kv", (("", 48 + 16),))
    assert cache_values(latent, units, 10) == 10 * 64
    state = CacheSpec("arrays", fixed=(("lin_v", DK * DV),), size=2, mask="ssm")
    assert cache_values(state, units, 10) == cache_values(state, units, 10_000) == 5 * DK * DV
    assert not rewinds(state) and rewinds(kv)
    both = CacheSpec("list", parts=(kv, state))
    assert cache_values(both, units, 10) == 10 * 32 + 5 * DK * DV and not rewinds(both)


def test_weight_bytes_of_a_hybrid_layer_sum_to_the_shares():
    p = hybrid_plan(3)
    rows = 2 * 5 * DK + 10 * DV
    tensors = {
        "layers.0.attention.in_proj_qkv.weight": ((rows, 32), rows * 32 * 4),
        "layers.0.attention.out_proj.weight": ((32, 60), 32 * 60 * 4),
        "layers.0.attention.A_log": ((10,), 40),
    }
    got = weight_bytes(p, tensors)
    assert sum(got) == sum(nb for _, nb in tensors.values())
    share = [Fraction(len(q.unit("lin_v")), 10) for q in p.parts]
    assert [Fraction(g) for g in got] == [s * sum(nb for _, nb in tensors.values()) for s in share]


def test_styles_from_a_table_split_a_fused_projection_and_local_counts():
    """The styles a table gives, applied on one process as rank 1 of 2 would: the fused
    projection keeps its q, k and v rows of its heads (ShardInPlace with segments), the
    conv its channels, A_log its value heads, the local counts follow."""
    import mlx.core as mx
    import mlx.nn as nn

    from llama_tp.parallel.kind_shard import table_styles
    from llama_tp.parallel.module_swap import module_at

    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            rows = 2 * 4 * DK + 8 * DV
            self.in_proj_qkv = nn.Linear(32, rows, bias=False)
            self.conv1d = nn.Conv1d(rows, rows, 4, groups=rows, bias=False)
            self.out_proj = nn.Linear(8 * DV, 32, bias=False)
            self.A_log = mx.arange(8, dtype=mx.float32)
            self.num_k_heads, self.num_v_heads = 4, 8

    class Rank1:
        def rank(self):
            return 1

        def size(self):
            return 2

    table = linear_attention(4, 8)
    p = make_plan(2, 2, 8, 32, 64, 2, layers=[LayerSpec({"attention": table})], units=table.units)
    styles = table_styles(table, p.parts, totals={"lin_k": 4, "lin_v": 8})
    m = Linear()
    w = m.in_proj_qkv.weight
    for path in ("in_proj_qkv", "conv1d", ""):
        module = module_at(m, path)
        split = styles[path].split(module, path, 2)
        styles[path].apply(module, Rank1(), None, split)
    want = mx.concatenate([w[8:16], w[24:32], w[56:80]])
    assert mx.array_equal(m.in_proj_qkv.weight, want)
    assert m.conv1d.weight.shape == (40, 4, 1) and m.conv1d.groups == 40
    assert m.A_log.tolist() == [4.0, 5.0, 6.0, 7.0]
    assert (m.num_k_heads, m.num_v_heads) == (2, 4)
    assert type(styles["out_proj"]).__name__ == "RowwiseParallel"
