"""The chat page, GET /v1/status and GET /metrics on one rank (an app served in this
process); tests/test_chat_page.py has the 2-rank server and the browser."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")
from serve_client import KEY, http, serving  # noqa: E402
from test_server_plumbing import client  # noqa: E402

from llama_tp.server.runner import create_app  # noqa: E402


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text page (the client's parser)."""
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(base: str) -> dict:
    code, text = http(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert code == 200, text
    return samples(text)


def status(base: str, key: str = KEY) -> tuple[int, dict]:
    code, text = http(f"{base}/v1/status", headers={"Authorization": f"Bearer {key}"})
    return code, json.loads(text)


def wait_for_reports(base: str, ranks: int, timeout: float = 30) -> dict:
    """The status once every rank has reported after this call (they do about once a
    second), so that the reports cover what happened before it."""
    start = time.monotonic()
    while True:
        code, body = status(base)
        assert code == 200, body
        age = body["reported_seconds_ago"]
        fresh = age is not None and age < time.monotonic() - start
        if (fresh and len(body["ranks"]) == ranks) or time.monotonic() > start + timeout:
            return body
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tiny_dir):
    from llama_tp import load

    model, tokenizer = load(tiny_dir)
    app = create_app(model, tokenizer, model_name="tiny", api_key=KEY)
    with serving(app) as base:
        yield base


def test_page_is_served_without_a_key_and_speaks_the_public_api(served):
    code, page = http(f"{served}/")
    assert code == 200 and "<title>llama_tp</title>" in page
    # What it calls: the public routes, relative to where it was loaded from.
    assert '"v1/chat/completions"' in page and '"v1/status"' in page
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere


def test_status_and_metrics_need_the_key(served):
    assert status(served, "wrong")[0] == 401
    code, text = http(f"{served}/metrics", headers={"Authorization": "Bearer wrong"})
    assert code == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"


def test_status_lists_the_rank_and_metrics_move_with_traffic(served):
    body = wait_for_reports(served, 1)
    assert body["model"] == "tiny" and body["state"] == "ok"
    assert body["mesh"] == {"ranks": 1, "tp": 1, "pp": 1, "dp": 1}
    (rank,) = body["ranks"]
    assert rank["rank"] == 0 and rank["stage"] == 0 and rank["tensor"] == 0
    assert rank["active_memory"] > 0 and rank["peak_memory"] >= rank["active_memory"]
    assert body["watchdog"]["active"] is False  # one process: no watchdog
    before = scrape(served)
    c = client(served, KEY)
    messages = [{"role": "user", "content": "Hello there"}]
    r = c.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    # The next turn starts with the first one: a prompt-cache hit.
    messages += [{"role": "assistant", "content": r.choices[0].message.content}]
    messages += [{"role": "user", "content": "And then?"}]
    r2 = c.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="m", messages=messages, temperature=3)
    after = scrape(served)

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    route = "/v1/chat/completions"
    assert moved("llama_tp_requests_total", route=route, status="200") == 2
    assert moved("llama_tp_requests_total", route=route, status="400") == 1
    assert moved("llama_tp_requests_total", route="/metrics", status="200") == 1
    assert moved("llama_tp_prompt_tokens_total") == r.usage.prompt_tokens + r2.usage.prompt_tokens
    out = r.usage.completion_tokens + r2.usage.completion_tokens
    assert moved("llama_tp_completion_tokens_total") == out
    assert moved("llama_tp_prompt_cache_hits_total") == 1
    assert moved("llama_tp_prompt_cached_tokens_total") == (
        r2.usage.prompt_tokens_details.cached_tokens
    )
    assert moved("llama_tp_time_to_first_token_seconds_count") == 2
    # Every token after a request's first has its latency.
    assert moved("llama_tp_time_per_output_token_seconds_count") == out - 2
    assert moved("llama_tp_batch_size_count") >= out - 2
    assert after[("llama_tp_queue_depth", ())] == 0
    assert after[("llama_tp_rank_memory_bytes", (("kind", "active"), ("rank", "0")))] > 0
    wait_for_reports(served, 1)  # a report after the steps carries their time
    assert ("llama_tp_rank_step_seconds", (("rank", "0"),)) in scrape(served)
    assert status(served)[1]["totals"]["completion_tokens"] >= out


def test_two_apps_in_one_process_keep_their_own_counts(tiny_dir, served):
    from llama_tp import load

    model, tokenizer = load(tiny_dir)
    app = create_app(model, tokenizer, model_name="other", api_key=KEY)
    with serving(app) as base:
        before = scrape(served)
        client(base, KEY).models.list()
        assert (
            scrape(base)[("llama_tp_requests_total", (("route", "/v1/models"), ("status", "200")))]
            == 1
        )
        assert scrape(served).get(
            ("llama_tp_requests_total", (("route", "/v1/models"), ("status", "200")))
        ) == before.get(("llama_tp_requests_total", (("route", "/v1/models"), ("status", "200"))))
