"""The architectures llama_tp does not implement, on mlx-lm's own model classes.

`classes.route(config)` says which path runs a config (native first); `loader.load_generic`
builds mlx-lm's `Model` lazily and makes this rank's part of it: its pipeline stage
(`stages.py`, or mlx-lm's own `pipeline()`), its tensor part (`tensor.py`: the model's
`shard()` or a style table), read from the files' headers (`reads.py`). The engine runs
the result as any model (`model.GenericModel`); `loading/generic.py` is the loader's
branch here.
"""
