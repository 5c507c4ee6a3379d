"""Every tool-call format llama_tp reads and forces, one description each (`FORMATS`),
and which one a model's tokenizer teaches (`detect`).

The families' rows (`models/registry.py`, `Family.tools`) name the formats their
releases use; `detect(tokenizer, model_type)` takes the first of the row's formats whose
markers the chat template holds, then mlx-lm's own inference (a format of ours, or one
of mlx-lm's parsers kept as it is: `mlx_format`), then any format the template shows,
then a format whose own tokens the vocabulary holds (a template that does not show
tools). The parsers live in `json_calls.py`, `xml_calls.py`, `gemma_calls.py` and
`harmony.py`, the grammars in `grammars.py`.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import gemma_calls as g
from . import grammars
from . import json_calls as j
from . import xml_calls as x
from .base import Calls, ToolFormat, marked
from .harmony import harmony
from .reader import Reader, Step, until

_FORMATS = [
    ToolFormat("qwen3_coder", x.qwen3_coder, grammars.qwen3_coder,
               ("<function=", "<parameter="), start="<tool_call>", end="</tool_call>"),
    ToolFormat("glm45", x.glm, grammars.glm(newlines=True), ("<arg_key>", "\n<arg_key>"),
               start="<tool_call>", end="</tool_call>"),
    ToolFormat("glm47", x.glm, grammars.glm(newlines=False), ("<arg_key>",), ("\n<arg_key>",),
               start="<tool_call>", end="</tool_call>"),
    ToolFormat("hermes", j.hermes, grammars.hermes, ("<tool_call>",),
               ("<function=", "<arg_key>", "<invoke name="), start="<tool_call>",
               end="</tool_call>"),
    ToolFormat("minimax_m2", x.minimax_m2, grammars.minimax_m2, ("<minimax:tool_call>",),
               tokens=("<minimax:tool_call>",), start=x.MINIMAX, end=x.MINIMAX_END),
    ToolFormat("deepseek_v3_2", x.deepseek_v3_2, grammars.deepseek_v3_2,
               (x.DSML, "invoke name="), start=x.DSML_CALLS, end=x.DSML_CALLS_END),
    ToolFormat("deepseek_v3", j.deepseek_v3, grammars.deepseek_v3, (j.DS_CALLS, "```json"),
               start=j.DS_CALLS, end=j.DS_CALLS_END),
    ToolFormat("deepseek_v3_1", j.deepseek_v3_1, grammars.deepseek_v3_1, (j.DS_CALLS,),
               ("```json",), tokens=(j.DS_CALLS, j.DS_SEP), start=j.DS_CALLS,
               end=j.DS_CALLS_END),
    ToolFormat("kimi_k2", j.kimi_k2, grammars.kimi_k2, (j.KIMI_SECTION,),
               tokens=(j.KIMI_SECTION,), start=j.KIMI_SECTION, end=j.KIMI_SECTION_END),
    ToolFormat("kimi_k3", x.kimi_k3, grammars.kimi_k3, ("<|open|>", "<|close|>", "'call'"),
               tokens=("<|open|>", "<|close|>", "<|sep|>"), start=x.K3_TOOLS,
               end=x.K3_TOOLS_END),
    ToolFormat("mistral_args", j.mistral, grammars.mistral_args, ("[TOOL_CALLS]", "[ARGS]"),
               tokens=("[TOOL_CALLS]", "[ARGS]"), start="[TOOL_CALLS]", short_ids=True),
    ToolFormat("mistral_json", j.mistral, grammars.mistral_json, ("[TOOL_CALLS]",),
               ("[ARGS]",), tokens=("[TOOL_CALLS]",), start="[TOOL_CALLS]", short_ids=True),
    ToolFormat("nemotron_v2", j.nemotron_v2, grammars.nemotron_v2, ("<TOOLCALL>",),
               tokens=("<TOOLCALL>", "</TOOLCALL>"), start="<TOOLCALL>", end="</TOOLCALL>"),
    ToolFormat("llama3_json", j.llama3_json, grammars.llama3_json,
               ('"parameters": ', "<|start_header_id|>"), start="<|python_tag|>"),
    ToolFormat("llama4_json", j.llama4_json, grammars.llama4_json,
               ('"parameters": ', "<|header_start|>"), start="<|python_start|>"),
    ToolFormat("harmony", harmony, grammars.harmony, ("<|channel|>", '"functions."'),
               tokens=("<|channel|>", "<|constrain|>", "<|message|>"), reasoning=True),
    ToolFormat("gemma4", g.gemma4, grammars.gemma('<|"|>', "<|tool_call>", "<tool_call|>"),
               ("<|tool_call>",), tokens=("<|tool_call>", "<tool_call|>"),
               start="<|tool_call>", end="<tool_call|>"),
    ToolFormat("function_gemma", g.function_gemma,
               grammars.gemma("<escape>", "<start_function_call>", "<end_function_call>"),
               ("<start_function_call>",), tokens=("<start_function_call>",),
               start="<start_function_call>", end="<end_function_call>"),
]  # fmt: skip
FORMATS: dict[str, ToolFormat] = {f.name: f for f in _FORMATS}

# mlx-lm's parser names -> ours (the first the template shows, else the first)
MLX_NAMES = {
    "json_tools": ("hermes",),
    "qwen3_coder": ("qwen3_coder",),
    "glm47": ("glm45", "glm47"),
    "kimi_k2": ("kimi_k2",),
    "kimi_k3": ("kimi_k3",),
    "minimax_m2": ("minimax_m2",),
    "gemma4": ("gemma4",),
    "function_gemma": ("function_gemma",),
    "mistral": ("mistral_args", "mistral_json"),
}


def template_text(tokenizer: Any) -> str:
    """The chat template's text ("" when it has none; every named one, joined)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, list):  # transformers' [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""


def _vocabulary(tokenizer: Any) -> Any:
    try:
        return tokenizer.get_vocab()
    except Exception:  # a tokenizer without one: no format found by its tokens
        return {}


def family_formats(model_type: str | None) -> tuple[str, ...]:
    """The formats the family's row names (a GGUF architecture maps to its row)."""
    from ...models.registry import FAMILIES, GGUF_FAMILIES

    if model_type in GGUF_FAMILIES and model_type not in FAMILIES:
        model_type = GGUF_FAMILIES[model_type].model_type
    row = FAMILIES.get(model_type) if model_type else None
    return row.tools if row is not None else ()


def detect(tokenizer: Any, model_type: str | None = None) -> ToolFormat | None:
    """The format `tokenizer`'s template teaches (see the module's docstring)."""
    template = template_text(tokenizer)
    row = [FORMATS[n] for n in family_formats(model_type) if n in FORMATS]
    for fmt in row:
        if fmt.shown_by(template):
            return fmt
    found = _mlx_inference(tokenizer, template)
    if found is not None:
        return found
    for fmt in _FORMATS:
        if fmt.shown_by(template):
            return fmt
    vocab = _vocabulary(tokenizer)
    for fmt in row + _FORMATS:
        if fmt.in_vocabulary(vocab):
            return fmt
    return None


def _mlx_inference(tokenizer: Any, template: str) -> ToolFormat | None:
    """mlx-lm's inference from the template and vocabulary: ours for the formats we
    know, else mlx-lm's parser as it is (`mlx_format`)."""
    from mlx_lm import tokenizer_utils

    infer = getattr(tokenizer_utils, "_infer_tool_parser", None)  # private
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        kind = infer(hf) if infer is not None else None
    except Exception:  # a tokenizer mlx-lm's inference cannot read
        kind = None
    if kind is None:
        return None
    if kind in MLX_NAMES:
        ours = [FORMATS[n] for n in MLX_NAMES[kind]]
        return next((f for f in ours if f.shown_by(template)), ours[0])
    return mlx_format(kind)


def mlx_format(kind: str) -> ToolFormat:
    """mlx-lm's parser `kind` as a format: a call held whole between its markers, parsed
    by mlx-lm, its arguments in one piece; no forced grammar."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{kind}")
    start, end = module.tool_call_start, module.tool_call_end or ""

    def section(r: Reader, calls: Calls, tools: list, begin: str) -> Step:
        body, _ = yield from until(r, (end,) if end else ())
        try:
            found = module.parse_tool_call(body, tools)
        except Exception:  # mlx-lm's parsers raise what their parsing meets
            return False
        for call in found if isinstance(found, list) else [found]:
            args = call.get("arguments", {})
            calls.start(call["name"], call.get("id"))
            calls.args(args if isinstance(args, str) else _dumps(args))
            calls.end()
        return True

    return ToolFormat(f"mlx_lm.{kind}", marked((start,), section), start=start, end=end)


def _dumps(args: Any) -> str:
    import json

    return json.dumps(args, ensure_ascii=False)
