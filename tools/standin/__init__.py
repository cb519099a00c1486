"""The stand-in for users' hardware at real shapes, for tools and tests (never the package): random
checkpoints of the published Qwen3.5/3.6 shapes, their contexts and long sessions measured with
replayed acceptance, and per-thread CPU time."""
