"""`python -m llama_tp.generate`: one prompt in, the model's reply out.

    python -m llama_tp.generate --prompt "What is the capital of France?"
    mlx.launch -n 2 -- python -m llama_tp.generate --model path/to/model --prompt hi

The loop itself is `llama_tp.engine.generation` (`stream_generate`, re-exported
here for `from llama_tp.generate import stream_generate`).
"""

from __future__ import annotations

import os
import select
import sys

import mlx.core as mx

from .cluster import watchdog
from .cluster.distributed import all_gather_object, broadcast_object, eprint0, print0, world
from .console.command import script, start
from .engine.generation import stream_generate, vocab_bytes


def _parser():
    from .console.cli import ArgumentParser, add_model_args

    p = ArgumentParser(
        prog="python -m llama_tp.generate",
        description="Generate text from one prompt with a model (a GGUF file, a Hugging "
        "Face/MLX folder or a hub id), on one process or across the ranks of a launcher "
        "(llama_tp.launch, mlx.launch, mpirun).",
    )
    add_model_args(p, max_tokens=100)
    p.add_argument("--prompt", "-p", default="hello", help="the prompt ('-' reads stdin)")
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print speed and every rank's peak memory on stderr (and the mesh, with --pp)",
    )
    return p


def read_stdin(idle: float = 1.0) -> bytes:
    """All of stdin. Under mlx.launch, which forwards input but never its end,
    the input also ends once it has paused for `idle` seconds."""
    if world().size() == 1:
        return sys.stdin.buffer.read()
    fd, chunks = sys.stdin.fileno(), []
    while True:
        ready, _, _ = select.select([fd], [], [], idle if chunks else None)
        data = os.read(fd, 1 << 16) if ready else b""
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def read_prompt(prompt: str, group: mx.distributed.Group) -> str:
    """The prompt text; `-` means rank 0's stdin, shared with every rank."""
    from .console.cli import UsageError

    if prompt != "-":
        return prompt
    text = None
    if group.rank() == 0:
        data = read_stdin()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            text = UsageError(f"stdin is not valid UTF-8 (byte {data[e.start]:#04x} at {e.start})")
    text = broadcast_object(text, group)
    if isinstance(text, Exception):
        raise text
    return text


def fit_context(n_prompt: int, max_tokens: int, context: int, group: mx.distributed.Group) -> int:
    """`max_tokens`, lowered (with a warning) so that prompt and reply fit the model's
    context; a prompt that leaves no room at all is a usage error."""
    from .console.cli import UsageError

    if n_prompt >= context:
        raise UsageError(
            f"the prompt is {n_prompt} tokens, but the model's context is {context} tokens "
            "(max_position_embeddings): no room to generate"
        )
    if n_prompt + max_tokens > context:
        eprint0(
            f"warning: --max-tokens lowered from {max_tokens} to {context - n_prompt}: the "
            f"prompt's {n_prompt} tokens and the reply must fit the model's context of "
            f"{context} tokens",
            group=group,
        )
        max_tokens = context - n_prompt
    return max_tokens


def main() -> int:
    from .checkpoints.tokenizer import encode_prompt
    from .console.cli import (
        UsageError,
        check_model_args,
        load_checked,
        load_draft_checked,
        sampling_params,
    )

    args = start(_parser(), check_model_args, watch=True)
    group = world()
    prompt = read_prompt(args.prompt, group)
    if not prompt:
        raise UsageError("the prompt is empty")
    model, tokenizer, ckpt = load_checked(args, group)
    draft = load_draft_checked(args, model, tokenizer, ckpt, group)
    ids = encode_prompt(tokenizer, prompt, args.system_prompt, not args.ignore_chat_template)
    max_tokens = fit_context(len(ids), args.max_tokens, model.args.max_position_embeddings, group)
    params = sampling_params(args).but(max_tokens=max_tokens)
    if args.verbose:
        from .engine import expert_load

        expert_load.start(model)  # routes per rank, for a mixture-of-experts model
    r = None
    for r in stream_generate(model, tokenizer, ids, params, group=group, draft=draft):
        print0(r.text, end="")
    print0()
    if args.verbose and r is not None:
        from .engine.step import describe_step
        from .loading.pipeline import describe_stages

        mesh = getattr(model, "mesh", None)  # tp x pp mesh (loading/pipeline.py)
        with watchdog.stage("gathering the statistics"):
            peaks = all_gather_object(
                (mx.get_peak_memory(), vocab_bytes(model), ckpt.load_stats), group
            )
            stages = describe_stages(model, group) if mesh is not None else []
            load_of_experts = expert_load.gather(model, ckpt.placement, group)
        eprint0(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec")
        eprint0(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec")
        if r.speculative is not None:
            eprint0(f"Speculative ({args.draft or args.draft_model}): {r.speculative.summary()}")
        per_rank = ", ".join(f"rank {i} {p / 1e9:.3f} GB" for i, (p, _, _) in enumerate(peaks))
        eprint0(f"Peak memory: {per_rank} ({group.size()} rank{'s' * (group.size() > 1)})")
        emb = ", ".join(f"rank {i} {b / 1e6:.1f} MB" for i, (_, b, _) in enumerate(peaks))
        eprint0(f"Embedding and head: {emb}")
        from .loading.weight_transfer import where_from

        load = ", ".join(
            f"rank {i} {where_from(s)}, peak {s['peak_memory'] / 1e6:.1f} MB"
            f" in {s['seconds']:.1f} s"
            for i, (_, _, s) in enumerate(peaks)
        )
        eprint0(f"Loading: {load}")
        weights = ckpt.placement.plan.weights if ckpt.placement is not None else None
        if weights is not None:  # --split (parallel/shares.py)
            from .parallel.shares import split_text

            eprint0(f"Weighted {split_text(weights)} of each tensor group")
        if ckpt.notes:
            eprint0(f"Weights: {'; '.join(ckpt.notes)}")
        eprint0(f"Matrix products: {ckpt.products}")
        eprint0(f"Decode step: {describe_step(model)}")
        from .generic.classes import path_line

        eprint0(f"Model: {path_line(ckpt)}")
        if load_of_experts is not None:
            eprint0(f"Expert load {load_of_experts.summary()}")
        if mesh is not None:
            eprint0(f"Mesh: --tp {mesh.tp} x --pp {mesh.pp}")
            eprint0("\n".join(stages))
    return 0


cli = script(main)  # the console script

if __name__ == "__main__":
    cli()
