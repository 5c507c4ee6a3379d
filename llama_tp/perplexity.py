"""`python -m llama_tp.perplexity`: a model's perplexity on a text file.

python -m llama_tp.perplexity --text-file tests/data/paris.txt
mlx.launch -n 2 -- python -m llama_tp.perplexity --text-file tests/data/paris.txt
"""

from __future__ import annotations

from .console.command import script, start


def _parser():
    from .console.cli import ArgumentParser, add_load_args, add_quiet_arg

    p = ArgumentParser(
        prog="python -m llama_tp.perplexity",
        description="Perplexity of a model on a text file, on one process or across ranks.",
    )
    p.add_argument("--model", help="GGUF file or Hugging Face/MLX directory (default: built-in)")
    p.add_argument("--text-file", required=True, help="UTF-8 text to score")
    p.add_argument("--context-length", type=int, default=512, help="tokens per window")
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="window step, below --context-length (default: half of it)",
    )
    add_load_args(p)
    p.add_argument(
        "--limit-tokens",
        type=int,
        default=None,
        metavar="N",
        help="score only the text's first N tokens (default: all)",
    )
    add_quiet_arg(p)
    return p


def _check(args) -> None:
    """UsageError for windows that cannot be scored; sets `args.stride`'s default."""
    from .console.cli import UsageError

    if args.context_length < 2:
        raise UsageError(f"--context-length must be at least 2, got {args.context_length}")
    args.stride = args.stride or args.context_length // 2
    if not 0 < args.stride < args.context_length:
        raise UsageError(f"--stride must be in 1..{args.context_length - 1}, got {args.stride}")
    if args.limit_tokens is not None and args.limit_tokens < 2:
        raise UsageError(f"--limit-tokens must be at least 2, got {args.limit_tokens}")


def main() -> int:
    from .cluster.distributed import print0, world
    from .console.cli import UsageError
    from .engine.perplexity import perplexity
    from .loading.loader import default_model, load

    args = start(_parser(), _check)
    try:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--text-file {args.text_file}: {e}") from None
    group = world()
    from .console.cli import model_on_some_rank
    from .parallel.shares import SplitError

    path = args.model or model_on_some_rank(default_model, group)

    try:
        model, tokenizer = load(
            path,
            group,
            not args.no_vocab_parallel,
            args.dtype,
            moe_split=args.moe_split,
            split=args.split,
            weights_cache=args.weights_cache,
        )
    except SplitError as e:  # the same on every rank
        raise UsageError(str(e)) from None
    tokens = tokenizer.encode(text)[: args.limit_tokens]
    result = perplexity(model, tokens, args.context_length, args.stride)
    print0(f"Perplexity: {result.perplexity:.6f}")
    print0(f"Tokens evaluated: {result.tokens}")
    print0(
        f"Tokens per second: {result.tokens_per_second:.1f} ({group.size()} "
        f"rank{'s' * (group.size() > 1)})"
    )
    return 0


cli = script(main)  # the console script

if __name__ == "__main__":
    cli()
