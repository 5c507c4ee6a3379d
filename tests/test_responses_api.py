"""The Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}, POST
/v1/responses/input_tokens) through the real `openai` client, on an app served in this
process (one rank): the chat route's text and usage for a string or items, a forced
function call as a `function_call` item (streamed with its argument deltas), its output
sent back through `previous_response_id` and as items (the same prompt both ways), the
store, and bad bodies answered with a 400 naming the field.

The tiny model speaks Llama 3.1's chat language (the release's template and special
tokens: tests/chat_families.py), whose bare-JSON calls a named function or "required"
constrains. Its replies have no reasoning: the reasoning items are tested on chat chunks
that carry it (test_responses_translation.py).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
from chat_families import write_family_model  # noqa: E402
from test_serve_tools import ASK, TOOLS  # noqa: E402
from test_server_plumbing import serving  # noqa: E402

from llama_tp.server.protocol import Defaults  # noqa: E402
from llama_tp.server.response_store import ResponseStore  # noqa: E402
from llama_tp.server.runner import create_app  # noqa: E402

KEY = "sesame"
QUESTION = "What is the capital of France?"
# The chat route's tools in the Responses API's flat shape
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model with Llama 3.1's template behind a key; replies of 16 tokens at most
    unless a request says."""
    from llama_tp import load

    path = tmp_path_factory.mktemp("responses") / "llama3_1"
    model, tokenizer = load(write_family_model("llama3_1", path, max_position_embeddings=4096))
    app = create_app(
        model,
        tokenizer,
        model_name="tiny",
        api_key=KEY,
        defaults=Defaults(max_tokens=16),
        responses=ResponseStore(8, 1 << 20),
    )
    with serving(app) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_text_or_items_give_the_chat_routes_text(served):
    c = served
    chat = c.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=8,
    )
    text, finish = chat.choices[0].message.content, chat.choices[0].finish_reason
    r = c.responses.create(model="m", instructions="Be brief.", input=QUESTION, max_output_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert [o.type for o in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    assert r.output_text == text and r.instructions == "Be brief."
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    # Items: a developer message is the system one, content as input_text parts.
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    r2 = c.responses.create(model="m", input=items, max_output_tokens=8, store=False)
    assert (r2.output_text, r2.usage.input_tokens) == (text, r.usage.input_tokens)
    # Streamed: the event sequence, numbered, whose deltas make the same text.
    events = list(c.responses.create(model="m", input=items, max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if r.status == "completed" else "response.incomplete",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    final = events[-1].response
    assert final.output_text == text and final.usage.input_tokens == r.usage.input_tokens
    assert c.responses.input_tokens.count(model="m", input=items).input_tokens == (
        r.usage.input_tokens
    )
    # text.format: the reply constrained to a schema
    city = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": city, "strict": True}}
    r = c.responses.create(model="m", input=QUESTION, text=fmt, max_output_tokens=40)
    assert json.loads(r.output_text)["city"] in ("Paris", "Lima") and r.status == "completed"
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"
    # top_logprobs: each token's, as the chat route gives them
    r = c.responses.create(model="m", input=QUESTION, max_output_tokens=3, top_logprobs=2)
    part = r.output[0].content[0]
    assert 0 < len(part.logprobs) <= r.usage.output_tokens  # not the end of sequence's
    assert "".join(t.token for t in part.logprobs) == part.text
    assert all(len(t.top_logprobs) == 2 for t in part.logprobs)


def _call(r) -> tuple[str, dict]:
    (item,) = r.output
    assert item.type == "function_call" and item.id.startswith("fc_") and item.call_id
    return item.name, json.loads(item.arguments)


def test_a_forced_call_and_its_output_sent_back(served):
    c = served
    ask = {"model": "m", "input": ASK[0]["content"], "tools": FLAT, "max_output_tokens": 200}
    r = c.responses.create(**ask, tool_choice=NAMED)
    name, args = _call(r)
    assert r.status == "completed" and name == "get_weather"
    assert args["city"] in ("Paris", "Tokyo", "Lima")
    with c.responses.stream(**ask, tool_choice=NAMED) as s:
        events = list(s)
        streamed = s.get_final_response()
    assert _call(streamed) == (name, args)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and "".join(deltas) == streamed.output[0].arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == streamed.output[0].arguments
    # "required": one of the tools
    required = c.responses.create(**ask, tool_choice="required")
    assert _call(required)[0] in ("get_weather", "get_time")

    # The next turn: the call's output, after the stored conversation or with it as items.
    call = r.output[0]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    turn = {"model": "m", "tools": FLAT, "max_output_tokens": 6}
    after = c.responses.create(**turn, previous_response_id=r.id, input=[output])
    items = [
        *ASK,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": name,
            "arguments": call.arguments,
        },
        output,
    ]
    explicit = c.responses.create(**turn, input=items, store=False)
    assert after.usage.input_tokens == explicit.usage.input_tokens
    assert after.output_text == explicit.output_text and after.previous_response_id == r.id
    # ... which is the chat route's prompt for the same turn
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C", "name": name},
    ]
    chat = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=6)
    assert chat.usage.prompt_tokens == after.usage.input_tokens
    assert chat.choices[0].message.content == after.output_text

    # The store: GET answers what was kept, DELETE forgets it; store: false keeps nothing.
    assert c.responses.retrieve(r.id).output[0].call_id == call.call_id
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(explicit.id)
    c.responses.delete(after.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(after.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(after.id)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(**turn, previous_response_id=after.id, input="and then?")
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"


BAD = [  # (the request's fields, the field the 400 names)
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
    ),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
        "input[0].call_id",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{"}]},
        "input[0].arguments",
    ),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": None}, "input"),
    ({"input": "x" * 5_000_000}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [*FLAT, FLAT[0]]}, "tools[2].name"),
    ({"tools": FLAT, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": FLAT, "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    (
        {
            "tools": FLAT,
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "x"}],
            },
        },
        "tool_choice.tools[0]",
    ),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"metadata": {str(k): "v" for k in range(17)}}, "metadata"),
    ({"background": True}, "background"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
]


@pytest.mark.parametrize("change, param", BAD, ids=[p for _, p in BAD])
def test_a_bad_body_is_a_400_naming_the_field(served, change, param):
    body = {"model": "m", "input": "hi", "max_output_tokens": 2, **change}
    with pytest.raises(openai.BadRequestError) as e:
        served.responses.create(**{k: v for k, v in body.items() if v is not None})
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["message"].startswith(f"'{param}'") or param == "input", e.value.body
