#!/usr/bin/env bash
# The launch forms of llama_tp. mlx.launch runs the command as given: name the
# interpreter, and put `--` before it so mlx.launch keeps its hands off the
# command's own flags (it has a --verbose of its own).

# One process:
python -m llama_tp.generate --prompt "What is the capital of France?"

# Two ranks on this machine (ring backend over 127.0.0.1):
python -m llama_tp.launch -n 2 -m llama_tp.generate --prompt "What is the capital of France?" --verbose

# Two Macs, from a hostfile (see hostfiles/README.md):
python -m llama_tp.launch --hostfile hostfiles/ring-2-macs.json -m llama_tp.generate --prompt "hi"

# MPI (needs Open MPI; on Linux: apt-get install openmpi-bin libopenmpi-dev):
python -m llama_tp.launch --backend mpi -n 2 -m llama_tp.generate --prompt "hi"

# Chat at this terminal on two ranks (Ctrl-C stops a reply, Ctrl-D or /quit leaves):
python -m llama_tp.launch -n 2 -m llama_tp.chat

# The Python chat API and the two-layer tensor-parallel demonstration, two ranks:
python -m llama_tp.launch -n 2 -- python examples/chat_api.py
python -m llama_tp.launch -n 2 -- python examples/tp_mlp.py

# Four Macs over Ethernet; MPI and JACCL from hostfiles that name their backend:
python -m llama_tp.launch --hostfile hostfiles/ring-4-macs.json -m llama_tp.chat
python -m llama_tp.launch --hostfile hostfiles/mpi-2-macs.json -m llama_tp.generate --prompt "hi"
python -m llama_tp.launch --hostfile hostfiles/jaccl-2-macs.json -m llama_tp.chat
