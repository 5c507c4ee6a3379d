"""A mixture-of-experts model on 1 and 2 ranks against mlx-lm on the same weights.

    python bench/moe.py [--spec moe-a3b-fp32] [-p 128 -g 64 -n 3]
    python bench/moe.py --spec deepseek-v3-fp32 --section deepseek-v3
    python bench/moe.py --spec glm4-moe-fp32 --section glm4-moe

One run, three `python -m llama_tp.bench` invocations on the synthetic Qwen3-MoE `--spec`
(written once into the cache; `moe-a3b` is Qwen3-30B-A3B's shape scaled down), then one
process timing both engines in turns:

1. 1 rank, with `--compare mlx-lm`: mlx-lm's own model and loop on the same weights;
2. 2 ranks, experts split by tensor, with `--compare mlx-lm`: mlx-lm's own sharding
   (`sharded_load`, which supports qwen3_moe) on the same 2 ranks;
3. 2 ranks, experts split by expert;
4. llama_tp and mlx-lm loaded in one process, generating in turns for `--rounds`
   rounds (the order swapped each round): on a shared machine the load that comes and
   goes weighs on both alike; the 1-rank target is the median of the paired ratios.

Ranks start through `python -m llama_tp.launch` (OpenBLAS preloaded, one thread per
rank); the one process gets OpenBLAS with two threads. Every figure is bench's own:
tokens/s (means of `-n` trials after a warm-up), each rank's MLX peak memory and
weights, its resident set (max RSS), and the tokens routed to each rank's experts
(counted in one more trial). Rewrites the section "Mixture of experts" of
docs/benchmarks.md and docs/benchmarks/mixture-of-experts.json (`--section NAME`: the
section NAME and docs/benchmarks/NAME.json, e.g. for the synthetic DeepSeek-V3 or GLM-4.5).
Targets (issue 26): 1 rank >= 1.0x mlx-lm's generation tokens/s; 2 ranks' per-rank
memory <= 0.55x the 1-rank figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from llama_tp.benchmarks import sections
from llama_tp.cluster.blas import find_openblas

NAME = "mixture-of-experts"

PY = sys.executable


def bench(spec: str, ranks: int, flags: list[str], args) -> dict:
    cmd = [PY, "-m", "llama_tp.bench", "--synthetic", spec, "--json", "--quiet"]
    cmd += ["-p", str(args.p), "-g", str(args.g), "-n", str(args.n), *flags]
    env = dict(os.environ)
    if ranks > 1:
        port = ["--starting-port", str(args.port)] if args.port else []
        cmd = [PY, "-m", "llama_tp.launch", "-n", str(ranks), *port, "--", *cmd]
        env["OPENBLAS_NUM_THREADS"] = "1"
    else:
        env["OPENBLAS_NUM_THREADS"] = "2"
        if find_openblas():  # as the launcher does for its ranks
            env["LD_PRELOAD"] = find_openblas()
    print(" ".join(cmd[cmd.index("-m") :]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def interleaved(path: str, rounds: int, p: int, g: int) -> dict:
    """llama_tp and mlx-lm on the same weights in one process, their generations taking
    turns (the order swapped every round), so that the machine's other load weighs on
    both alike: each engine's median tokens/s and the median of the paired ratios."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step as mlx_lm_step
    from mlx_lm.generate import generation_stream

    from llama_tp.benchmarks.runner import timed
    from llama_tp.engine.generation import generate_step
    from llama_tp.engine.sampling import make_sampler
    from llama_tp.loading.loader import load_model

    ours, ckpt = load_model(path)
    theirs, _ = load(path)
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

    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2

    out: dict = {"rounds": rounds, "trials": trials}
    for key in ("prompt_tps", "generation_tps"):
        a = [t[key] for t in trials["llama_tp"]]
        b = [t[key] for t in trials["mlx-lm"]]
        out[key] = {"llama_tp": median(a), "mlx-lm": median(b)}
        out[f"{key}_ratio"] = median([x / y for x, y in zip(a, b, strict=True)])
    out["chat"] = two_turns(ours, ckpt, g)
    return out


# The synthetic tokenizer is word-level (`w3 w4 ...`) with no chat template: a template
# of its own words.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w5' }} "
    "{{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w5 {% endif %}"
)


def two_turns(model, ckpt, g: int) -> dict:
    """A 2-turn `Chat` on `model`: what each turn's prompt held, reused and prefilled."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    from llama_tp.conversation.chat import Chat

    # the folder's own tokenizer.json, as the class it was written for: transformers 5
    # picks the class from config.json's model type (Qwen3.5's BPE class, which encodes
    # these words to nothing)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(ckpt.path) / "tokenizer.json"),
        bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )  # fmt: skip
    hf.chat_template = CHAT_TEMPLATE
    tok = TokenizerWrapper(hf)
    chat = Chat(model, tok, max_tokens=g, temp=0.0)
    turns = []
    for message in ("w10 w11 w12 w13 w14 w15 w16 w17", "w20 w21 w22 w23"):
        chat.send(message)
        s = chat.last_stats
        turns.append(
            {
                k: getattr(s, k)
                for k in (
                    "prompt_tokens",
                    "reused_tokens",
                    "prefilled_tokens",
                    "generated_tokens",
                    "context_tokens",
                )
            }  # fmt: skip
        )
    first, second = turns
    only_new = second["prefilled_tokens"] == second["prompt_tokens"] - first["context_tokens"]
    return {"turns": turns, "second_turn_prefills_only_new_tokens": only_new}


def _row(name: str, r: dict, engine: str = "llama_tp") -> str:
    x = r[engine]
    peak = " / ".join(f"{v:.2f}" for v in x["peak_memory_gb"])
    rss = " / ".join(f"{v:.2f}" for v in x.get("max_rss_gb", [])) or "-"
    load = x.get("expert_load", {}).get("routes_by_expert")
    share = " / ".join(f"{100 * n / sum(load):.1f}%" for n in load) if load else "-"
    return (
        f"| {name} | {x['prompt_tps']:.1f} | {x['generation_tps']:.2f} | {peak} | {rss} | {share} |"
    )


def one_process(path: str, args) -> dict:
    """`interleaved` in a child process with the one process's BLAS setup."""
    cmd = [PY, __file__, "--one-process", path, "--rounds", str(args.rounds)]
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
    """The section "Mixture of experts" of docs/benchmarks.md, from the results."""
    runs, targets = res["runs"], res["targets"]
    name = res.get("section", NAME)
    cmd = "python bench/moe.py" + (
        "" if name == NAME else f" --spec {res['spec']} --section {name}"
    )
    md = [f"### Mixture of experts: synthetic `{res['spec']}` against mlx-lm", ""]
    md += [
        f"Generated by `{cmd}` (raw results: [benchmarks/{name}.json](benchmarks/{name}.json)).",
        "",
    ]
    head = "| run | prompt tok/s | gen tok/s | MLX peak GB per rank | max RSS GB per rank | "
    head += "routes per rank (by expert) |"
    md += [head, "|" + "---|" * 6]
    for name, r in runs.items():
        if name == "1 process, interleaved":
            continue
        md.append(_row(f"llama_tp, {name}", r))
        if "mlx_lm" in r and r["mlx_lm"].get("supported"):
            md.append(_row(f"mlx-lm, {name.split(',')[0]}", r, "mlx_lm"))
    g = runs["1 process, interleaved"]["generation_tps"]
    md += [
        "",
        f"One process, {res['rounds']} interleaved rounds: llama_tp {g['llama_tp']:.2f}, "
        f"mlx-lm {g['mlx-lm']:.2f} generated tok/s (medians).",
        *_chat_lines(runs["1 process, interleaved"].get("chat")),
        "",
        *(f"- {k}: {_figure(v)}" for k, v in targets.items()),
        "",
        sections.facts_line(res),
    ]
    return "\n".join(md)


def _figure(v) -> str:
    return ("yes" if v else "no") if isinstance(v, bool) else f"{v:.3f}"


def _chat_lines(chat: dict | None) -> list[str]:
    if chat is None:  # a results file written before the chat step
        return []
    first, second = chat["turns"]
    return [
        "",
        f"A 2-turn `Chat` in the same process: the first turn prefilled "
        f"{first['prefilled_tokens']} of {first['prompt_tokens']} prompt tokens and held "
        f"{first['context_tokens']} after its reply; the second prefilled "
        f"{second['prefilled_tokens']} of {second['prompt_tokens']} ("
        f"{second['reused_tokens']} reused: "
        + ("only its new tokens)." if chat["second_turn_prefills_only_new_tokens"] else
           "more than its new tokens).")
    ]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="moe-a3b-fp32")
    p.add_argument("-p", type=int, default=128, help="prompt tokens")
    p.add_argument("-g", type=int, default=64, help="generated tokens")
    p.add_argument("-n", type=int, default=3, help="trials")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--rounds", type=int, default=7, help="interleaved 1-process rounds")
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose section to rewrite")
    p.add_argument("--section", default=NAME, help="the section (and results file) to write")
    p.add_argument("--port", type=int, help="the ranks' starting port (default: the launcher's)")
    p.add_argument("--one-process", help=argparse.SUPPRESS)  # the interleaved run's child
    args = p.parse_args()
    if args.one_process:
        print(json.dumps(interleaved(args.one_process, args.rounds, args.p, args.g)))
        return 0
    res = sections.run_facts("bench/moe.py")
    compare = ["--compare", "mlx-lm", "--collective-steps", "0"]
    runs = {
        "1 rank": bench(args.spec, 1, compare, args),
        "2 ranks, by tensor": bench(args.spec, 2, [*compare, "--moe-split", "tensor"], args),
        "2 ranks, by expert": bench(
            args.spec, 2, ["--moe-split", "expert", "--collective-steps", "0"], args
        ),
    }
    one, two = runs["1 rank"], runs["2 ranks, by tensor"]
    runs["1 process, interleaved"] = side = one_process(one["model_path"], args)
    targets = {
        "generation_vs_mlx_lm_1_rank": side["generation_tps_ratio"],
        "chat_second_turn_prefills_only_new_tokens": side["chat"][
            "second_turn_prefills_only_new_tokens"
        ],
        "peak_memory_2_ranks_over_1": max(
            max(r["llama_tp"]["peak_memory_gb"]) for k, r in runs.items() if k.startswith("2")
        )
        / one["llama_tp"]["peak_memory_gb"][0],
        "weights_2_ranks_over_1": max(two["llama_tp"]["weights_gb"])
        / one["llama_tp"]["weights_gb"][0],
        "max_rss_2_ranks_over_1": max(two["llama_tp"]["max_rss_gb"])
        / one["llama_tp"]["max_rss_gb"][0],
    }
    res.update(spec=args.spec, rounds=args.rounds, runs=runs, targets=targets)
    if args.section != NAME:
        res["section"] = args.section
    sections.write_results(args.section, res)
    sections.replace_section(args.section, section(res), Path(args.out))
    print(section(res))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
