"""Running a model: loading, the generation step and loop, sampling on shards, chat, batching."""
