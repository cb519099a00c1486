"""The field policy: fields a request sends that Dyno does not know are ignored, named in one log
line and counted for /stats. Clients add fields with every release; refusing them would break each
client's next release against a server that could have answered (docs/server.md, "Field policy")."""

import logging
import re
import threading
from collections import Counter
from typing import Any, Iterator, List, Tuple

from pydantic import BaseModel

log = logging.getLogger("dyno.serve")


def unknown_fields(value: Any, where: Tuple = ()) -> Iterator[str]:
    """The dotted paths of the fields a validated request held that its types do not declare
    (pydantic keeps them in `model_extra` on types with extra="allow"), depth first."""
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            yield ".".join(map(str, (*where, name)))
        for name in type(value).model_fields:
            yield from unknown_fields(getattr(value, name, None), (*where, name))
        for path, part in getattr(value, "parts", lambda: ())():  # fields a type reads itself (Responses input)
            yield from unknown_fields(part, (*where, *path))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from unknown_fields(v, (*where, i))


# Field names come from clients: the counter keeps this many distinct paths (the rest count as OTHER)
# and the log line names this many, so no request can grow the server's memory or its log unbounded.
MAX_PATHS = 256
MAX_LOGGED = 16
MAX_PATH_CHARS = 120
OTHER = "(other)"


def _short(path: str) -> str:
    return path if len(path) <= MAX_PATH_CHARS else path[: MAX_PATH_CHARS - 3] + "..."


class IgnoredFields:
    """How often each unknown field was ignored, by path with list indices as `*`, for /stats."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    def note(self, route: str, request: BaseModel) -> List[str]:
        """Log and count the unknown fields of `request`, sent to `route`; returns their paths."""
        paths = list(dict.fromkeys(unknown_fields(request)))
        if paths:
            named = ", ".join(_short(p) for p in paths[:MAX_LOGGED])
            more = f" and {len(paths) - MAX_LOGGED} more" if len(paths) > MAX_LOGGED else ""
            log.info("dyno: %s: ignored unknown fields: %s%s", route, named, more)
            with self._lock:
                for key in (_short(re.sub(r"\.\d+(?=\.|$)", ".*", p)) for p in paths):
                    known = key in self._counts or len(self._counts) < MAX_PATHS
                    self._counts[key if known else OTHER] += 1
        return paths

    def as_json(self) -> dict:
        """{"total": fields ignored, "by_field": {path: count}}, at most MAX_PATHS + 1 paths."""
        with self._lock:
            return {"total": sum(self._counts.values()), "by_field": dict(sorted(self._counts.items()))}
