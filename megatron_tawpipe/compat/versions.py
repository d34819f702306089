"""The megatron-core and torch releases this package supports, stated once.

``setup.py`` reads this file on its own (it runs before torch and megatron-core are installed, so this
module imports only the standard library); every version check uses it: the run-time patches' self-checks
(:mod:`megatron_tawpipe.compat.patches`), the CPU layer, the deferred linear layers.

A range is ``(lowest, first unsupported)``: ``("0.16", "0.20")`` is ``>=0.16,<0.20``, every 0.16.x to
0.19.x; ``None`` leaves that side open.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

Range = Tuple[Optional[str], Optional[str]]

#: CI runs 0.16.1 (Python 3.11), and checks 0.17.0 and 0.19.2 under Python 3.12.
MEGATRON_CORE_RANGE: Range = ("0.16", "0.20")
#: Not pinned above on purpose: install the torch build you want first (the CPU build on CPU machines, a
#: CUDA build on GPU clusters); any torch >= 2.6 satisfies the requirement.
TORCH_RANGE: Range = ("2.6", None)

RANGES = {"megatron-core": MEGATRON_CORE_RANGE, "torch": TORCH_RANGE}


def release(version: str) -> Tuple[int, ...]:
    """The release numbers of a version: "0.16.1" -> (0, 16, 1); local and pre-release parts are dropped
    ("2.13.0+cpu" -> (2, 13, 0), "0.17.0rc1" -> (0, 17, 0))."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _compare(a: Tuple[int, ...], b: Tuple[int, ...]) -> int:
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def in_range(version: str, bounds: Range) -> bool:
    """Whether ``version`` lies in ``bounds`` (lowest included, first unsupported excluded)."""
    low, high = bounds
    found = release(version)
    return (low is None or _compare(found, release(low)) >= 0) and (
        high is None or _compare(found, release(high)) < 0)


def specifier(bounds: Range) -> str:
    """``bounds`` as a requirement specifier: ``>=0.16,<0.20``."""
    low, high = bounds
    return ",".join(part for part in (low and f">={low}", high and f"<{high}") if part)


def requirement(package: str) -> str:
    """``package``'s install requirement: ``megatron-core>=0.16,<0.20``."""
    return package + specifier(RANGES[package])


def parse_specifier(text: str) -> Range:
    """The range a ``>=A,<B`` specifier (or a requirement ``name>=A,<B``) states; other operators are refused."""
    low = high = None
    spec = re.sub(r"^[A-Za-z0-9_.\-\[\]]+", "", text.strip())
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = re.fullmatch(r"(>=|<)\s*([0-9][0-9.]*)", part)
        if match is None:
            raise ValueError(f"{text!r}: only '>=' and '<' bounds state a supported range")
        if match.group(1) == ">=":
            low = match.group(2)
        else:
            high = match.group(2)
    return low, high


def installed(package: str) -> Optional[str]:
    """The installed version of ``package`` (a distribution name: "megatron-core", "torch"), or None."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
