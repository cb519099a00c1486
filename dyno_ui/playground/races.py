"""What the Compare tab races: each pairing's two sides, the one drafting more first.

A side is a job setting (speculation mode and draft sources) with the words the page shows for it;
the race's speedup is the first side's tok/s over the second's, so the one added to is second.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Side:
    key: str  # its runs' key in the exported JSON
    label: str  # its name in the summary line, the race chart and its column's heading
    mode: str  # SpecConfig mode: "mtp" drafts, "off" decodes plainly
    copies: Optional[str] = None  # its draft sources (round/copies.py); None: the server's --copies


PAIRINGS: Dict[str, Tuple[Side, Side]] = {
    "MTP against plain decoding": (Side("mtp", "MTP", "mtp"), Side("plain", "plain", "off")),
    "head + copies against the head alone": (Side("copies", "head + copies", "mtp", "on"),
                                             Side("head", "head only", "mtp", "off")),
}
DEFAULT = next(iter(PAIRINGS))


def pairing(name: str) -> Tuple[Side, Side]:
    """The sides of the pairing called `name`; a name the page does not offer is a one-line error."""
    from speculative.errors import DynoError

    if name not in PAIRINGS:
        raise DynoError(f"race must be one of {', '.join(map(repr, PAIRINGS))}, got {name!r}")
    return PAIRINGS[name]


def names(sides: Tuple[Side, Side]) -> Tuple[str, str]:
    return sides[0].label, sides[1].label
