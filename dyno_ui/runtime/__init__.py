"""The engine thread and what requests share below the APIs: the neutral chat request and the one way
it becomes a job, jobs and their outputs, the served model, text assembly, metrics. No web framework
is imported here (tests/test_layering.py checks it)."""
