"""Generation: a KV-cache sampler with one compiled decode loop, and its sampling parameters."""

from posttrain.generate.sampler import Completions, Sampler, Turn
from posttrain.generate.sampling import SamplingParams, select, truncate

__all__ = ["Completions", "Sampler", "Turn", "SamplingParams", "select", "truncate"]
