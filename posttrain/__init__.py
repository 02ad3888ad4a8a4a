"""posttrain."""
