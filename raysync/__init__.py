"""raysync."""
