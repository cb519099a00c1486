"""The prompt cache: reusable prompt states in memory (store) and on disk (disk)."""
