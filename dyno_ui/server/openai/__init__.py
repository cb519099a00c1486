"""The OpenAI API: schema (types and validation), convert (requests to jobs, outputs to responses), routes."""
