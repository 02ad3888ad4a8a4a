"""Trainer recipes: thin compositions of data, loss, train step and loop (SFT so far)."""
