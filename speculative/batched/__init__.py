"""Batched drafting: requests decoded together as rows of one round (speculator.BatchSpeculator),
those that join together prefilled together (prefill.py)."""

from .prefill import Joiner
from .speculator import BatchSpeculator, Leaving, RowEvents

__all__ = ["BatchSpeculator", "Joiner", "Leaving", "RowEvents"]
