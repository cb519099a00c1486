"""Measuring drafting on this machine: the cost model, the stored depth (tuning), paired benchmarks, prompt suites."""
