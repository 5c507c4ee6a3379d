"""Generate text from Python, on one process or across ranks.

    python examples/generate_api.py
    mlx.launch -n 2 -- python examples/generate_api.py

Every rank runs this same script; the model is sharded when there is more than
one rank, and only rank 0 prints.
"""

from llama_tp import load
from llama_tp.distributed import print0
from llama_tp.generate import stream_generate
from llama_tp.loader import default_model
from llama_tp.tokenizer import encode_prompt

model, tokenizer = load(default_model())
prompt = encode_prompt(tokenizer, "Name three French cities.")
for response in stream_generate(model, tokenizer, prompt, max_tokens=48):
    print0(response.text, end="")
print0()
