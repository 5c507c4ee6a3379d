"""Exhaustive pure-Python checks of the partition plan (no mlx needed)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from fractions import Fraction

import pytest

from llama_tp.parallel.partition import Plan, make_plan, weight_bytes
from llama_tp.parallel.plan_text import format_plan

HEADS = [(8, 8), (8, 2), (9, 3), (12, 4), (14, 2), (32, 8), (6, 1)]
HIDDEN = [7, 96, 352, 448, 1000, 1408, 4864, 14336]
GROUP_SIZES = [None, 32, 64]
HEAD_DIM, DIM = 16, 64


def _valid(n_heads: int, n: int, hidden: int, gs: int | None) -> bool:
    if gs is not None and hidden % gs:
        return False
    return n <= n_heads and hidden // (gs or 1) >= n


def _all_plans():
    """Every valid plan of the grid: n from 1 to max(8, n_heads)."""
    for nh, nkv in HEADS:
        for n in range(1, max(8, nh) + 1):
            for hidden in HIDDEN:
                for gs in GROUP_SIZES:
                    if _valid(nh, n, hidden, gs):
                        yield make_plan(nh, nkv, HEAD_DIM, DIM, hidden, n, group_size=gs)


PLANS = list(_all_plans())


def _check_attention(p: Plan) -> None:
    g = p.n_heads // p.n_kv_heads
    assert [part.rank for part in p.parts] == list(range(p.n))
    # Every query head on exactly one rank, contiguously in rank order.
    assert [h for part in p.parts for h in part.q_heads] == list(range(p.n_heads))
    for part in p.parts:
        assert len(part.q_heads) > 0 and part.q_heads.step == 1
        # Exactly the KV heads of its query heads, contiguous.
        needed = sorted({h // g for h in part.q_heads})
        assert list(part.kv_heads) == needed
        # kv_map maps each local query head to its KV head; None iff regular GQA.
        local = [h // g - part.kv_heads.start for h in part.q_heads]
        per_kv = Counter(local)
        regular = len(set(per_kv.values())) == 1
        if part.kv_map is None:
            assert regular
            nq, nkv = len(part.q_heads), len(part.kv_heads)
            assert local == [i // (nq // nkv) for i in range(nq)]  # what plain GQA does
        else:
            assert not regular
            assert list(part.kv_map) == local
    q_counts = [len(part.q_heads) for part in p.parts]
    if p.n <= p.n_kv_heads:
        # Whole KV groups, no replication, group counts balanced (larger first).
        assert [h for part in p.parts for h in part.kv_heads] == list(range(p.n_kv_heads))
        kv_counts = [len(part.kv_heads) for part in p.parts]
        assert max(kv_counts) - min(kv_counts) <= 1
        assert kv_counts == sorted(kv_counts, reverse=True)
        assert all(part.q_heads.start % g == 0 and len(part.q_heads) % g == 0 for part in p.parts)
        assert all(part.kv_map is None for part in p.parts)
        assert p.replicated_kv_heads() == {}
    else:
        assert max(q_counts) - min(q_counts) <= 1
        assert q_counts == sorted(q_counts, reverse=True)
    holders = Counter(h for part in p.parts for h in part.kv_heads)
    assert p.replicated_kv_heads() == {
        h: [part.rank for part in p.parts if h in part.kv_heads]
        for h, c in holders.items()
        if c > 1
    }
    assert p.even_attention == (p.n_kv_heads % p.n == 0)
    if p.even_attention:
        # The equal contiguous split, i.e. mlx's shard_linear rows r*out/N:(r+1)*out/N.
        for r, part in enumerate(p.parts):
            qs, ks = p.n_heads // p.n, p.n_kv_heads // p.n
            assert part.q_heads == range(r * qs, (r + 1) * qs)
            assert part.kv_heads == range(r * ks, (r + 1) * ks)


def _check_ffn(p: Plan) -> None:
    unit = p.group_size or 1
    assert [c for part in p.parts for c in part.ffn] == list(range(p.hidden_dim))
    sizes = [len(part.ffn) for part in p.parts]
    assert max(sizes) - min(sizes) <= unit
    assert sizes == sorted(sizes, reverse=True)
    assert all(part.ffn.start % unit == 0 and part.ffn.stop % unit == 0 for part in p.parts)
    even = p.hidden_dim % p.n == 0 and (
        p.group_size is None or (p.hidden_dim // p.n) % p.group_size == 0
    )
    assert p.even_ffn == even
    if even:
        step = p.hidden_dim // p.n
        assert [part.ffn for part in p.parts] == [
            range(r * step, (r + 1) * step) for r in range(p.n)
        ]


def test_grid_is_exhaustive() -> None:
    ns = {(p.n_heads, p.n_kv_heads, p.n) for p in PLANS}
    assert {(nh, nkv, n) for nh, nkv in HEADS for n in range(1, max(8, nh) + 1) if n <= nh} == ns
    assert any(p.group_size == 64 and not p.even_ffn for p in PLANS)
    assert any(p.replicated_kv_heads() for p in PLANS)
    assert any(part.kv_map is not None for p in PLANS for part in p.parts)


@pytest.mark.parametrize("nh,nkv", HEADS)
def test_attention(nh: int, nkv: int) -> None:
    for p in PLANS:
        if (p.n_heads, p.n_kv_heads) == (nh, nkv):
            _check_attention(p)


@pytest.mark.parametrize("gs", GROUP_SIZES)
def test_ffn(gs: int | None) -> None:
    for p in PLANS:
        if p.group_size == gs:
            _check_ffn(p)


def test_examples() -> None:
    p = make_plan(14, 2, 64, 896, 4864, 3)
    assert [(x.q_heads, x.kv_heads, x.kv_map) for x in p.parts] == [
        (range(0, 5), range(0, 1), None),
        (range(5, 10), range(0, 2), (0, 0, 1, 1, 1)),
        (range(10, 14), range(1, 2), None),
    ]
    assert p.replicated_kv_heads() == {0: [0, 1], 1: [1, 2]}
    p = make_plan(32, 8, 128, 4096, 14336, 3, group_size=64)
    assert [len(x.kv_heads) for x in p.parts] == [3, 3, 2]
    assert [x.ffn for x in p.parts] == [range(0, 4800), range(4800, 9600), range(9600, 14336)]
    # 8 query heads over 4 ranks with 2 KV heads: replicated but regular.
    p = make_plan(8, 2, 64, 512, 1024, 4)
    assert all(x.kv_map is None and len(x.kv_heads) == 1 for x in p.parts)
    assert not p.even_attention


@pytest.mark.parametrize(
    "args,numbers",
    [
        ((8, 2, 16, 64, 128, 0), ["0"]),
        ((8, 2, 16, 64, 128, -1), ["-1"]),
        ((8, 2, 16, 64, 128, 9), ["8 query heads", "9 ranks", "at most 8"]),
        ((8, 3, 16, 64, 128, 2), ["8", "3"]),
        ((8, 2, 16, 64, 100, 2, 32), ["100", "32"]),
        ((8, 2, 16, 64, 96, 4, 32), ["3 groups", "4 ranks"]),
        ((8, 2, 16, 64, 3, 4), ["3", "4 ranks"]),
    ],
)
def test_refusals(args: tuple, numbers: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        make_plan(*args)
    msg = str(err.value)
    assert "\n" not in msg
    for s in numbers:
        assert s in msg
    if args[5] == 9:
        assert msg == "cannot split 8 query heads over 9 ranks: at most 8 ranks"


def _fake_checkpoint(
    nh: int, nkv: int, hidden: int, gs: int | None, layers: int = 2
) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (stored shape, nbytes) of a Llama checkpoint, bf16 or 4-bit."""
    t: dict[str, tuple[tuple[int, ...], int]] = {}

    def linear(name: str, out: int, inp: int, bias: bool) -> None:
        if gs is None:
            t[f"{name}.weight"] = ((out, inp), out * inp * 2)
        else:
            t[f"{name}.weight"] = ((out, inp // 8), out * inp // 8 * 4)  # 4 bits in uint32
            for k in ("scales", "biases"):
                t[f"{name}.{k}"] = ((out, inp // gs), out * inp // gs * 2)
        if bias:
            t[f"{name}.bias"] = ((out,), out * 2)

    t["tok_embeddings.weight"] = ((1000, DIM), 1000 * DIM * 2)
    t["output.weight"] = ((1000, DIM), 1000 * DIM * 2)
    t["norm.weight"] = ((DIM,), DIM * 2)
    for i in range(layers):
        pre = f"layers.{i}"
        t[f"{pre}.attention_norm.weight"] = ((DIM,), DIM * 2)
        t[f"{pre}.ffn_norm.weight"] = ((DIM,), DIM * 2)
        linear(f"{pre}.attention.wq", nh * HEAD_DIM, DIM, True)
        linear(f"{pre}.attention.wk", nkv * HEAD_DIM, DIM, True)
        linear(f"{pre}.attention.wv", nkv * HEAD_DIM, DIM, True)
        linear(f"{pre}.attention.wo", DIM, nh * HEAD_DIM, True)
        linear(f"{pre}.feed_forward.w1", hidden, DIM, True)
        linear(f"{pre}.feed_forward.w3", hidden, DIM, True)
        linear(f"{pre}.feed_forward.w2", DIM, hidden, True)
    return t


@pytest.mark.parametrize("gs", [None, 32])
@pytest.mark.parametrize("nh,nkv", HEADS)
def test_weight_bytes(nh: int, nkv: int, gs: int | None) -> None:
    hidden = 1408  # 44 groups of 32: uneven for n = 3, 5, 6, 7, 8
    tensors = _fake_checkpoint(nh, nkv, hidden, gs)
    total = sum(nb for _, nb in tensors.values())
    whole = {
        k: nb
        for k, (_, nb) in tensors.items()
        if not k.startswith("layers.") or "norm" in k or k.endswith(("wo.bias", "w2.bias"))
    }
    kv_bytes = sum(nb for k, (_, nb) in tensors.items() if ".wk." in k or ".wv." in k)
    for n in range(1, nh + 1):
        p = make_plan(nh, nkv, HEAD_DIM, DIM, hidden, n, group_size=gs)
        if gs and any(part.q_heads.start * HEAD_DIM % gs for part in p.parts):
            continue  # a quantized wo split inside a group: the placement refuses it
        if gs and nh * HEAD_DIM % gs:
            continue  # wo's columns are not whole groups: no such quantized checkpoint
        got = weight_bytes(p, tensors)
        extra_heads = sum(len(r) - 1 for r in p.replicated_kv_heads().values())
        kv_extra = Fraction(kv_bytes * extra_heads, nkv)
        assert sum(got) == total + (n - 1) * sum(whole.values()) + kv_extra
        # Per rank: the whole tensors plus its proportional share of the others.
        for part in p.parts:
            share = Fraction(0)
            for k, (_, nb) in tensors.items():
                if k in whole:
                    continue
                if ".wq." in k or ".wo." in k:
                    share += Fraction(nb * len(part.q_heads), nh)
                elif ".wk." in k or ".wv." in k:
                    share += Fraction(nb * len(part.kv_heads), nkv)
                else:
                    share += Fraction(nb * len(part.ffn), hidden)
            assert got[part.rank] == sum(whole.values()) + share


def test_format_plan() -> None:
    p = make_plan(14, 2, 64, 896, 4864, 3)
    text = format_plan(p, None)
    lines = text.splitlines()
    assert "0-4" in lines[2] and "0*" in lines[2] and "0-1621" in lines[2]
    assert "5-9" in lines[3] and "0*,1*" in lines[3]
    assert lines[-1] == "imbalance: 21.4% of query heads"  # (5 - 4) / (14 / 3)
    tensors = _fake_checkpoint(14, 2, 4864, None, layers=1)
    text = format_plan(p, weight_bytes(p, tensors))
    assert "KiB" in text and text.splitlines()[-1].endswith("% of weight bytes")
    even = format_plan(make_plan(32, 8, 128, 4096, 14336, 4))
    assert "*" not in even and even.splitlines()[-1] == "imbalance: 0.0% of query heads"


def test_plan_module_imports_without_mlx() -> None:
    # The partition plan is pure Python: importable (with its packages) where mlx is not.
    code = (
        "import sys\n"
        "sys.modules['mlx'] = None\n"  # any `import mlx...` now fails
        "from llama_tp.parallel.partition import make_plan\n"
        "print(make_plan(8, 2, 16, 64, 100, 3).parts[0].q_heads)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "range(0, 3)"
