"""Putting the server together: the in-process `create_app`, and the command's run on
every rank (listen early on rank 0, load with the start-up agreement, then step).

On rank 0 uvicorn runs on a daemon thread with its own event loop, while the
main thread runs the step loop: MLX's collectives stay on the main thread,
where the watchdog expects them.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoints.chat_template import renderer_for
from ..checkpoints.pooling import EmbeddingSpec, embedding_spec
from ..cluster import watchdog
from ..cluster.distributed import agree_ok, all_gather_object, eprint0, world
from ..cluster.listen import bind
from ..engine.batch import BatchEngine
from ..engine.embeddings import hidden_refusal
from .app import ModelInfo, build_app
from .guard import Hosts
from .limits import Limits
from .protocol import MAX_DRAFT_TOKENS, Defaults
from .response_store import ResponseStore
from .scheduler import Scheduler
from .step_loop import run_steps


def model_info(
    model: nn.Module,
    tokenizer,
    name: str,
    use_chat_template: bool = True,
    max_body: int = 0,
    embedding: EmbeddingSpec | None = None,
    size: int | None = None,
    **ollama,
) -> ModelInfo:
    """What the HTTP side knows of `model`. `embedding`: the checkpoint's (default: the
    last token's, undeclared), refused when the model gives no hidden states; `size`:
    the weights' bytes on every rank together (default: this rank's); `ollama`: its
    `digest` and `details` as Ollama lists them."""
    context, vocab = model.args.max_position_embeddings, model.args.vocab_size
    embedding = embedding or EmbeddingSpec()
    if embedding.problem is None and hidden_refusal(model) is not None:
        embedding = replace(embedding, problem=hidden_refusal(model))
    size = weight_bytes(model) if size is None else size
    return ModelInfo(
        name=name,
        context=context,
        vocab_size=vocab,
        renderer=renderer_for(tokenizer, use_chat_template),
        limits=Limits.of(context, vocab, tokenizer, max_body),
        model_type=getattr(model.args, "model_type", ""),
        dim=model.args.dim,
        embedding=embedding,
        size=size,
        size_vram=size if mx.metal.is_available() else 0,  # Apple silicon: unified memory
        **ollama,
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()) if hasattr(v, "nbytes"))


def ollama_details(ckpt) -> dict:
    """The checkpoint as Ollama's model details describe one: its format and family."""
    fmt = "gguf" if ckpt.format == "gguf" else "safetensors"
    family = getattr(ckpt.args, "model_type", "") or ""
    return {"format": fmt, "family": family, "families": [family] if family else None}


def digest_of(ckpt) -> str:
    """The weights' fingerprint the ranks compared at start-up ("" when unreadable)."""
    from ..checkpoints.fingerprint import weights_fingerprint

    try:
        return weights_fingerprint(ckpt)
    except OSError:
        return ""


def batching(model: nn.Module, scheduler: Scheduler | None, engine: BatchEngine) -> str:
    """'continuous', or one sequence at a time (the scheduler's batch lowered to 1, said on
    stderr) when some cache of the model cannot merge into a batch (`caches.why_not_merge`)
    or its layers cannot take a batch's mask (`batch_refusal` of mlx-lm's classes).
    Such caches (Llama 4's chunked one) do not keep finished prompts either: the prompt
    cache steps them back, which a chunked cache past its first chunk cannot do."""
    from ..engine import caches

    why = getattr(model, "batch_refusal", None) or caches.why_not_merge(caches.new(model))
    if why is None:
        return "continuous"
    engine.prompt_cache = None
    if scheduler is not None:
        scheduler.max_batch = 1
    eprint0(f"serve: one sequence at a time: {why}")
    return f"one sequence at a time: {why}"


def create_app(
    model: nn.Module,
    tokenizer,
    *,
    model_name: str = "llama_tp",
    max_batch: int = 8,
    max_queue: int = 64,
    prompt_cache_size: int = 10,
    defaults: Defaults | None = None,
    api_key: str | None = None,
    cors: list[str] | None = None,
    hosts: Hosts | None = None,
    max_body: int = 0,
    responses: ResponseStore | None = None,
    embedding: EmbeddingSpec | None = None,
):
    """A ready FastAPI app serving `model` in this process (one rank), e.g. for tests
    (`embedding`: the checkpoint's, `checkpoints.pooling.embedding_spec(path)`):

        app = create_app(model, tokenizer)
        uvicorn.run(app, port=8080)

    The step loop runs on a daemon thread started here (`app.state.scheduler.request_stop()`
    ends it).
    """
    scheduler = Scheduler(max_batch, max_queue)
    engine = BatchEngine(model, tokenizer, prompt_cache_size=prompt_cache_size)
    app = build_app(scheduler, defaults, api_key, cors, hosts, max_body, responses)
    use_template = (defaults or Defaults()).use_chat_template
    app.state.model = model_info(model, tokenizer, model_name, use_template, max_body, embedding)
    app.state.scheduler, app.state.engine = scheduler, engine
    app.state.monitor.ranks = world().size()
    app.state.monitor.batching = batching(model, scheduler, engine)
    scheduler.ready = True
    app.state.steps = threading.Thread(
        target=run_steps, args=(engine, scheduler, world()), name="llama_tp-steps", daemon=True
    )
    app.state.steps.start()
    return app


class HTTPThread:
    """uvicorn on a daemon thread, serving on a socket bound before the model loads."""

    def __init__(self, app, sock: socket.socket):
        import uvicorn

        config = uvicorn.Config(
            app, log_level="warning", http="h11", ws="none", lifespan="off", access_log=False
        )
        self.server = uvicorn.Server(config)
        # Not the main thread: uvicorn leaves the signal handlers to us.
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="llama_tp-http", daemon=True
        )
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def defaults_from(args: argparse.Namespace) -> Defaults:
    return Defaults(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        min_p=args.min_p,
        top_k=args.top_k,
        seed=args.seed,
        system_prompt=args.system_prompt,
        use_chat_template=not args.ignore_chat_template,
        num_draft_tokens=args.num_draft_tokens,
        template_kwargs=template_args(args.chat_template_args),
        reasoning_budget=args.reasoning_budget,
    )


def template_args(text: str | None) -> dict:
    """--chat-template-args: a JSON object of template variables (UsageError else)."""
    import json

    from ..console.cli import UsageError
    from .errors import RequestError
    from .reasoning import checked_kwargs

    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--chat-template-args is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise UsageError(f"--chat-template-args must be a JSON object, got {text[:80]!r}")
    try:
        return checked_kwargs(value, "--chat-template-args")
    except RequestError as e:
        raise UsageError(str(e)) from None


def serve(args: argparse.Namespace) -> int:
    """The command on every rank: rank 0 listens and decides, every rank computes."""
    from ..console.cli import load_checked

    group = world()  # the watchdog knows its size (console/command.py's start)
    rank0 = group.rank() == 0
    replicas = args.dp or 1
    scheduler = Scheduler(args.max_batch, args.max_queue, replicas, group.size()) if rank0 else None
    http = sock = error = None
    if rank0:
        try:
            sock = bind(args.host, args.port)
        except OSError as e:
            error = e
    agree_ok(error, group)
    if rank0:
        # Listening before the model loads: the app answers 503 "loading" meanwhile.
        hosts = Hosts(args.host, _origins(args.allowed_hosts))
        store = ResponseStore(args.responses_store_size, args.responses_store_bytes)
        app = build_app(
            scheduler, defaults_from(args), args.api_key, _origins(args.cors), hosts,
            args.max_body_bytes, store,
        )  # fmt: skip
        http = HTTPThread(app, sock)
        eprint0(f"serve: listening on http://{args.host}:{args.port}; loading the model ...")
    else:
        # Ctrl-C at a terminal reaches every rank: the others wait for rank 0's stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    t0 = time.perf_counter()
    model, tokenizer, ckpt = load_checked(args, group)
    name = args.model_name or Path(str(ckpt.path)).name
    engine = BatchEngine(model, tokenizer, prompt_cache_size=args.prompt_cache_size)
    batched = batching(model, scheduler, engine)  # every rank: the engine's prompt cache
    held = sum(all_gather_object(weight_bytes(model), group))  # every rank's, for /api/ps
    if rank0:
        meta = ckpt.metadata if ckpt.format == "gguf" else None
        info = model_info(
            model, tokenizer, name, not args.ignore_chat_template, args.max_body_bytes,
            embedding_spec(ckpt.path, meta), held, digest=digest_of(ckpt),
            details=ollama_details(ckpt),
        )  # fmt: skip
        app.state.model = info
        app.state.monitor.ranks, app.state.monitor.mesh = group.size(), ckpt.mesh
        app.state.monitor.batching = batched
        scheduler.ready = True

        def stop(signum, frame) -> None:
            scheduler.request_stop()

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)

        def fail() -> None:  # the watchdog is about to end this process
            scheduler.fail_all(f"a rank of the server failed: {watchdog.PEER_LOST}")
            time.sleep(0.5)

        watchdog.on_exit(fail)
        eprint0(
            f"serve: {name} on {group.size()} rank{'s' * (group.size() > 1)}"
            f"{_mesh_words(ckpt.mesh)}, context "
            f"{info.context} tokens, loaded in {time.perf_counter() - t0:.1f} s; ready on "
            f"http://{args.host}:{args.port}/v1 (batch {args.max_batch}, queue {args.max_queue})"
        )
    try:
        run_steps(engine, scheduler, group, ckpt.mesh)
    finally:
        if http is not None:
            http.stop()
    eprint0("serve: stopped")
    return 0


def _mesh_words(mesh) -> str:
    """' (2 replicas of --tp 1 x --pp 2: ranks 0, 1 | 2, 3)' for the start-up line."""
    if mesh is None or (mesh.pp == 1 and mesh.dp == 1):
        return ""
    shape = f"--tp {mesh.tp} x --pp {mesh.pp}"
    if mesh.dp == 1:
        return f" ({shape})"
    ranks = " | ".join(", ".join(map(str, r)) for r in mesh.replicas)
    return f" ({mesh.dp} replicas of {shape}: ranks {ranks})"


def _origins(names: str | None) -> list[str] | None:
    """--cors "https://a.example,https://b.example" (or "*") as a list of origins (and
    --allowed-hosts' names)."""
    return [o.strip() for o in names.split(",") if o.strip()] if names else None


def check_args(args: argparse.Namespace) -> None:
    """Raise UsageError for server flags out of range."""
    from ..console.cli import UsageError

    for flag in ("max_batch", "max_queue"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.num_draft_tokens <= MAX_DRAFT_TOKENS:  # a request's own limit
        raise UsageError(
            f"--num-draft-tokens must be from 0 to {MAX_DRAFT_TOKENS}, got {args.num_draft_tokens}"
        )
    if args.max_body_bytes < 0:
        raise UsageError(f"--max-body-bytes must be >= 0, got {args.max_body_bytes}")
    template_args(args.chat_template_args)
    if args.reasoning_budget < -1:
        raise UsageError(f"--reasoning-budget must be >= -1, got {args.reasoning_budget}")
    if args.prompt_cache_size < 0:
        raise UsageError(f"--prompt-cache-size must be >= 0, got {args.prompt_cache_size}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("responses_store_size", "responses_store_bytes"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")


def fastapi_missing() -> bool:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return True
    return False
