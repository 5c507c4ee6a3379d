"""einshard for MLX: split or replicate one array over a group with one expression,
and einsums over the parts (what JAX gets from XLA).

The language (ayaka14732/einshard): `"a b -> 2 a2 b4"`. The left side names the
axes (letters and `_`), the right side repeats them with how they split:

- `a4`: axis `a` split into 4 equal parts; a bare `a` is whole;
- a standalone number (`2`): the array replicated that many times;
- `...` on both sides: the axes it stands for are whole;
- `*` after an axis or standalone (`a*`, `a2*`, `*`): take the remaining ranks:
  with F the product of the fixed numbers and the starred numbers s1..sk, each
  starred element gets s_i * (N / F / prod(s))^(1/k), which must be whole.

The product of all parts and replicas must be N. Rank order: the right side's
elements form a grid, the last varying fastest, and rank r sits at r's row-major
coordinates (JAX's device mesh on CPU): in `"a b -> 2 a2* b*"` on 16 ranks
(a in 4, b in 2), ranks 0 and 8 hold a-part 0, b-part 0. Replicas hold identical
data. `layout` and `local_shape` are pure functions of (expr, shape, rank, size).

    W1 = einshard(W1, "x y -> x y*")      # this rank's columns of W1
    Y = sharded_einsum("bx,xy->by", shard(X, "... -> * ..."), shard(W1, "x y -> x y*"))
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import mlx.core as mx

from ..cluster.distributed import world

_RIGHT = re.compile(r"^(?P<name>[^\W\d]+)?(?P<num>[1-9]\d*)?(?P<star>\*)?$")
_NAME = re.compile(r"^[^\W\d]+$")


class EinshardError(ValueError):
    """An expression that does not parse, does not fit the array or the group size."""


@dataclass(frozen=True)
class Element:
    """One right-hand element: an axis (`name`) or a replication (`name` None)."""

    name: str | None
    number: int
    star: bool


def parse(expr: str) -> tuple[list[str | None], list[Element | None]]:
    """`"a ... b -> * a2 ... b"` -> (["a", None, "b"], [Element(None, 1, True), ...]);
    None stands for `...`."""
    if expr.count("->") != 1:
        raise EinshardError(f"einshard expression {expr!r}: expected one '->'")
    lhs, rhs = (s.split() for s in expr.split("->"))
    left: list[str | None] = []
    for tok in lhs:
        if tok != "..." and not _NAME.match(tok):
            raise EinshardError(f"einshard expression {expr!r}: bad axis name {tok!r}")
        left.append(None if tok == "..." else tok)
    right: list[Element | None] = []
    for tok in rhs:
        m = _RIGHT.match(tok)
        if tok == "...":
            right.append(None)
        elif m is None or not (m["name"] or m["num"] or m["star"]):
            raise EinshardError(f"einshard expression {expr!r}: bad element {tok!r}")
        else:
            right.append(Element(m["name"], int(m["num"] or 1), bool(m["star"])))
    names_l = [t for t in left if t]
    names_r = [e.name for e in right if e and e.name]
    if len(set(names_l)) != len(names_l) or len(set(names_r)) != len(names_r):
        raise EinshardError(f"einshard expression {expr!r}: an axis is named twice")
    if set(names_l) != set(names_r):
        raise EinshardError(
            f"einshard expression {expr!r}: the right side must name the left side's axes "
            f"{names_l}, got {names_r}"
        )
    if left.count(None) > 1 or left.count(None) != right.count(None):
        raise EinshardError(f"einshard expression {expr!r}: '...' at most once, on both sides")
    return left, right


def _root(q: int, k: int) -> int | None:
    r = round(q ** (1 / k))
    return next((c for c in (r - 1, r, r + 1) if c > 0 and c**k == q), None)


@dataclass(frozen=True)
class Layout:
    """Where the parts of an array of `shape` are on `size` ranks: `grid` (the mesh
    sizes of the right side's elements) and, per dimension, its parts and the grid
    position that indexes them (None: whole)."""

    shape: tuple[int, ...]
    size: int
    grid: tuple[int, ...]
    dims: tuple[tuple[int, int | None], ...]  # (parts, grid position) per dimension

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for g in reversed(self.grid):
            rank, c = divmod(rank, g)
            out.append(c)
        return tuple(reversed(out))

    def index(self, rank: int) -> tuple[int, ...]:
        """The part each dimension of `rank` holds (0 for whole dimensions)."""
        c = self.coords(rank)
        return tuple(0 if pos is None else c[pos] for _, pos in self.dims)

    def local_shape(self) -> tuple[int, ...]:
        return tuple(d // parts for d, (parts, _) in zip(self.shape, self.dims, strict=True))

    def slices(self, rank: int) -> tuple[slice, ...]:
        return tuple(
            slice(i * n, (i + 1) * n)
            for i, n in zip(self.index(rank), self.local_shape(), strict=True)
        )


def layout(expr: str, shape: tuple[int, ...], size: int) -> Layout:
    """The layout `expr` gives an array of `shape` on `size` ranks (no mlx needed)."""
    left, right = parse(expr)
    shape = tuple(shape)
    if None in left:
        extra = len(shape) - (len(left) - 1)
        if extra < 0:
            raise EinshardError(f"{expr!r} names {len(left) - 1} axes, the array has {len(shape)}")
        i, j = left.index(None), right.index(None)
        hidden = [f"...{k}" for k in range(extra)]
        left = left[:i] + hidden + left[i + 1 :]
        right = right[:j] + [Element(h, 1, False) for h in hidden] + right[j + 1 :]
    elif len(left) != len(shape):
        raise EinshardError(f"{expr!r} names {len(left)} axes, the array has {len(shape)}")
    fixed = prod(e.number for e in right if not e.star)
    starred = [e.number for e in right if e.star]
    factor = 1
    if starred:
        if size % fixed or (size // fixed) % prod(starred):
            raise EinshardError(
                f"{expr!r}: {size} ranks do not divide into {fixed} fixed x {prod(starred)} "
                "starred parts"
            )
        f = _root(size // fixed // prod(starred), len(starred))
        if f is None:
            raise EinshardError(
                f"{expr!r}: {size} ranks leave {size // fixed} for {len(starred)} starred "
                f"element(s) in the ratio {starred}, not a whole number each"
            )
        factor = f
    grid = tuple(e.number * (factor if e.star else 1) for e in right)
    if prod(grid) != size:
        raise EinshardError(
            f"{expr!r}: parts and replicas multiply to {prod(grid)}, not the group size {size}"
        )
    pos = {e.name: k for k, e in enumerate(right) if e.name}
    dims = []
    for name, d in zip(left, shape, strict=True):
        parts = grid[pos[name]]
        if d % parts:
            shown = name if not name.startswith("...") else "an axis of '...'"
            raise EinshardError(f"{expr!r}: axis {shown} of size {d} does not split into {parts}")
        dims.append((parts, pos[name] if parts > 1 else None))
    return Layout(shape, size, grid, tuple(dims))


def local_shape(expr: str, shape: tuple[int, ...], rank: int, size: int) -> tuple[int, ...]:
    """The shape of rank `rank`'s part (the same on every rank)."""
    if not 0 <= rank < size:
        raise EinshardError(f"rank {rank} is not in a group of {size}")
    return layout(expr, shape, size).local_shape()


def _group(group: mx.distributed.Group | None) -> mx.distributed.Group:
    return group or world()


def einshard(x: mx.array, expr: str, group: mx.distributed.Group | None = None) -> mx.array:
    """This rank's part of `x` (every rank passes the whole array) per `expr`."""
    g = _group(group)
    return mx.contiguous(x[layout(expr, x.shape, g.size()).slices(g.rank())])


@dataclass
class ShardedArray:
    """This rank's part `local` of a global array, and where every rank's part is:
    `parts[d]` per dimension and `owner[d][r]`, the part rank r holds."""

    local: mx.array
    shape: tuple[int, ...]
    parts: tuple[int, ...]
    owner: tuple[tuple[int, ...], ...]
    group: mx.distributed.Group

    def map(self, fn: Callable[[mx.array], mx.array]) -> ShardedArray:
        """An elementwise function of the parts (relu, silu, ...)."""
        return ShardedArray(fn(self.local), self.shape, self.parts, self.owner, self.group)

    def combine(
        self, other: ShardedArray, fn: Callable[[mx.array, mx.array], mx.array]
    ) -> ShardedArray:
        """An elementwise function of two arrays split the same way (silu(a) * b, ...)."""
        if (self.shape, self.parts, self.owner) != (other.shape, other.parts, other.owner):
            raise EinshardError("elementwise operands must have the same shape and layout")
        return ShardedArray(
            fn(self.local, other.local), self.shape, self.parts, self.owner, self.group
        )

    def full(self) -> mx.array:
        """The whole array on every rank (one all_gather; replicas are skipped)."""
        n = self.group.size()
        if n == 1 or all(p == 1 for p in self.parts):
            return self.local
        every = mx.distributed.all_gather(self.local[None], group=self.group)
        first: dict[tuple[int, ...], int] = {}
        for r in range(n):
            first.setdefault(tuple(o[r] for o in self.owner), r)

        def build(d: int, prefix: tuple[int, ...]) -> mx.array:
            if d == len(self.shape):
                return every[first[prefix]]
            return mx.concatenate([build(d + 1, (*prefix, i)) for i in range(self.parts[d])], d)

        return build(0, ())


def shard(x: mx.array, expr: str, group: mx.distributed.Group | None = None) -> ShardedArray:
    """`einshard(x, expr, group)` with its layout, for `sharded_einsum`."""
    g = _group(group)
    lay = layout(expr, x.shape, g.size())
    owner = tuple(zip(*(lay.index(r) for r in range(g.size())), strict=True)) or ()
    parts = tuple(p for p, _ in lay.dims)
    return ShardedArray(einshard(x, expr, g), tuple(x.shape), parts, owner, g)


def _subscripts(subscripts: str, n_operands: int) -> tuple[list[str], str]:
    if "->" not in subscripts or "." in subscripts:
        raise EinshardError(f"sharded_einsum {subscripts!r}: give '->' and no '...'")
    lhs, out = subscripts.replace(" ", "").split("->")
    ins = lhs.split(",")
    if len(ins) != n_operands:
        raise EinshardError(f"sharded_einsum {subscripts!r}: {n_operands} operands given")
    return ins, out


def sharded_einsum(subscripts: str, *operands: ShardedArray) -> ShardedArray:
    """`mx.einsum(subscripts, ...)` over sharded operands, with at most one all_sum.

    Every axis letter split in several operands must be split the same way (same parts
    on the same ranks); an operand holding such an axis whole uses its matching part
    (no communication). Then: only free axes split (they appear in the output) -> the
    result is sharded on them, no communication; only reduced axes split -> local
    partial sums, one all_sum (one replica of each part counted), result whole; both
    -> refused (hybrid needs an all_sum within sub-groups, which the ring backend
    lacks). Anything else that is not naturally sharded raises `EinshardError`.
    """
    ins, out = _subscripts(subscripts, len(operands))
    g = operands[0].group
    rank = g.rank()
    split: dict[str, tuple[int, tuple[int, ...], int]] = {}  # letter -> parts, owner, size
    sizes: dict[str, int] = {}
    for k, (op, letters) in enumerate(zip(operands, ins, strict=True)):
        if len(letters) != len(op.shape):
            raise EinshardError(f"{subscripts!r}: operand {k} has {len(op.shape)} axes")
        for d, c in enumerate(letters):
            if sizes.setdefault(c, op.shape[d]) != op.shape[d]:
                raise EinshardError(f"{subscripts!r}: axis {c} has sizes {sizes[c]}, {op.shape[d]}")
            if op.parts[d] == 1:
                continue
            mine = (op.parts[d], op.owner[d], k)
            if c in split and split[c][:2] != mine[:2]:
                raise EinshardError(
                    f"{subscripts!r} is not naturally sharded: axis {c} is split "
                    f"{split[c][0]} ways in operand {split[c][2]} and {mine[0]} ways in "
                    f"operand {k}{' on other ranks' if split[c][0] == mine[0] else ''}"
                )
            split.setdefault(c, mine)
    locals_ = []
    for op, letters in zip(operands, ins, strict=True):
        x = op.local
        for d, c in enumerate(letters):
            if c in split and op.parts[d] == 1:  # whole here, split elsewhere: take the part
                parts, owner, _ = split[c]
                w = op.shape[d] // parts
                index = [slice(None)] * x.ndim
                index[d] = slice(owner[rank] * w, (owner[rank] + 1) * w)
                x = x[tuple(index)]
        locals_.append(x)
    reduced = [c for c in split if c not in out]
    free = [c for c in split if c in out]
    if reduced and free:
        raise EinshardError(
            f"{subscripts!r} is not naturally sharded here: free axes {free} and reduced "
            f"axes {reduced} are both split (hybrid parallelism needs sub-group sums)"
        )
    y = mx.einsum(subscripts, *locals_)
    shape = tuple(sizes[c] for c in out)
    if reduced:
        first: dict[tuple[int, ...], int] = {}
        for r in range(g.size()):
            first.setdefault(tuple(split[c][1][r] for c in reduced), r)
        if first[tuple(split[c][1][rank] for c in reduced)] != rank:
            y = mx.zeros_like(y)  # a replica of a part already counted
        y = mx.distributed.all_sum(y, group=g)
        return ShardedArray(y, shape, (1,) * len(out), ((0,) * g.size(),) * len(out), g)
    parts = tuple(split[c][0] if c in split else 1 for c in out)
    owner = tuple(split[c][1] if c in split else (0,) * g.size() for c in out)
    return ShardedArray(y, shape, parts, owner, g)
