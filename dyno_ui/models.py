"""Where models are: the bundled default and user-given folders."""

import os
from pathlib import Path

from speculative.errors import DynoError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_MODEL = ASSETS / "dyno-tiny"


def default_model() -> Path:
    """DYNO_MODEL if set, else the bundled dyno-tiny (an error saying so when it is absent)."""
    if os.environ.get("DYNO_MODEL"):
        return Path(os.environ["DYNO_MODEL"])
    if not (BUNDLED_MODEL / "config.json").exists():
        raise DynoError(f"the bundled model is not installed at {BUNDLED_MODEL}; pass --model PATH "
                        f"or set DYNO_MODEL")
    return BUNDLED_MODEL
