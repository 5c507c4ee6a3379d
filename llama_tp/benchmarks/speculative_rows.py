"""Speculative-decoding rows: one `python -m llama_tp.bench --prompt TEXT [--draft ...]
--json` run on 1 process or N ranks started directly (MLX_RANK + a ring hostfile), and
the prompts they use (a free-form question, a "repeat this passage" request). Used by
bench/spec_bench.py and bench/speculative.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..cluster.blas import find_openblas

PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed La dame de fer, it was constructed as the "
    "centerpiece of the 1889 World's Fair, and to crown the centennial anniversary of the "
    "French Revolution. Although initially criticised by some of France's leading artists "
    "and intellectuals for its design, it has since become a global cultural icon of France."
)
PROMPTS = {
    "question": "What are the main differences between a violin and a viola? "
    "Answer in a few sentences.",
    "repeat": f"Repeat the following passage word for word.\n\n{PASSAGE}",
}


def run_row(
    model: str, ranks: int, prompt: str, draft: str | None, a: argparse.Namespace
) -> dict | None:
    """Rank 0's JSON (None when the run failed); `a`: g, n, k, k_model, openblas, timeout."""
    cmd = [sys.executable, "-m", "llama_tp.bench", "--model", model, "--prompt", prompt]
    cmd += ["-g", str(a.g), "-n", str(a.n), "--json", "--collective-steps", "0"]
    if draft:
        cmd += ["--draft", draft, "--num-draft-tokens", str(a.k if draft == "ngram" else a.k_model)]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    if a.openblas and find_openblas():
        env["LD_PRELOAD"] = find_openblas()
    if ranks == 1:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        out = p.stdout
    else:
        port = 36000 + (os.getpid() % 300) * 20
        host = Path(tempfile.mkstemp(suffix=".json")[1])
        host.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)]))
        procs = [
            subprocess.Popen(
                cmd,
                env={**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(host)},
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            for r in range(ranks)
        ]
        out = procs[0].communicate(timeout=a.timeout)[0]
        for p in procs[1:]:
            p.wait(timeout=60)
        host.unlink()
    line = next((x for x in out.splitlines() if x.startswith("{")), None)
    return json.loads(line) if line else None
