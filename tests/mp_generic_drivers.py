"""The drivers on 2 ranks of models on mlx-lm's classes, in one launch
(tests/test_generic_drivers.py).

    python -m llama_tp.launch -n 2 -- python tests/mp_generic_drivers.py GEMMA SPLIT PHI3

Prints one JSON line on rank 0: the greedy tokens of GEMMA on 2 pipeline stages and of its
`convert --shards 2` folder SPLIT (each rank reading its own folder), GEMMA's perplexity on
2 stages, Chat turns on PHI3 on 2 stages, and the line every rank raised for PHI3 split by
tensor (it has no tensor split).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama_tp.checkpoints.tokenizer import load_tokenizer  # noqa: E402
from llama_tp.cluster.distributed import all_gather_object, first_line, world  # noqa: E402
from llama_tp.conversation.chat import Chat  # noqa: E402
from llama_tp.engine.generation import stream_generate  # noqa: E402
from llama_tp.engine.perplexity import perplexity  # noqa: E402
from llama_tp.loading.loader import load_model  # noqa: E402

PROMPT = [1, 5, 9, 33, 70, 12, 100, 7, 250, 3]
TEXT = [1, *range(20, 80)]
TURNS = ["hello there", "and again"]


def tokens(path: Path, group, **mesh) -> tuple[list[int], dict]:
    model, ckpt = load_model(path, group, **mesh)
    tok = load_tokenizer(ckpt)
    out = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=8, eos_token_ids=set())]
    return out, ckpt.load_stats


def chat_turns(path: Path, group, **mesh) -> list:
    model, ckpt = load_model(path, group, **mesh)
    chat = Chat(model, load_tokenizer(ckpt), max_tokens=8)
    out = []
    for turn in TURNS:
        reply = "".join(chat.stream(turn))
        out.append([reply, chat.last_stats.reused_tokens])
    return out


def main() -> None:
    gemma, split, phi3 = (Path(p) for p in sys.argv[1:4])  # phi3: KV caches, no tensor split
    group = world()
    res: dict = {}
    res["pp"], _ = tokens(gemma, group, pp=2)
    res["split"], stats = tokens(split, group, pp=2)
    res["split_read"] = all_gather_object(stats["bytes_read"], group)
    model, _ = load_model(gemma, group, pp=2)
    res["perplexity"] = perplexity(model, TEXT, context_length=32, stride=16).perplexity
    res["chat"] = chat_turns(phi3, group, pp=2)
    try:
        load_model(phi3, group)
        res["refused"] = None
    except Exception as e:
        res["refused"] = all_gather_object(first_line(e), group)
    if group.rank() == 0:
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
