"""The Anthropic Messages API: schema (types and validation), convert (requests to jobs, outputs to
messages and stream events), routes."""
