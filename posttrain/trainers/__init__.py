"""Trainer recipes: config, data -> batches and loss over `train.lifecycle.run_trainer` (SFT so far)."""
