"""Helpers of `python -m llama_tp.bench`: the timed runs, its table, mlx-lm's side
of --compare, synthetic checkpoints."""
