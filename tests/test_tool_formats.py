"""Every tool-call format's parser on recorded replies (conversation/tool_formats/): the
replies of llama.cpp's tests/test-chat.cpp and vLLM's tool-parser tests, each read whole
and streamed cut at every position, giving the same content and calls, the calls'
argument fragments joined being the JSON text of the whole reply's arguments; which
format each release's template teaches (tests/chat_families.py), and that every native
family's registry row names formats that exist."""

from __future__ import annotations

import json

import pytest
from chat_families import FAMILIES

from llama_tp.conversation.tool_calls import ToolStream, tool_format
from llama_tp.conversation.tool_formats import FORMATS, ReplySplitter
from llama_tp.models.registry import FAMILIES as ROWS
from llama_tp.models.registry import GGUF_FAMILIES


def _fn(fn_name: str, **props) -> dict:
    return {"type": "function", "function": {"name": fn_name, "parameters": {
        "type": "object", "properties": props}}}  # fmt: skip


TOOLS = [
    _fn("get_weather", city={"type": "string"}, unit={"enum": ["celsius", "fahrenheit"]}),
    _fn("get_time", city={"type": "string"}),
    _fn("special_function", arg1={"type": "integer"}),
    _fn("special_function_with_opt", arg1={"type": "integer"}, arg2={"type": "integer"}),
    _fn("python", code={"type": "string"}),
    _fn("todo_list", todos={"type": "array", "items": {"type": "object"}}),
    _fn("set_nullable", name={"type": ["string", "null"]}, count={"type": ["integer", "null"]}),
    _fn("set_union", value={"anyOf": [{"type": "string"}, {"type": "object"}]}),
    _fn("edit", oldString={"type": "string"}, newString={"type": "string"},
        replaceAll={"type": "boolean"}),
]  # fmt: skip
W = {"city": "Paris"}
CODE = 'def hello():\n    print("Hello, world!")\n\nhello()'
NESTED = {"todos": [{"item": "Check stuff", "selected": False}, {"item": "格 ünï", "n": [1, 2.5]}]}

# (format, reply, content, [(name, arguments)], reasoning)
CASES = [
    # Hermes (Qwen2.5/3): vLLM's test_hermes_tool_parser, llama.cpp's Qwen/Hermes cases
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", W)], ""),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
     '\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>',
     "Let me check.\n", [("get_weather", W), ("get_time", {})], ""),
    ("hermes", '<tool_call>{"name": "todo_list", "arguments": ' + json.dumps(NESTED) + "}"
     "</tool_call>\nDone.", "\nDone.", [("todo_list", NESTED)], ""),
    ("hermes", '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n'
     "</tool_call>", "", [("python", {"code": "print(1)"})], ""),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', "", [("get_time", {})], ""),
    ("hermes", "a <tool_call> b", "a <tool_call> b", [], ""),
    ("hermes", '<tool_call>\n{"nam": "x"}\n</tool_call> ok', '<tool_call>\n{"nam": "x"}\n'
     "</tool_call> ok", [], ""),
    ("hermes", '<think>\nLet me call <tool_call>? No, later.\n</think>\n\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "<think>\nLet me call <tool_call>? No, later.\n</think>\n\n", [("get_weather", W)], ""),
    # Qwen3-Coder's XML (and Qwen3.5, Nemotron 3 Nano, Step-3.5): llama.cpp's cases
    ("qwen3_coder", "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>"
     "\n</function>\n</tool_call>", "", [("special_function", {"arg1": 1})], ""),
    ("qwen3_coder", "Let me call it.\n<function=special_function>\n<parameter=arg1>\n1\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=special_function_with_opt>"
     "\n<parameter=arg1>\n1\n</parameter>\n<parameter=arg2>\n2\n</parameter>\n</function>\n"
     "</tool_call>", "Let me call it.\n",
     [("special_function", {"arg1": 1}),
      ("special_function_with_opt", {"arg1": 1, "arg2": 2})], ""),
    ("qwen3_coder", f"<tool_call>\n<function=python>\n<parameter=code>\n{CODE}\n</parameter>\n"
     "</function>\n</tool_call>", "", [("python", {"code": CODE})], ""),
    ("qwen3_coder", "<tool_call>\n<function=todo_list>\n<parameter=todos>\n"
     + json.dumps(NESTED["todos"]) + "\n</parameter>\n</function>\n</tool_call>", "",
     [("todo_list", NESTED)], ""),
    ("qwen3_coder", "<tool_call>\n<function=set_nullable>\n<parameter=name>\nnull\n</parameter>\n"
     "<parameter=count>\n42\n</parameter>\n</function>\n</tool_call>", "",
     [("set_nullable", {"name": None, "count": 42})], ""),
    ("qwen3_coder", "<tool_call>\n<function=set_union>\n<parameter=value>\n{not valid json\n"
     "</parameter>\n</function>\n</tool_call>", "",
     [("set_union", {"value": "{not valid json"})], ""),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "",
     [("get_time", {})], ""),
    ("qwen3_coder", "<tool_call>\n<function get_weather>\n</tool_call>",
     "<tool_call>\n<function get_weather>\n</tool_call>", [], ""),
    # GLM-4.5/4.6 and 4.7/5 (vLLM's glm4_moe tests, the templates' spellings)
    ("glm45", "I'll check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>",
     "I'll check.", [("get_weather", {"city": "Paris", "unit": "celsius"})], ""),
    ("glm47", "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value>"
     "</tool_call><tool_call>get_time</tool_call>", "",
     [("special_function", {"arg1": 1}), ("get_time", {})], ""),
    ("glm47", "<tool_call>todo_list<arg_key>todos</arg_key><arg_value>"
     + json.dumps(NESTED["todos"]) + "</arg_value></tool_call>", "", [("todo_list", NESTED)], ""),
    # MiniMax-M2 (vLLM's minimax_m2 tests)
    ("minimax_m2", 'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter '
     'name="city">Paris</parameter>\n<parameter name="unit">celsius</parameter>\n</invoke>\n'
     '<invoke name="special_function">\n<parameter name="arg1">7</parameter>\n</invoke>\n'
     "</minimax:tool_call>", "Sure.\n",
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("special_function", {"arg1": 7})], ""),
    # DeepSeek V3.2's DSML (llama.cpp's cases)
    ("deepseek_v3_2", "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_time\">\n"
     '<｜DSML｜parameter name="city" string="true">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     '<｜DSML｜invoke name="special_function">\n<｜DSML｜parameter name="arg1" string="false">1'
     "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", "",
     [("get_time", {"city": "Tokyo"}), ("special_function", {"arg1": 1})], ""),
    # DeepSeek V3 (R1, 0324) and V3.1
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
     '```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
     '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", "",
     [("get_time", {"city": "Tokyo"}), ("get_weather", W)], ""),
    ("deepseek_v3_1", "CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
     '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
     '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "CONTENT",
     [("get_time", W), ("get_weather", W)], ""),
    ("deepseek_v3_1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get time<｜tool▁sep｜>{}",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get time<｜tool▁sep｜>{}", [], ""),
    # Kimi K2 (vLLM's kimi_k2 tests) and K3's XTML (llama.cpp's)
    ("kimi_k2", "I'll look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
     "functions.todo_list:1<|tool_call_argument_begin|>" + json.dumps(NESTED)
     + "<|tool_call_end|><|tool_calls_section_end|>", "I'll look.",
     [("get_weather", W), ("todo_list", NESTED)], ""),
    ("kimi_k3", "<|open|>response<|sep|>On it.<|close|>response<|sep|><|open|>tools<|sep|>"
     '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"'
     "<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool=\"todo_list\" "
     'index="2"<|sep|><|open|>json type="object"<|sep|>' + json.dumps(NESTED)
     + "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>", "On it.",
     [("get_weather", W), ("todo_list", NESTED)], ""),
    # Mistral: the JSON list (v3, Nemo) and name[ARGS] (Small 3.2, Ministral 3)
    ("mistral_json", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": '
     '"abc123def"}, {"name": "get_time", "arguments": {}}]', "",
     [("get_weather", W), ("get_time", {})], ""),
    ("mistral_args", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]special_function'
     '[CALL_ID]abc123def[ARGS]{"arg1": 1}', "",
     [("get_weather", W), ("special_function", {"arg1": 1})], ""),
    ("mistral_args", "[TOOL_CALLS]get_weather(city='Paris')",
     "[TOOL_CALLS]get_weather(city='Paris')", [], ""),
    # Nemotron Nano v2
    ("nemotron_v2", 'Checking.\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}, {"name": "get_time", "arguments": {"city": "Tokyo"}}]</TOOLCALL>', "Checking.\n",
     [("get_weather", W), ("get_time", {"city": "Tokyo"})], ""),
    # Llama 3.x (vLLM's llama3_json tests) and 4
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", W)], ""),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather",'
     ' "parameters": {"city": "Paris"}}', "", [("get_time", {}), ("get_weather", W)], ""),
    ("llama3_json", "The weather {in Paris} is fine.", "The weather {in Paris} is fine.", [], ""),
    ("llama3_json", "<|python_tag|>brave_search.call(query=\"x\")",
     "<|python_tag|>brave_search.call(query=\"x\")", [], ""),
    ("llama4_json", '<|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city":'
     ' "Paris"}}{"name": "get_time", "parameters": {}}', "",
     [("get_weather", W), ("get_time", {})], ""),
    # gpt-oss's harmony (llama.cpp's cases)
    ("harmony", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>"
     "final<|message|>Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", [], "I'm\nthinking"),
    ("harmony", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions."
     'special_function<|channel|>analysis<|message|>{"arg1": 1}', "",
     [("special_function", {"arg1": 1})], "I'm\nthinking"),
    ("harmony", "<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|"
     "channel|>commentary to=functions.edit <|constrain|>json<|message|>{\"oldString\": \"if (part"
     ' < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}', "",
     [("edit", {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {",
                "replaceAll": False})], "Thinking about edit..."),
    ("harmony", "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking"
     "<|end|><|start|>assistant<|channel|>final<|message|>Hello", "Hello", [], "I'm\nthinking"),
    ("harmony", "<|channel|>analysis<|message|>I will run python<|end|><|start|>assistant to="
     "container.exec<|channel|>commentary<|message|>python3 -c 'print(1)'", "", [],
     "I will run python"),
    # Gemma 4 and FunctionGemma
    ("gemma4", 'On it.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,unit:<|"|>celsius<|"|>}'
     '<tool_call|><|tool_call>call:todo_list{todos:[{item:<|"|>Check stuff<|"|>,selected:false},'
     '{item:<|"|>格 ünï<|"|>,n:[1,2.5]}]}<tool_call|>', "On it.",
     [("get_weather", {"city": "Paris, FR", "unit": "celsius"}), ("todo_list", NESTED)], ""),
    ("gemma4", "<|tool_call>call:get_time{}<tool_call|>", "", [("get_time", {})], ""),
    ("function_gemma", "<start_function_call>call:get_weather{city:<escape>Paris<escape>,unit:"
     "<escape>celsius<escape>}<end_function_call>", "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})], ""),
]  # fmt: skip


def _run(name: str, pieces: list[str]) -> tuple[str, str, list[tuple], list[dict]]:
    """(reasoning, content, [(id, name, arguments)], the deltas) of a reply fed in `pieces`."""
    split = ReplySplitter(FORMATS[name], TOOLS, "call_")
    deltas = [split.feed(p) for p in pieces] + [split.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    calls = [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in split.tool_calls()
    ]
    return reasoning, content, calls, [c for d in deltas for c in d.calls]


def _joined(deltas: list[dict]) -> dict[int, tuple]:
    """Each call's (id, name, arguments) from its deltas, checking their shape."""
    out: dict[int, tuple] = {}
    for d in deltas:
        i, fn = d["index"], d["function"]
        if i not in out:
            assert d["type"] == "function" and d["id"] and fn["name"], d
            assert i == len(out), "calls come in order"
            out[i] = (d["id"], fn["name"], fn["arguments"])
        else:
            assert set(d) == {"index", "function"} and set(fn) == {"arguments"}, d
            out[i] = (*out[i][:2], out[i][2] + fn["arguments"])
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{k}" for k, c in enumerate(CASES)])
def test_a_recorded_reply_gives_its_content_and_calls_however_it_is_cut(case):
    name, reply, content, calls, reasoning = case
    whole = _run(name, [reply])
    assert whole[:2] == (reasoning, content)
    assert [(n, json.loads(a)) for _, n, a in whole[2]] == calls
    assert list(_joined(whole[3]).values()) == whole[2]
    cuts = [[reply[:i], reply[i:]] for i in range(1, len(reply))] + [list(reply)]
    for pieces in cuts:
        got = _run(name, pieces)
        assert got[:3] == whole[:3], pieces
        assert list(_joined(got[3]).values()) == whole[2], pieces


def test_arguments_stream_as_they_are_written():
    """A JSON call's arguments reach the client as the model writes them; a parameter
    format's as each parameter completes."""
    s = ToolStream(FORMATS["hermes"], TOOLS)
    assert s.feed('Sure. <tool_call>\n{"name": "python", "arguments": {"code": "pri') == "Sure. "
    first = s.deltas()
    assert first[0]["function"] == {"name": "python", "arguments": '{"code": "pri'}
    assert s.feed('nt(1)"}}\n</tool_call>') == "" and s.deltas() == [
        {"index": 0, "function": {"arguments": 'nt(1)"}'}}
    ]
    assert s.finish()[1][0]["function"]["arguments"] == '{"code": "print(1)"}'
    assert s.finish() == ("", [])  # finished once
    s = ToolStream(FORMATS["qwen3_coder"], TOOLS)
    s.feed("<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n</param")
    assert [d["function"]["arguments"] for d in s.deltas()] == [""]  # the name, at once
    s.feed("eter>\n<parameter=arg2>\n")
    assert s.deltas() == [{"index": 0, "function": {"arguments": '{"arg1": 1'}}]


def test_long_replies_in_small_pieces():
    """Text and arguments far longer than what the reader keeps between pieces."""
    prose = "".join(f"Line {k}: the weather <tool is fine.\n" for k in range(400))
    code = "".join(f"print({k}, '</tool_call>')\n" for k in range(400))
    replies = {
        "hermes": prose + "<tool_call>\n" + json.dumps({"name": "python", "arguments": {
            "code": code}}) + "\n</tool_call>",
        "qwen3_coder": prose + f"<tool_call>\n<function=python>\n<parameter=code>\n{code}\n"
        "</parameter>\n</function>\n</tool_call>",
        "harmony": f"<|channel|>analysis<|message|>{prose}<|end|><|start|>assistant<|channel|>"
        "commentary to=functions.python <|constrain|>json<|message|>" + json.dumps({"code": code}),
    }  # fmt: skip
    for name, reply in replies.items():
        whole = _run(name, [reply])
        assert whole[2][0][1] == "python" and json.loads(whole[2][0][2]) == {"code": code}
        assert prose in (whole[0] + whole[1])
        for step in (7, 4096):
            pieces = [reply[i : i + step] for i in range(0, len(reply), step)]
            got = _run(name, pieces)
            assert got[:3] == whole[:3], (name, step)
            assert list(_joined(got[3]).values()) == whole[2]


def _reply(name: str, calls: int = 2) -> str:
    """The first recorded reply of format `name` with that many calls."""
    return next(c[1] for c in CASES if c[0] == name and len(c[3]) == calls)


def test_ids_are_the_models_or_the_prefix_or_mistrals_nine_characters():
    kimi = _run("kimi_k2", [_reply("kimi_k2")])[2]
    assert [i for i, _, _ in kimi] == ["functions.get_weather:0", "functions.todo_list:1"]
    assert [i for i, _, _ in _run("hermes", [_reply("hermes")])[2]] == ["call_0", "call_1"]
    ids = [i for i, _, _ in _run("mistral_args", [_reply("mistral_args")])[2]]
    assert ids[1] == "abc123def" and len(ids[0]) == 9 and ids[0].isalnum()
    assert ids == [i for i, _, _ in _run("mistral_args", [_reply("mistral_args")])[2]]  # prefix
    random = ToolStream(FORMATS["mistral_json"], TOOLS)
    random.feed(_reply("mistral_json"))
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in random.finish()[1])


# -- which format a model has --------------------------------------------------------------

TEMPLATE_FORMAT = {  # each release's template -> the format it teaches
    "qwen3": "hermes", "qwen3_coder": "qwen3_coder", "qwen3_next": "hermes",
    "qwen3_5": "qwen3_coder", "qwen2_5": "hermes", "deepseek_v3_1": "deepseek_v3_1",
    "deepseek_v3_2": "deepseek_v3_2", "deepseek_v3_0324": "deepseek_v3",
    "deepseek_r1_distill_llama": "deepseek_v3", "kimi_k2": "kimi_k2",
    "kimi_k2_thinking": "kimi_k2", "kimi_linear": "kimi_k2", "kimi_k3": "kimi_k3",
    "glm4_6": "glm45", "glm4_7": "glm47", "glm5": "glm47", "minimax_m2": "minimax_m2",
    "gpt_oss": "harmony", "gemma4": "gemma4", "step3_5": "qwen3_coder",
    "nemotron_3_nano": "qwen3_coder", "nemotron_nano_v2": "nemotron_v2",
    "llama3_1": "llama3_json", "llama3_3": "llama3_json", "llama4": "llama4_json",
    "mistral_small_3_2": "mistral_args", "ministral_3_reasoning": "mistral_args",
    "mixtral": "mistral_json",
}  # fmt: skip


class _Tokenizer:
    """What detection reads of a tokenizer: its template and vocabulary."""

    def __init__(self, template: str | None, vocab: dict | None = None):
        self.chat_template, self._vocab = template, vocab or {}

    def get_vocab(self) -> dict:
        return self._vocab


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.tools))
def test_each_release_template_teaches_its_format(name):
    family = FAMILIES[name]
    tok = _Tokenizer(family.chat_template, dict.fromkeys(family.tokens, 0))
    assert tool_format(tok, family.model_type).name == TEMPLATE_FORMAT[name]
    assert tool_format(tok).name == TEMPLATE_FORMAT[name]  # without the row too
    if family.model_type != "llama":  # (a Llama folder may hold another family's template)
        assert TEMPLATE_FORMAT[name] in ROWS[family.model_type].tools


def test_detection_rows_first_then_templates_then_vocabulary():
    # Qwen3-Coder ships as qwen3_moe, whose row says Hermes first: its template decides.
    coder = _Tokenizer(FAMILIES["qwen3_coder"].chat_template)
    assert tool_format(coder, "qwen3_moe").name == "qwen3_coder"
    # A GGUF architecture reads its family's row.
    ds = _Tokenizer(FAMILIES["deepseek_v3_1"].chat_template)
    assert tool_format(ds, "deepseek2").name == "deepseek_v3_1"
    # No template that shows tools: the vocabulary's own tokens (Gemma 3 shows none).
    vocab = dict.fromkeys(FAMILIES["kimi_k2"].tokens, 0)
    assert tool_format(_Tokenizer(None, vocab), "kimi_k2").name == "kimi_k2"
    gemma3 = FAMILIES["gemma3"]
    assert tool_format(_Tokenizer(gemma3.chat_template, dict.fromkeys(gemma3.tokens, 0))) is None
    # mlx-lm's inference for a format llama_tp has no description of: its parser as is
    pythonic = tool_format(_Tokenizer("{{ '<|tool_call_start|>' }}"))
    assert pythonic.name == "mlx_lm.pythonic" and pythonic.grammar is None
    s = ToolStream(pythonic, None)
    text = s.feed('Sure<|tool_call_start|>[get_time(city="Lima")]<|tool_call_end|>')
    rest, calls = s.finish()
    assert text + rest == "Sure" and calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Lima"}


def test_every_native_family_names_tool_formats_that_exist():
    for model_type, row in ROWS.items():
        assert row.tools, f"{model_type}: no tool format"
        assert set(row.tools) <= set(FORMATS), f"{model_type}: {row.tools}"
    for arch, row in GGUF_FAMILIES.items():
        assert ROWS[row.model_type].tools, arch
