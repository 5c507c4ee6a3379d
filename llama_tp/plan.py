"""`python -m llama_tp.plan --model M -n N`: how a model splits over N ranks, no launch needed.

python -m llama_tp.plan -n 3
python -m llama_tp.plan -n 2 --sequence-parallel
python -m llama_tp.plan -n 4 --tp 2 --pp 2      # the tp x pp mesh (loading/mesh_plan.py)
python -m llama_tp.plan -n 4 --pp 2 --dp 2      # the server's replicas: each one's plan
python -m llama_tp.plan -n 3 --model DIR/config.json   # before downloading: the config alone
python -m llama_tp.plan -n 2 --split 3:1        # rank 0 takes 3/4 (parallel/shares.py)
python -m llama_tp.plan --synthetic 70b-q4 -n 2 # a model's shape, no weights needed
"""

from __future__ import annotations

from pathlib import Path

from .console.command import script, start


def _parser():
    from .console.cli import ArgumentParser, add_mesh_args, add_moe_split_arg, add_split_arg

    p = ArgumentParser(
        prog="python -m llama_tp.plan",
        description="Show how a model's heads, feed-forward columns and weight bytes "
        "split over N ranks.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        help="GGUF file, Hugging Face/MLX directory, or a model's config.json alone (its "
        "tensors' shapes, nothing downloaded) (default: built-in)",
    )
    src.add_argument(
        "--synthetic",
        metavar="SIZE-DTYPE",
        help="the shape of a synthetic model instead, e.g. 70b-q4 (Llama-3-70B's shape, MLX "
        "4-bit): its tensors' shapes written once into the cache, no weights",
    )
    p.add_argument(
        "--gguf-quant",
        metavar="MIX",
        help="with --model DIR/config.json: plan a GGUF of llama.cpp's quantization mix MIX "
        "(Q4_K_M, Q5_K_M) of it, as the loader would hold it",
    )
    p.add_argument("-n", type=int, required=True, help="number of ranks")
    p.add_argument(
        "--no-vocab-parallel", action="store_true", help="the plan with a whole embedding and head"
    )
    p.add_argument(
        "--sequence-parallel", action="store_true", help="the plan with sequence parallelism"
    )
    add_mesh_args(p)  # the ranks are -n's; with --dp, each replica's plan
    add_moe_split_arg(p)
    add_split_arg(p)
    return p


def _check(args) -> None:
    """UsageError for a mesh or split that cannot be; sets `args.mesh` (ranks per tensor
    group, stages) and `args.weights` (the split's)."""
    from .console.cli import UsageError
    from .parallel.mesh import MeshError, mesh_shape
    from .parallel.shares import SplitError, fixed_weights

    if args.n < 1:
        raise UsageError(f"-n must be at least 1, got {args.n}")
    try:
        args.mesh = tp, stages = mesh_shape(args.n, args.tp, args.pp, args.dp)
        if args.pp_split and stages == 1:
            raise MeshError("--pp-split needs --pp (the number of pipeline stages)")
        args.weights = fixed_weights(args.split, tp, "plan")
    except (MeshError, SplitError) as e:  # the loader's line, a usage error as there
        raise UsageError(str(e)) from None


def main() -> int:
    """`python -m llama_tp.plan --model M -n N`: print the plan, no launch needed."""
    from .console.cli import UsageError
    from .parallel.shares import SplitError

    args = start(_parser(), _check)
    tp, stages = args.mesh
    if (args.dp or 1) > 1:
        print(replicas_line(args.n, args.dp))
        args.n //= args.dp
    if generic_route(args) is not None:  # mlx-lm's classes (generic/): stages and bytes
        return print_generic(args, tp, stages)
    if stages > 1:
        if args.sequence_parallel:
            raise UsageError("--tp/--pp take the built-in plan, without --sequence-parallel")
        return print_mesh(args)

    # Reading shapes is lazy: no weight is loaded to print the plan.
    from .checkpoints.build import skeleton
    from .checkpoints.slices import model_shape
    from .parallel.parallelize import format_plan_table
    from .parallel.placement import kv_cache_bytes, place, state_bytes
    from .parallel.plan_text import format_plan
    from .parallel.shard import builtin_plan

    ckpt = _open(model_path(args), args.gguf_quant)
    shape = model_shape(ckpt)
    try:
        placement = place(
            shape,
            args.n,
            vocab_parallel=not args.no_vocab_parallel,
            moe_split=args.moe_split,
            split=args.weights,
        )
    except SplitError as e:  # the loader's line, a usage error as there
        raise UsageError(str(e)) from None
    model = skeleton(ckpt)  # for the style table: lazy, nothing read
    styles = builtin_plan(model, placement, sequence_parallel=args.sequence_parallel)
    print(f"{ckpt.path.name}: the plan (path -> style -> each rank's slice)")
    print(format_plan_table(model, styles, args.n))
    print()
    print(f"{ckpt.path.name}:")
    a = ckpt.args
    print(
        format_plan(
            placement.plan,
            [r.nbytes for r in placement.ranks],
            [r.vocab for r in placement.ranks],
            [kv_cache_bytes(shape, r) for r in placement.ranks],
            (a.kv_lora_rank, a.qk_rope_head_dim) if a.kv_lora_rank else None,
            _sliding(a),
            [state_bytes(shape, r) for r in placement.ranks],
        )
    )
    _print_shared(ckpt.args)
    _print_indexer(ckpt.args, shape)
    _print_chunked(ckpt.args)
    _print_headwise(ckpt.args)
    _print_kimi_k3(ckpt.args)
    if args.n > 1:
        _print_wide_qk_norm(ckpt.args)
        _print_mamba(ckpt.args)
    if ckpt.format == "gguf":
        from .checkpoints.gguf import split_notes

        for note in [*ckpt.notes, *split_notes(ckpt, placement.plan)]:
            print(note)
    elif ckpt.format == "config":  # a GGUF mix planned from the config (--gguf-quant)
        for note in ckpt.notes:
            print(note)
    print(f"Runs {path_line(ckpt)}")
    return 0


def path_line(ckpt) -> str:
    """'native: model_type 'llama' is implemented natively' (or a GGUF architecture)."""
    from .generic.classes import path_line as line

    return line(ckpt)


def generic_route(args):
    """The route of --model when mlx-lm's classes run it (None: native, or not a folder)."""
    if args.synthetic or not args.model:
        return None
    from .generic.loader import checkpoint_route

    route = checkpoint_route(args.model)
    return route if route is not None and route.generic else None


def print_generic(args, tp: int, pp: int) -> int:
    """The plan of a model on mlx-lm's classes (`generic/plan.py`): no launch, nothing read."""
    from .console.cli import UsageError
    from .generic.plan import plan_lines
    from .generic.tensor import TensorSplitError
    from .parallel.mesh import MeshError
    from .parallel.shares import SplitError, parse_split

    try:
        weights = parse_split(args.split, pp) if args.split and pp > 1 and tp == 1 else None
        if args.split and weights is None:
            raise SplitError(
                f"--split {args.split}: mlx-lm's classes split tensors evenly; "
                "weigh pipeline stages with --pp and --split instead"
            )
        print("\n".join(plan_lines(Path(args.model), tp, pp, args.pp_split, weights)))
    except (MeshError, SplitError, TensorSplitError) as e:
        raise UsageError(str(e)) from None
    return 0


def _print_shared(a) -> None:
    """The KV-shared layers' line (Gemma 4's last layers), if the model has any."""
    from .models.registry import layer_specs

    shared = sum(s.cache is not None and s.cache.kind == "shared" for s in layer_specs(a))
    if shared:
        print(
            f"{shared} of {a.n_layers} layers attend over an earlier layer's keys and values "
            "(KV-shared): no cache of their own, and each stays on its source's stage"
        )


def _print_indexer(a, shape, staged: bool = False) -> None:
    """Sparse attention's line (DeepSeek-V3.2, GLM-5): its indexer replicated, with what
    that costs every rank (`staged`: every rank of a stage, for the stage's layers)."""
    if "index_topk" not in a.extra:
        return
    from .parallel.plan_text import human_bytes

    held = sum(b for name, (_, b) in shape.tensors.items() if ".attention.indexer." in name)
    whom = (
        "every rank of a stage holds its layers' part of its" if staged else "every rank holds its"
    )
    print(
        f"sparse attention: each query attends to the top {a.index_topk} keys its lightning "
        f"indexer ({a.index_n_heads} heads of {a.index_head_dim}) picks; the indexer is "
        f"replicated, so {whom} {human_bytes(held)} of weights and caches its "
        f"{a.index_head_dim} key values per token and layer (in the KV cache above)"
    )


def _print_chunked(a) -> None:
    """Llama 4's line: its chunked-attention layers and global layers without RoPE."""
    from .models.registry import layer_specs

    chunked = sum(s.cache is not None and s.cache.kind == "chunked" for s in layer_specs(a))
    if "rope_layers" not in a.extra:
        return
    nope = a.rope_layers.count(0)
    if chunked:
        print(
            f"chunked attention: {chunked} of {a.n_layers} layers attend within chunks of "
            f"{a.attention_chunk_size} positions (their caches hold the current chunk, in "
            f"the KV cache above at 1000 tokens); {nope} global layers without RoPE"
        )
    else:
        print(f"{nope} of {a.n_layers} layers attend without RoPE (global attention)")


def _print_headwise(a) -> None:
    """Step-3.5's line: its sliding layers' own heads and the head-wise gates."""
    if "swa_heads" not in a.extra:
        return
    nh, nkv = a.swa_heads
    n = sum(t == "sliding_attention" for t in a.layer_types)
    gate = "; each head's output gated by sigmoid(g_proj(x)), split with its heads"
    print(
        f"{n} of {a.n_layers} layers slide over {nh} query / {nkv} KV heads of their own, "
        f"split apart from the global layers' (a KV head two ranks' query heads need is "
        f"held by both){gate if a.headwise_gate else ''}"
    )


def _print_kimi_k3(a) -> None:
    """Kimi K3's line: its fused KDA, its latent experts' sum before their norm, the
    attention residuals' block states."""
    if a.model_type != "kimi_k3":
        return
    latent, size = a.routed_expert_hidden_size, a.attn_res_block_size
    experts = (
        f"experts in a latent width of {latent}: the routed and shared partial sums "
        f"all-reduced together before the latent's norm (one all-reduce per layer)"
        if latent
        else "experts summed once per layer"
    )
    blocks = (
        f"attention residuals over blocks of {size} layers: a pipeline stage hands on "
        f"the block states begun before it beside h ({a.dim} values each, per position)"
        if size
        else "no attention residuals"
    )
    print(
        f"Kimi K3: fused KDA (q | k | v in one projection and one conv, split by heads as "
        f"3 segments; {a.kda_heads} heads of {a.kda_head_dim}); {experts}; {blocks}"
    )


def _print_wide_qk_norm(a) -> None:
    """MiniMax-M2's line: q/k norms over all heads, one more small all-reduce per layer."""
    if "wide_qk_norm" not in a.extra:
        return
    print(
        f"q/k norms over all heads ({a.n_heads * a.head_dim} query, "
        f"{a.n_kv_heads * a.head_dim} key values): split by heads, each rank's sums of "
        f"squares are all-reduced, 2 float32 values per token in each of {a.n_layers} "
        "layers (one more collective per layer)"
    )


def _print_mamba(a) -> None:
    """Nemotron-H's line: how its Mamba-2 layers split (whole groups, or one group's norm
    reduced over the ranks)."""
    if "ssm_state" not in a.extra or "M" not in a.pattern:
        return
    layers, nh, ng = a.pattern.count("M"), a.mamba_num_heads, a.n_groups
    how = (
        f"in whole groups of {nh // ng} heads (a group's B, C and gated norm on one rank)"
        if ng > 1
        else "anywhere: the one group's B and C on every rank, its gated norm's sum of "
        "squares all-reduced (one float32 value per token and layer, one more collective)"
    )
    print(
        f"Mamba-2 ({layers} of {a.n_layers} layers): {nh} heads of {a.mamba_head_dim} "
        f"in {ng} group{'s' if ng > 1 else ''} of {a.ssm_state} state values, split by heads "
        f"{how}; each rank holds its heads' conv and scan state"
    )


def _sliding(a) -> tuple[int, int, int] | None:
    """(sliding-window layers, layers, window) of a model with some (gpt-oss, Gemma),
    else None; a KV-shared sliding layer holds no window of its own."""
    from .models.registry import layer_specs

    specs = layer_specs(a)
    n = sum(s.cache is not None and s.cache.kind == "rotating" for s in specs)
    return (n, a.n_layers, a.sliding_window) if n else None


def _open(model: str | Path, gguf_quant: str | None = None):
    """The checkpoint at `model`, or a model's `config.json` alone: the plan of the tensors
    it implies (as a GGUF of the mix `gguf_quant`), before downloading them."""
    from .checkpoints import open_checkpoint
    from .checkpoints.config_only import read_config_only
    from .console.cli import UsageError
    from .loading.kernel_choice import kernels_here

    path = Path(model)
    if path.name == "config.json" and path.is_file():
        return read_config_only(path, gguf_quant)
    if gguf_quant:
        raise UsageError("--gguf-quant plans from a config.json alone: --model DIR/config.json")
    # a GGUF's types as the loader here holds them: as stored with the native kernels,
    # converted elsewhere (MLX's GPU, no kernels)
    return open_checkpoint(path, blocks=kernels_here())


def model_path(args):
    """--model, the shapes of --synthetic SIZE-DTYPE (`benchmarks/synthetic.py`), or the
    built-in model."""
    from .loading.loader import default_model

    if args.synthetic:
        from .benchmarks.synthetic import synthetic_dir
        from .console.cli import UsageError

        try:
            return synthetic_dir(args.synthetic, shapes_only=True)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return args.model or default_model()


def replicas_line(n: int, dp: int) -> str:
    """'2 replicas (serve --dp 2) of 2 ranks each: ranks 0-1 | 2-3; ...' (rank order, as on
    one host: parallel/mesh.py places replicas in host order)."""
    per = n // dp
    blocks = " | ".join(
        f"{d * per}-{d * per + per - 1}" if per > 1 else str(d * per) for d in range(dp)
    )
    return (
        f"{dp} replicas (serve --dp {dp}) of {per} rank{'s' * (per > 1)} each: ranks {blocks} "
        "(in rank order, as on one host); the plan of each, its ranks numbered from 0:"
    )


def print_mesh(args) -> int:
    """The tp x pp mesh: each rank's stage, layers, tensor rank and slice, then each
    stage's plan table (loading/mesh_plan.py)."""
    from .checkpoints.slices import model_shape
    from .console.cli import UsageError
    from .loading.mesh_plan import format_mesh, mesh_plan
    from .parallel.mesh import MeshError
    from .parallel.shares import SplitError

    ckpt = _open(model_path(args))
    try:
        mp = mesh_plan(
            ckpt,
            args.n,
            args.tp,
            args.pp,
            args.pp_split,
            not args.no_vocab_parallel,
            moe_split=args.moe_split,
            split=args.weights,
        )
    except (MeshError, SplitError) as e:
        raise UsageError(str(e)) from None
    print(format_mesh(mp, ckpt.path.name))
    _print_shared(ckpt.args)
    _print_indexer(ckpt.args, model_shape(ckpt), staged=True)
    _print_chunked(ckpt.args)
    _print_headwise(ckpt.args)
    _print_wide_qk_norm(ckpt.args)
    if ckpt.format == "gguf":
        from .checkpoints.gguf import split_notes

        print()
        for note in [*ckpt.notes, *split_notes(ckpt, mp.placement.plan)]:
            print(note)
    print(f"Runs {path_line(ckpt)}")
    return 0


cli = script(main)  # the console script

if __name__ == "__main__":
    cli()
