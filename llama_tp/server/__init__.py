"""The server behind `python -m llama_tp.serve`: OpenAI's, Anthropic's and Ollama's APIs.

- `protocol`: request validation (errors naming the field);
- `responses`: the response bodies and stream chunks;
- `app`: the FastAPI routes, authentication and server-sent events;
- `scheduler`: rank 0's queue and per-step decisions, and the step loop of every rank;
- `runner`: `create_app` (in-process, one rank) and the command's run on every rank;
- `status`, `metrics`, `page/`: every rank's figures gathered to rank 0 (`GET /v1/status`),
  Prometheus metrics (`GET /metrics`), the chat page (`GET /`).

FastAPI and uvicorn are an optional extra (`pip install "llama_tp[serve]"`);
importing this package does not need them.
"""

from __future__ import annotations

from .protocol import Defaults, RequestError
from .runner import create_app
from .scheduler import Scheduler
from .step_loop import run_steps

__all__ = ["Defaults", "RequestError", "Scheduler", "create_app", "run_steps"]
