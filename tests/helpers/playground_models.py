"""A tiny checkpoint whose MTP head agrees with its trunk, for the playground's browser tests.

Every layer's output projection is zeroed, so the trunk's last hidden state is the embedding of
the current token and the head's fc keeps only its embedding half; the untied lm_head maps each
letter's embedding to the next letter. Trunk and head therefore both continue "abc…z abc…" (a real
checkpoint through the real loader and engine: nearly every draft is accepted).
"""

import glob
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from helpers import tiny_models

ZEROED = (".o_proj.weight", ".out_proj.weight", ".down_proj.weight")


def alphabet_model(folder) -> Path:
    """Build it in `folder` and return the folder."""
    return _alphabet(tiny_models.build(Path(folder), seed=1, tie_word_embeddings=False))


# The full-attention layer's output, kept at this scale in the VL variant: enough that the image
# moves the first tokens (three test images, three answers) while the head's alphabet stays mostly right.
IMAGE_ATTENTION = "model.language_model.layers.3.self_attn.o_proj.weight"
IMAGE_SCALE = 4.0


def alphabet_vl_model(folder) -> Path:
    """The same trunk and head on the tiny Qwen3.5-VL checkpoint (vision_models.build), with its last
    layer's attention kept (scaled): the answer depends on the image through the image rows' M-RoPE
    positions and the tower's embeddings, and the head's drafts are mostly accepted, some refused."""
    from helpers import vision_models

    folder = vision_models.build(Path(folder), seed=1, tie_word_embeddings=False)
    return _alphabet(folder, scaled={IMAGE_ATTENTION: IMAGE_SCALE})


def _alphabet(folder: Path, scaled=None) -> Path:
    """Rewrite the language model's and head's weights in `folder` as the module says (the vision
    tower's are left as they are); `scaled`: {weight name: factor} kept instead of zeroed."""
    from tokenizers import Tokenizer

    scaled = scaled or {}
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    letters = [tok.encode(c).ids[0] for c in "abcdefghijklmnopqrstuvwxyz "]  # the space: words, not one long one
    for path in glob.glob(str(folder / "*.safetensors")):
        weights = load_file(path)
        for name, w in weights.items():
            if name.startswith("model.visual."):
                continue
            if name in scaled:
                weights[name] = w * scaled[name]
            elif name.endswith(ZEROED) or "norm" in name:  # norms are stored zero-centred: 0 means 1
                weights[name] = np.zeros_like(w)
        if "mtp.fc.weight" in weights:
            hidden = weights["mtp.fc.weight"].shape[0]
            fc = np.zeros_like(weights["mtp.fc.weight"])  # [H, 2H]: the embedding half, then the hidden half
            fc[:, :hidden] = np.eye(hidden, dtype=fc.dtype)
            weights["mtp.fc.weight"] = fc
        if "lm_head.weight" in weights:
            embed = weights["model.language_model.embed_tokens.weight"]
            head = np.zeros_like(weights["lm_head.weight"])
            for i, token in enumerate(letters):  # each letter leads to the next; others to some letter
                head[letters[(i + 1) % len(letters)]] = embed[token]
            weights["lm_head.weight"] = head
        save_file(weights, path, metadata={"format": "pt"})
    return folder
