"""Tensor parallelism in two layers: an all-to-sharded layer, then a sharded-to-all one.

    python examples/tp_mlp.py
    mlx.launch -n 2 -- python examples/tp_mlp.py

This is how llama_tp splits every feed-forward block (and, by heads, every
attention block). The first layer's output columns are split over the ranks:
each rank computes its slice of the hidden activations from the whole input,
with no communication. The second layer's input rows are split the same way:
each rank turns its slice into a partial output, and one all-reduce (inside
ShardedToAllLinear) sums the partial outputs into the whole output on every
rank. Each rank reports the shapes it holds, and how far its output is from
the unsplit layers' (rounding only).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from llama_tp import print0, world
from llama_tp.cluster.distributed import all_gather_object

group = world()
n, rank = group.size(), group.rank()
dim, hidden, batch = 64, 840, 4  # 840: divisible by every rank count up to 8

# Every rank builds the same full layers and input (same seed), then keeps its part.
mx.random.seed(0)
up = nn.Linear(dim, hidden, bias=False)
down = nn.Linear(hidden, dim, bias=False)
x = mx.random.normal((batch, dim))
reference = down(nn.silu(up(x)))

up = shard_linear(up, "all-to-sharded", group=group)  # weight (hidden / n, dim)
down = shard_linear(down, "sharded-to-all", group=group)  # weight (dim, hidden / n)
h = nn.silu(up(x))  # (batch, hidden / n): this rank's columns, no communication
y = down(h)  # (batch, dim): the partial products summed over the ranks
mx.eval(y)
error = mx.abs(y - reference).max().item()

line = (
    f"rank {rank}/{n}: x {tuple(x.shape)} | all-to-sharded weight {tuple(up.weight.shape)}"
    f" -> h {tuple(h.shape)} | sharded-to-all weight {tuple(down.weight.shape)}"
    f" -> y {tuple(y.shape)} | max |y - unsplit| = {error:.1e}"
)
for each in all_gather_object(line, group):  # printed in rank order, once, by rank 0
    print0(each)
