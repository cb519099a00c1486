"""Where models are: the bundled default and user-given folders."""

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_MODEL = ASSETS / "dyno-tiny"


def default_model() -> Path:
    """DYNO_MODEL if set, else the bundled dyno-tiny."""
    return Path(os.environ.get("DYNO_MODEL", BUNDLED_MODEL))
