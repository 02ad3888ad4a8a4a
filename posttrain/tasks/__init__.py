"""Built-in tasks and the tiny-model recipe behind `posttrain demo`."""
