"""Run on every rank (one process, or under mlx.launch): one grid of requests through
every driver of the generation core; rank 0 prints one JSON object.

    mlx.launch -n 2 -- python tests/mp_determinism.py MODEL PLAIN_TOKENIZER_MODEL

MODEL is a tiny model with a chat template; PLAIN_TOKENIZER_MODEL the same weights
with a tokenizer that has none. The grid: greedy; seeded temperature, top-p, min-p
and top-k sampling; stop strings; log-probabilities (greedy and sampled). The
drivers: `generate` (encode_prompt + stream_generate, as the command), `chat`
(Chat.send), `batch` (batch_generate, a batch per setting), `spec` (stream_generate
with prompt-lookup drafts), `server` (the real app, scheduler and step loop: each
request alone, with drafts alone, and the grid 8 at a time) and `processor` (a logits
processor banning a token on every rank's own columns). On several ranks each runs
with a vocabulary-parallel head ("vp") and a whole one ("whole").

Output: {variant: {driver: {request: {"text", "tokens"?, "logprobs"?}}}}.
"""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.tokenizer import encode_prompt, load_tokenizer
from llama_tp.conversation.chat import Chat
from llama_tp.engine.batch import BatchEngine, batch_generate
from llama_tp.engine.generation import stream_generate
from llama_tp.loading.loader import load_model

WORLD = mx.distributed.init()
PROMPTS = ["Ranks share", "abc abc abc abc abc abc"]
MAX_TOKENS = 8
SETTINGS = {  # stream_generate's names; "stop" is filled in from the greedy text
    "greedy": {},
    "temperature": {"temp": 0.9, "seed": 11},
    "top_p": {"temp": 1.0, "top_p": 0.8, "seed": 12},
    "min_p": {"temp": 1.0, "min_p": 0.05, "seed": 13},
    "top_k": {"temp": 1.5, "top_k": 5, "seed": 14},
    "stop": {},
    "logprobs": {"logprobs": 3},
    "sampled_logprobs": {"temp": 0.7, "seed": 15, "logprobs": 2},
}
PLAIN = ("greedy", "temperature")  # the grid of the tokenizer without a chat template


def result(responses) -> dict:
    rs = list(responses)
    out = {"text": "".join(r.text for r in rs), "tokens": [r.token for r in rs if not r.eos]}
    if rs and rs[0].logprob is not None:
        out["logprobs"] = [r.logprob for r in rs if not r.eos]
    return out


def grid(model, tok, names) -> dict[str, tuple[str, dict]]:
    """{request id: (prompt, settings)}, the stop strings taken from the greedy text."""
    requests = {}
    for i, prompt in enumerate(PROMPTS):
        for name in names:
            kw = dict(SETTINGS[name], max_tokens=MAX_TOKENS)
            if name == "stop":
                text = result(stream_generate(model, tok, encode_prompt(tok, prompt), **kw))
                kw["stop"] = [stop_in(text["text"])]
            requests[f"{name}/{i}"] = (prompt, kw)
    return requests


def stop_in(text: str) -> str:
    """A printable 3-character stop string that first occurs after the text's start."""
    for i in range(1, len(text) - 3):
        s = text[i : i + 3]
        if s.isprintable() and "\ufffd" not in s and text.find(s) == i:
            return s
    raise AssertionError(f"no stop string to take from {text!r}")


def run_generate(model, tok, requests, **extra) -> dict:
    return {
        rid: result(stream_generate(model, tok, encode_prompt(tok, p), **kw, **extra))
        for rid, (p, kw) in requests.items()
    }


def run_chat(model, tok, requests) -> dict:
    out = {}
    for rid, (p, kw) in requests.items():
        kw = {k: v for k, v in kw.items() if k != "logprobs"}  # Chat gives text only
        out[rid] = {"text": Chat(model, tok, **kw).send(p)}
    return out


def run_batch(model, tok, requests) -> dict:
    out = {}
    for name in sorted({rid.split("/")[0] for rid in requests}):  # the same order on every rank
        mine = {rid: r for rid, r in requests.items() if rid.startswith(name + "/")}
        kw = dict(next(iter(mine.values()))[1])
        seed, stop = kw.pop("seed", 0), kw.pop("stop", ())
        if stop:  # a stop string per prompt: one batch each
            for rid, (p, k) in mine.items():
                [r] = batch_generate(model, tok, [p], seeds=[seed], stop=tuple(k["stop"]), **kw)
                out[rid] = {"text": r.text, "tokens": r.tokens}
            continue
        res = batch_generate(
            model, tok, [p for p, _ in mine.values()], seeds=[seed] * len(mine), **kw
        )
        for rid, r in zip(mine, res, strict=True):
            out[rid] = {"text": r.text, "tokens": r.tokens}
            if r.logprobs is not None:
                out[rid]["logprobs"] = r.logprobs
    return out


def run_server(model, tok) -> callable:
    """The real app, scheduler and step loop on every rank; rank 0 also runs `client`
    (given the base URL) on a thread. Returns a function doing that for `client`."""
    from llama_tp.server.app import build_app
    from llama_tp.server.runner import HTTPThread, bind, model_info
    from llama_tp.server.scheduler import Scheduler
    from llama_tp.server.step_loop import run_steps

    def serve(client) -> dict:
        engine = BatchEngine(model, tok, prompt_cache_size=0)
        scheduler, out = None, {}
        if WORLD.rank() == 0:
            scheduler = Scheduler(max_batch=8, max_queue=64)
            app = build_app(scheduler)
            app.state.model = model_info(model, tok, "grid")
            scheduler.ready = True
            sock = bind("127.0.0.1", 0)
            http = HTTPThread(app, sock)
            base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

            def drive():
                try:
                    out.update(client(base))
                finally:
                    scheduler.request_stop()

            threading.Thread(target=drive, daemon=True).start()
        run_steps(engine, scheduler, WORLD)
        if WORLD.rank() == 0:
            http.stop()
        return out

    return serve


def ask(base: str, prompt: str, kw: dict, drafts: int = 0) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    body = {"max_tokens": kw["max_tokens"], "temperature": kw.get("temp", 0.0)}
    extra = {"num_draft_tokens": drafts}
    for name in ("top_p", "seed", "stop"):
        if name in kw:
            body[name] = kw[name]
    for name in ("min_p", "top_k"):  # llama_tp (and mlx-lm) take them too
        if name in kw:
            extra[name] = kw[name]
    if "logprobs" in kw:
        body.update(logprobs=True, top_logprobs=kw["logprobs"])
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], extra_body=extra, **body
    )
    out = {"text": r.choices[0].message.content}
    if r.choices[0].logprobs is not None:
        out["logprobs"] = [t.logprob for t in r.choices[0].logprobs.content]
    return out


def server_client(requests):
    def client(base: str) -> dict:
        alone = {rid: ask(base, p, kw) for rid, (p, kw) in requests.items()}
        drafted = {rid: ask(base, p, kw, drafts=3) for rid, (p, kw) in requests.items()}
        with ThreadPoolExecutor(8) as pool:  # 8 at a time: batches of 8
            futures = {rid: pool.submit(ask, base, p, kw) for rid, (p, kw) in requests.items()}
            batched = {rid: f.result() for rid, f in futures.items()}
        return {"server": alone, "server_spec": drafted, "server_batch": batched}

    return client


def ban_processor(token: int):
    """A logits processor that forbids `token`, on whichever rank holds its column."""

    def ban(tokens: mx.array, logits: mx.array, shard) -> mx.array:
        if shard.start <= token < shard.stop:
            logits[:, token - shard.start] = -float("inf")
        return logits

    return ban


def variant(model, tok, plain_tok) -> dict:
    requests = grid(model, tok, list(SETTINGS))
    out = {
        "generate": run_generate(model, tok, requests),
        "chat": run_chat(model, tok, requests),
        "batch": run_batch(model, tok, requests),
        "spec": run_generate(model, tok, requests, draft="ngram", num_draft_tokens=3),
    }
    out.update(run_server(model, tok)(server_client(requests)))
    plain = grid(model, plain_tok, PLAIN)
    out["plain_generate"] = run_generate(model, plain_tok, plain)
    out["plain_chat"] = run_chat(model, plain_tok, plain)
    out["plain_batch"] = run_batch(model, plain_tok, plain)
    server = run_server(model, plain_tok)(server_client(plain))
    out["plain_server"], out["plain_server_batch"] = (
        server.get("server"),
        server.get("server_batch"),
    )
    # A logits processor: greedy with the plain greedy reply's first token banned.
    p, kw = requests["greedy/0"]
    first = out["generate"]["greedy/0"]["tokens"][0]
    banned = stream_generate(
        model, tok, encode_prompt(tok, p), logits_processors=[ban_processor(first)], **kw
    )
    out["processor"] = {"greedy/0": {**result(banned), "banned": first}}
    return out


if __name__ == "__main__":
    model_dir, plain_dir = sys.argv[1:3]
    plain_tok = load_tokenizer(open_checkpoint(Path(plain_dir)))
    results = {}
    heads = {"vp": True, "whole": False} if WORLD.size() > 1 else {"whole": False}
    for name, vocab_parallel in heads.items():
        model, ckpt = load_model(model_dir, WORLD, vocab_parallel)
        results[name] = variant(model, load_tokenizer(ckpt), plain_tok)
    if WORLD.rank() == 0:
        print(json.dumps(results), flush=True)
