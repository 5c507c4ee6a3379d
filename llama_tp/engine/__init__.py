"""The decoding core: the generation step and loop, caches, sampling on shards, batching."""
