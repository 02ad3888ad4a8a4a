"""Generation: a KV-cache sampler with one compiled decode loop, its sampling parameters, and image inputs."""

from posttrain.generate.sampler import Completions, Sampler, Turn
from posttrain.generate.sampling import SamplingParams, select, truncate
from posttrain.generate.vision import ImageInputs, expand_image_tokens

__all__ = ["Completions", "ImageInputs", "Sampler", "Turn", "SamplingParams", "expand_image_tokens", "select",
           "truncate"]
