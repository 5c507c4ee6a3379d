"""The benchmark helpers, in one place: the timed runs of `python -m llama_tp.bench`
(runner, report, compare_mlx_lm, synthetic checkpoints), and what the drivers in bench/
share (bench rows as processes, servers and their streaming clients, speculative rows,
the matrix's report, and each result's section of docs/benchmarks.md)."""
