"""An architecture llama_tp does not implement, on mlx-lm's classes, against mlx-lm itself.

    python bench/generic.py [--arch ministral3] [-p 128 -g 64 -n 3]

One run on a random-weight folder written once into the cache by mlx-lm's own class
(`--arch`, default Ministral 3: it has mlx-lm's `pipeline()`, so `pipeline_load` runs it
too; `--hidden`, `--layers`, `--vocab` set its size, float32 by default: the CPU's fast
path with OpenBLAS):

1. 2 ranks, `--pp 2`, with `--compare mlx-lm`: llama_tp's pipeline stages, then mlx-lm's
   own pipeline (`pipeline_load`) on the same weights and ranks (bench's table);
2. 1 rank, with `--compare mlx-lm`;
3. both engines loaded on the same 2 ranks (llama_tp's `--pp 2` and `pipeline_load`),
   generating in turns for `--rounds` rounds, the order swapped every round; then the
   same in one process (as `bench/moe.py` does). The targets are the medians of the
   paired ratios: on a shared machine the load that comes and goes weighs on both alike.

Rewrites the section "mlx-lm's classes" of docs/benchmarks.md and
docs/benchmarks/generic.json. Targets (issue 39): 2 pipeline ranks >= 1.0x mlx-lm's
pipeline's generation tokens/s; 1 process >= 0.95x mlx-lm's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llama_tp.benchmarks import sections

NAME = "generic"


def write_folder(arch: str, hidden: int, layers: int, vocab: int, dtype: str) -> Path:
    """The random-weight folder (cached): mlx-lm's class, its index file, a tokenizer-free
    config (bench feeds token ids)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from llama_tp.benchmarks.synthetic import cache_root

    out = cache_root() / f"generic-{arch}-{hidden}x{layers}-{vocab}-{dtype}"
    if (out / "model.safetensors.index.json").is_file():
        return out
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    config = {
        "model_type": arch, "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": hidden * 11 // 4, "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 256, "head_dim": 64, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 1e6, "llama_4_scaling_beta": 0.1,
                            "original_max_position_embeddings": 8192},
    }  # fmt: skip
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out)
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def write_tokenizer(out: Path) -> None:
    """A word-level tokenizer of two words: the prompt is token ids, but mlx-lm's loaders
    (`pipeline_load` too) read a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def bench(path: Path, ranks: int, flags: list[str], args) -> dict:
    """`python -m llama_tp.bench --model PATH --json` on `ranks` ranks (bench/moe.py's way:
    the ranks through llama_tp.launch, one BLAS thread each; the one process two)."""
    import os
    import subprocess

    from llama_tp.cluster.blas import find_openblas

    cmd = [sys.executable, "-m", "llama_tp.bench", "--model", str(path), "--json", "--quiet"]
    cmd += ["-p", str(args.p), "-g", str(args.g), "-n", str(args.n), *flags]
    env = dict(os.environ)
    if ranks > 1:
        port = ["--starting-port", str(args.port)] if args.port else []
        cmd = [sys.executable, "-m", "llama_tp.launch", "-n", str(ranks), *port, "--", *cmd]
        env["OPENBLAS_NUM_THREADS"] = "1"
    else:
        env["OPENBLAS_NUM_THREADS"] = "2"
        if find_openblas():
            env["LD_PRELOAD"] = find_openblas()
    print(" ".join(cmd[cmd.index("-m") :]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _paired(trials: dict[str, list[dict]], rounds: int) -> dict:
    """Each engine's median tokens/s and the median of the paired ratios (llama_tp / mlx-lm)."""

    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2

    out: dict = {"rounds": rounds, "trials": trials}
    for key in ("prompt_tps", "generation_tps"):
        a = [t[key] for t in trials["llama_tp"]]
        b = [t[key] for t in trials["mlx-lm"]]
        out[key] = {"llama_tp": median(a), "mlx-lm": median(b)}
        out[f"{key}_ratio"] = median([x / y for x, y in zip(a, b, strict=True)])
    return out


def staged_interleaved(path: str, rounds: int, p: int, g: int) -> dict | None:
    """On the 2 ranks of a launch: llama_tp's `--pp 2` model and mlx-lm's own pipeline
    (`pipeline_load`) of the same folder, both loaded, generating in turns (the order
    swapped every round); rank 0's result (None on the others)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step as mlx_lm_step
    from mlx_lm.generate import generation_stream
    from mlx_lm.utils import pipeline_load

    from llama_tp.benchmarks.runner import timed
    from llama_tp.cluster.distributed import barrier, world
    from llama_tp.engine.generation import generate_step
    from llama_tp.engine.sampling import make_sampler
    from llama_tp.loading.loader import load_model

    group = world()
    ours, _ = load_model(path, group, pp=2)
    theirs, _ = pipeline_load(path)
    prompt = mx.random.randint(0, ours.args.vocab_size, (p,), key=mx.random.key(0)).tolist()

    def run(engine: str) -> dict:
        barrier(group)
        if engine == "llama_tp":
            return timed(generate_step(ours, prompt, make_sampler(0.0), g), p)[0]
        steps = mlx_lm_step(mx.array(prompt), theirs, max_tokens=g, sampler=lambda x: x.argmax(-1))
        return timed(steps, p, generation_stream)[0]

    run("llama_tp"), run("mlx-lm")  # warm-up
    trials: dict[str, list[dict]] = {"llama_tp": [], "mlx-lm": []}
    for r in range(rounds):
        for engine in ("llama_tp", "mlx-lm")[:: 1 if r % 2 == 0 else -1]:
            trials[engine].append(run(engine))
    return _paired(trials, rounds) if group.rank() == 0 else None


def interleaved(path: str, rounds: int, p: int, g: int) -> dict:
    """bench/moe.py's interleaved run (llama_tp and mlx-lm in one process, generating in
    turns, the order swapped every round), with mlx-lm's `load_model` (the folder has no
    tokenizer: the prompt is token ids)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step as mlx_lm_step
    from mlx_lm.generate import generation_stream
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.runner import timed
    from llama_tp.engine.generation import generate_step
    from llama_tp.engine.sampling import make_sampler
    from llama_tp.loading.loader import load_model as load_ours

    ours, _ = load_ours(path)
    theirs, _ = load_model(Path(path))
    prompt = mx.random.randint(0, ours.args.vocab_size, (p,), key=mx.random.key(0)).tolist()

    def run(engine: str) -> dict:
        if engine == "llama_tp":
            return timed(generate_step(ours, prompt, make_sampler(0.0), g), p)[0]
        steps = mlx_lm_step(mx.array(prompt), theirs, max_tokens=g, sampler=lambda x: x.argmax(-1))
        return timed(steps, p, generation_stream)[0]

    run("llama_tp"), run("mlx-lm")  # warm-up
    trials: dict[str, list[dict]] = {"llama_tp": [], "mlx-lm": []}
    for r in range(rounds):
        for engine in ("llama_tp", "mlx-lm")[:: 1 if r % 2 == 0 else -1]:
            trials[engine].append(run(engine))
    return _paired(trials, rounds)


def two_ranks(path: Path, args) -> dict:
    """`staged_interleaved` on 2 ranks through llama_tp.launch (one BLAS thread each)."""
    import os
    import subprocess

    cmd = [sys.executable, __file__, "--two-ranks", str(path), "--rounds", str(args.rounds)]
    cmd += ["-p", str(args.p), "-g", str(args.g)]
    port = ["--starting-port", str(args.port)] if args.port else []
    cmd = [sys.executable, "-m", "llama_tp.launch", "-n", "2", *port, "--", *cmd]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def one_process(path: Path, args) -> dict:
    """`interleaved` in a child process with the one process's BLAS setup (OpenBLAS, two
    threads), as bench/moe.py runs it."""
    import os
    import subprocess

    from llama_tp.cluster.blas import find_openblas

    cmd = [sys.executable, __file__, "--one-process", str(path), "--rounds", str(args.rounds)]
    cmd += ["-p", str(args.p), "-g", str(args.g)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
    if find_openblas():
        env["LD_PRELOAD"] = find_openblas()
    print(" ".join(cmd[1:]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def section(res: dict) -> str:
    runs, targets = res["runs"], res["targets"]
    md = [f"### mlx-lm's classes: `{res['arch']}` ({res['size']}) against mlx-lm", ""]
    md += [
        f"Generated by `python bench/generic.py` (raw results: [benchmarks/{NAME}.json]"
        f"(benchmarks/{NAME}.json)).",
        "",
        "| run | prompt tok/s | gen tok/s | MLX peak GB per rank |",
        "|---|---|---|---|",
    ]
    for name, r in runs.items():
        if "llama_tp" not in r:
            continue
        for engine, label in (("llama_tp", "llama_tp"), ("mlx_lm", "mlx-lm")):
            x = r.get(engine)
            if not x or (engine == "mlx_lm" and not x.get("supported")):
                continue
            peak = " / ".join(f"{v:.2f}" for v in x["peak_memory_gb"])
            md.append(
                f"| {label}, {name} | {x['prompt_tps']:.1f} | {x['generation_tps']:.2f} | {peak} |"
            )
    two = runs["2 ranks, --pp 2, interleaved"]["generation_tps"]
    g = runs["1 process, interleaved"]["generation_tps"]
    md += [
        "",
        f"Both engines loaded on the same 2 ranks, {res['rounds']} interleaved rounds: "
        f"llama_tp {two['llama_tp']:.2f}, mlx-lm's pipeline {two['mlx-lm']:.2f} generated "
        "tok/s (medians). One process, the same way: llama_tp "
        f"{g['llama_tp']:.2f}, mlx-lm {g['mlx-lm']:.2f} generated tok/s. Targets are the "
        "medians of the paired ratios (llama_tp / mlx-lm):",
        "",
        *(f"- {k}: {v:.3f}" for k, v in targets.items()),
        "",
        sections.facts_line(res),
    ]
    return "\n".join(md)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="ministral3")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("-p", type=int, default=128, help="prompt tokens")
    p.add_argument("-g", type=int, default=64, help="generated tokens")
    p.add_argument("-n", type=int, default=3, help="trials")
    p.add_argument("--rounds", type=int, default=7, help="interleaved 1-process rounds")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--port", type=int, help="the ranks' starting port (default: the launcher's)")
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose section to rewrite")
    p.add_argument("--one-process", help=argparse.SUPPRESS)  # the interleaved runs' children
    p.add_argument("--two-ranks", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_process:
        print(json.dumps(interleaved(args.one_process, args.rounds, args.p, args.g)))
        return 0
    if args.two_ranks:
        res = staged_interleaved(args.two_ranks, args.rounds, args.p, args.g)
        if res is not None:
            print(json.dumps(res), flush=True)
        return 0
    path = write_folder(args.arch, args.hidden, args.layers, args.vocab, args.dtype)
    res = sections.run_facts("bench/generic.py")
    compare = ["--compare", "mlx-lm", "--collective-steps", "0"]
    runs: dict = {}
    partial = Path(f"/tmp/llama_tp-bench-{NAME}.json")  # what a failure would lose
    for name, ranks, flags in (("2 ranks, --pp 2", 2, ["--pp", "2"]), ("1 rank", 1, [])):
        runs[name] = bench(path, ranks, [*compare, *flags], args)
        if not runs[name]["mlx_lm"].get("supported"):
            raise RuntimeError(f"{name}: mlx-lm: {runs[name]['mlx_lm'].get('reason')}")
        partial.write_text(json.dumps(runs))
    runs["2 ranks, --pp 2, interleaved"] = staged = two_ranks(path, args)
    partial.write_text(json.dumps(runs))
    runs["1 process, interleaved"] = side = one_process(path, args)
    targets = {
        "generation_2_pipeline_ranks_vs_mlx_lm_pipeline": staged["generation_tps_ratio"],
        "prompt_2_pipeline_ranks_vs_mlx_lm_pipeline": staged["prompt_tps_ratio"],
        "generation_1_process_vs_mlx_lm": side["generation_tps_ratio"],
        "prompt_1_process_vs_mlx_lm": side["prompt_tps_ratio"],
    }
    size = f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}"
    res.update(arch=args.arch, size=size, rounds=args.rounds, runs=runs, targets=targets)
    sections.write_results(NAME, res)
    sections.replace_section(NAME, section(res), args.out)
    print(json.dumps(targets, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
