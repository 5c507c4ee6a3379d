"""Speculative decoding: `python -m llama_tp.bench --prompt TEXT [--draft ngram|DRAFT_DIR]`
on the built-in model as stored (Q4_1) and with float32 weights (a converted copy,
OpenBLAS preloaded), 1 and 2 ranks started directly, a free-form question and a "repeat
this passage" prompt (bench/spec_bench.py's rows); writes the section "Speculative
decoding" of docs/benchmarks.md and docs/benchmarks/speculative.json.

    .venv/bin/python bench/speculative.py            # ~10 min here
    .venv/bin/python bench/speculative.py -g 16 --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from llama_tp.benchmarks import sections
from llama_tp.benchmarks.speculative_rows import PROMPTS, run_row

NAME = "speculative"


def layer_skip_draft(f32: Path, out: Path, layers: int = 8) -> Path:
    """The first `layers` layers of the float32 model with its norm and head: the only
    draft model sharing SmolLM2's tokenizer on a machine without a model hub."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(f32 / "model.safetensors"))
    keep = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    mx.save_safetensors(str(out / "model.safetensors"), keep, metadata={"format": "mlx"})
    config = json.loads((f32 / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in f32.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def rows(f32: Path, gguf: str, g: int, draft_model: Path) -> list[dict]:
    a = argparse.Namespace(g=g, n=1, k=6, k_model=3, timeout=1200, openblas=False)
    out = []
    for label, model, blas in (("float32 + OpenBLAS", str(f32), True), ("Q4_1", gguf, False)):
        a.openblas = blas
        for ranks in (1, 2):
            for kind in ("question", "repeat"):
                for draft in (None, "ngram", str(draft_model)):
                    print(f"spec: {label} {ranks} {kind} {draft}", file=sys.stderr, flush=True)
                    r = run_row(model, ranks, PROMPTS[kind], draft, a)
                    t = (r or {}).get("llama_tp", {})
                    out.append(
                        {"weights": label, "ranks": ranks, "prompt": kind, "draft": draft, **t}
                    )
    return out


def _drafter(draft: str | None) -> str:
    if draft is None:
        return "-"
    return "ngram (K=6)" if draft == "ngram" else "draft model: 8 of 30 layers (K=3)"


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def section(res: dict) -> str:
    md = ["### Speculative decoding (prompt lookup)", "", sections.facts_line(res), ""]
    md += ["F32_DIR: `python -m llama_tp.convert -d --dtype float32 --out F32_DIR`."]
    md += ["The draft model is F32_DIR's first 8 layers with its norm and head"]
    md += ["(`layer_skip_draft` in bench/speculative.py): SmolLM2-135M is the only model with"]
    md += ["its tokenizer on this machine, so no trained small draft exists here."]
    md += ["Greedy, 48 new tokens, end-of-sequence ignored; ranks started directly,"]
    md += ["`OPENBLAS_NUM_THREADS=1`. Rounds = collective rounds per generated token.", ""]
    md += ["| weights | ranks | prompt | drafter | gen tok/s | vs plain | acceptance "]
    md[-1] += "| tokens/forward | rounds/token |"
    md += ["| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = None
    for r in res["spec"]:
        tps = r.get("generation_tps")
        base = tps if r["draft"] is None else base
        sp = r.get("speculative") or {}
        acc = f"{100 * sp['acceptance_rate']:.0f}%" if sp else "-"
        vs = f"{tps / base:.2f}x" if tps and base else "-"
        md.append(
            f"| {r['weights']} | {r['ranks']} | {r['prompt']} | {_drafter(r['draft'])} | "
            f"{_f(tps)} | {vs} | {acc} | {_f(sp.get('tokens_per_forward', 1.0))} | "
            f"{_f(r.get('rounds_per_token'), 1)} |"
        )
    md += ["", "The same rows for any model:", "", "```sh"]
    md += ["python bench/spec_bench.py --model F32_DIR --ranks 1 2 --openblas -g 48 -n 1", "```"]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-g", type=int, default=48, help="generated tokens per row")
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose section to rewrite")
    args = p.parse_args()
    from llama_tp import default_model

    res: dict = sections.run_facts("bench/speculative.py")
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32"
        convert = [sys.executable, "-m", "llama_tp.convert", "-d", "--dtype", "float32"]
        subprocess.run([*convert, "--out", str(f32), "--quiet"], check=True)
        draft = layer_skip_draft(f32, Path(tmp) / "draft8")
        res["spec"] = rows(f32, str(default_model()), args.g, draft)
    # the float32 copy lived in a temporary directory: name it as the docs do
    sections.write_results(NAME, res)
    sections.replace_section(NAME, re.sub(r"\S*/f32\b", "F32_DIR", section(res)), args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
