"""A parameter written as text (XML-like formats), typed by the function's schema.

Formats such as Qwen3-Coder's write a string parameter as it is and any other as JSON
(`<parameter=city>\\nParis\\n</parameter>`, `<parameter=days>\\n3\\n</parameter>`); the
schema of the function's parameter says which (as vLLM's qwen3_coder parser and
llama.cpp read them): a parameter whose schema allows only strings keeps its text, any
other is read as JSON when it is JSON (Python's True/False/None too), else kept as text.
"""

from __future__ import annotations

import json
from typing import Any

_PYTHON = {"True": True, "False": False, "None": None}


def properties(tools: list[dict], name: str) -> dict[str, Any]:
    """The `properties` of function `name`'s parameters ({} when it has none)."""
    for tool in tools:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def text_only(schema: Any) -> bool:
    """Whether `schema` allows strings only (its values are written as plain text)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or kind == ["string"]:
        return True
    if "enum" in schema and kind is None:
        return bool(schema["enum"]) and all(isinstance(v, str) for v in schema["enum"])
    if "const" in schema and kind is None:
        return isinstance(schema["const"], str)
    return False


def typed(text: str, schema: Any, as_text: bool | None = None) -> Any:
    """The value of a parameter written as `text`: kept as text when `as_text` says so
    (formats that mark strings, DeepSeek's `string="true"`) or the schema allows strings
    only or there is no schema; else its JSON value when it is JSON."""
    if as_text is None:
        as_text = schema is None or text_only(schema)
    if as_text:
        return text
    stripped = text.strip()
    if stripped in _PYTHON:
        return _PYTHON[stripped]
    try:
        return json.loads(stripped)
    except (ValueError, RecursionError):
        return text


def kind_of(schema: Any) -> str:
    """The JSON type name of `schema`'s values, for formats that write it beside a value
    (Kimi K3's `type="..."`): string, number, boolean, null, object or array."""
    if text_only(schema):
        return "string"
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    return {"integer": "number"}.get(kind, kind) if kind else "object"
