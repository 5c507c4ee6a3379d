"""Run on every rank (one process, or under mlx.launch): speculative decoding checks.

    mlx.launch -n 2 -- python tests/mp_speculative.py TARGET DRAFT BAD_DRAFT [--gguf PATH]
        [--skip CHECK,...]

TARGET and DRAFT are tiny models sharing a tokenizer (DRAFT: fewer layers, other
weights); BAD_DRAFT has another vocabulary. Every case runs on every rank; rank 0
prints one JSON object {case: {"ok": bool, ...}} (a case is ok only if it is ok on
every rank). Cases: greedy speculative output equals plain greedy output (prompt
lookup, a replicated and a sharded draft model, the target as its own draft),
across chat turns too; sampled output (temperature, top-p, top-k) equals plain
sampled output for every drafter, and the target as its own draft accepts every
sampled draft (its drafts use the target's keys); bad K and a mismatched tokenizer
give clear errors; with --gguf the built-in model with prompt lookup. --skip leaves out
checks by name (greedy, errors, sampled).
"""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx

from llama_tp.checkpoints.tokenizer import encode_prompt, load_tokenizer
from llama_tp.conversation.chat import Chat
from llama_tp.engine.drafters import load_draft
from llama_tp.engine.generation import stream_generate
from llama_tp.loading.loader import load_model

WORLD = mx.distributed.init()
RESULTS: dict[str, dict] = {}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Hello world! Tensor parallel inference runs on many Macs at once.",
]


def report(name: str, ok: bool, **detail) -> None:
    ok = bool(mx.distributed.all_sum(mx.array(int(not ok))).item() == 0)
    RESULTS[name] = {"ok": ok, **detail}


def tokens_of(model, tok, ids, max_tokens=16, **kw) -> tuple[list[int], object]:
    out, stats = [], None
    for r in stream_generate(model, tok, ids, max_tokens=max_tokens, eos_token_ids=set(), **kw):
        out.append(r.token)
        stats = r.speculative
    return out, stats


def check_greedy(target_dir: str, draft_dir: str) -> None:
    model, ckpt = load_model(target_dir, WORLD)
    tok = load_tokenizer(ckpt)
    replicated = load_draft(draft_dir, model, tok, WORLD)
    sharded = load_draft(draft_dir, model, tok, WORLD, sharded=True)
    self_draft, _ = load_model(target_dir, WORLD)
    drafts = {
        "ngram": ("ngram", 4),
        "replicated": (replicated, 3),
        "sharded": (sharded, 2),
        "self": (self_draft, 5),
    }
    for i, text in enumerate(PROMPTS):
        ids = encode_prompt(tok, text, None, False)
        plain, _ = tokens_of(model, tok, ids)
        for name, (draft, k) in drafts.items():
            spec, stats = tokens_of(model, tok, ids, draft=draft, num_draft_tokens=k)
            detail = dict(accept=round(stats.acceptance_rate, 3), tpf=stats.tokens_per_forward)
            if spec != plain:
                detail.update(plain=plain, spec=spec)
            report(f"greedy_{name}_{i}", spec == plain, **detail)
    # The target as its own draft accepts everything: K + 1 tokens per forward.
    ids = encode_prompt(tok, PROMPTS[0], None, False)
    _, stats = tokens_of(model, tok, ids, max_tokens=18, draft=self_draft, num_draft_tokens=5)
    report("self_draft_accepts_all", stats.acceptance_rate == 1.0, tpf=stats.tokens_per_forward)
    # Chat: three turns, replies identical to plain chat's, cache reused across turns.
    turns = ["Hello world!", "The quick brown fox", "Tensor parallel inference"]
    for name, (draft, k) in [("ngram", ("ngram", 3)), ("replicated", (replicated, 3))]:
        plain_chat = Chat(model, tok, max_tokens=12)
        spec_chat = Chat(model, tok, max_tokens=12, draft=draft, num_draft_tokens=k)
        same, reused = True, []
        for t in turns:
            a, b = plain_chat.send(t), spec_chat.send(t)
            same &= a == b and plain_chat._held == spec_chat._held
            reused.append(spec_chat.last_stats.reused_tokens)
        report(f"chat_{name}", same and reused[-1] > 0, reused=reused)


def check_errors(target_dir: str, bad_dir: str) -> None:
    model, ckpt = load_model(target_dir, WORLD)
    tok = load_tokenizer(ckpt)
    messages = []
    for k in (0, 65, "3"):
        try:
            next(stream_generate(model, tok, [1, 5], draft="ngram", num_draft_tokens=k))
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    ok = all(m and "num_draft_tokens" in m for m in messages)
    report("bad_k", ok, messages=messages)
    try:
        load_draft(bad_dir, model, tok, WORLD)
        message = None
    except ValueError as e:
        message = str(e)
    ok = message is not None and "tokenizer" in message and "\n" not in message
    report("mismatched_tokenizer", ok, message=message)


SAMPLED = [dict(temp=0.8, seed=3), dict(temp=1.0, top_p=0.9, top_k=20, seed=4)]


def check_sampled(target_dir: str, draft_dir: str) -> None:
    """Sampled speculative decoding gives the plain sampled tokens, whatever the drafter."""
    model, ckpt = load_model(target_dir, WORLD)
    tok = load_tokenizer(ckpt)
    drafts = {
        "ngram": "ngram",
        "replicated": load_draft(draft_dir, model, tok, WORLD),
        "sharded": load_draft(draft_dir, model, tok, WORLD, sharded=True),
        "self": load_model(target_dir, WORLD)[0],
    }
    for i, kw in enumerate(SAMPLED):
        ids = encode_prompt(tok, PROMPTS[0], None, False)
        plain, _ = tokens_of(model, tok, ids, **kw)
        for name, draft in drafts.items():
            spec, stats = tokens_of(model, tok, ids, draft=draft, num_draft_tokens=3, **kw)
            detail = dict(accept=round(stats.acceptance_rate, 3))
            if spec != plain:
                detail.update(plain=plain, spec=spec)
            ok = spec == plain and (name != "self" or stats.acceptance_rate == 1.0)
            report(f"sampled_{name}_{i}", ok, **detail)


def check_gguf(path: str) -> None:
    model, ckpt = load_model(path, WORLD)
    tok = load_tokenizer(ckpt)
    text = (
        "Repeat this passage exactly: The Eiffel Tower is a wrought-iron lattice tower on "
        "the Champ de Mars in Paris, France. It is named after the engineer Gustave Eiffel."
    )
    ids = encode_prompt(tok, text, None, True)
    plain, _ = tokens_of(model, tok, ids, max_tokens=20)
    spec, stats = tokens_of(model, tok, ids, max_tokens=20, draft="ngram", num_draft_tokens=4)
    detail = dict(accept=round(stats.acceptance_rate, 3), tpf=stats.tokens_per_forward)
    if spec != plain:
        detail.update(plain=plain, spec=spec)
    report("gguf_ngram", spec == plain, **detail)


if __name__ == "__main__":
    args = sys.argv[1:]
    gguf = None
    if "--gguf" in args:
        i = args.index("--gguf")
        gguf, args = args[i + 1], args[:i] + args[i + 2 :]
    skip = set()
    if "--skip" in args:
        i = args.index("--skip")
        skip, args = set(args[i + 1].split(",")), args[:i] + args[i + 2 :]
    target, draft, bad = args
    seconds = {}
    for name, run in [
        ("greedy", lambda: check_greedy(target, draft)),
        ("errors", lambda: check_errors(target, bad)),
        ("sampled", lambda: check_sampled(target, draft)),
        ("gguf", lambda: gguf and check_gguf(gguf)),
    ]:
        if name in skip:
            continue
        tic = time.perf_counter()
        run()
        seconds[name] = round(time.perf_counter() - tic, 1)
    RESULTS["seconds"] = {"ok": True, **seconds}
    if WORLD.rank() == 0:
        print(json.dumps(RESULTS), flush=True)
