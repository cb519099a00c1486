"""What a server runs with, as data: built by `dyno serve` and by `python app.py`, read by the server."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple, Union

from speculative.config import SpecConfig
from speculative.errors import DynoError
from speculative.heads.precision import parse_head_bits

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value, what: str = "size") -> Optional[int]:
    """Bytes from an int or a string such as `8GB`, `512MiB`, `1.5g` or `0`; None stays None."""
    if value is None or isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise DynoError(f"{what} must be a number of bytes such as 8GB, 512MiB or 0, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ModelOptions:
    """Which model to load and how to draft with it (the flags `generate`, `serve` and `app.py` share)."""

    model: Union[str, Path, None] = None  # a folder or a Hugging Face repo id; None: $DYNO_MODEL, else dyno-tiny
    speculative: str = SpecConfig.mode
    draft_depth: Union[int, str] = "auto"
    draft_vocab: Union[int, str, None] = "auto"  # N, "auto" (draft_vocab.resolve picks N) or None: full
    mtp_head: Optional[str] = None
    mtp_head_bits: Optional[str] = None
    mtp_base: Optional[str] = None
    distributed: Optional[str] = None  # "pipeline" or "tensor": split across the ranks of mlx.launch
    copies: str = "on"  # drafts copied from the context: on (beside the head's), off, only (docs/how-it-works.md)

    def load_args(self, mode: Optional[str] = None) -> dict:
        """The loader's keyword arguments for this model (`mode` overrides --speculative)."""
        return dict(mode=mode or self.speculative, mtp_head=self.mtp_head, mtp_base=self.mtp_base,
                    head_bits=self.mtp_head_bits, copies=self.copies)

    def __post_init__(self):
        """Every value checked before anything is loaded."""
        if self.distributed not in (None, "pipeline", "tensor"):
            raise DynoError(f"--distributed must be pipeline or tensor, got {self.distributed!r}")
        if self.draft_depth != "auto":
            SpecConfig(self.speculative, self.draft_depth)
        SpecConfig(self.speculative, draft_vocab=self.draft_vocab, copies=self.copies)
        parse_head_bits(self.mtp_head_bits)


# `--decode-concurrency auto`'s width: what mlx-lm's server batches and more than local clients
# (an editor, an agent and its subagents) send at once; --max-batch-memory bounds the rows it admits.
DEFAULT_BATCH_WIDTH = 8


@dataclass(frozen=True)
class ServeOptions:
    """A server: the model, where it listens, how it decodes, and what it shows."""

    model: ModelOptions = ModelOptions()
    host: str = "127.0.0.1"
    port: int = 8080
    # Requests decoded together: "auto" batches up to DEFAULT_BATCH_WIDTH (rows admitted within
    # --max-batch-memory), one at a time across split ranks; 1 decodes one at a time.
    decode_concurrency: Union[int, str] = "auto"
    max_tokens_default: int = 512  # for requests that do not set max_tokens
    reasoning_budget: Optional[int] = None  # thinking tokens for chat requests that set no budget (None: unlimited)
    ui: bool = True  # the playground at /ui
    ui_front: bool = False  # `python app.py`: / redirects to the playground, Gradio's URL line last
    api_key: Optional[str] = None  # required on /v1/* and at the playground's login
    allowed_origins: Tuple[str, ...] = ()  # CORS: browser origins allowed to call the API ("*": any)
    allowed_hosts: Tuple[str, ...] = ()  # Host names served besides the bound address and loopback ("*": any)
    max_body_bytes: int = 32 * 1024 * 1024  # larger request bodies get a 413
    served_model_names: Tuple[str, ...] = ()  # ids requests may use besides the model's folder name
    prompt_cache_bytes: Union[int, str, None] = None  # reusable prompt states' memory (None: see speculative/backend/memory.py)
    prompt_cache_dir: Optional[Path] = None  # keep evicted (and, on shutdown, live) prompt states here
    prompt_cache_disk_bytes: Union[int, str, None] = None  # that folder's budget (None: see speculative/prompt_cache/disk.py)
    max_batch_memory: Union[int, str, None] = None  # batched rows' estimated KV + state (None: see speculative/backend/memory.py)
    max_queue: int = 64  # requests waiting beyond those being decoded; more are refused (503, Retry-After)
    default_thinking: bool = False  # Anthropic requests without `thinking`: the template's default, not none
    allow_image_urls: bool = False  # fetch http(s) image URLs (off: only data: URLs; a fetching server is an SSRF hole)
    max_images: int = 8  # images per request
    max_image_bytes: Union[int, str] = 20 * 1024 * 1024  # encoded bytes per image
    max_image_pixels: int = 40_000_000  # decoded width x height per image

    def __post_init__(self):
        object.__setattr__(self, "allowed_origins", tuple(o.rstrip("/") or o for o in self.allowed_origins))
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        object.__setattr__(self, "max_body_bytes", parse_size(self.max_body_bytes, "--max-body-bytes"))
        if not self.max_body_bytes or self.max_body_bytes < 1:
            raise DynoError(f"--max-body-bytes must be at least 1 byte, got {self.max_body_bytes}")
        for name in self.allowed_hosts:
            if not name or "/" in name or name != name.strip():
                raise DynoError(f"--allowed-hosts takes host names such as dyno.lan (or *), got {name!r}")
        for name in ("prompt_cache_bytes", "prompt_cache_disk_bytes", "max_batch_memory", "max_image_bytes"):  # "8GB", "512MiB", 0, bytes
            object.__setattr__(self, name, parse_size(getattr(self, name), "--" + name.replace("_", "-")))
        if self.api_key is not None and not self.api_key.strip():
            raise DynoError("--api-key must not be empty")
        for origin in self.allowed_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise DynoError(f"--allowed-origins takes origins such as https://example.com (or *), got {origin!r}")
        for name in self.served_model_names:
            if not name or name != name.strip():
                raise DynoError(f"--served-model-name must be a non-empty name without surrounding spaces, got {name!r}")
        if self.decode_concurrency != "auto" and (
                isinstance(self.decode_concurrency, bool) or not isinstance(self.decode_concurrency, int)
                or self.decode_concurrency < 1):
            raise DynoError(f"--decode-concurrency must be a number of requests (1 or more) or auto, "
                            f"got {self.decode_concurrency!r}")
        for name in ("max_images", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise DynoError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise DynoError(f"--max-queue must be 0 or more, got {self.max_queue}")
        if self.max_tokens_default < 1:
            raise DynoError(f"--max-tokens-default must be at least 1, got {self.max_tokens_default}")
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise DynoError(f"--reasoning-budget must be 0 or more, got {self.reasoning_budget}")
        if self.model.distributed and self.batched:
            raise DynoError("--distributed decodes one request at a time across the ranks; "
                            "drop --decode-concurrency")

    @property
    def width(self) -> int:
        """Requests decoded together: the number given, or auto's (one across split ranks)."""
        if self.decode_concurrency != "auto":
            return self.decode_concurrency
        return 1 if self.model.distributed else DEFAULT_BATCH_WIDTH

    @property
    def batched(self) -> bool:
        return self.width > 1
