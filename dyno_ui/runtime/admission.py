"""How many requests a batch may hold: each row's memory estimated from the model's config, rows
admitted while their sum stays within a budget.

A row holds attention keys and values for every token it will see (prompt + max_tokens) in each
full-attention layer (the MTP head's included) and a fixed recurrent state in each Gated DeltaNet
layer, plus, while a round verifies, one state per fed token on the rollback tape. The estimate
errs high: a row that stops early frees its share sooner.
"""

from dataclasses import dataclass
from typing import Iterable

STATE_BYTES = 4  # recurrent states are kept in float32
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class RowMemory:
    """Bytes one batch row holds: `per_token` for every token it sees, `per_row` whatever its length,
    `per_fed` for each token a round feeds (the rollback tape)."""

    per_token: int
    per_row: int
    per_fed: int

    @classmethod
    def of(cls, config: dict, head_layers: int = 0) -> "RowMemory":
        """The estimate for a Hugging Face config (Qwen3.5's fields; missing ones count as none)."""
        tc = config.get("text_config", config)
        dtype = DTYPE_BYTES.get(str(tc.get("dtype") or tc.get("torch_dtype") or "bfloat16"), 2)
        layers = int(tc.get("num_hidden_layers", 0))
        kinds = tc.get("layer_types")
        if kinds:
            attention = sum(k == "full_attention" for k in kinds)
        else:
            interval = int(tc.get("full_attention_interval") or 1)
            attention = layers // interval
        linear = layers - attention
        head_dim = int(tc.get("head_dim") or tc.get("hidden_size", 0) // max(1, tc.get("num_attention_heads", 1)))
        kv = 2 * int(tc.get("num_key_value_heads", 0)) * head_dim * dtype  # keys and values, one token, one layer
        nk, dk = int(tc.get("linear_num_key_heads", 0)), int(tc.get("linear_key_head_dim", 0))
        nv, dv = int(tc.get("linear_num_value_heads", 0)), int(tc.get("linear_value_head_dim", 0))
        conv = (int(tc.get("linear_conv_kernel_dim", 1)) - 1) * (2 * nk * dk + nv * dv) * dtype
        state = nv * dv * dk * STATE_BYTES
        return cls(per_token=(attention + head_layers) * kv, per_row=linear * (conv + state),
                   per_fed=linear * state)

    def row(self, tokens: int, depth: int = 0) -> int:
        """Bytes of a row that will see `tokens` tokens, verified `depth` + 1 at a time."""
        return self.per_token * tokens + self.per_row + self.per_fed * (depth + 1)


class Admission:
    """Rows admitted while their estimated bytes fit `budget`; an empty batch takes any one row (it
    would run alone in serial mode too)."""

    def __init__(self, memory: RowMemory, budget: int):
        self.memory, self.budget = memory, budget

    def fits(self, held: Iterable[int], tokens: int, depth: int = 0) -> bool:
        """Whether a row of `tokens` tokens fits beside rows whose estimates are `held`."""
        held = list(held)
        return not held or sum(held) + self.memory.row(tokens, depth) <= self.budget
