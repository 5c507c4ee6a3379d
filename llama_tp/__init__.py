"""llama_tp: tensor-parallel inference on MLX: open models natively, the rest on mlx-lm's classes.

    from llama_tp import Chat, load
    model, tokenizer = load()               # the built-in model; sharded under mlx.launch
    chat = Chat(model, tokenizer)           # multi-turn chat; see llama_tp.conversation.chat

The top level holds what you run (`python -m llama_tp.generate`, `.chat`, `.serve`, ...)
and this public API; the subpackages hold how it works (see docs/architecture.md's module map).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

__version__ = "0.1.0"

# Public name -> the module that defines it. Imported on first use: `llama_tp.plan`
# and the command-line tools start without paying for mlx-lm and transformers.
_API = {
    "load": "llama_tp.loading.loader",
    "load_model": "llama_tp.loading.loader",
    "LoadOptions": "llama_tp.loading.loader",
    "SamplingParams": "llama_tp.engine.settings",
    "default_model": "llama_tp.loading.loader",
    "Chat": "llama_tp.conversation.chat",
    "stream_generate": "llama_tp.engine.generation",
    "generate_step": "llama_tp.engine.generation",
    "make_sampler": "llama_tp.engine.sampling",
    "encode_prompt": "llama_tp.checkpoints.tokenizer",
    "open_checkpoint": "llama_tp.checkpoints",
    "world": "llama_tp.cluster.distributed",
    "print0": "llama_tp.cluster.distributed",
    "eprint0": "llama_tp.cluster.distributed",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'llama_tp' has no attribute {name!r}")


# Modules that lived at the top level before the subpackages: their old import paths
# (documented in earlier READMEs) and `python -m` names keep working.
MOVED = {
    "llama_tp.distributed": "llama_tp.cluster.distributed",
    "llama_tp.watchdog": "llama_tp.cluster.watchdog",
    "llama_tp.blas": "llama_tp.cluster.blas",
    "llama_tp.collectives": "llama_tp.cluster.collectives",
    "llama_tp.layers": "llama_tp.parallel.layers",
    "llama_tp.vocab_parallel": "llama_tp.parallel.vocab",
    "llama_tp.tokenizer": "llama_tp.checkpoints.tokenizer",
    "llama_tp.gguf_tokenizer": "llama_tp.checkpoints.gguf_tokenizer",
    "llama_tp.loader": "llama_tp.loading.loader",
    "llama_tp.sampling": "llama_tp.engine.sampling",
    "llama_tp.conversation": "llama_tp.conversation.chat",
    "llama_tp.agreement": "llama_tp.loading.agreement",
    "llama_tp.cli": "llama_tp.console.cli",
    "llama_tp.terminal": "llama_tp.console.terminal",
    "llama_tp.line_editor": "llama_tp.console.line_editor",
    "llama_tp.synthetic": "llama_tp.benchmarks.synthetic",
    "llama_tp.bench_mlx_lm": "llama_tp.benchmarks.compare_mlx_lm",
}


class _MovedLoader(importlib.abc.Loader):
    """Imports an old name as the module at its new path (the same module object)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self._spec = module.__spec__  # the import system overwrites it with the alias's
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._spec  # already executed under its new name

    def get_code(self, fullname: str):
        # `python -m llama_tp.<old>` runs the new module as __main__.
        return compile(
            f"import runpy\nrunpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n",
            f"<{fullname} -> {self.new}>",
            "exec",
        )


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
