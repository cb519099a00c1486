"""Where models are: the bundled default, user-given folders and the Hugging Face cache."""

import os
import sysconfig
from pathlib import Path
from typing import Iterable, List, Union

from speculative.errors import DynoError



def assets_folder(checkout: Path = Path(__file__).resolve().parent.parent / "assets",
                  installed: Path = Path(sysconfig.get_path("data")) / "share" / "dyno-mlx" / "assets") -> Path:
    """assets/ of a checkout (an editable install), else where a wheel put it (pyproject's data-files)."""
    return checkout if checkout.is_dir() or not installed.is_dir() else installed


ASSETS = assets_folder()
BUNDLED_MODEL = ASSETS / "dyno-tiny"


def default_model() -> Union[str, Path]:
    """DYNO_MODEL if set (a folder or a Hugging Face repo id, as --model), else the bundled dyno-tiny (an error
    saying so when it is absent)."""
    if os.environ.get("DYNO_MODEL"):
        return os.environ["DYNO_MODEL"]
    if not (BUNDLED_MODEL / "config.json").exists():
        raise DynoError(f"the bundled model is not installed at {BUNDLED_MODEL}; pass --model PATH or REPO "
                        f"or set DYNO_MODEL")
    return BUNDLED_MODEL


def hf_cache_snapshots() -> List[Path]:
    """Snapshot folders of the model repositories in the local Hugging Face cache (none when it is empty)."""
    try:
        from huggingface_hub import scan_cache_dir

        repos = scan_cache_dir().repos
    except Exception:
        return []  # no Hugging Face cache yet
    return [Path(rev.snapshot_path) for repo in repos if repo.repo_type == "model" for rev in repo.revisions]


def local_folders(extra: Iterable[Path] = ()) -> List[Path]:
    """The bundled model, `extra` and the Hugging Face cache's snapshots, each folder once.

    Folders are the same when their resolved paths are (`assets/dyno-tiny` typed into the playground
    is the bundled model, not a second one); the first spelling seen is kept.
    """
    seen, out = set(), []
    for folder in [BUNDLED_MODEL, *extra, *hf_cache_snapshots()]:
        key = Path(folder).expanduser().resolve()
        if key not in seen:
            seen.add(key)
            out.append(Path(folder))
    return out
