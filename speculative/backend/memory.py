"""MLX memory, handled as mlx-lm handles it: the model wired while decoding, MLX's buffer cache
cleared at mlx-lm's cadence and once a model is let go, a warning when the model is close to the
maximum recommended size, and default budgets for what the model leaves of the device's memory.

Where the device reports no recommended working set (MLX's CPU backend), there is no wired limit
to take: `Memory.wired` does nothing and the budgets are shares of the RAM.
"""

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.utils import maybe_set_recommended_wired_limit

CLEAR_EVERY_TOKENS = 256  # mlx-lm's generate_step clears MLX's buffer cache every 256 tokens
CLEAR_EVERY_ROUNDS = 512  # its BatchGenerator every 512 generation steps (one step: one batch round)
CLOSE_TO_MAX = 0.9  # mlx-lm warns when the model takes more than this share of the recommended size
PROMPT_CACHE_SHARE = 8  # --prompt-cache-bytes' default: 1/8 of what the model leaves
BATCH_MEMORY_SHARE = 4  # --max-batch-memory's default: 1/4 of what the model leaves


def recommended_size() -> Optional[int]:
    """Metal's maximum recommended working set in bytes (what mlx-lm wires to), None where MLX reports none."""
    try:
        size = mx.device_info().get("max_recommended_working_set_size")
    except Exception:  # an MLX build without device_info
        return None
    return int(size) if size else None


def device_memory() -> int:
    """The memory the budgets share: the recommended working set where MLX reports one, else the RAM."""
    return recommended_size() or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def model_bytes(*modules) -> int:
    """Bytes of the modules' arrays (the trunk's weights, the head's), each array counted once."""
    seen: Dict[int, int] = {}
    for module in modules:
        if module is not None:
            for _, a in tree_flatten(module.parameters()):
                seen[id(a)] = a.nbytes
    return sum(seen.values())


def size_warning(model: int, recommended: Optional[int]) -> Optional[str]:
    """mlx-lm's warning when the model takes more than 0.9 of the recommended size (None: no warning)."""
    if not recommended or model <= CLOSE_TO_MAX * recommended:
        return None
    return (f"dyno: warning: the model takes {model // 2**20} MB, which is close to the maximum recommended "
            f"size of {recommended // 2**20} MB; this can be slow (mlx-lm's work-arounds: "
            "https://github.com/ml-explore/mlx-lm/tree/main#large-models)")


def spare(model: int, total: int) -> int:
    """What the model's own bytes leave of `total`."""
    return max(0, total - model)


def default_prompt_cache_bytes(model: int, total: int) -> int:
    """--prompt-cache-bytes when none is given: 1/PROMPT_CACHE_SHARE of what the model leaves of `total`."""
    return spare(model, total) // PROMPT_CACHE_SHARE


def default_batch_memory(model: int, total: int) -> int:
    """--max-batch-memory when none is given: 1/BATCH_MEMORY_SHARE of what the model leaves of `total`."""
    return spare(model, total) // BATCH_MEMORY_SHARE


def budget_notice(model: int, total: int, given: Dict[str, int]) -> Optional[str]:
    """One line when budgets the user gave (flag -> bytes) and the model together exceed `total`."""
    asked = {flag: n for flag, n in given.items() if n}
    if not asked or model + sum(asked.values()) <= total:
        return None
    flags = " + ".join(f"{flag} {n / 1e9:.2f} GB" for flag, n in asked.items())
    return (f"dyno: warning: {flags} and the model's {model / 1e9:.2f} GB exceed the {total / 1e9:.2f} GB "
            "this device has for them; memory may swap")


def synchronize_streams() -> None:
    """Wait for MLX's work on this thread's streams: the default one (Dyno's rounds) and mlx-lm's
    generation stream (generate_step's, which plain decoding runs on)."""
    mx.synchronize()
    mx.synchronize(generation_stream)


class Cadence:
    """Calls `clear` each time the count passes another multiple of `every`."""

    def __init__(self, every: int, clear: Callable[[], None]):
        self.every, self.clear, self.count = every, clear, 0

    def add(self, n: int = 1) -> None:
        before, self.count = self.count, self.count + n
        if self.count // self.every > before // self.every:
            self.clear()


@dataclass(frozen=True)
class Memory:
    """The MLX calls Dyno's memory handling makes, and how often it clears the buffer cache, as
    fields: tests pass recording calls and shorter cadences in."""

    take_wired: Callable[[], Optional[int]] = maybe_set_recommended_wired_limit  # old limit, None: no limit here
    set_wired: Callable[[int], int] = mx.set_wired_limit
    clear_cache: Callable[[], None] = mx.clear_cache
    synchronize: Callable[[], None] = synchronize_streams
    tokens_between_clears: int = CLEAR_EVERY_TOKENS  # a single generation's cadence
    rounds_between_clears: int = CLEAR_EVERY_ROUNDS  # a batch's

    # mlx_lm.generate.wired_limit is the same context manager, but it prints its warning to stdout
    # (where `dyno generate` writes the text) on every call; Dyno warns once per model (loader.py).
    @contextlib.contextmanager
    def wired(self) -> Iterator[None]:
        """The recommended wired limit while the block runs (on the thread that makes the MLX calls),
        the old one back after MLX has finished its work; nothing where the device has no such limit."""
        old = self.take_wired()
        if old is None:
            yield
            return
        try:
            yield
        finally:
            self.synchronize()  # the limit must not change under an async eval
            self.set_wired(old)

    def per_tokens(self) -> Cadence:
        """Clears MLX's buffer cache every `tokens_between_clears` tokens of a generation (count them in)."""
        return Cadence(self.tokens_between_clears, self.clear_cache)

    def per_rounds(self) -> Cadence:
        """Clears MLX's buffer cache every `rounds_between_clears` rounds of a batch (count them in)."""
        return Cadence(self.rounds_between_clears, self.clear_cache)


MLX_MEMORY = Memory()
