"""A tiny random Qwen3.5-VL checkpoint in the raw Hugging Face layout: the tiny trunk and head of
tiny_models, a vision tower under `model.visual.*`, an image processor config and a tokenizer with
the vision tokens, padded to the config's vocabulary. mlx-vlm 0.7.10 loads it as it loads a release.
"""

import io
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from helpers import tiny_models

# Vision token ids right after the byte alphabet and the text specials (256 + 5).
VISION_TOKENS = {"vision_start_token_id": 261, "vision_end_token_id": 262,
                 "image_token_id": 263, "video_token_id": 264}
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen3.5's template renders an image part as <|vision_start|><|image_pad|><|vision_end|>, as this one.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VISION_CONFIG = dict(model_type="qwen3_5", depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                     num_heads=2, patch_size=8, spatial_patch_size=8, spatial_merge_size=2,
                     temporal_patch_size=2, in_channels=3, num_position_embeddings=64,
                     deepstack_visual_indexes=[])
PREPROCESSOR = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 16 * 16, "longest_edge": 128 * 128},
                "image_processor_type": "Qwen2VLImageProcessorFast"}


def write_tokenizer(folder: Path) -> None:
    """The tiny byte-level tokenizer with the vision specials and an image-aware chat template."""
    from tokenizers import Tokenizer

    tiny_models.write_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(VISION_SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def build(folder, seed: int = 1, **overrides) -> Path:
    """Write the tiny VL checkpoint to `folder` (trunk and head as tiny_models.build); returns it."""
    from mlx_vlm.models.qwen3_5.config import VisionConfig
    from mlx_vlm.models.qwen3_5.vision import VisionModel

    folder = tiny_models.build(folder, seed=seed, **overrides)
    mx.random.seed(seed + 100)
    tower = VisionModel(VisionConfig(**VISION_CONFIG))
    weights = {}
    for name, v in tree_flatten(tower.parameters()):
        if name.endswith("patch_embed.proj.weight"):
            v = v.transpose(0, 4, 1, 2, 3)  # MLX NDHWC -> PyTorch NCDHW, as releases store it
        weights[f"model.visual.{name}"] = v
    mx.save_safetensors(str(folder / "model-visual.safetensors"), weights, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-visual.safetensors" for k in weights})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    config.update(VISION_TOKENS, vision_config=VISION_CONFIG,
                  architectures=["Qwen3_5ForConditionalGeneration"])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    write_tokenizer(folder)
    return folder


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A random RGB image as PNG bytes."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
