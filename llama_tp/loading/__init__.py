"""Loading a model: checkpoint -> placement -> sharded model on this rank, its sources (one
copy), the mesh's plan and pipeline stages, the ranks' agreement."""
