"""`python -m llama_tp.convert`: a checkpoint into an HF / MLX directory or a pre-split one.

    python -m llama_tp.convert --out smollm2-mlx
    python -m llama_tp.convert --model smollm2-mlx --out smollm2-q8 --quantize 8
    python -m llama_tp.convert --model smollm2-mlx --out smollm2-tp2 --shards 2
    python -m llama_tp.convert --model smollm2-mlx --out smollm2-2x2 --shards 4 --tp 2 --pp 2

The conversion itself is `llama_tp.checkpoints.convert`; a split for a tp x pp mesh
(`--pp` > 1) is `llama_tp.loading.mesh_split`.
"""

from __future__ import annotations

from pathlib import Path

from .console.command import script, start


def _parser():
    from .console.cli import ArgumentParser, add_moe_split_arg, add_split_arg

    p = ArgumentParser(
        prog="python -m llama_tp.convert",
        description="Convert a GGUF file, Hugging Face/MLX directory or original Meta "
        "checkpoint into a directory that llama_tp and mlx-lm both load, optionally "
        "quantized, or pre-split into one folder per rank.",
    )
    p.add_argument(
        "--model", help="checkpoint to convert (default: the built-in SmolLM2-135M-Instruct)"
    )
    p.add_argument("--out", required=True, help="output directory (must be empty or new)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.add_argument(
        "--quantize", "-q", type=int, choices=(4, 8), help="quantize to 4 or 8 bits (MLX affine)"
    )
    p.add_argument(
        "--group-size", type=int, choices=(32, 64, 128), default=64, help="values per scale"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="dequantize quantized weights and cast every weight to this type",
    )
    p.add_argument(
        "-d",
        "--dequantize",
        action="store_true",
        help="dequantize quantized weights (to float16 unless --dtype says otherwise)",
    )
    p.add_argument(
        "--shards",
        type=int,
        help="write one folder per rank for a run on this many ranks (with --pp: ranks of "
        "the tp x pp mesh)",
    )
    p.add_argument(
        "--tp",
        type=int,
        help="with --shards: ranks per stage of the tp x pp mesh the folders are for "
        "(default: --shards / --pp)",
    )
    p.add_argument(
        "--pp",
        type=int,
        help="with --shards: pipeline stages of that mesh; folder r holds rank r's stage "
        "(default 1: plain tensor parallelism)",
    )
    p.add_argument(
        "--pp-split",
        metavar="N,N...|W:W...",
        help="with --pp: layers per stage, e.g. 10,12, or weights of the stages' bytes, e.g. "
        "3:1 (default: balanced by parameter bytes)",
    )
    p.add_argument(
        "--no-vocab-parallel",
        action="store_true",
        help="with --shards: keep the embedding and output head whole in every folder",
    )
    add_moe_split_arg(p)
    add_split_arg(p)
    p.add_argument(
        "--quiet", action="store_true", help="no progress bar and no 'wrote' line on stderr"
    )
    return p


def _check(args) -> None:
    """UsageError for an --out that cannot be written and flags that exclude each other;
    `--dequantize` becomes `args.dtype` float16 (unless --dtype says another)."""
    from .console.cli import UsageError

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"--out {out}: directory is not empty (use --force to write into it)")
    if args.shards is not None and args.shards < 1:
        raise UsageError(f"--shards must be at least 1, got {args.shards}")
    args.dtype = args.dtype or ("float16" if args.dequantize else None)
    if args.dtype and args.quantize:
        raise UsageError("--quantize and --dtype/--dequantize exclude each other")
    if args.no_vocab_parallel and args.shards is None:
        raise UsageError("--no-vocab-parallel only applies with --shards")
    mesh = [f for f in MESH if getattr(args, f) is not None]
    if mesh and args.shards is None:
        raise UsageError(f"--{mesh[0].replace('_', '-')} only applies with --shards")
    if args.split is not None and args.shards is None:
        raise UsageError("--split only applies with --shards")


MESH = ("tp", "pp", "pp_split")  # the flags of a tp x pp mesh split


def main() -> int:
    from .checkpoints.convert import convert
    from .console.cli import UsageError
    from .loading.loader import default_model

    args = start(_parser(), _check)
    out, mesh = Path(args.out), any(getattr(args, f) is not None for f in MESH)
    src = Path(args.model) if args.model else default_model()
    from .generic.loader import checkpoint_route

    route = checkpoint_route(src)
    if route is not None and route.generic:  # mlx-lm's classes: pre-split by stage only
        return convert_generic(args, src, out, route)
    kw = dict(quantize=args.quantize, group_size=args.group_size, dtype=args.dtype)
    kw.update(vocab_parallel=not args.no_vocab_parallel, progress=not args.quiet)
    kw.update(moe_split=args.moe_split, split=args.split)
    from .loading.mesh_split import convert_mesh
    from .parallel.mesh import MeshError
    from .parallel.shares import SplitError

    try:
        if not mesh:
            convert(src, out, shards=args.shards, **kw)
        else:
            convert_mesh(
                src, out, shards=args.shards, tp=args.tp, pp=args.pp, pp_split=args.pp_split, **kw
            )
    except (MeshError, SplitError) as e:  # the loader's one-line messages, as usage errors
        raise UsageError(str(e)) from None
    return 0


def convert_generic(args, src: Path, out: Path, route) -> int:
    """`--shards N` of a model on mlx-lm's classes: one folder per pipeline stage."""
    from .console.cli import UsageError
    from .generic.convert import convert_stages
    from .parallel.mesh import MeshError

    pp = args.pp or args.shards
    given = [f for f in ("quantize", "dtype", "dequantize", "split") if getattr(args, f)]
    if args.shards is None or given or (args.tp or 1) != 1 or pp != args.shards:
        raise UsageError(
            f"{route.model_type} runs on mlx-lm's classes: convert pre-splits it by stage only "
            f"(--shards N [--pp N] [--pp-split]); mlx_lm.convert converts and quantizes it"
        )
    try:
        convert_stages(src, out, pp, args.pp_split, progress=not args.quiet)
    except MeshError as e:
        raise UsageError(str(e)) from None
    return 0


cli = script(main)  # the console script

if __name__ == "__main__":
    cli()
