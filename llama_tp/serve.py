"""`python -m llama_tp.serve`: an HTTP server for OpenAI, Anthropic and Ollama clients, on
one process or on every rank of a launch (rank 0 listens; all ranks compute).

    python -m llama_tp.serve --port 8080
    mlx.launch -n 2 -- python -m llama_tp.serve --model path/to/model

See llama_tp.server for the pieces and docs/serving.md for the API.
"""

from __future__ import annotations

from .console.command import script, start
from .server.runner import create_app

__all__ = ["create_app", "main"]

INSTALL_HINT = (
    'the server needs FastAPI, uvicorn and prometheus_client: pip install "llama_tp[serve]"'
)


def _parser():
    from .console.cli import ArgumentParser, add_model_args
    from .server.response_store import BYTES as STORE_BYTES
    from .server.response_store import COUNT as STORE_COUNT

    p = ArgumentParser(
        prog="python -m llama_tp.serve",
        description="Serve a model over HTTP to OpenAI (chat, completions, Responses, "
        "embeddings), Anthropic and Ollama clients, on one process or across the ranks of "
        "a launcher (rank 0 listens; llama_tp.launch --restart keeps it up through faults).",
    )
    add_model_args(p, max_tokens=256, draft=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--cors",
        default=None,
        metavar="ORIGINS",
        help="let browser pages from these origins call the API (comma-separated, or '*')",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="Host names requests may give besides the local ones and any address "
        "(comma-separated; '*.example.com' for a domain, '*' for any); others get 403",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=0,
        metavar="N",
        help="the largest request body read (default 0: room for the largest prompt the "
        "model's context can hold, at least 8 MiB); larger ones get 413",
    )
    p.add_argument("--model-name", default=None, help="the id /v1/models reports")
    p.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="sequences decoded together by each replica (default 8)",
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting at most; more get 429"
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="finished conversations kept for reuse of their prefill (default 10; 0: off)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=STORE_COUNT,
        metavar="N",
        help="responses the Responses API keeps for previous_response_id and GET "
        f"/v1/responses/ID, oldest evicted first (default {STORE_COUNT}; 0: none)",
    )
    p.add_argument(
        "--responses-store-bytes",
        type=int,
        default=STORE_BYTES,
        metavar="N",
        help="bytes the kept responses' conversations take at most, oldest evicted first "
        f"(default {STORE_BYTES >> 20} MiB)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=0,
        metavar="K",
        help="prompt-lookup drafts checked per step for requests that do not set "
        "num_draft_tokens, while a request decodes alone; the text is the same with or "
        "without (default 0: off; at most 16)",
    )
    p.add_argument(
        "--chat-template-args",
        default=None,
        metavar="JSON",
        help="chat template variables for requests that do not set them, as mlx-lm's "
        """server takes them, e.g. '{"enable_thinking": false}'""",
    )
    p.add_argument(
        "--reasoning-budget",
        type=int,
        default=-1,
        metavar="N",
        help="close a reply's think block after N tokens, for chat requests that do not set "
        "reasoning_budget_tokens (default -1: no budget; 0: answer without thinking)",
    )
    p.add_argument("--ignore-chat-template", action="store_true")
    p.set_defaults(serving=True)  # --dp (replicas) is allowed here only
    return p


def _check_installed(args) -> None:
    from .server.runner import fastapi_missing

    if fastapi_missing():
        raise RuntimeError(INSTALL_HINT)


def main() -> int:
    from .console.cli import check_model_args
    from .server.runner import check_args, serve

    return serve(start(_parser(), _check_installed, check_model_args, check_args, watch=True))


cli = script(main)  # the console script

if __name__ == "__main__":
    cli()
