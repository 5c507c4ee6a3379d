"""Every architecture of the installed mlx-lm through llama_tp (generic/, and the native
path for the ones llama_tp implements), against mlx-lm's own greedy tokens.

Two processes write every tiny folder with mlx-lm's own class and run mlx-lm and llama_tp
on it. One launch of 2 ranks and one of 3 then run every architecture in pipeline stages
(a few also by tensor on the 2 ranks), and one of 4 ranks a tp 2 x pp 2 mesh
(tests/mp_generic.py: one load and 4 greedy tokens per architecture, its refusal where it
cannot be cut). The table (`tests/generic_models.py`) says what must hold, and
docs/models.md is rendered from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, launch
from generic_models import (
    NEW_TOKENS,
    NO_PIPELINE,
    STYLE_TABLE,
    architectures,
    own_keys,
    render_models_md,
    runnable,
    tensor_split,
)

MP = str(ROOT / "tests" / "mp_generic.py")
# Launched on 2 ranks by tensor: every architecture with mlx-lm's shard() or the style
# table. A refused split (one line on every rank) is tests/test_generic_drivers.py's.
BY_TENSOR = [a for a in runnable() if tensor_split(a) in ("mlx-lm's shard()", "the style table")]
HALF = NEW_TOKENS // 2  # the greedy tokens a launch compares (one process: all of them)


def _rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    """Every runnable architecture's folder, mlx-lm's greedy tokens and llama_tp's on one
    process (two processes, half of the table each)."""
    from fixtures import train_sentencepiece

    base = tmp_path_factory.mktemp("generic")
    train_sentencepiece(base / "tokenizer", 389)
    args = [sys.executable, MP, "write", str(base / "models"), str(base / "tokenizer")]
    procs = [
        subprocess.Popen(
            [*args, f"{i}/2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )  # fmt: skip
        for i in range(2)
    ]
    rows = {}
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-2000:]
        rows |= {r["name"]: r for r in _rows(out)}
    return base / "models", rows


@pytest.fixture(scope="module")
def launched(written) -> dict:
    """(flag, n) -> name -> rank 0's row."""
    root, _ = written
    every = ",".join(runnable())  # NO_PIPELINE's too: their refusal on every rank
    own = ",".join(own_keys())  # configs of their own keys only: on 2 ranks
    runs = {
        2: ["--pp", "2", f"{every},{own}", "--tp", "2", ",".join(BY_TENSOR)],
        3: ["--pp", "3", every],
        4: ["--mesh", "4", "ministral3,gemma2"],
    }  # fmt: skip
    out: dict = {}
    for n, spec in runs.items():
        p = launch(n, [MP, "run", str(root), *spec], timeout=900)
        assert p.returncode == 0, p.stderr[-2000:]
        for r in _rows(p.stdout):
            out.setdefault((r["flag"], n), {})[r["name"]] = r
    return out


def _check_stages(name: str, r: dict, want: list[int], n: int) -> None:
    assert r.get("tokens") == want, (name, n, r.get("error"), r.get("trace"))
    reads = [rank[0] for rank in r["ranks"]]
    held = [rank[2] for rank in r["ranks"]]
    layers = sorted(tuple(rank[1]) for rank in r["ranks"])
    assert reads == held, (name, n)  # each rank read exactly what it holds
    # the stages partition the layers (mlx-lm's pipeline() keeps its own list's length)
    assert len(layers) == n and layers[0][0] == 0 and layers[-1][1] == 6, (name, layers)
    assert all(a[1] == b[0] for a, b in zip(layers, layers[1:], strict=False)), (name, layers)


def test_one_process_gives_mlx_lms_greedy_tokens(written):
    _, rows = written
    assert set(rows) == set(runnable()) | set(own_keys())
    wrong = {
        k: r.get("error") or r["tokens"] for k, r in rows.items() if r.get("tokens") != r["mlx_lm"]
    }
    assert not wrong


@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_stages_give_mlx_lms_greedy_tokens(written, launched, n):
    """Every architecture on n launched ranks in pipeline stages: mlx-lm's greedy tokens,
    each rank reading only its stage's tensors; the ones that cannot be cut refused in one
    line on every rank; on 2 ranks also the folders of only their own config keys of the
    architectures that name the hidden width otherwise (`generic_models.own_keys`: dbrx,
    gpt_bigcode, gptj, phixtral; their later stage read it from the embedding it had
    dropped)."""
    _, ref = written
    rows = launched[("--pp", n)]
    assert set(rows) == set(runnable()) | set(own_keys() if n == 2 else ())
    for name, r in rows.items():
        if name in NO_PIPELINE:
            assert "cannot be split" in r["error"] and "\n" not in r["error"], (name, r)
            assert r["errors"] == [r["error"]] * n, name
            continue
        _check_stages(name, r, ref[name]["mlx_lm"][:HALF], n)
    # mlx-lm's own pipeline() where the model has one (the same models on 2 and 3 ranks),
    # the generic stage wrapper otherwise
    by_mlx_lm = {a for a, r in rows.items() if r.get("by_mlx_lm") and a in runnable()}
    assert "ministral3" in by_mlx_lm and "gemma2" not in by_mlx_lm, by_mlx_lm
    other = launched[("--pp", 5 - n)]
    assert by_mlx_lm == {a for a, r in other.items() if r.get("by_mlx_lm") and a in runnable()}


def test_most_architectures_split_into_pipeline_stages(written, launched):
    """The issue's bar: >= 90% of the installed mlx-lm's text architectures give mlx-lm's
    greedy tokens on 2 and 3 launched pipeline ranks."""
    ref = written[1]
    passed = [
        a
        for a in runnable()
        if all(launched[("--pp", n)][a].get("tokens") == ref[a]["mlx_lm"][:HALF] for n in (2, 3))
    ]
    assert len(passed) / len(architectures()) >= 0.9, (len(passed), len(architectures()))


def test_tensor_splits(written, launched):
    """shard() on 2 ranks for every architecture that defines it, the style table for
    every one it covers: mlx-lm's greedy tokens."""
    _, ref = written
    rows = launched[("--tp", 2)]
    for name in BY_TENSOR:
        r = rows[name]
        want = ref[name]["mlx_lm"][:HALF]
        assert r.get("tokens") == want, (name, r.get("error"), r.get("trace"))
        assert r["how"] == tensor_split(name), name
    assert {tensor_split(a) for a in BY_TENSOR} == {"mlx-lm's shard()", "the style table"}


def test_tensor_splits_inside_pipeline_stages(written, launched):
    """--tp 2 --pp 2 on 4 ranks: each stage split by the model's shard() or the style table."""
    _, ref = written
    rows = launched[("--mesh", 4)]
    for name in ("ministral3", "gemma2"):  # shard() (and its own pipeline()), the table
        r = rows[name]
        assert r.get("tokens") == ref[name]["mlx_lm"][:HALF], (name, r.get("error"), r.get("trace"))
        assert r["how"] == tensor_split(name) and not r["by_mlx_lm"], (name, r)
        stages = [tuple(x[1]) for x in r["ranks"]]
        assert stages[0] == stages[1] and stages[2] == stages[3] and stages[0] != stages[2]


def test_the_style_table_splits_exactly_the_listed_architectures(written):
    """Without a launch (stand-in groups): the style table takes every architecture of
    STYLE_TABLE and refuses, in one line suggesting --pp, every other one without shard()."""
    from llama_tp.generic.loader import Opened, split_rank
    from llama_tp.generic.plan import StandInGroup
    from llama_tp.generic.tensor import TensorSplitError

    root, _ = written
    for name in runnable():
        if tensor_split(name) in ("the native plan", "mlx-lm's shard()"):
            continue
        try:
            placed = split_rank(Opened(root / name), 2, 1, 0, StandInGroup(2, 0), None)
            assert name in STYLE_TABLE and placed.how == "the style table", name
        except TensorSplitError as e:
            assert name not in STYLE_TABLE, (name, e)
            assert str(e).endswith("run --pp 2 instead") and "\n" not in str(e), e


def test_models_md_is_rendered_from_the_table():
    doc = (ROOT / "docs" / "models.md").read_text()
    assert render_models_md() in doc, "regenerate: python tests/generic_models.py --models-md"
