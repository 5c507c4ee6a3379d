#!/usr/bin/env bash
# The launch forms of llama_tp. mlx.launch runs the command as given: name the
# interpreter, and put `--` before it so mlx.launch keeps its hands off the
# command's own flags (it has a --verbose of its own).

# One process:
python -m llama_tp.generate --prompt "What is the capital of France?"

# Two ranks on this machine (ring backend over 127.0.0.1):
mlx.launch -n 2 -- python -m llama_tp.generate --prompt "What is the capital of France?" --verbose

# Two Macs, from a hostfile (see hostfiles/README.md):
mlx.launch --hostfile hostfiles/ring-2-macs.json -- python -m llama_tp.generate --prompt "hi"

# MPI (needs Open MPI; on Linux: apt-get install openmpi-bin libopenmpi-dev):
mlx.launch --backend mpi -n 2 -- python -m llama_tp.generate --prompt "hi"
