"""How a model is split over ranks: the partition plan, range-sharded and
vocabulary-parallel layers, applying the plan to a model."""
