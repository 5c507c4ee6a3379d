"""The einshard seed's 2-layer MLP, tensor-parallel on MLX: W1 split by columns,
W2 by rows, X replicated; one all_sum, inserted by `sharded_einsum`.

    python examples/einshard_mlp.py                                  # one process
    python -m llama_tp.launch -n 4 -- python examples/einshard_mlp.py               # 4 ranks

Prints the output's shape and checks it against the single-process result.
"""

from __future__ import annotations

import mlx.core as mx

from llama_tp.parallel.einshard import shard, sharded_einsum


def init_params(seed: int = 42) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((128, 256), key=k1), mx.random.normal((256, 64), key=k2)


def forward(W1, W2, X):
    """Z = relu(X @ W1) @ W2 over sharded operands: (8, 128) -> (8, 64)."""
    Y = sharded_einsum("bx,xy->by", X, W1)  # sharded on y, no communication
    Y = Y.map(lambda y: mx.maximum(y, 0))  # relu, on each rank's columns
    return sharded_einsum("by,yz->bz", Y, W2)  # y reduced: one all_sum, complete


def main() -> None:
    group = mx.distributed.init()
    W1, W2 = init_params()
    X = mx.random.normal((8, 128), key=mx.random.key(0))
    Z = forward(
        shard(W1, "x y -> x y*", group),
        shard(W2, "y z -> y* z", group),
        shard(X, "... -> * ...", group),  # replicated
    )
    ref = mx.maximum(X @ W1, 0) @ W2
    ok = mx.allclose(Z.local, ref, atol=1e-3).item()
    if group.rank() == 0:
        print(Z.shape, f"ranks={group.size()}", "equals one process" if ok else "MISMATCH")


if __name__ == "__main__":
    main()
