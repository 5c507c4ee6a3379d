"""einshard expressions: parsing, layouts and local shapes as pure functions of
(expr, shape, rank, size), no ranks launched (the launches are in test_styles.py)."""

from __future__ import annotations

from math import prod

import pytest

from llama_tp.parallel.einshard import EinshardError, layout, local_shape, parse

# (size, shape, expr, local shape): the einshard package's own cases, then more.
CASES = [
    (1, (2,), "... -> * ...", (2,)),
    (16, (2,), "a -> 16 a", (2,)),
    (16, (2, 8), "a b -> 2 a b*", (2, 1)),
    (8, (4, 4), "a b -> * a* b*", (2, 2)),
    (16, (2, 8), "... a -> 2 ... a*", (2, 1)),
    (16, (4, 16, 8), "a b c -> a2* b2 c*", (1, 8, 4)),
    (16, (4, 8), "a b -> 2 a2 b4", (2, 2)),
    (16, (4, 8, 20, 10), "a ... d -> 4 a2 ... d2", (2, 8, 20, 5)),
    (16, (4, 8, 20, 10), "a b c d -> 4 a2 b c d2", (2, 8, 20, 5)),
    (16, (4, 8), "a b -> * a2 b", (2, 8)),
    (16, (4, 8), "a b -> 2 a2* b*", (1, 4)),
    (2, (128, 256), "x y -> x y*", (128, 128)),
    (4, (256, 64), "y z -> y* z", (64, 64)),
    (8, (8, 128), "... -> * ...", (8, 128)),
    (6, (6, 4), "a b -> a* b", (1, 4)),
    (6, (6, 4), "a b -> 3 a2 b", (3, 4)),
    (4, (8, 8), "a b -> b2 a2", (4, 4)),
    (3, (9,), "a -> a*", (3,)),
    (1, (5, 7), "a b -> a b", (5, 7)),
    (4, (2, 3, 4), "... c -> ... c*", (2, 3, 1)),
    (4, (), "... -> * ...", ()),
]


@pytest.mark.parametrize("size, shape, expr, local", CASES)
def test_local_shape(size, shape, expr, local):
    for rank in range(size):
        assert local_shape(expr, shape, rank, size) == local


@pytest.mark.parametrize("size, shape, expr, local", CASES)
def test_parts_tile_the_array_and_replicas_agree(size, shape, expr, local):
    """Every block is held by the same number of ranks (its replicas); together they tile it."""
    lay = layout(expr, shape, size)
    holders: dict[tuple, list[int]] = {}
    for r in range(size):
        holders.setdefault(lay.index(r), []).append(r)
    blocks = prod(p for p, _ in lay.dims)
    assert len(holders) == blocks
    assert {len(v) for v in holders.values()} == {size // blocks}


def test_rank_order_is_row_major_over_the_right_side():
    """'a b -> 2 a2* b*' on 16 ranks (the einshard docs): grid (2, 4, 2), ranks 0 and 8
    hold a-part 0 b-part 0, rank 1 and 9 a-part 0 b-part 1, rank 2 a-part 1 b-part 0."""
    lay = layout("a b -> 2 a2* b*", (4, 8), 16)
    assert lay.grid == (2, 4, 2)
    assert lay.index(0) == lay.index(8) == (0, 0)
    assert lay.index(1) == lay.index(9) == (0, 1)
    assert lay.index(2) == (1, 0)
    # "a b -> * a2 b": a's part alternates with the rank, 8 replicas each.
    lay = layout("a b -> * a2 b", (4, 8), 16)
    assert [lay.index(r)[0] for r in range(4)] == [0, 1, 0, 1]


def test_parse():
    left, right = parse("a ... b -> * a2 ... b")
    assert left == ["a", None, "b"]
    assert right[0].name is None and right[0].star and right[1].number == 2
    assert right[2] is None and right[3].name == "b" and right[3].number == 1


@pytest.mark.parametrize(
    "size, shape, expr, message",
    [
        (4, (6, 8), "a b -> a4 b", "axis a of size 6 does not split into 4"),
        (4, (8, 8), "a b -> a2 b", "multiply to 2, not the group size 4"),
        (4, (8, 8), "a b -> a2 b4", "multiply to 8, not the group size 4"),
        (6, (8, 8), "a b -> a4*", "right side must name"),
        (6, (8, 8), "a b -> a4* b", "do not divide"),
        (8, (8, 8), "a b -> a* b*", "not a whole number each"),
        (2, (8, 8), "a b -> a b c2", "right side must name"),
        (2, (8, 8), "a b c -> a b c", "names 3 axes, the array has 2"),
        (2, (8, 8), "a b a -> a b", "named twice"),
        (2, (8, 8), "a b", "expected one '->'"),
        (2, (8, 8), "a 1b -> a b", "bad axis name"),
        (2, (8, 8), "a b -> a0 b", "bad element"),
        (2, (8, 8), "... a -> a*", "'...' at most once, on both sides"),
        (2, (3, 8), "... b -> 2 ... b", "no error"),
        (2, (3, 8), "a ... -> ... a2", "axis a of size 3 does not split into 2"),
        (4, (8, 3), "a ... -> a2 ... 2", "no error"),
    ],
)
def test_errors(size, shape, expr, message):
    if message == "no error":
        layout(expr, shape, size)
        return
    with pytest.raises(EinshardError, match=message.replace("(", r"\(").replace("*", r"\*")):
        local_shape(expr, shape, 0, size)
