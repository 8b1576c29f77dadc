"""How a draft head is made: run config, data preparation, feature collection, losses and the trainer."""
