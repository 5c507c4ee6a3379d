"""Every architecture of the installed mlx-lm through llama_tp (generic/, and the native
path for the ones llama_tp implements), against mlx-lm's own greedy tokens.

One process writes every tiny folder with mlx-lm's own class and runs both mlx-lm and
llama_tp on it; one launch of 2 ranks and one of 3 load every folder in turn split into
pipeline stages; one launch of 2 ranks splits the ones with a tensor split by tensor
(tests/mp_generic.py). The table (`tests/generic_models.py`) says what must hold, and
docs/models.md is rendered from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, launch, run_python
from generic_models import (
    NO_PIPELINE,
    STYLE_TABLE,
    architectures,
    render_models_md,
    runnable,
    tensor_split,
)

MP = str(ROOT / "tests" / "mp_generic.py")


def _rows(out: str) -> dict[str, dict]:
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["name"]: r for r in rows}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    """Every runnable architecture's folder, mlx-lm's greedy tokens and llama_tp's (1 process)."""
    from fixtures import train_sentencepiece

    base = tmp_path_factory.mktemp("generic")
    train_sentencepiece(base / "tokenizer", 389)
    p = run_python([MP, "write", str(base / "models"), str(base / "tokenizer")], timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return base / "models", _rows(p.stdout)


def _run(root: Path, n: int, flag: str, names: list[str] | None = None) -> dict:
    p = launch(n, [MP, "run", str(root), flag, str(n), *(names or [])], timeout=1500)
    assert p.returncode == 0, p.stderr[-2000:]
    return _rows(p.stdout)


@pytest.fixture(scope="module")
def pipelines(written) -> dict[int, dict]:
    root, _ = written
    return {n: _run(root, n, "--pp") for n in (2, 3)}


def test_one_process_gives_mlx_lms_greedy_tokens(written):
    _, rows = written
    assert set(rows) == set(runnable())
    wrong = {
        k: r.get("error") or r["tokens"] for k, r in rows.items() if r.get("tokens") != r["mlx_lm"]
    }
    assert not wrong


@pytest.mark.parametrize("n", [2, 3])
def test_pipeline_stages_give_mlx_lms_greedy_tokens(written, pipelines, n):
    _, ref = written
    rows = pipelines[n]
    assert set(rows) == set(ref)
    for name, r in rows.items():
        if name in NO_PIPELINE:  # refused in one line, on every rank, and the launch goes on
            assert "cannot be split" in r["error"] and "\n" not in r["error"], (name, r)
            continue
        assert r.get("tokens") == ref[name]["mlx_lm"], (name, r.get("error"), r.get("trace"))
        reads = [rank[0] for rank in r["ranks"]]
        held = [rank[2] for rank in r["ranks"]]
        layers = [tuple(rank[1]) for rank in r["ranks"]]
        assert reads == held, name  # each rank read exactly what it holds
        if not r.get("by_mlx_lm"):  # the stages partition the layers, in rank order
            assert layers[0][0] == 0 and layers[-1][1] == 6, (name, layers)
            assert all(a[1] == b[0] for a, b in zip(layers, layers[1:], strict=False)), name


def test_most_architectures_split_into_pipeline_stages(written, pipelines):
    """The issue's bar: >= 90% of the installed mlx-lm's text architectures."""
    every = architectures()
    ref = written[1]
    passed = [
        a
        for a in runnable()
        if all(pipelines[n][a].get("tokens") == ref[a]["mlx_lm"] for n in (2, 3))
    ]
    assert len(passed) / len(every) >= 0.9, (len(passed), len(every))


def test_tensor_splits(written):
    """shard() where mlx-lm defines it, the style table where it knows the layers, a one-line
    refusal suggesting --pp otherwise."""
    root, ref = written
    split = [a for a in runnable() if tensor_split(a)]
    refused = next(a for a in runnable() if not tensor_split(a) and a not in NO_PIPELINE)
    rows = _run(root, 2, "--tp", [*split, refused])
    for name in split:
        r = rows[name]
        want = ref[name]["mlx_lm"][: len(r.get("tokens") or [])]
        assert r.get("tokens") == want and len(want) == 4, (name, r.get("error"), r.get("trace"))
        assert r["how"] == tensor_split(name), name
    line = rows[refused]["error"]
    assert "run --pp 2 instead" in line and "\n" not in line, line
    assert set(STYLE_TABLE) <= set(split)


def test_tensor_splits_inside_pipeline_stages(written):
    """--tp 2 --pp 2 on 4 ranks: each stage split by the model's shard() or the style table."""
    root, ref = written
    names = ["ministral3", "gemma3_text"]  # shard() (and its own pipeline()), the style table
    rows = _run(root, 4, "--mesh", names)
    for name in names:
        r = rows[name]
        assert r.get("tokens") == ref[name]["mlx_lm"][:4], (name, r.get("error"), r.get("trace"))
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
