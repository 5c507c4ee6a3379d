"""The one request-parsing path: a body's bytes -> JSON -> the API's pydantic model, any
failure a `RequestError` (400) naming the body or the field.

`decode(raw, limits)` takes what `json.loads` takes, and refuses up front what would
choke it or the steps after it (the chat template's `tojson`, pydantic, the grammar
compiler, the tokenizer), each with one line naming where:

- not UTF-8 or not JSON, and `NaN` / `Infinity` (not JSON, though Python's json reads them);
- more objects and arrays than `limits.json_values`, counted on the bytes before parsing
  (brackets inside strings count too): a body of millions of tiny objects would hold
  the interpreter (and with it every other request) for seconds while it is parsed;
- nesting deeper than `limits.json_depth` (json.loads and tojson recurse);
- a lone surrogate (`"\\ud800"`: valid JSON, but no text a tokenizer can encode).

`validate(model, data, name)` is pydantic's validation with its first error turned into
a RequestError by the API's `name` (OpenAI's `param` "messages[0].role", or the dotted
"messages.0.content" of Anthropic's and Ollama's errors: `dotted`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import RequestError

_SURROGATE = re.compile("[\ud800-\udfff]")
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}

Loc = tuple  # a value's place in the body: ("messages", 0, "content")


Place = Callable[[Loc], str]  # how an API writes a place: openai_param or dotted_place


class BodyError(RequestError):
    """A body that cannot be read as JSON text; `param`: the place of the value at fault."""

    def __init__(self, reason: str, loc: Loc, place: Place, code: str = "invalid_json"):
        where = place(loc)
        text = f"{label(place, loc)}: {reason}" if where else reason
        super().__init__(text, where or None, 400, code)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def decode(raw: bytes, max_values: int, max_depth: int, place: Place) -> Any:
    """The JSON value of a body (BodyError naming the problem and, inside, its place)."""
    brackets = raw.count(b"{") + raw.count(b"[")
    if brackets > max_values:
        raise BodyError(
            f"the body holds {brackets} JSON objects and arrays (brackets in strings "
            f"counted); at most {max_values} are read",
            (),
            place,
            "body_too_complex",
        )
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BodyError(f"the body nests JSON deeper than {max_depth} levels", (), place) from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise BodyError(f"the body is not valid JSON: {e}"[:300], (), place) from None
    check_value(data, max_depth, place)
    return data


def check_value(data: Any, max_depth: int, place: Place, where: Loc = ()) -> None:
    """BodyError when `data` (decoded JSON) nests deeper than `max_depth` or holds a
    lone surrogate, in a string or a key; `where`: the place of `data` itself."""
    stack: list[tuple[Any, Loc]] = [(data, where)]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, str):
            _text(value, loc, place)
            continue
        if len(loc) - len(where) >= max_depth:
            why = f"JSON nested deeper than {max_depth} levels"
            raise BodyError(why if loc else f"the body nests {why}", loc, place)
        if isinstance(value, dict):
            for k, v in value.items():
                _text(k, loc, place)
                if isinstance(v, (dict, list, str)):
                    stack.append((v, (*loc, k)))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, (dict, list, str)):
                    stack.append((v, (*loc, i)))


def _text(s: str, loc: Loc, place: Place) -> None:
    found = None if s.isascii() else _SURROGATE.search(s)
    if found is not None:
        raise BodyError(
            f"a lone surrogate ({ascii(found.group())}) is not text", loc, place, "invalid_value"
        )


def loads(text: str, max_depth: int, place: Place, where: Loc) -> Any:
    """JSON text inside a body (a tool call's `arguments`): its value, or BodyError at
    `where` (not JSON, too deep, a lone surrogate)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        why = f"JSON nested deeper than {max_depth} levels"
        raise BodyError(why, where, place, "invalid_value") from None
    except ValueError as e:
        raise BodyError(f"not JSON: {e}"[:300], where, place, "invalid_value") from None
    check_value(value, max_depth, place, where)
    return value


def validate(model: type[BaseModel], data: Any, name: Callable[[list[dict]], RequestError]):
    """`data` as `model`, or the RequestError `name` makes of pydantic's errors."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise name(e.errors()) from None


def dotted(prefix: str = "") -> Callable[[list[dict]], RequestError]:
    """Anthropic's and Ollama's error naming: "messages.0.content.1.type: ..." (under
    `prefix`); of a union's errors (one per member) the deepest says most."""

    def name(errors: list[dict]) -> RequestError:
        err = max(errors, key=lambda x: len(x["loc"]))
        if err["type"] == "model_attributes_type" and not prefix:
            return RequestError("the body is not a JSON object", None)
        path = field_path(err["loc"], prefix)
        message = err["msg"]
        if "input" in err and err["type"] != "missing":
            message += f", got {err['input']!r}"[:200]
        return RequestError(f"{path}: {message}" if path else message, path or None)

    return name


def field_path(loc: Loc, prefix: str = "") -> str:
    """pydantic's error location as a dotted path; the names pydantic gives the members of
    a union ("str", "list[Block]", "function-after[...]") are left out."""
    parts = [prefix] if prefix else []
    for part in loc:
        if isinstance(part, int) or (part.isidentifier() and part not in _TYPE_NAMES):
            parts.append(str(part))
    return ".".join(parts)


def label(place: Place, loc: Loc) -> str:
    """A field's name at the head of an error message: quoted in OpenAI's ('messages[0]'),
    as it is in Anthropic's and Ollama's (messages.0)."""
    where = place(loc)
    return f"'{where}'" if place is openai_param else where


def dotted_place(loc: Loc) -> str:
    """A place in the body as Anthropic's and Ollama's errors name a field: "messages.0"."""
    return ".".join(str(p) for p in loc)


def openai_param(loc: Loc) -> str:
    """A place in the body as OpenAI names a field: "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
