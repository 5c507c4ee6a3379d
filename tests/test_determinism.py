"""The same request gives the same text through every driver (docs/determinism.md)."""

from __future__ import annotations

import pytest
from conftest import run_python

PROMPT = "Tell me a story about a cat."


@pytest.fixture(scope="module")
def built_in_server():
    """The built-in model served in this process by uvicorn on a free port: its base URL."""
    pytest.importorskip("fastapi")
    from llama_tp import load
    from llama_tp.server.runner import HTTPThread, bind, create_app

    model, tokenizer = load()
    sock = bind("127.0.0.1", 0)
    app = create_app(model, tokenizer)
    http = HTTPThread(app, sock)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        http.stop()
        app.state.scheduler.request_stop()
        app.state.steps.join(10)


def test_generate_and_the_server_sample_the_same_text(built_in_server):
    """The issue's symptom: `generate --temp 1 --seed 5` and the server asked the same chat
    message with seed 5 and temperature 1 answered different texts."""
    openai = pytest.importorskip("openai")
    args = ["-m", "llama_tp.generate", "--prompt", PROMPT, "--temp", "1", "--seed", "5"]
    gen = run_python([*args, "--max-tokens", "12"], timeout=120)
    assert gen.returncode == 0, gen.stderr
    client = openai.OpenAI(base_url=built_in_server, api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": PROMPT}],
        temperature=1,
        seed=5,
        max_tokens=12,
    )
    assert r.choices[0].message.content == gen.stdout[:-1]
