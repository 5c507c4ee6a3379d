"""The bench's table on rank 0."""

from __future__ import annotations

from typing import Any


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _fmt_gb(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def traffic_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """One line per rank: its place in the mesh, its messages per generated token
    (group, op, count x bytes), the bytes it sends and its rounds."""
    from ..parallel.plan_text import human_bytes

    lines = []
    for r in ranks:
        msgs = ", ".join(
            f"{m['group']} {m['op']} {m['calls']} x {human_bytes(m['bytes'])}"
            for m in r["messages"]
        )
        lines.append(
            f"rank {r['rank']} (stage {r['stage']}, tensor rank {r['tp_rank']}): "
            f"{msgs or 'none'}; sends {human_bytes(r['bytes_sent'])} in {r['rounds']} rounds"
        )
    return lines


def print_table(r: dict[str, Any]) -> None:
    """The human-readable report (rank 0)."""
    rows = [("llama_tp", r["llama_tp"])]
    ml = r.get("mlx_lm")
    if ml and ml.get("supported"):
        rows.append(("mlx-lm", ml))
    vp = ", vocab-parallel" if r["vocab_parallel"] else ""
    mesh = r["llama_tp"].get("mesh")
    if mesh and mesh["pp"] > 1:
        split = ",".join(map(str, mesh["layers_per_stage"]))
        vp += f"; mesh --tp {mesh['tp']} x --pp {mesh['pp']}, layers {split}"
    blas = "reference BLAS" if r["blas"]["reference"] else (r["blas"]["library"] or "system BLAS")
    print(f"model: {r['model']}  ({r['ranks']} rank{'s' * (r['ranks'] > 1)}{vp}; {blas})")
    print(
        f"prompt {r['prompt_tokens']} tokens, generation {r['generation_tokens']} tokens, "
        f"{r['num_trials']} trials after a warm-up; pinned: {r['pin_core'] or 'no'}"
    )
    head = "| engine | prompt t/s | gen t/s | TTFT ms | load s | peak GB per rank | CPU/wall |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, x in rows:
        print(
            f"| {name} | {x['prompt_tps']:.2f} | {x['generation_tps']:.2f} | "
            f"{1e3 * x['ttft_s']:.1f} | {x['load_time_s']:.2f} | "
            f"{_fmt_gb(x['peak_memory_gb'])} | {x['cpu_per_wall']:.2f} |"
        )
    t = r["llama_tp"]
    _per_rank(
        "llama_tp loading",
        "rank {i} read {b:.1f} MB, peak {g:.2f} GB",
        [(b / 1e6, g) for b, g in zip(t["load_bytes_read"], t["load_peak_memory_gb"], strict=True)],
    )
    if "activation_peak_gb" in t:
        _per_rank(
            "llama_tp run peak above the weights (activations, KV cache)",
            "rank {i} {b:.0f} MB (weights {g:.2f} GB)",
            [(a * 1e3, w) for a, w in zip(t["activation_peak_gb"], t["weights_gb"], strict=True)],
        )
    if "expert_load" in t:
        print(f"llama_tp expert load {t['expert_load']['summary']}")
    if "prefill_collectives" in t:
        per = t["prefill_collectives"]["per_layer"]
        print(
            f"llama_tp prefill ({t['prefill_collectives']['tokens']} tokens) collectives "
            "per layer: " + (", ".join(f"{op} {d['calls']}" for op, d in per.items()) or "none")
        )
    if "ratio" in r:
        q = r["ratio"]
        print(
            f"| llama_tp / mlx-lm | {q['prompt_tps']:.2f}x | {q['generation_tps']:.2f}x | | | | |"
        )
        print(f"greedy tokens identical to mlx-lm's: first {r['same_tokens_as_mlx_lm']}")
    if ml and not ml.get("supported"):
        print(f"mlx-lm: {ml['reason']}")
    c, t = r["llama_tp"]["collectives"], r["llama_tp"]
    other = "sampling, with the next token's embedding row when vocabulary-parallel"
    if mesh and mesh["pp"] > 1:
        other = "sampling, and the hidden state's send or receive between stages"
    per = c["all_reduces_per_layer"]  # None: mlx-lm's classes (the whole step only)
    where = (
        f"{per:.2f} per layer over {t['n_layers']} layers, "
        f"{c['all_reduces_outside_layers']} outside the layers"
        if per is not None
        else f"over {t['n_layers']} layers"
    )
    print(
        f"collectives per token: {c['all_reduces_per_token']} all-reduces ({where}), "
        f"{c['other_collectives_per_token']} other ({other}); "
        f"{c['collective_bytes_per_token'] / 1e3:.1f} KB per rank"
    )
    if r["ranks"] > 1 and "traffic" in t:
        print("per generated token, each rank's messages (count x bytes of one message):")
        for line in traffic_lines(t["traffic"]):
            print(f"  {line}")
    sp = t.get("speculative")
    if sp:
        rate = f"{100 * sp['acceptance_rate']:.1f}% ({sp['accepted']}/{sp['drafted']})"
        print(
            f"speculative ({sp['draft']}, K={sp['k']}): acceptance {rate}, "
            f"{sp['tokens_per_forward']:.2f} tokens per target forward, "
            f"{sp['collectives_per_token']:.1f} collective rounds per token"
        )
    elif mesh and mesh["pp"] > 1:
        print(
            f"collective rounds per token: {t['rounds_per_token']} (the stages one after "
            "the other: each stage's tensor-group rounds, the hops between stages, the "
            "logits' all-reduce)"
        )
    else:
        print(f"collective rounds per token: {t['rounds_per_token']}")
    print(
        f"decode step: {t['decode_step_ms']:.1f} ms, {t['decode_step_ms_no_collectives']:.1f} ms "
        f"with collectives replaced by identity: {100 * t['collective_share']:.0f}% in collectives"
    )


def _per_rank(title: str, item: str, values: list[tuple[float, float]]) -> None:
    """One line: `title: ` and `item` (with {i}, {b}, {g}) for each rank's pair of values."""
    print(f"{title}: " + ", ".join(item.format(i=i, b=b, g=g) for i, (b, g) in enumerate(values)))
