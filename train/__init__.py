"""How a draft head is made: data sources and preparation, regeneration, feature collection and shards,
batching, losses, the trainer and its checkpoints."""
