"""Multi-rank check of the range-sharded layers.

Run as: mlx.launch -n N --starting-port P python tests/mp_layers_check.py

Every rank builds the same random two-layer block (all-to-sharded, then
sharded-to-all) from a fixed seed, keeps its uneven feed-forward range from
`make_plan`, and compares the sharded output with the unsharded one. Rank 0
prints OK only if every rank matched; any mismatch exits non-zero on all ranks
(mlx.launch itself exits 0 either way, so callers should look for OK).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, so the repository root is not on sys.path by default.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx import nn  # noqa: E402

from llama_tp.parallel.layers import shard_linear_range  # noqa: E402
from llama_tp.parallel.partition import make_plan  # noqa: E402

DIM = 64


def _block(w1: nn.Module, w2: nn.Module, x: mx.array) -> mx.array:
    """x (B, L, DIM) -> (B, L, DIM); the nonlinearity acts on the sharded hidden."""
    return w2(nn.silu(w1(x)))


def check(group: mx.distributed.Group, hidden: int, quant: tuple[int, int] | None) -> bool:
    """Sharded vs unsharded block on this rank; quant is (group_size, bits) or None."""
    n, rank = group.size(), group.rank()
    mx.random.seed(1234)  # same weights and input on every rank
    w1, w2 = nn.Linear(DIM, hidden), nn.Linear(hidden, DIM)
    if quant is not None:
        w1 = nn.QuantizedLinear.from_linear(w1, *quant)
        w2 = nn.QuantizedLinear.from_linear(w2, *quant)
    x = mx.random.normal((2, 5, DIM))
    ref = _block(w1, w2, x)

    gs = quant[0] if quant else None
    plan = make_plan(n, n, DIM // n, DIM, hidden, n, group_size=gs)
    assert n == 1 or not plan.even_ffn, "the check is meant for an uneven split"
    ffn = plan.parts[rank].ffn
    s1 = shard_linear_range(w1, "all-to-sharded", ffn.start, ffn.stop, group)
    s2 = shard_linear_range(w2, "sharded-to-all", ffn.start, ffn.stop, group)
    out = _block(s1, s2, x)
    ok = out.shape == ref.shape and mx.allclose(out, ref, rtol=1e-4, atol=1e-4).item()
    if not ok:
        err = mx.abs(out - ref).max().item() if out.shape == ref.shape else out.shape
        print(f"rank {rank}: hidden={hidden} quant={quant} ffn={ffn} error {err}", file=sys.stderr)
    return ok


def main() -> int:
    group = mx.distributed.init()
    n = group.size()
    cases = [
        (97, None),  # prime: no N > 1 divides it
        ((2 * n + 1) * 32, (32, 4)),  # an odd number of groups
        ((2 * n + 1) * 64, (64, 8)),
    ]
    failed = sum(not check(group, hidden, quant) for hidden, quant in cases)
    # Agree on the outcome so that rank 0 never reports OK for another rank's failure.
    failed = int(mx.distributed.all_sum(mx.array(failed), group=group).item())
    if failed:
        return 1
    if group.rank() == 0:
        print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
