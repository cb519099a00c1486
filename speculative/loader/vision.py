"""Images in a prompt, for Qwen3.5/3.6 checkpoints that carry a vision tower (`model.visual.*`).

mlx-vlm (an extra: VISION_INSTALL) provides the tower and the image processor, the reference
implementation; the trunk stays mlx-lm's. What an image gives the engine is a `VisionInput`: the
prompt's input embeddings with the tower's rows in the `<|image_pad|>` rows, and the 3-axis M-RoPE
positions of the prompt with the delta every later row is shifted by (target.MRoPE).
"""

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
import mlx.nn as nn

from ..errors import DynoError, one_line
from ..target import MRoPE

VISION_INSTALL = "pip install 'dyno-mlx[vision]'"
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send: images, bytes per image, pixels per image (before resizing)."""

    max_images: int = 8
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000  # decoded width x height; the processor then resizes to its own bound


@dataclass
class Vision:
    """A checkpoint's vision tower (mlx-vlm's VisionModel) and image processor, with the token ids and
    rotary embedding the prompt's positions need."""

    tower: nn.Module
    processor: object  # mlx-vlm's Qwen3VLImageProcessor (numpy and Pillow)
    rotary: object  # mlx-vlm's Qwen3_5RotaryEmbedding over the text's rotary dims
    image_token_id: int
    vision_start_token_id: int
    merge_size: int


@dataclass(frozen=True)
class VisionInput:
    """What prefill takes beside a prompt with images: [1, n, H] embeddings and the M-RoPE positions."""

    embeddings: mx.array
    rope: MRoPE
    images: Tuple[Tuple[str, Tuple[int, int, int]], ...]  # (sha256 of the bytes, grid t, h, w) per image
    key: Tuple[int, ...] = ()  # the prompt as the prompt cache keys it (cache_key)


# An image's rows in a prompt-cache key: ids no tokenizer has, spelling the digest of its pixels, so
# that two images of the same size (the same placeholder ids) never share an entry.
IMAGE_KEY_BASE = 1 << 30


def cache_key(tokens: Sequence[int], image_token_id: int, pixels: Sequence[str]) -> Tuple[int, ...]:
    """`tokens` with each image's rows replaced by its pixels' digest, 28 bits a row, repeated; the
    rows at any prefix the cache resumes from (message boundaries, past the images) spell it whole."""
    key, image, row = [], -1, 0
    for i, t in enumerate(tokens):
        if t != image_token_id:
            key.append(t)
            continue
        if i == 0 or tokens[i - 1] != image_token_id:
            image, row = image + 1, 0
        digest = pixels[image]
        key.append(IMAGE_KEY_BASE + int(digest[(7 * row) % 63 : (7 * row) % 63 + 7], 16))
        row += 1
    return tuple(key)


def _tower_weights(path: Path) -> dict:
    """The tower's tensors under mlx-vlm's names (vision_tower.* stripped), from the checkpoint's shards."""
    prefixes = ("model.visual.", "vision_tower.", "model.language_model.visual.")
    index = path / "model.safetensors.index.json"
    if index.exists():  # only the shards that hold the tower
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for k, f in weight_map.items() if k.startswith(prefixes)})
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    out = {}
    for name in files:
        for key, value in mx.load(str(path / name)).items():
            for prefix in prefixes:
                if key.startswith(prefix):
                    out[key[len(prefix):]] = value
    return out


_PROCESSOR_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
                   "do_rescale", "do_normalize", "do_convert_rgb")


def _processor_kwargs(path: Path) -> Optional[dict]:
    """The image processor's settings from the folder's preprocessor_config.json (processor_config.json's
    image_processor over it), as mlx-vlm 0.7.10 reads them; None when there is none. Not mlx-vlm's own
    reader: it asks the Hub for a file the folder lacks."""
    raw = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            data = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        raw.update(data.get("image_processor", {}) if name == "processor_config.json" else data)
    if not raw:
        return None
    out = {"patch_size": 16, **{k: raw[k] for k in _PROCESSOR_KEYS if k in raw}}
    size = raw.get("size") or {}
    for key, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if size.get(key) is not None:
            out[name] = size[key]
    out.update({k: raw[k] for k in ("min_pixels", "max_pixels") if raw.get(k) is not None})
    return out


def load_vision(path: Path, config: dict) -> Tuple[Optional[Vision], Optional[str]]:
    """(the vision tower and processor, None), or (None, why this model cannot take images)."""
    if "vision_config" not in config:
        return None, (f"{path.name} has no vision tower (a text-only conversion); "
                      "use a vision-language conversion (the original Qwen repo, or an mlx-vlm conversion)")
    processor_kwargs = _processor_kwargs(path)
    if processor_kwargs is None:
        return None, (f"{path.name} has no image processor config (preprocessor_config.json); "
                      "use a vision-language conversion (the original Qwen repo, or an mlx-vlm conversion)")
    weights = _tower_weights(path)
    if not weights:
        return None, (f"{path.name} has no vision tower weights (model.visual.*); "
                      "use a vision-language conversion (the original Qwen repo, or an mlx-vlm conversion)")
    try:
        from mlx_vlm.models.qwen3_5.config import ModelConfig
        from mlx_vlm.models.qwen3_5.language import Qwen3_5RotaryEmbedding
        from mlx_vlm.models.qwen3_5.vision import VisionModel
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor
    except ImportError:
        return None, f"images need mlx-vlm: {VISION_INSTALL}"
    try:
        cfg = ModelConfig.from_dict(config)
        tower = VisionModel(cfg.vision_config)
        weights = tower.sanitize(weights)  # PyTorch's Conv3d layout to MLX's
        quantization = config.get("quantization")
        if quantization and any(k.endswith(".scales") for k in weights):
            nn.quantize(tower, quantization["group_size"], quantization["bits"],
                        class_predicate=lambda p, m: f"{p}.scales" in weights)
        tower.load_weights(list(weights.items()))
        mx.eval(tower.parameters())
        tower.eval()
        text = cfg.text_config
        rope = text.rope_parameters
        rotary = Qwen3_5RotaryEmbedding(int(text.head_dim * rope["partial_rotary_factor"]),
                                        max_position_embeddings=text.max_position_embeddings,
                                        base=rope["rope_theta"], mrope_section=rope["mrope_section"])
        processor = Qwen3VLImageProcessor(**processor_kwargs)
    except Exception as e:  # a tower that does not load costs images, not the model
        return None, f"the vision tower of {path.name} cannot be loaded: {one_line(e)}"
    return Vision(tower, processor, rotary, cfg.image_token_id, cfg.vision_start_token_id,
                  cfg.vision_config.spatial_merge_size), None


def decode_image(data: bytes, limits: ImageLimits, which: str = "image"):
    """A Pillow RGB image from encoded bytes, or a DynoError saying what is wrong with them."""
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise DynoError(f"{which} is {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
    except Exception:
        raise DynoError(f"{which} cannot be decoded: not a PNG, JPEG, WebP or GIF image") from None
    if image.format not in FORMATS:
        raise DynoError(f"{which} is {image.format or 'an unknown format'}; images must be PNG, JPEG, WebP or GIF")
    if getattr(image, "n_frames", 1) > 1:
        raise DynoError(f"{which} is animated; video input is not supported")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise DynoError(f"{which} is {width}x{height} pixels, over the limit of {limits.max_pixels}")
    try:
        image.load()
        return image.convert("RGB")
    except Exception as e:
        raise DynoError(f"{which} cannot be decoded: {one_line(e)}") from None


def rope_index(tokens: Sequence[int], grids: Sequence[Tuple[int, int, int]], image_token_id: int,
               merge_size: int) -> Tuple[List[List[int]], int]:
    """The prompt's 3-axis positions and its rope delta, as mlx-vlm's get_rope_index for still images:
    text rows count on all axes; an image's rows take (t, h, w) of its merged grid after the text
    before it, and the text after it resumes at that image's largest position + 1."""
    axes: List[List[int]] = [[], [], []]
    at = i = image = 0
    while i < len(tokens):
        if tokens[i] != image_token_id:
            for a in axes:
                a.append(at)
            at, i = at + 1, i + 1
            continue
        t, h, w = grids[image][0], grids[image][1] // merge_size, grids[image][2] // merge_size
        for ti in range(t):
            for hi in range(h):
                for wi in range(w):
                    for a, v in zip(axes, (ti, hi, wi)):
                        a.append(at + v)
        at, i, image = at + max(t, h, w), i + t * h * w, image + 1
    return axes, at - len(tokens)


@dataclass(frozen=True)
class ProcessedImages:
    """A prompt's images as the image processor leaves them (numpy, no MLX yet): the tower's input,
    each image's patch grid and the digest of its bytes."""

    pixel_values: Any  # numpy [patches, C x temporal patch x patch x patch]
    grids: Tuple[Tuple[int, int, int], ...]
    digests: Tuple[str, ...]  # sha256 of each image's bytes
    pixels: Tuple[str, ...] = ()  # sha256 of each image's processed pixels (the tower's input rows)


def process_images(vision: Vision, tokens: Sequence[int], images: Sequence[bytes],
                   limits: ImageLimits = ImageLimits()) -> Tuple[List[int], ProcessedImages]:
    """(token ids with each image's placeholder widened to its rows, the processed images), with
    Pillow and numpy alone: any thread may call it (MLX work is `vision_input`'s, the engine thread's).

    `tokens` hold one `<|image_pad|>` per image (as chat templates render an image part), in order.
    """
    if len(images) > limits.max_images:
        raise DynoError(f"{len(images)} images in one request, over the limit of {limits.max_images}")
    placeholders = sum(t == vision.image_token_id for t in tokens)
    if placeholders != len(images):
        raise DynoError(f"the prompt has {placeholders} image placeholders for {len(images)} images")
    decoded = [decode_image(b, limits, f"image {i + 1}") for i, b in enumerate(images)]
    try:
        processed = vision.processor(decoded)
    except Exception as e:
        raise DynoError(f"the image cannot be processed: {one_line(e)}") from None
    grids = tuple(tuple(int(x) for x in g) for g in processed["image_grid_thw"].tolist())
    widened, image = [], 0
    for t in tokens:
        if t == vision.image_token_id:
            g = grids[image]
            widened += [t] * (g[0] * g[1] * g[2] // vision.merge_size**2)
            image += 1
        else:
            widened.append(t)
    digests = tuple(hashlib.sha256(b).hexdigest() for b in images)
    pixel_values = np.ascontiguousarray(processed["pixel_values"])
    ends = np.cumsum([t * h * w for t, h, w in grids])  # each image's patches, in order
    pixels = tuple(hashlib.sha256(np.asarray(grid).tobytes() + rows.tobytes()).hexdigest()
                   for grid, rows in zip(grids, np.split(pixel_values, ends[:-1])))
    return widened, ProcessedImages(pixel_values, grids, digests, pixels)


def vision_input(target, vision: Vision, tokens: Sequence[int], images: ProcessedImages) -> VisionInput:
    """What prefill takes for widened `tokens` with their processed `images`: the tower's rows in the
    image rows' embeddings, the prompt's M-RoPE positions and delta."""
    tower_dtype = vision.tower.patch_embed.proj.weight.dtype
    features, _ = vision.tower(mx.array(images.pixel_values).astype(tower_dtype), mx.array(images.grids))
    embeddings = target.embed(mx.array(list(tokens))[None])
    rows = mx.array([i for i, t in enumerate(tokens) if t == vision.image_token_id])
    embeddings[0, rows] = features.astype(embeddings.dtype)  # the tower's rows, in order, as mlx-vlm's scatter
    axes, delta = rope_index(tokens, images.grids, vision.image_token_id, vision.merge_size)
    rope = MRoPE(vision.rotary, mx.array(axes, dtype=mx.int32), delta)
    mx.eval(embeddings)
    key = cache_key(tokens, vision.image_token_id, images.pixels) if images.pixels else ()
    return VisionInput(embeddings, rope, tuple(zip(images.digests, images.grids)), key)


def image_prompt(target, vision: Vision, tokens: Sequence[int], images: Sequence[bytes],
                 limits: ImageLimits = ImageLimits()) -> Tuple[List[int], VisionInput]:
    """(widened token ids, what prefill takes for them): `process_images`, then `vision_input`."""
    widened, processed = process_images(vision, tokens, images, limits)
    return widened, vision_input(target, vision, widened, processed)


def checked_vision(lm) -> Vision:
    """`lm`'s vision tower and processor; a model that takes no images (no tower, or no mlx-vlm) is a
    DynoError saying why and what to do."""
    if lm.vision is None:
        raise DynoError(lm.vision_error or f"{lm.name} takes no images")
    return lm.vision


def images_for(lm, tokens: Sequence[int], images: Sequence[bytes],
               limits: ImageLimits = ImageLimits()) -> Tuple[List[int], Optional[VisionInput]]:
    """`image_prompt` for a LoadedModel `lm`: (tokens, None) without images; a model that takes none
    (no tower, or no mlx-vlm) is a DynoError saying why and what to do."""
    if not images:
        return list(tokens), None
    return image_prompt(lm.target, checked_vision(lm), tokens, images, limits)
