"""The generation loop and `python -m llama_tp.generate`.

    python -m llama_tp.generate --prompt "What is the capital of France?"
    mlx.launch -n 2 python -m llama_tp.generate --model path/to/model --prompt hi

Every rank runs the same loop on the same tokens; the sharded layers' all-reduces
keep their logits identical, and a shared seed keeps their samples identical.
"""

from __future__ import annotations

import os
import random
import select
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import watchdog
from .agreement import TokenCheck
from .distributed import agree_ok, all_gather_object, broadcast_object, eprint0, print0, world
from .sampling import make_sampler, token_logprobs, vocab_shard


def agree_seed(seed: int | None, group: mx.distributed.Group | None = None) -> int:
    """Seed every rank's RNG with the same value (rank 0's choice when `seed` is None).

    Ranks that sampled differently would feed different tokens into their
    caches and silently compute garbage from then on.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    seed = broadcast_object(seed, group)
    mx.random.seed(seed)
    return seed


def generate_step(
    model: nn.Module,
    prompt: list[int],
    sampler: Callable[[mx.array], mx.array],
    max_tokens: int,
    cache: list[Any] | None = None,
    prefill_step_size: int = 512,
) -> Iterator[tuple[int, mx.array]]:
    """Yield up to `max_tokens` (token id, logits) after `prompt` (a generator, as in mlx-lm).

    `sampler` maps logits (1, V) to a token (1,); with a vocabulary-parallel head
    the logits are this rank's (1, V_local). The prompt is prefilled in chunks;
    then each step builds the next token's graph before waiting for the current
    one (`mx.async_eval`), so Python work overlaps computation.
    """
    cache = cache if cache is not None else make_prompt_cache(model)
    tokens = mx.array(prompt, dtype=mx.int32)

    def step(x: mx.array) -> tuple[mx.array, mx.array]:
        logits = model(x[None], cache=cache)[:, -1, :]  # (1, V) or (1, V_local)
        return sampler(logits).reshape(-1), logits  # (1,)

    # All but the last prompt token only fill the cache: their logits are never
    # evaluated, so the output head runs for the last position alone (as in mlx-lm).
    while tokens.size > 1:
        n = min(prefill_step_size, tokens.size - 1)
        model(tokens[None, :n], cache=cache)
        mx.eval([c.state for c in cache])
        tokens = tokens[n:]
    y, logits = step(tokens)
    mx.async_eval(y)
    for n in range(max_tokens):
        nxt = step(y) if n + 1 < max_tokens else None
        if nxt is not None:
            mx.async_eval(nxt[0])
        yield y.item(), logits
        if nxt is not None:
            y, logits = nxt


@dataclass
class Response:
    text: str  # the new piece of text (may be empty while a character is incomplete)
    token: int
    logprob: float | None  # with stream_generate(logprobs=...): of `token`
    top_logprobs: list[tuple[int, float]] | None  # the `logprobs` most likely (id, logprob)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    finish_reason: str | None  # "stop", "length" or None


def stream_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: list[int],
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    cache: list[Any] | None = None,
    should_stop: Callable[[], bool] | None = None,
    logprobs: int | None = None,
    eos_token_ids: set[int] | None = None,
    group: mx.distributed.Group | None = None,
) -> Iterator[Response]:
    """Generate from token ids `prompt`, yielding text pieces as they are decoded.

    `cache` (from `make_prompt_cache`) already holding earlier tokens continues
    from them: `prompt` is then only the new tokens. `should_stop` is asked on
    every rank after every token; when any rank answers True, all ranks stop at
    the same token (finish_reason "interrupted"), so their caches stay alike.
    `logprobs=k` adds each token's log-probability and the k most likely
    alternatives (0: the token's only), exact also with a sharded vocabulary.
    `eos_token_ids` replaces the tokenizer's end-of-sequence ids (e.g. a chat
    template's end-of-turn token as well).
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    group = group or world()
    # Armed only under the commands (llama_tp.watchdog.install): a peer that stops
    # would otherwise leave this rank waiting in a collective forever.
    with watchdog.stage(f"prompt processing ({len(prompt)} tokens)", "load"):
        seed = agree_seed(seed, group)
        shard = vocab_shard(model)
        sampler = make_sampler(temp, top_p, min_p, top_k, shard=shard, seed=seed)
        detok = tokenizer.detokenizer
        detok.reset()
        eos = set(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
        check = TokenCheck(prompt, group, eos)
        tic = time.perf_counter()
        prompt_tps = 0.0
        steps = generate_step(model, prompt, sampler, max_tokens, cache)
        for n, (token, logits) in enumerate(steps, start=1):
            if n == 1:
                prompt_tps = len(prompt) / (time.perf_counter() - tic)
                tic = time.perf_counter()
            gen_tps = (n - 1) / (time.perf_counter() - tic) if n > 1 else 0.0
            token = check.fault(n, token)
            finish = None
            if token in eos:
                finish = "stop"
            else:
                detok.add_token(token)
                if n == max_tokens:
                    finish = "length"
                elif should_stop is not None and _any_rank(should_stop(), group):
                    finish = "interrupted"
            check.add(n, token, final=finish is not None)
            if finish:
                detok.finalize()
            lp = top = None
            if logprobs is not None:
                chosen, ids, vals = token_logprobs(logits, mx.array([token]), shard, logprobs)
                lp = chosen.item()
                if ids is not None:
                    top = list(zip(ids[0].tolist(), vals[0].tolist(), strict=True))
            yield Response(
                detok.last_segment, token, lp, top, len(prompt), prompt_tps, n, gen_tps, finish
            )
            if finish:
                return
            watchdog.progress(f"generation step {n + 1}")


def _any_rank(flag: bool, group: mx.distributed.Group) -> bool:
    """True on every rank when `flag` is True on any rank (one tiny all-reduce)."""
    if group.size() == 1:
        return flag
    return mx.distributed.all_sum(mx.array(int(flag)), group=group, stream=mx.cpu).item() > 0


def vocab_bytes(model: nn.Module) -> int:
    """Bytes of the embedding and output head this rank holds (shared once when tied)."""
    from mlx.utils import tree_flatten

    parts = [model.tok_embeddings] + ([model.output] if "output" in model else [])
    return sum(v.nbytes for m in parts for _, v in tree_flatten(m.parameters()))


def _parser():
    from .cli import ArgumentParser, add_model_args

    p = ArgumentParser(
        prog="python -m llama_tp.generate",
        description="Generate text with a Llama-family model, on one process or across "
        "the ranks started by mlx.launch.",
    )
    add_model_args(p, max_tokens=100)
    p.add_argument("--prompt", "-p", default="hello", help="the prompt ('-' reads stdin)")
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument(
        "--verbose", action="store_true", help="print speed and every rank's peak memory on stderr"
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
    from .cli import UsageError

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


def load_checked(args, group: mx.distributed.Group):
    """The commands' loading: (model, tokenizer) of `args.model`, after the start-up
    agreement (llama_tp.agreement); any rank's failure makes every rank raise."""
    from .agreement import check_agreement
    from .loader import default_model, load_model
    from .tokenizer import load_tokenizer

    path = error = None
    try:
        path = args.model or default_model()
    except Exception as e:  # e.g. the built-in model is missing on one host
        error = e
    agree_ok(error, group)
    with watchdog.stage("loading the model", "load"):
        model, ckpt = load_model(path, group, not args.no_vocab_parallel)
    with watchdog.stage("start-up checks", "load"):
        tokenizer = error = None
        try:
            tokenizer = load_tokenizer(ckpt)
        except Exception as e:
            error = e
        agree_ok(error, group)
        check_agreement(model, ckpt, tokenizer, group)
    return model, tokenizer, ckpt


def fit_context(n_prompt: int, max_tokens: int, context: int, group: mx.distributed.Group) -> int:
    """`max_tokens`, lowered (with a warning) so that prompt and reply fit the model's
    context; a prompt that leaves no room at all is a usage error."""
    from .cli import UsageError

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
    from .cli import UsageError, check_model_args, start_watchdog
    from .tokenizer import encode_prompt

    args = _parser().parse_args()
    check_model_args(args)
    start_watchdog(args)
    group = world()
    watchdog.set_group_size(group.size())
    prompt = read_prompt(args.prompt, group)
    if not prompt:
        raise UsageError("the prompt is empty")
    model, tokenizer, ckpt = load_checked(args, group)
    ids = encode_prompt(tokenizer, prompt, args.system_prompt, not args.ignore_chat_template)
    max_tokens = fit_context(len(ids), args.max_tokens, model.args.max_position_embeddings, group)
    r = None
    for r in stream_generate(
        model,
        tokenizer,
        ids,
        max_tokens=max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        min_p=args.min_p,
        top_k=args.top_k,
        seed=args.seed,
        group=group,
    ):
        print0(r.text, end="")
    print0()
    if args.verbose and r is not None:
        with watchdog.stage("gathering the statistics"):
            peaks = all_gather_object(
                (mx.get_peak_memory(), vocab_bytes(model), ckpt.load_stats), group
            )
        eprint0(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec")
        eprint0(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec")
        per_rank = ", ".join(f"rank {i} {p / 1e9:.3f} GB" for i, (p, _, _) in enumerate(peaks))
        eprint0(f"Peak memory: {per_rank} ({group.size()} rank{'s' * (group.size() > 1)})")
        emb = ", ".join(f"rank {i} {b / 1e6:.1f} MB" for i, (_, b, _) in enumerate(peaks))
        eprint0(f"Embedding and head: {emb}")
        load = ", ".join(
            f"rank {i} read {s['bytes_read'] / 1e6:.1f} MB, peak {s['peak_memory'] / 1e6:.1f} MB"
            f" in {s['seconds']:.1f} s"
            for i, (_, _, s) in enumerate(peaks)
        )
        eprint0(f"Loading: {load}")
    return 0


if __name__ == "__main__":
    from .cli import run

    run(main)
