"""Generate text from Python, on one process or across ranks.

    python examples/generate_api.py
    python -m llama_tp.launch -n 2 -- python examples/generate_api.py

Every rank runs this same script; the model is sharded when there is more than
one rank, and only rank 0 prints.
"""

from llama_tp import encode_prompt, load, print0, stream_generate

model, tokenizer = load()  # the built-in model
prompt = encode_prompt(tokenizer, "Name three French cities.")
for response in stream_generate(model, tokenizer, prompt, max_tokens=48):
    print0(response.text, end="")
print0()
