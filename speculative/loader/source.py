"""Where a model's files are: a local folder, or a Hugging Face repo id (ORG/NAME) taken from the
local Hugging Face cache, else downloaded through huggingface_hub with mlx-lm's file patterns."""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

from ..errors import DynoError, one_line

CARD = "README.md"  # not in mlx-lm's patterns; its base_model is how Dyno finds the original's MTP head
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
LOGIN = "`hf auth login` or HF_TOKEN"
Notify = Callable[[str], None]


@dataclass(frozen=True)
class ModelSource:
    """A model's local folder and, when it came from the Hub, its repo id."""

    folder: Path
    repo_id: Optional[str] = None

    @property
    def name(self) -> str:
        """What the model is called where it is shown: the repo id the user typed, else the folder's name."""
        return self.repo_id or self.folder.name


def is_repo_id(spec) -> bool:
    """Whether `spec` names a Hub repository: ORG/NAME that is no existing path and does not look like one
    (a path starts with `.`, `/` or `~`, or has more than one `/`)."""
    text = str(spec)
    return not text.startswith((".", "/", "~")) and bool(_REPO_ID.match(text)) and not Path(text).exists()


def allow_patterns() -> List[str]:
    """The files a repo id downloads: mlx-lm's own patterns (what its `load` fetches), and the model card."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return [*DEFAULT_ALLOW_PATTERNS, CARD]


def cache_repo_id(folder) -> Optional[str]:
    """The repo id of a snapshot folder in the Hugging Face cache (`models--ORG--NAME/snapshots/REV`), else None."""
    from ..heads.find import snapshot_repo

    return snapshot_repo(Path(os.path.abspath(Path(folder).expanduser())))


def resolve(spec, notify: Optional[Notify] = None,
            check_config: Optional[Callable[[dict], None]] = None) -> ModelSource:
    """The folder `spec` names: a local path as it is, a repo id from the cache or downloaded.

    `check_config` sees a repo's config.json before its weights are downloaded (a model that cannot
    be used is refused without fetching gigabytes); `notify` receives the line said before a download.
    """
    if not is_repo_id(spec):
        folder = Path(spec).expanduser()
        return ModelSource(folder, cache_repo_id(folder))
    repo = str(spec)
    return ModelSource(_snapshot(repo, notify or (lambda m: None), check_config), repo)


def cached(repo: str) -> Optional[Path]:
    """The snapshot of `repo` in the local Hugging Face cache when it holds the whole model, else None."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, allow_patterns=allow_patterns(), local_files_only=True))
    except Exception:  # not cached, partly cached, or not a valid repo id: no snapshot to use
        return None
    # Files fetched one by one (an original's card and index while its head was looked for) leave a
    # snapshot huggingface_hub cannot tell from a whole one: it must have the config and the weights.
    return folder if (folder / "config.json").is_file() and any(folder.glob("model*.safetensors")) else None


def _snapshot(repo: str, notify: Notify, check_config) -> Path:
    """The local snapshot of `repo`: the cache first, else a download with huggingface_hub's progress bars."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download

    from ..heads.find import offline

    folder = cached(repo)
    if folder is not None:
        return folder
    if offline():
        raise DynoError(f"{repo} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 prevents downloading "
                        f"it; unset HF_HUB_OFFLINE to download it, or pass a local folder")
    try:
        config = _config(Path(hf_hub_download(repo, "config.json")), repo)
        if check_config is not None:
            check_config(config)
        notify(f"dyno: downloading {repo} from the Hugging Face Hub into {constants.HF_HUB_CACHE}. "
               f"Set HF_HUB_OFFLINE=1 to prevent downloads.")
        return Path(snapshot_download(repo, allow_patterns=allow_patterns()))
    except DynoError:
        raise
    except Exception as e:
        raise hub_error(repo, e) from None


def _config(path: Path, repo: str) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DynoError(f"the config.json of {repo} cannot be read: {one_line(e)}") from None
    if not isinstance(config, dict):
        raise DynoError(f"the config.json of {repo} is not a JSON object")
    return config


def hub_error(repo: str, e: Exception) -> DynoError:
    """One line for what went wrong fetching `repo`, saying what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError)

    if isinstance(e, GatedRepoError):  # before its base class, RepositoryNotFoundError
        return DynoError(f"{repo} is a gated repository: accept its conditions at {constants.ENDPOINT}/{repo}, "
                         f"then log in ({LOGIN})")
    if isinstance(e, RepositoryNotFoundError):
        return DynoError(f"model not found: {repo} is no local folder and no model repository on the Hugging Face "
                         f"Hub (a private one needs {LOGIN})")
    if isinstance(e, RemoteEntryNotFoundError):
        return DynoError(f"{repo} has no config.json: not a model mlx-lm can load")
    if isinstance(e, HFValidationError):
        return DynoError(f"model path not found: {repo}")
    if isinstance(e, LocalEntryNotFoundError):  # what huggingface_hub raises when the Hub cannot be reached
        cause = f" ({one_line(e.__cause__)})" if e.__cause__ else ""
        return DynoError(f"cannot reach the Hugging Face Hub to download {repo}{cause}; check the connection, or "
                         f"set HF_HUB_OFFLINE=1 to use only the local cache")
    if isinstance(e, HfHubHTTPError):
        return DynoError(f"the Hugging Face Hub refused {repo}: {one_line(e)}")
    return DynoError(f"the download of {repo} stopped ({one_line(e)}); run again to resume it")
