"""A head folder that loads and drafts but never guesses right: the bundled head with its fc zeroed.

Its output still equals plain decoding (every draft is verified); only acceptance shows it is broken,
which is what the head-health guard (speculative/heads/health.py) must notice.
"""

import json
from pathlib import Path

import mlx.core as mx

from dyno_ui.paths import BUNDLED_MODEL
from speculative.heads.mtp import HeadWeights, read_checkpoint_head, write_head_folder


def zeroed_fc_head(folder: Path) -> Path:
    """Write the bundled model's head with fc.weight zeroed to `folder` (a standalone head folder)."""
    head = read_checkpoint_head(BUNDLED_MODEL)
    tensors = {**head.tensors, "fc.weight": mx.zeros_like(head.tensors["fc.weight"])}
    text_config = json.loads((BUNDLED_MODEL / "config.json").read_text())["text_config"]
    broken = HeadWeights(tensors, norms_shifted=head.norms_shifted, source=head.source)
    return write_head_folder(folder, broken, text_config)
