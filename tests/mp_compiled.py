"""Run on one process or under llama_tp.launch: the compiled decode step gives the eager
step's tokens (engine/step.py).

    python -m llama_tp.launch -n N -- python tests/mp_compiled.py SPEC [SPEC ...] [--extras]

SPEC is `PATH[@SPLIT[@MOE_SPLIT]]` (`load_model(PATH, split=SPLIT, moe_split=MOE_SPLIT)`;
`-` for either: the default). For every spec, every rank generates with the step
compiled and then eager (`step.set_compile`) and compares the tokens: greedy and seeded
(temperature) single sequences, and a batch of 5 prompts at most 3 at a time (rows
join and leave), greedy for some rows and seeded for others; `--extras` (first spec):
prompt-lookup speculative decoding, a seeded top-p row in a batch (its logits compiled,
its sampling eager) and a two-turn `Chat`. Rank 0 prints one JSON line per spec:
{"spec", "same": {check: bool}, "tokens": {check: count}, "traces": compilations}.
"""

from __future__ import annotations

import json
import sys

from llama_tp import load_model
from llama_tp.checkpoints.tokenizer import encode_prompt, load_tokenizer
from llama_tp.cluster.distributed import world
from llama_tp.engine import step
from llama_tp.engine.batch import BatchEngine, Decision, Join, SamplingParams
from llama_tp.engine.generation import stream_generate

PROMPTS = ["hello", "The quick brown fox", "Tensor parallel", "abc", "Où est la gare?"]


def _generate(model, tok, **kw) -> list[int]:
    ids = encode_prompt(tok, PROMPTS[1])
    return [r.token for r in stream_generate(model, tok, ids, max_tokens=14, **kw)]


def _batch(model, tok, top_p: float = 1.0) -> list[list[int]]:
    engine = BatchEngine(model, tok)
    todo = [
        Join(
            i,
            encode_prompt(tok, p),
            SamplingParams(
                max_tokens=6 + 3 * i,
                temperature=0.0 if i % 2 else 0.8,
                top_p=top_p,
                seed=i,
            ),
        )  # fmt: skip
        for i, p in enumerate(PROMPTS)
    ]
    out: dict[int, list[int]] = {}
    while todo or len(engine):
        joins = [todo.pop(0) for _ in range(min(len(todo), 3 - len(engine)))]
        engine.apply(Decision(joins=joins))
        for e in engine.step():
            out.setdefault(e.uid, []).append(e.token)
    return [out[i] for i in range(len(PROMPTS))]


def _chat(model, tok) -> list[str]:
    from llama_tp.conversation.chat import Chat

    chat = Chat(model, tok, max_tokens=8, temp=0.0)
    return [chat.send("hello"), chat.send("and then?")]


def checks(model, tok, extras: bool, only: tuple[str, ...] = ()) -> dict:
    """Compiled against eager on each check (`only`: these of the plain ones)."""
    runs = {
        "greedy": lambda: _generate(model, tok),
        "seeded": lambda: _generate(model, tok, temp=0.9, seed=7),
        "batch": lambda: _batch(model, tok),
    }
    if only:
        runs = {k: v for k, v in runs.items() if k in only}
    if extras:
        runs["speculative"] = lambda: _generate(model, tok, draft="ngram", num_draft_tokens=3)
        runs["batch_top_p"] = lambda: _batch(model, tok, top_p=0.9)
        runs["chat"] = lambda: _chat(model, tok)
    same, counts = {}, {}
    for name, run in runs.items():
        step.set_compile(True)
        compiled = run()
        step.set_compile(False)
        eager = run()
        step.set_compile(True)
        same[name] = compiled == eager
        flat = [t for row in compiled for t in row] if name.startswith("batch") else compiled
        counts[name] = len(flat)
    return {"same": same, "tokens": counts}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    extras = "--extras" in sys.argv
    group = world()
    failed = False
    for i, spec in enumerate(args):
        path, *rest = spec.split("@")
        split = rest[0] if rest and rest[0] != "-" else None
        moe = rest[1] if len(rest) > 1 and rest[1] != "-" else None
        model, ckpt = load_model(path, group, split=split, moe_split=moe)
        tok = load_tokenizer(ckpt)
        res = {"spec": spec, **checks(model, tok, extras and i == 0)}
        res["traces"] = step.decode_step_for(model).stats()["traces"]
        failed |= not all(res["same"].values())
        if group.rank() == 0:
            print(json.dumps(res), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
