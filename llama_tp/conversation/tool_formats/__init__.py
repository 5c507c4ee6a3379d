"""Tool calls in every family's format: one description per format (`catalog.py`), the
parsers (`json_calls.py`, `xml_calls.py`, `gemma_calls.py`, `harmony.py`) and grammars
(`grammars.py`) they name; `conversation/tool_calls.py` is what the rest of llama_tp uses.
"""

from .base import ReplyDelta, ReplySplitter, ToolFormat
from .catalog import FORMATS, detect, family_formats, mlx_format, template_text

__all__ = [
    "FORMATS",
    "ReplyDelta",
    "ReplySplitter",
    "ToolFormat",
    "detect",
    "family_formats",
    "mlx_format",
    "template_text",
]
