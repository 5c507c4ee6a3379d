"""`python -m llama_tp.chat`: chat with a model at the terminal, on one process or across ranks.

    python -m llama_tp.chat
    mlx.launch -n 2 -- python -m llama_tp.chat --system-prompt "Be brief."

The conversation itself is `llama_tp.conversation.Chat`; reading the terminal
under mlx.launch is `llama_tp.terminal`.
"""

from __future__ import annotations

from .cluster import watchdog
from .cluster.distributed import world
from .console.command import script, start
from .conversation.chat import Chat, ChatTemplateError, ContextOverflowError, TurnStats

__all__ = ["Chat", "ChatTemplateError", "ContextOverflowError", "TurnStats", "main"]


HELP = """Commands:
  /reset        start the conversation over (the system prompt stays)
  /system TEXT  set the system prompt (/system alone removes it)
  /help         this list
  /quit         leave (or Ctrl-D on an empty line)
Ctrl-C stops a reply. Start a message with // to send one that begins with /."""


def _parser():
    from .console.cli import ArgumentParser, add_model_args

    p = ArgumentParser(
        prog="python -m llama_tp.chat",
        description="Chat with a model at the terminal, on one process or across the "
        "ranks of a launcher (llama_tp.launch, mlx.launch, mpirun).",
    )
    add_model_args(p, max_tokens=256)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="context limit in tokens (default: the model's)",
    )
    p.add_argument(
        "--drop-oldest",
        action="store_true",
        help="when the conversation outgrows the context, drop its oldest turns "
        "(default: say so and keep it)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="per-turn token counts and speed on stderr (and the mesh, with --pp)",
    )
    return p


def _check_context(args) -> None:
    """UsageError for a --max-context that holds nothing."""
    from .console.cli import UsageError

    if args.max_context is not None and args.max_context <= 0:
        raise UsageError(f"--max-context must be positive, got {args.max_context}")


def main() -> int:
    from .console.cli import check_model_args, load_checked, load_draft_checked, sampling_params
    from .console.terminal import Console

    # The watchdog is armed during loading and replies, not while waiting for input.
    args = start(_parser(), check_model_args, _check_context, watch=True)
    group = world()
    model, tokenizer, ckpt = load_checked(args, group)
    draft = load_draft_checked(args, model, tokenizer, ckpt, group)
    if args.verbose:
        from .engine import expert_load

        expert_load.start(model)  # routes per rank of each reply (mixture-of-experts models)
    if args.verbose and getattr(model, "mesh", None) is not None:  # tp x pp mesh
        from .cluster.distributed import eprint0
        from .loading.pipeline import describe_stages

        with watchdog.stage("gathering the mesh", "load"):
            stages = describe_stages(model, group)
        eprint0(f"Mesh: --tp {model.mesh.tp} x --pp {model.mesh.pp}")
        eprint0("\n".join(stages))
    chat = Chat(
        model,
        tokenizer,
        args.system_prompt,
        params=sampling_params(args),
        seed=args.seed,
        max_context=args.max_context,
        overflow="drop_oldest" if args.drop_oldest else "error",
        group=group,
        draft=draft,
    )
    with Console(group) as console:
        # A watchdog exit skips the `with`: give the terminal back first.
        watchdog.on_exit(lambda: console._terminal and console._terminal.restore())
        console.info(
            f"Chat on {group.size()} rank{'s' * (group.size() > 1)}; /help lists the commands, "
            "Ctrl-C stops a reply, Ctrl-D or /quit leaves."
        )
        while (line := console.read_line(">> ")) is not None:
            command, _, rest = line.strip().partition(" ")
            if line.startswith("//"):
                line = line[1:]
            elif command in ("/quit", "/exit", "/q"):
                break
            elif command == "/reset":
                chat.reset()
                console.info("[conversation reset]")
                continue
            elif command == "/system":
                chat.system = rest.strip() or None
                console.info("[system prompt set]" if rest.strip() else "[system prompt removed]")
                continue
            elif command in ("/help", "/?"):
                console.info(HELP)
                continue
            elif command.startswith("/"):
                console.info(f"unknown command {command}; /help lists them")
                continue
            if not line.strip():
                continue
            try:
                with console.replying():
                    for piece in chat.stream(line, should_stop=console.interrupted):
                        console.write(piece)
            except (ContextOverflowError, ChatTemplateError) as e:
                # Raised alike on every rank, before the turn's first collective.
                console.error(str(e))
                continue
            stats = chat.last_stats
            console.write("\n[interrupted]\n" if stats.finish_reason == "interrupted" else "\n")
            if args.verbose:  # after the reply, in order with it when at a terminal
                load = expert_load.gather(model, ckpt.placement, group)  # every rank
                expert_load.start(model)
                console.info(
                    f"[prompt {stats.prompt_tokens} tokens ({stats.prefilled_tokens} prefilled, "
                    f"{stats.prompt_tps:.1f} tok/s), generated {stats.generated_tokens} "
                    f"({stats.generation_tps:.1f} tok/s), {stats.finish_reason}, "
                    f"context {stats.context_tokens}"
                    + (f"; {stats.speculative.summary()}" if stats.speculative else "")
                    + (f"; expert load {load.summary()}" if load else "")
                    + "]"
                )
    return 0


cli = script(main)  # the console script

if __name__ == "__main__":
    cli()
