"""A server that heals itself: `python -m llama_tp.launch -n N --restart -m llama_tp.serve ...`.

A long-lived process on the launching machine owns the HTTP front door and never holds
the model; the ranks behind it (an ordinary `llama_tp.launch ... -m llama_tp.serve`,
rank 0 listening on a private port) come and go:

- `command`: the supervised command split into the launcher's flags, the supervisor's
  own and the server's; the command each generation of ranks runs.
- `hosts`: the hosts a launch names, whether each answers, and re-placing the model over
  the ones that remain (the memory-weighted plan, or a one-line refusal with the numbers).
- `ranks`: one generation of ranks: the launcher subprocess, its stderr read for fault
  lines, readiness, stopping every process it started.
- `faults`: what a fault line says (which rank, which host, what happened).
- `control`: the state machine: detect, drain, relaunch with backoff, resume; requests
  held while recovering; the figures of `/v1/status` and `/metrics`.
- `streams`: a proxied answer's events: held until the first token (so that a request
  that has not started can be replayed), and the fault event in each API's shape.
- `front`: the FastAPI app in front: the proxy, status, metrics, the page, the restart route.
- `service`: the entry point (signals, uvicorn, the exit code).

The ranks keep MLX's distributed backend between them; between the front door and
rank 0 there is only HTTP, the server's own API (docs/reliability.md).
"""
