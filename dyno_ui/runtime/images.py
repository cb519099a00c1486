"""Images a chat request refers to, as bytes the engine takes (speculative/loader/vision.py).

Every API hands its images over as URLs (Anthropic's base64 sources become data: URLs): a data:
URL is decoded here; an http(s) URL is fetched only when the server allows it (`dyno serve
--allow-image-urls`, off by default: a server that fetches any URL for anyone is an SSRF hole),
within the byte limit and a time limit.
"""

import base64
import binascii
import urllib.request
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from speculative.errors import DynoError
from speculative.loader.vision import FORMATS, ImageLimits

MEDIA_TYPES = tuple(FORMATS.values())  # image/png, image/jpeg, image/webp, image/gif
FETCH_SECONDS = 10.0


@dataclass(frozen=True)
class ImagePolicy:
    """What a server takes: its limits, and whether it fetches http(s) image URLs."""

    limits: ImageLimits = ImageLimits()
    fetch_urls: bool = False
    fetch_seconds: float = FETCH_SECONDS


def image_bytes(url: str, policy: ImagePolicy, which: str = "image") -> bytes:
    """The bytes `url` (data: or, when allowed, http(s)) holds, or a DynoError saying what is wrong."""
    if url.startswith("data:"):
        header, comma, data = url[5:].partition(",")
        media_type, *params = header.split(";")
        if not comma or "base64" not in params:
            raise DynoError(f"{which}: a data: URL must be base64 (data:image/png;base64,...)")
        if media_type.lower() not in MEDIA_TYPES:
            raise DynoError(f"{which}: media type {media_type or 'none'!r} is not an image this server takes "
                            f"({', '.join(MEDIA_TYPES)})")
        if len(data) * 3 // 4 > policy.limits.max_bytes:
            raise DynoError(f"{which} is over the limit of {policy.limits.max_bytes} bytes")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise DynoError(f"{which}: the data: URL is not valid base64") from None
    if url.startswith(("http://", "https://")):
        if not policy.fetch_urls:
            raise DynoError(f"{which}: this server does not fetch image URLs (dyno serve --allow-image-urls); "
                            "send the image as a data: URL")
        return _fetch(url, policy, which)
    raise DynoError(f"{which}: the URL must be a data: URL{' or http(s)' if policy.fetch_urls else ''}")


def _fetch(url: str, policy: ImagePolicy, which: str) -> bytes:
    """GET `url` within the time and byte limits."""
    limit = policy.limits.max_bytes
    try:
        with urllib.request.urlopen(url, timeout=policy.fetch_seconds) as response:
            data = response.read(limit + 1)
    except Exception as e:
        raise DynoError(f"{which}: cannot fetch {url}: {e}") from None
    if len(data) > limit:
        raise DynoError(f"{which} is over the limit of {limit} bytes")
    return data


def request_images(urls: Sequence[str], policy: ImagePolicy) -> Tuple[bytes, ...]:
    """Every image of a request, in order, as bytes (the count checked before anything is decoded)."""
    if len(urls) > policy.limits.max_images:
        raise DynoError(f"{len(urls)} images in one request, over the limit of {policy.limits.max_images}")
    return tuple(image_bytes(u, policy, f"image {i + 1}") for i, u in enumerate(urls))


def placeholder_count(text: Optional[str]) -> int:
    """How many image placeholders a message's text holds."""
    from .request import IMAGE_PLACEHOLDER

    return (text or "").count(IMAGE_PLACEHOLDER)
