"""The partition plan as text: one row per rank (heads, feed-forward columns, experts,
bytes), the shorthand of its ranges, and byte counts. Pure Python, as the plan."""

from __future__ import annotations

from .partition import Plan, RankPart
from .shares import split_text


def format_ranges(items: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def format_kv_heads(kv: range, replicated: dict[int, list[int]]) -> str:
    """KV heads as ranges, replicated heads listed singly with a '*'."""
    out, run = [], []
    for h in kv:
        if h in replicated:
            if run:
                out.append(format_ranges(run))
                run = []
            out.append(f"{h}*")
        else:
            run.append(h)
    if run:
        out.append(format_ranges(run))
    return ",".join(out)


def human_bytes(nbytes: int) -> str:
    x = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return 100.0 * (max(values) - min(values)) / mean if mean else 0.0


def share_line(weights: tuple[float, ...] | None, nbytes: list[int]) -> str:
    """'imbalance: 0.4% of weight bytes' (balanced), or for a weighted split what each
    rank holds against its weight: 'split 3:1 (75.0% / 25.0%): weight bytes 74.1% /
    25.9%' (replicated tensors, norms and routers, keep it off the weights)."""
    if weights is None:
        return f"imbalance: {imbalance(nbytes):.1f}% of weight bytes"
    got = " / ".join(f"{100 * b / sum(nbytes):.1f}%" for b in nbytes)
    return f"{split_text(weights)}: weight bytes {got}"


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1} [{len(r)}]" if len(r) else "-"


def expert_header(plan: Plan) -> list[str]:
    """The columns a mixture-of-experts plan adds to a rank's row (none for a dense one)."""
    if plan.experts is None:
        return []
    return ["experts", "expert columns"] + (["shared columns"] if plan.experts.shared_dim else [])


def expert_cells(plan: Plan, part: RankPart) -> list[str]:
    """A rank's experts, its columns of each, and its shared-expert columns."""
    if plan.experts is None:
        return []
    cells = [_span(part.experts), _span(part.expert_ffn)]
    return cells + ([_span(part.shared_ffn)] if plan.experts.shared_dim else [])


def expert_line(plan: Plan) -> str:
    """'; 7 experts (top 2 per token) of 48 columns, split by expert' (none when dense)."""
    e = plan.experts
    if e is None:
        return ""
    shared = f" + a shared expert of {e.shared_dim}" if e.shared_dim else ""
    return f"; {e.n_experts} experts of {e.hidden_dim} columns{shared}, split by {e.split}"


def cache_line(
    cache_per_rank: list[int],
    latent: tuple[int, int] | None,
    sliding: tuple[int, int, int] | None = None,
) -> str:
    """'KV cache per 1,000 tokens: rank 0 1.50 MiB, ...' and what it holds. `sliding`:
    (sliding-window layers, layers, window) when some layers attend to a window only."""
    ranks = ", ".join(f"rank {i} {human_bytes(b)}" for i, b in enumerate(cache_per_rank))
    if latent is None and sliding:
        n, total, window = sliding
        return (
            f"KV cache per 1,000 tokens: {ranks} (keys and values of its KV heads; {n} of "
            f"{total} layers slide over a window of {window} tokens: their cache holds "
            f"{window} tokens at most, whatever the length)"
        )
    if latent is None:
        return f"KV cache per 1,000 tokens: {ranks} (keys and values of its KV heads)"
    rank, rope = latent
    return (
        f"KV cache per 1,000 tokens: {ranks} (every rank caches the whole latent, "
        f"{rank} + {rope} RoPE values per token and layer, as one process does)"
    )


def state_line(
    state_per_rank: list[int], what: str = "conv and delta-rule states of its linear-attention"
) -> str:
    """'Recurrent state per sequence: rank 0 1.50 MiB, ...': what a rank's recurrent
    layers hold whatever the length (`what`: their heads' conv and delta-rule states, or
    a Mamba-2 layer's conv and scan states)."""
    ranks = ", ".join(f"rank {i} {human_bytes(b)}" for i, b in enumerate(state_per_rank))
    return f"Recurrent state per sequence: {ranks} (the {what} heads, whatever the length)"


def format_plan(
    plan: Plan,
    bytes_per_rank: list[int] | None = None,
    vocab: list[range | None] | None = None,
    cache_per_rank: list[int] | None = None,
    latent: tuple[int, int] | None = None,
    sliding: tuple[int, int, int] | None = None,
    state_per_rank: list[int] | None = None,
) -> str:
    """Human-readable table of the plan, one row per rank (each kind's units: heads,
    columns, experts, a kind's own; with each rank's vocabulary
    rows when `vocab` says them), then the imbalance, or the shares of a weighted split,
    and each rank's KV cache. `latent`: (kv_lora_rank, qk_rope_head_dim) of multi-head
    latent attention, whose heads share one cached latent (no KV heads); `sliding`:
    (sliding-window layers, layers, window) (`cache_line`). `state_per_rank`: each rank's
    fixed recurrent state, part of `cache_per_rank`, printed on its own line."""
    replicated = plan.replicated_kv_heads()
    kv_header = [] if latent else ["kv heads"]
    kinds = [u.what for u in plan.units]  # the kinds' own units (linear-attention heads...)
    header = ["rank", "q heads", *kv_header, "ffn columns", *expert_header(plan), *kinds]
    vocab = vocab if vocab and all(v is not None for v in vocab) else None
    if vocab is not None:
        header.append("vocabulary rows")
    if bytes_per_rank is not None:
        header.append("weights")
    rows = [header]
    for p in plan.parts:
        q = format_ranges(list(p.q_heads)) + ("" if p.kv_map is None else " (mapped)")
        kv = [] if latent else [f"{format_kv_heads(p.kv_heads, replicated)} [{len(p.kv_heads)}]"]
        row = [
            str(p.rank),
            f"{q} [{len(p.q_heads)}]",
            *kv,
            _span(p.ffn),
            *expert_cells(plan, p),
            *(_span(p.unit(u.name)) for u in plan.units),
        ]
        if vocab is not None:
            row.append(_span(vocab[p.rank]))
        if bytes_per_rank is not None:
            row.append(human_bytes(bytes_per_rank[p.rank]))
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    heads = (
        f"{plan.n_heads} heads of latent attention (v_head_dim {plan.head_dim})"
        if latent
        else f"{plan.n_heads} query / {plan.n_kv_heads} KV heads (head_dim {plan.head_dim})"
    )
    lines = [
        f"{plan.n} ranks: {heads}, hidden_dim {plan.hidden_dim}"
        + (f", group_size {plan.group_size}" if plan.group_size else "")
        + f"; attention {'even' if plan.even_attention else 'uneven'}, "
        f"feed-forward {'even' if plan.even_ffn else 'uneven'}" + expert_line(plan)
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if replicated:
        lines.append("* replicated KV head; (mapped): query heads use an explicit KV map")
    if bytes_per_rank is not None:
        lines.append(share_line(plan.weights, bytes_per_rank))
    elif plan.weights is not None:
        counts = " / ".join(str(len(p.q_heads)) for p in plan.parts)
        lines.append(f"{split_text(plan.weights)}: query heads {counts}")
    else:
        counts = [len(p.q_heads) for p in plan.parts]
        lines.append(f"imbalance: {imbalance(counts):.1f}% of query heads")
    if cache_per_rank is not None:
        state = state_per_rank if state_per_rank and any(state_per_rank) else None
        if state:  # the KV cache line: what grows with the tokens
            cache_per_rank = [c - s for c, s in zip(cache_per_rank, state, strict=True)]
        lines.append(cache_line(cache_per_rank, latent, sliding))
        if state and any(u.name == "ssm_heads" for u in plan.units):
            lines.append(state_line(state, "conv and scan states of its Mamba-2"))
        elif state:
            lines.append(state_line(state))
    return "\n".join(lines)
