"""The package's imports flow one way (docs/architecture.md's module map), with no cycles.

Layers, lowest first; a module may import its own package's modules (none of a higher
layer of its package) and any lower layer, never a higher one:

    cluster < parallel, model_args < the layers' kinds, blocks, caches and masks
            < model < models < checkpoints < generic < engine < console
            < server, benchmarks < supervisor < the commands at the top (generate, chat, ...)

`models/` straddles `model`: the modules the model is made of (the core kinds, the
blocks, the caches and masks: `LOW`) are below it, the families built on it above.

Every import counts, including those inside functions (they are real dependencies,
only deferred). The root `llama_tp/__init__.py` is the public facade: it imports
nothing at import time but its lazy table, and nothing imports it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "llama_tp"
LAYERS = {
    "cluster": 0,
    "kernels": 0,  # below everything that computes (imports only mlx)
    "parallel": 1,
    "model_args": 1,  # ModelArgs, beneath the model (it imports nothing of the package)
    "model": 2,
    "models": 3,  # the families and their kinds, built on the model (but `LOW`)
    "checkpoints": 4,
    "generic": 4.5,  # mlx-lm's classes: uses the checkpoint readers, the loader uses it
    "loading": 5,  # checkpoint -> placement -> sharded model, its sources, the mesh's plan
    "engine": 6,  # the decoding core: the step, sampling, batching, speculative decoding
    "conversation": 7,  # Chat and tool calls
    "console": 8,
    "server": 9,
    "benchmarks": 9,
    "checks": 9,  # the doctor's checks
    "supervisor": 10,  # the front door of `launch --restart`: above the server it fronts
}
TOP = 11  # the commands: llama_tp/<name>.py
# the modules of `models/` the model is made of (its core kinds, blocks, caches, masks):
# below `model`, above the parallel layers their kinds' `shard` uses
LOW = {
    "models.attention": 1.5,
    "models.feed_forward": 1.5,
    "models.blocks": 1.5,
    "models.caches": 1.5,
    "models.masks": 1.5,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every llama_tp module `path` imports (a `from X import name` counts as X.name
    when that is a module, else X)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("llama_tp")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("llama_tp"):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if resolves(sub) else mod)
    return found


def resolves(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def layer(module: str) -> float:
    parts = module.split(".")
    if len(parts) == 1:
        return TOP + 1  # the facade
    return LOW.get(".".join(parts[1:3]), LAYERS.get(parts[1], TOP))


def graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in root.rglob("*.py")}


def violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(edges.items()):
        for dst in sorted(targets):
            same_package = src.split(".")[:2] == dst.split(".")[:2] and layer(src) < TOP
            upward = layer(dst) > layer(src) if same_package else layer(dst) >= layer(src)
            if dst == "llama_tp" and src != "llama_tp":
                bad.append(f"{src} imports the facade llama_tp (import the defining module)")
            elif upward and src != "llama_tp":
                bad.append(f"{src} (layer {layer(src)}) imports {dst} (layer {layer(dst)})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (one per back edge)."""
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = "open"
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == "open":
                found.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(edges):
        if n not in state:
            visit(n)
    return found


def test_imports_flow_down_the_layers():
    assert violations(graph()) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_every_subpackage_has_a_layer():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages <= set(LAYERS), subpackages - set(LAYERS)


def test_the_top_level_stays_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top


@pytest.mark.parametrize(
    "edges, expected",
    [
        # an upward import: the engine reaching into a command
        ({"llama_tp.loading.loader": {"llama_tp.generate"}}, "layer 5) imports llama_tp.generate"),
        # the model importing the engine
        ({"llama_tp.model": {"llama_tp.engine.sampling"}}, "layer 2) imports"),
        # a block importing the model, or a family built on it
        ({"llama_tp.models.blocks": {"llama_tp.model"}}, "layer 1.5) imports"),
        ({"llama_tp.models.blocks": {"llama_tp.models.gemma"}}, "layer 1.5) imports"),
        # cluster importing the parallel layers
        ({"llama_tp.cluster.watchdog": {"llama_tp.parallel.layers"}}, "layer 0) imports"),
        # importing the facade from inside
        ({"llama_tp.loading.agreement": {"llama_tp"}}, "imports the facade"),
    ],
)
def test_the_layering_check_catches(edges, expected):
    assert any(expected in v for v in violations(edges)), violations(edges)


def test_the_cycle_check_catches_a_cycle(tmp_path):
    edges = {
        "llama_tp.checkpoints.a": {"llama_tp.checkpoints.b"},
        "llama_tp.checkpoints.b": {"llama_tp.checkpoints.c"},
        "llama_tp.checkpoints.c": {"llama_tp.checkpoints.a"},
    }
    assert cycles(edges) == [
        ["llama_tp.checkpoints.a", "llama_tp.checkpoints.b", "llama_tp.checkpoints.c"]
        + ["llama_tp.checkpoints.a"]
    ]


def test_old_import_paths_still_work():
    """Documented before the subpackages: `llama_tp.distributed`, `.loader`, `.tokenizer`."""
    import llama_tp.distributed as old
    from llama_tp.distributed import print0  # noqa: F401
    from llama_tp.loader import default_model
    from llama_tp.tokenizer import encode_prompt

    import llama_tp
    from llama_tp.cluster import distributed

    assert old is distributed
    assert distributed.__spec__.name == "llama_tp.cluster.distributed"
    assert default_model is llama_tp.default_model
    assert encode_prompt is llama_tp.encode_prompt


def test_the_module_map_names_every_module_and_no_other():
    """docs/architecture.md's module table (its first column) names every module of the
    package (`__init__.py` of the subpackages aside), and nothing that does not exist."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page[page.index("| module | what |") :].split("\n\n", 1)[0]
    listed = {
        name
        for row in table.splitlines()[2:]
        for name in re.findall(r"`([\w/]+\.py)`", row.split(" | ")[0])
    }
    modules = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.parent == PACKAGE or p.name != "__init__.py"
    }
    assert sorted(modules - listed) == [], "add these to docs/architecture.md's module map"
    assert sorted(listed - modules) == [], "docs/architecture.md's module map names these"
