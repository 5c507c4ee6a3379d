"""What the commands share before and after their own work: the flags (the model's,
sampling, loading, the mesh, drafts) and their checks, argument errors printed by rank 0
only, the exit codes, and loading with the start-up checks. How a command starts and ends
(one `error:` line, its exit code) is `console/command.py`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

import mlx.core as mx

from ..cluster import watchdog
from ..cluster.distributed import agreed, all_gather_object, is_rank0
from ..engine.settings import KEYWORDS, SamplingParams, SettingsError, default

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PEER = watchdog.EXIT_PEER
DEFAULT_TIMEOUT = 60.0  # seconds, for each generation step
DEFAULT_LOAD_TIMEOUT = 600.0  # seconds, for loading, the start-up checks, the prompt


class UsageError(ValueError):
    """Bad command-line input: exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that prints usage errors on rank 0 only (every rank parses the same argv)."""

    def error(self, message: str) -> NoReturn:
        if is_rank0():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)


def add_moe_split_arg(p: argparse.ArgumentParser) -> None:
    """`--moe-split tensor|expert`: how a mixture-of-experts model's experts split."""
    from ..parallel.placement import DEFAULT_MOE_SPLIT

    p.add_argument(
        "--moe-split",
        choices=("tensor", "expert"),
        default=DEFAULT_MOE_SPLIT,
        help="mixture-of-experts models on several ranks: 'tensor' gives every rank a slice "
        "of every expert, 'expert' whole experts per rank (default %(default)s)",
    )


def add_split_arg(p: argparse.ArgumentParser) -> None:
    """`--split 3:1|memory`: each tensor rank's share (parallel/shares.py)."""
    p.add_argument(
        "--split",
        metavar="W:W...|memory",
        default=None,
        help="divide each tensor-parallel group unevenly: one weight per tensor rank, e.g. "
        "3:1 (rank 0 takes 3/4 of the heads, columns, experts and vocabulary rows), or "
        "'memory' (in proportion to each rank's available memory; default: balanced)",
    )


def add_load_args(p: argparse.ArgumentParser) -> None:
    """How the model is loaded and run: --no-vocab-parallel, --dtype, --moe-split, --split
    and --no-compile (every command that loads)."""
    p.add_argument(
        "--no-vocab-parallel",
        action="store_true",
        help="keep the embedding and output head whole on every rank",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        help="dequantize and cast the weights at load (each rank its own slices): on a "
        "Linux CPU float32 with OpenBLAS preloaded is the fast path; default: as stored",
    )
    add_moe_split_arg(p)
    add_split_arg(p)
    p.add_argument(
        "--weights-cache",
        metavar="DIR|none",
        default=None,
        help="where a rank without the model keeps the slices it received, for the next "
        "start (default: $LLAMA_TP_WEIGHTS_CACHE, else ~/.cache/llama_tp/weights; "
        "'none': keep nothing)",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="run each decode step eagerly instead of as one compiled graph (the same "
        "tokens; for comparing, or where compiling fails)",
    )


def apply_compile_flag(args) -> None:
    """`--no-compile`: decode steps eager (engine/step.py); else compiled (the default, or
    LLAMA_TP_COMPILE=0 in the environment)."""
    if getattr(args, "no_compile", False):
        from ..engine.step import set_compile

        set_compile(False)


def add_quiet_arg(p: argparse.ArgumentParser) -> None:
    """`--quiet`: no progress bars (they show on rank 0's terminal only anyway)."""
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bars on stderr (shown only at a terminal, on rank 0)",
    )


def quiet(on: bool) -> None:
    """Apply `--quiet` (see `llama_tp.cluster.progress`)."""
    from ..cluster.progress import set_quiet

    set_quiet(on)


def add_model_args(p: argparse.ArgumentParser, max_tokens: int, draft: bool = True) -> None:
    """The model and sampling flags that generate and chat share (mlx_lm's names);
    `draft=False` leaves out the speculative decoding flags (serve has its own)."""
    p.add_argument(
        "--model",
        help="GGUF file, Hugging Face/MLX directory or hub repo id "
        "(default: the built-in SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=max_tokens,
        help=f"new tokens at most (default {max_tokens})",
    )
    for k in KEYWORDS:
        if k.help:  # the sampling flags every command gives alike, SamplingParams' defaults
            value = default(k.field)
            p.add_argument(k.flag, type=type(value), default=value, help=k.help)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system-prompt", default=None)
    add_load_args(p)
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="in prefill, split the norms and residual stream along the sequence over the "
        "ranks (activation memory outside attention and feed-forward ~1/N)",
    )
    add_mesh_args(p)
    if draft:
        add_draft_args(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="with several ranks: give up when a generation step makes no progress for "
        f"this long, e.g. a stopped peer (default {DEFAULT_TIMEOUT:g}; 0: never)",
    )
    p.add_argument(
        "--load-timeout",
        type=float,
        default=DEFAULT_LOAD_TIMEOUT,
        metavar="SECONDS",
        help="the same for loading, the start-up checks and processing the prompt "
        f"(default {DEFAULT_LOAD_TIMEOUT:g}; 0: never)",
    )
    add_quiet_arg(p)


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    """The tp x pp (x dp) mesh (parallel/mesh.py): --tp, --pp, --pp-split, --dp."""
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="ranks per tensor-parallel group (default: all ranks / --pp)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=None,
        help="pipeline stages, each holding a contiguous range of layers (default 1); "
        "--tp x --pp must be the number of ranks",
    )
    p.add_argument(
        "--pp-split",
        default=None,
        metavar="N,N...|W:W...",
        help="layers per stage, e.g. 10,12, or weights of the stages' bytes, e.g. 3:1 "
        "(default: balanced by parameter bytes)",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel model replicas, each on --tp x --pp ranks (llama_tp.serve only; "
        "default 1)",
    )


def check_mesh_args(args: argparse.Namespace) -> None:
    """UsageError for --pp-split without --pp, and --dp > 1 outside the server (whose
    parser sets `serving`); the rest is checked against the world."""
    if getattr(args, "pp_split", None) and (args.pp or 1) == 1:
        raise UsageError("--pp-split needs --pp (the number of pipeline stages)")
    dp = getattr(args, "dp", None)
    if dp is not None and dp > 1 and not getattr(args, "serving", False):
        raise UsageError(
            f"--dp {dp}: data-parallel replicas serve separate requests at once, which only "
            "llama_tp.serve does; this command runs one copy of the model (drop --dp)"
        )


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding: --draft ngram|PATH, --draft-model PATH, --num-draft-tokens K."""
    p.add_argument(
        "--draft",
        metavar="ngram|PATH",
        help="speculative decoding: 'ngram' (prompt lookup) or a draft model sharing the "
        "tokenizer (any format --model takes)",
    )
    p.add_argument("--draft-model", metavar="PATH", help="the same as --draft PATH")
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=4,
        metavar="K",
        help="tokens drafted per step, verified in one forward (default 4)",
    )
    p.add_argument(
        "--draft-sharded",
        action="store_true",
        help="shard the draft model over the ranks like the model (default: whole on every rank)",
    )


def draft_source(args: argparse.Namespace) -> str | None:
    """'ngram', a draft model's path, or None; UsageError for conflicting or bad flags."""
    if args.draft and args.draft_model:
        raise UsageError("give --draft or --draft-model, not both")
    source = args.draft or args.draft_model
    if source is None:
        if args.draft_sharded:
            raise UsageError("--draft-sharded needs --draft-model PATH")
        return None
    if args.num_draft_tokens < 1:
        from ..engine.settings import MAX_DRAFT_TOKENS

        raise UsageError(
            f"--num-draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}, got {args.num_draft_tokens}"
        )
    if source == "ngram" and args.draft_sharded:
        raise UsageError("--draft-sharded needs a draft model, not ngram")
    return source


def load_draft_checked(args: argparse.Namespace, model, tokenizer, ckpt, group):
    """The `draft` argument of stream_generate / Chat for the command's flags: None,
    'ngram', or the draft model (loaded whole on every rank, or sharded, by the split
    weights of the model's checkpoint `ckpt`: the two must share vocabulary rows)."""
    from ..engine.drafters import load_draft

    source = draft_source(args)
    if source in (None, "ngram"):
        return source
    split = ckpt.placement.plan.weights if ckpt.placement is not None else None
    with watchdog.stage("loading the draft model", "load"):
        return load_draft(source, model, tokenizer, group, args.draft_sharded, split)


_NO_FLAG = object()  # the command has no such flag


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The command's sampling flags (those of `KEYWORDS` it has) as the engine's validated
    `SamplingParams` (`--seed` unset: None, agreed at generation); UsageError naming the
    flag."""
    flags = {k.field: k.flag for k in KEYWORDS if k.flag}
    given = {f: getattr(args, flag[2:].replace("-", "_"), _NO_FLAG) for f, flag in flags.items()}
    try:
        return SamplingParams(**{f: v for f, v in given.items() if v is not _NO_FLAG})
    except SettingsError as e:
        raise UsageError(e.named(flags[e.field])) from None


def check_model_args(args: argparse.Namespace) -> None:
    """Raise UsageError, naming the value, for the model commands' flags out of range."""
    sampling_params(args)
    check_mesh_args(args)
    if hasattr(args, "draft"):
        draft_source(args)
    for flag in ("timeout", "load_timeout"):
        value = getattr(args, flag)
        if not value >= 0:  # NaN too
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0 seconds, got {value}")


def model_on_some_rank(find: Callable[[], object], group: mx.distributed.Group) -> str:
    """This rank's path from `find` (the built-in model), or where it has none, the first
    rank's that has one: that rank sends it its slices (`loading/model_sources.py`). When
    no rank has one, every rank raises its own error."""
    mine = error = None
    try:
        mine = str(find())
    except Exception as e:
        error = e
    paths = all_gather_object(mine, group) if group.size() > 1 else [mine]
    found = [p for p in paths if p]
    if not found:
        raise error
    return mine or found[0]


def load_checked(args, group: mx.distributed.Group):
    """The commands' loading: (model, tokenizer) of `args.model`, after the start-up
    agreement (llama_tp.agreement); any rank's failure makes every rank raise."""
    from ..checkpoints.tokenizer import load_tokenizer
    from ..loading.agreement import check_agreement
    from ..loading.loader import LoadOptions, default_model, load_model

    path = args.model or model_on_some_rank(default_model, group)
    from ..parallel.mesh import MeshError
    from ..parallel.shares import SplitError

    with watchdog.stage("loading the model", "load"):
        try:
            model, ckpt = load_model(path, group, options=LoadOptions.from_args(args))
        except (MeshError, SplitError) as e:  # the same on every rank
            raise UsageError(str(e)) from None
    with watchdog.stage("start-up checks", "load"):
        tokenizer = agreed(lambda: load_tokenizer(ckpt), group)
        check_agreement(model, ckpt, tokenizer, group)
    return model, tokenizer, ckpt
