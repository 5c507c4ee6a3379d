"""A server that heals itself: `python -m llama_tp.launch -n N --restart -m llama_tp.serve ...`.

A long-lived process on the launching machine owns the HTTP front door and never holds
the model; the ranks behind it (an ordinary `llama_tp.launch ... -m llama_tp.serve`,
rank 0 listening on a private port) come and go:

- `command`: the supervised command split into the launcher's flags, the supervisor's
  own and the server's; the command each generation of ranks runs.
- `hosts`: the hosts a launch names and whether each answers; `replacement`: the model
  re-placed over the ones that remain (memory-weighted), or one line saying why not.
- `ranks`: one generation of ranks: the launcher subprocess, its stderr read for fault
  lines, readiness, stopping every process it started.
- `faults`: what a fault line says (which rank, which host, what happened).
- `control`: the state machine: detect, drain, relaunch with backoff, resume.
- `admission`: the requests' side: held while recovering, up to a bound; what a stream
  cut off is told; the `supervisor` section of `/v1/status` (`metrics`: of `/metrics`).
- `streams`: a proxied answer's events: held until the first token (so that a request
  that has not started can be replayed), and the fault event in each API's shape.
- `front`: the FastAPI app in front: the proxy, status, metrics, the page, the restart route.
- `service`: the entry point (signals, uvicorn, the exit code).

The ranks keep MLX's distributed backend between them; between the front door and
rank 0 there is only HTTP, the server's own API (docs/reliability.md).
"""
