"""The section "llama_tp against mlx-lm" of docs/benchmarks.md and its plot, from
bench/versus_mlx_lm.py's results."""

from __future__ import annotations

from pathlib import Path

_COLORS = {
    ("llama_tp", "reference"): "tab:blue",
    ("llama_tp", "openblas"): "tab:green",
    ("mlx-lm", "reference"): "tab:red",
    ("mlx-lm", "openblas"): "tab:orange",
}
_DEFAULTS = {"launcher": "direct", "copies": 1, "blas_threads": True}


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r["result"]]


def _get(run: dict, key: str):
    return run.get(key, _DEFAULTS[key])


def _plain(run: dict) -> bool:
    """A row of the main matrix: not mlx.launch, not concurrent copies, not unlimited threads."""
    launched = run["launcher"] == "mlx.launch" and run["ranks"] > 1
    return not launched and _get(run, "copies") == 1 and _get(run, "blas_threads")


def _find(rows: list[dict], label: str, ranks: int, blas: str, pin: bool, **special):
    """The result of the plain row with these settings, or of the special one `special` names."""
    for row in _ok(rows):
        r = row["run"]
        if (r["label"], r["ranks"], r["blas"], r["pin"]) != (label, ranks, blas, pin):
            continue
        if special and all(_get(r, k) == v for k, v in special.items()):
            return row["result"]
        if not special and _plain(r):
            return row["result"]
    return None


def _series(rows: list[dict]) -> dict[tuple, list[tuple[int, float]]]:
    """(model, engine, blas, pinned) -> [(ranks, generation tokens/s)], plain rows only."""
    out: dict[tuple, list[tuple[int, float]]] = {}
    for row in _ok(rows):
        run, res = row["run"], row["result"]
        if not _plain(run):
            continue
        key = (run["label"], "llama_tp", run["blas"], run["pin"])
        out.setdefault(key, []).append((run["ranks"], res["llama_tp"]["generation_tps"]))
        ml = res.get("mlx_lm")
        if ml and ml.get("supported"):
            key = (run["label"], "mlx-lm", run["blas"], run["pin"])
            out.setdefault(key, []).append((run["ranks"], ml["generation_tps"]))
    return out


def write_plot(data: dict, path: Path) -> None:
    """Generation tokens/s against rank count, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(data["rows"])
    models = list(dict.fromkeys(k[0] for k in series))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for (m, engine, blas, pinned), points in sorted(series.items()):
            if m != model:
                continue
            points.sort()
            label = f"{engine}, {'OpenBLAS' if blas == 'openblas' else 'ref. BLAS'}"
            label += ", pinned 1 core/rank" if pinned else ""
            xs, ys = zip(*points, strict=True)
            style = ":" if pinned else "-" if engine == "llama_tp" else "--"
            color = _COLORS[engine, blas]
            ax.plot(xs, ys, style, color=color, marker="s" if pinned else "o", label=label)
        ax.set_title(model)
        ax.set_xlabel("ranks")
        ax.set_xticks(sorted({x for k, p in series.items() if k[0] == model for x, _ in p}))
        ax.set_ylabel("generation tokens/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gb(values: list[float] | None) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "-"


def _settings(run: dict) -> str:
    blas = "OpenBLAS" if run["blas"] == "openblas" else "reference"
    if run["blas"] == "openblas" and not _get(run, "blas_threads") and run["ranks"] > 1:
        blas += " (threads unlimited)"
    if _get(run, "copies") > 1:
        where = f"{run['copies']} independent processes at once"
    else:
        where = "1 process" if run["ranks"] == 1 else run["launcher"]
    pinned = "yes" if run["pin"] else "no"
    return f"| {run['label']} | {run['ranks']} | {blas} | {where} | {pinned} |"


def _speed_row(row: dict) -> str:
    run, res = row["run"], row["result"]
    if "error" in res:
        return _settings(run) + f" failed: {res['error']} |" + " |" * 7
    lt, ml = res["llama_tp"], res.get("mlx_lm") or {}
    gen = f"{lt['generation_tps']:.2f}"
    if res.get("copies_generation_tps"):
        gen = " + ".join(f"{g:.2f}" for g in res["copies_generation_tps"])
    if ml.get("supported"):
        mlx = f"{ml['prompt_tps']:.2f} | {ml['generation_tps']:.2f} | "
        mlx += f"{res['ratio']['generation_tps']:.2f}x"
    elif ml:
        mlx = "- | - | not supported"
    else:
        mlx = "- | - | -"
    return (
        f"{_settings(run)} {lt['prompt_tps']:.2f} | {gen} | {mlx} | "
        f"{1e3 * lt['ttft_s']:.0f} | {lt['cpu_per_wall']:.2f} | {_load(res)} |"
    )


def _load(res: dict) -> str:
    return f"{res['load_before']:.1f}" if "load_before" in res else "-"


def _memory_row(row: dict) -> str:
    run, res = row["run"], row["result"]
    if "error" in res or _get(run, "copies") > 1:
        return ""
    lt, ml = res["llama_tp"], res.get("mlx_lm") or {}
    c = lt["collectives"]
    return (
        f"{_settings(run)} {_gb(lt['load_peak_memory_gb'])} | {_gb(lt['peak_memory_gb'])} | "
        f"{_gb(ml.get('load_peak_memory_gb'))} | {_gb(ml.get('peak_memory_gb'))} | "
        f"{c['all_reduces_per_token']} ({c['all_reduces_per_layer']:.2f}) | "
        f"{c['other_collectives_per_token']} | {c['collective_bytes_per_token'] / 1e3:.1f} | "
        f"{lt['decode_step_ms']:.0f} | {lt['decode_step_ms_no_collectives']:.0f} | "
        f"{100 * lt['collective_share']:.0f}% |"
    )


def _s(n: int) -> str:
    return f"{n} rank{'s' * (n > 1)}"


def _findings(rows: list[dict]) -> list[str]:
    """The targets of issue #9 and what explains the figures, as measured in this run."""
    out = []
    for label in dict.fromkeys(r["run"]["label"] for r in rows):
        for blas in ("reference", "openblas"):
            for n in (1, 2):
                res = _find(rows, label, n, blas, False)
                if not res or not res.get("mlx_lm"):
                    continue
                lt, ml = res["llama_tp"], res["mlx_lm"]
                if not ml.get("supported"):
                    out.append(f"{label}, {_s(n)}: {ml['reason']}")
                    continue
                line = (
                    f"{label}, {_s(n)}, {blas} BLAS: llama_tp generates at "
                    f"{res['ratio']['generation_tps']:.2f}x mlx-lm's speed "
                    f"({lt['generation_tps']:.2f} vs {ml['generation_tps']:.2f} tokens/s), "
                    f"prompt at {res['ratio']['prompt_tps']:.2f}x; greedy tokens equal for the "
                    f"first {res['same_tokens_as_mlx_lm']} of {len(lt['tokens'])}"
                )
                if n > 1:
                    line += (
                        f"; peak memory per rank while loading {max(lt['load_peak_memory_gb']):.2f}"
                        f" GB vs mlx-lm's {max(ml['load_peak_memory_gb']):.2f} GB"
                    )
                out.append(line)
            one, two = _find(rows, label, 1, blas, True), _find(rows, label, 2, blas, True)
            if one and two:
                g1, g2 = one["llama_tp"]["generation_tps"], two["llama_tp"]["generation_tps"]
                line = (
                    f"{label}, {blas} BLAS, scaling: 2 ranks pinned to cores 0 and 1 generate "
                    f"{g2:.2f} tokens/s, 1 rank pinned to core 0 {g1:.2f}: {g2 / g1:.2f}x "
                    "(target >= 1.6x)"
                )
                copies = _find(rows, label, 1, blas, True, copies=2)
                if copies:
                    each = copies["copies_generation_tps"]
                    line += (
                        f". Two independent 1-rank processes at once, on cores 0 and 1, generate "
                        f"{' and '.join(f'{g:.2f}' for g in each)} tokens/s: alone on the "
                        f"machine each would do {g1:.2f}, so sharing the machine (memory "
                        f"bandwidth, caches) bounds 2 ranks at about {sum(each) / g1:.2f}x "
                        "before any communication"
                    )
                out.append(line)
        for n in (1, 2):
            ref, ob = (
                _find(rows, label, n, "reference", False),
                _find(rows, label, n, "openblas", False),
            )
            if ref and ob:
                a, b = ref["llama_tp"], ob["llama_tp"]
                out.append(
                    f"{label}, {_s(n)}: OpenBLAS changes generation from "
                    f"{a['generation_tps']:.2f} to {b['generation_tps']:.2f} tokens/s and prompt "
                    f"from {a['prompt_tps']:.2f} to {b['prompt_tps']:.2f} tokens/s; generated "
                    f"tokens {'identical' if a['tokens'] == b['tokens'] else 'differ'}"
                )
        limited = _find(rows, label, 2, "openblas", False)
        unlimited = _find(rows, label, 2, "openblas", False, blas_threads=False)
        if limited and unlimited:
            out.append(
                f"{label}, 2 ranks, OpenBLAS: {unlimited['llama_tp']['generation_tps']:.2f} "
                f"tokens/s with OpenBLAS's default threads (one per core in each rank), "
                f"{limited['llama_tp']['generation_tps']:.2f} with OPENBLAS_NUM_THREADS=1"
            )
        launched = _find(rows, label, 2, "reference", False, launcher="mlx.launch")
        direct = _find(rows, label, 2, "reference", False)
        if launched and direct:
            out.append(
                f"{label}, 2 ranks: under mlx.launch {launched['llama_tp']['generation_tps']:.2f} "
                f"tokens/s, started directly {direct['llama_tp']['generation_tps']:.2f}; "
                f"mlx.launch itself used {launched['launcher_cpu_s']:.0f} s of CPU in "
                f"{launched['wall_s']:.0f} s"
            )
    for row in _ok(rows):
        c = row["result"]["llama_tp"]["collectives"]
        if row["run"]["ranks"] > 1 and c["all_reduces_per_layer"] != 2:
            out.append(f"{row['run']['label']}: {c['all_reduces_per_layer']} all-reduces per layer")
    return out


METHOD = [
    "- Random prompt tokens (the same on every rank and for both engines), one warm-up "
    "trial, then `-n` trials; end-of-sequence ignored (greedy decoding for exactly `-g` "
    "tokens). Time to first token = prefill + first token; generation tokens/s = the "
    "tokens after the first over the time after the first. Means over the trials.",
    "- mlx-lm: `mlx_lm.load` (1 rank) or `mlx_lm.utils.sharded_load` (its own tensor "
    "parallelism, as `mlx_lm.benchmark` does) on the same weights (a GGUF is converted "
    "with `llama_tp.convert`), driven through `mlx_lm.generate.generate_step`, timed "
    "the same way. mlx-lm shards only when both head counts divide by the rank count.",
    "- All-reduces per token are counted, not derived: `mx.distributed.all_sum` / "
    "`all_gather` / `all_max` are wrapped while one decode step's graph is built (the "
    "layers look them up at call time). The per-layer figure is counted on each layer "
    "alone; the vocabulary-parallel embedding adds one all-reduce, and the greedy sampler "
    'one all_gather of a (value, index) pair per rank ("other"). KB = bytes each rank '
    "contributes per token.",
    "- Collective share: 16 decode steps timed with the real collectives, then with every "
    "collective replaced by identity (numerically wrong, the same compute), best of two "
    "each: share = 1 - t_identity / t_real.",
    "- Multi-rank rows start the ranks directly (MLX_RANK and a ring hostfile, what "
    "mlx.launch gives them) unless marked mlx.launch: mlx.launch's per-rank I/O threads "
    "select() on the ranks' always-writable stdin and so spin on a CPU core while the ranks "
    "run. Multi-rank OpenBLAS rows set OPENBLAS_NUM_THREADS = cores / ranks unless marked "
    '"threads unlimited". Pinned rows use `--pin-core auto`: every thread of rank r on '
    "core r, OpenBLAS limited to one thread. CPU/wall = CPU seconds of rank 0 per wall "
    "second during the trials (1 = one core busy). Load before = the 1-minute load average "
    "when the row started (other processes on the machine make a row slower and noisier).",
]


def write_report(data: dict, png: str) -> str:
    """The section's markdown; `png`: the plot's path relative to the page."""
    m, rows = data["machine"], data["rows"]
    bp = m["blas_product"]
    flags = " --quick" if data["quick"] else ""
    lines = [
        "## llama_tp against mlx-lm",
        "",
        f"Generated by `.venv/bin/python bench/versus_mlx_lm.py{flags}` (raw results: "
        "[benchmarks/versus-mlx-lm.json](benchmarks/versus-mlx-lm.json)). Each row is one "
        "`python -m llama_tp.bench --json` run ([the bench command](#the-bench-command)).",
        "",
    ]
    if data.get("note"):
        lines += [f"**Conditions:** {data['note']}", ""]
    lines += [
        "### Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu']}, {m['cores']} cores |",
        f"| RAM | {m['ram_gb']:.1f} GB |",
        f"| kernel | {m['kernel']} ({m['os']}) |",
        f"| versions | Python {m['python']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, "
        f"llama_tp {m['llama_tp']}, libopenblas0-pthread {m['openblas'] or 'not installed'} |",
        f"| date | {m['date']}; load average at start {m['load_average'][0]:.2f}; "
        f"matrix run time {m['total_s'] / 60:.1f} min |",
        "",
        "### Method",
        "",
        *METHOD,
        "",
        "### BLAS",
        "",
        f"A (64, 4096) @ (4096, 4096) fp32 product (median of 5): {1e3 * bp['reference_s']:.0f}"
        " ms with MLX's bundled reference BLAS",
    ]
    if bp.get("openblas_s"):
        same = (
            "identical"
            if bp["identical"]
            else f"differ by at most {bp['max_abs_diff']:.3g} (largest value "
            f"{bp['max_abs_value']:.0f}; summation order)"
        )
        lines[-1] += (
            f", {1e3 * bp['openblas_s']:.1f} ms with `LD_PRELOAD={bp['openblas']}` "
            f"({bp['reference_s'] / bp['openblas_s']:.0f}x); results {same}."
        )
    lines[-1] += (
        " Only fp32 products go through BLAS: fp16/bf16 and quantized products use MLX's own "
        "kernels, so OpenBLAS leaves the fp16 model and SmolLM2's quantized layers alone."
    )
    settings = "| model | ranks | BLAS | launch | pinned |"
    lines += [
        "",
        "### Speed",
        "",
        settings + " llama_tp prompt t/s | llama_tp gen t/s | mlx-lm prompt t/s | "
        "mlx-lm gen t/s | gen ratio | TTFT ms | CPU/wall | load before |",
        "|" + "---|" * 13,
        *[_speed_row(r) for r in rows],
        "",
        f"![generation tokens/s against ranks]({png})",
        "",
        "### Memory and collectives",
        "",
        settings + " llama_tp peak GB/rank loading | running | mlx-lm loading | running | "
        "all-reduces/token (per layer) | other | KB/token | decode step ms | "
        "without collectives ms | collective share |",
        "|" + "---|" * 15,
        *[line for r in rows if (line := _memory_row(r))],
        "",
        "### Findings",
        "",
        *[f"- {f}" for f in dict.fromkeys(_findings(rows))],
        "",
        "### Commands",
        "",
        "`$OPENBLAS` is "
        + (f"`{bp['openblas']}`" if bp.get("openblas") else "not installed")
        + "; `ringN.json` is the hostfile mlx.launch writes for N local ranks, "
        '`[["127.0.0.1:5000"], ["127.0.0.1:5001"]]` for N = 2.',
        "",
        "```sh",
        *dict.fromkeys(r["shell"] for r in rows),
        "```",
        "",
    ]
    return "\n".join(lines)
