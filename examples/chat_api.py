"""The Python chat API, on one process or across ranks.

    python examples/chat_api.py
    python -m llama_tp.launch -n 2 -- python examples/chat_api.py
    python examples/chat_api.py --model path/to/model --max-tokens 64

Every rank runs this same script: the model is sharded when there is more than
one rank, every rank holds the same conversation (and gets the same replies),
and only rank 0 prints.
"""

import argparse

from llama_tp import Chat, eprint0, load, print0

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
parser.add_argument("--max-tokens", type=int, default=48)
args = parser.parse_args()

model, tokenizer = load(args.model)
chat = Chat(model, tokenizer, system="You are a helpful assistant.", max_tokens=args.max_tokens)


def report() -> None:
    s = chat.last_stats
    eprint0(
        f"[{s.prefilled_tokens} of {s.prompt_tokens} prompt tokens prefilled, "
        f"{s.generated_tokens} generated, {s.finish_reason}]"
    )


# send(): the whole reply at once.
question = "What is the capital of France?"
print0(f">> {question}")
print0(chat.send(question))
report()

# stream(): the reply in pieces as they are decoded. This turn reuses the KV cache
# of the first one, so only its own tokens are prefilled.
question = "And of Germany?"
print0(f">> {question}")
for piece in chat.stream(question):
    print0(piece, end="")
print0()
report()

# The conversation so far; reset() starts over (the system message stays).
for message in chat.history:
    print0(f"  {message['role']}: {message['content']!r}")
chat.reset()
