"""Dyno's user-facing layers: the CLI now; the server and playground build on the same engine."""
