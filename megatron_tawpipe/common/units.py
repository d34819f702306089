"""Link rates and times written as text: the one place they are read.

Rates
-----
The package carries every rate as **bytes per second** (a float; ``inf`` is a free link), and
:func:`parse_rate` reads text into that. A rate is ``<number>[ ]<prefix><unit>``:

* prefix: ``k``, ``M``, ``G``, ``T`` are powers of 1000 in either case (``m`` is mega: a rate
  has no milli); ``Ki``, ``Mi``, ``Gi``, ``Ti`` are powers of 1024;
* **bytes** per second: an upper-case ``B`` — ``B/s`` or ``Bps`` (``200GB/s``, ``1GiB/s``,
  ``10MBps``);
* **bits** per second: the word ``bit`` in any case, ``/s`` optional (``100Gbit/s``, ``1gbit``),
  a lower-case ``b`` — ``b/s`` or ``bps`` (``100Gb/s``, ``25Gbps``: the network notation) — or
  ``GbE`` (Ethernet: ``10GbE`` is 10 Gbit/s);
* no unit (``"3e9"``, or a number): bytes per second; ``inf`` (``infinite``, ``free``): no limit.

Only the case of ``B``/``b`` carries meaning; a rate must be positive.

tc's ``bps`` is the one exception
---------------------------------
tc(8) reads ``bps`` as **bytes** per second whatever its case (``10mbps`` is 10 MB/s, 80 Mbit/s),
where the notation above reads a lower-case ``bps`` as bits. The emulated cluster hands its rate
to tc as written, so that rate must mean what tc makes of it: :func:`parse_tc_rate` reads tc's
syntax only (``100mbit``, ``1gbit``, ``10mbps``, ``1gibit``; case-insensitive, a unit is
required) by rewriting tc's unit into the notation above (``<p>bit`` -> ``<p>bit/s``,
``<p>bps`` -> ``<p>B/s``) and returns **bits** per second (tc shapes in bits), or None for an
unshaped link.

Times
-----
:func:`parse_time` reads ``<number>[ ]<unit>`` with ``s``, ``ms``, ``us`` (``µs``) or ``ns``; no
unit (or a number) is seconds. A time must not be negative.

Pure Python, imports nothing from the package: the bottom layer.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Union

__all__ = ["parse_rate", "parse_tc_rate", "parse_time"]

Number = Union[int, float]

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_RATE_RE = re.compile(rf"({_NUMBER})\s*(\S*)")
_RATE_UNIT_RE = re.compile(r"(?P<prefix>(?:[kKmMgGtT][iI]?)?)(?P<base>[bB][iI][tT](?:/s)?|B/s|Bps|b/s|bps)")
_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
             "ki": 2.0 ** 10, "mi": 2.0 ** 20, "gi": 2.0 ** 30, "ti": 2.0 ** 40}
_UNLIMITED = ("inf", "infinite", "free")
_RATE_EXAMPLES = "e.g. 200GB/s, 1GiB/s, 100Gbit/s, 25Gbps, 10GbE, 3e9 (bytes/s) or inf"

_TC_RATE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*((?:[kmgt]i?)?)(bit|bps)", re.IGNORECASE)
_TC_UNSHAPED = ("", "none", "unlimited", "unshaped", "0")

_TIME_RE = re.compile(rf"({_NUMBER})\s*(\S*)")
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ns": 1e-9}


def _number(value, what: str) -> Optional[float]:
    """``value`` as a float when it is a number (not a bool), else None."""
    if isinstance(value, bool):
        raise ValueError(f"cannot parse {what} {value!r}")
    return float(value) if isinstance(value, (int, float)) else None


def parse_rate(text: Union[str, Number]) -> float:
    """Bytes per second of a rate: ``'200GB/s'`` -> 2e11, ``'100Gbit/s'`` and ``'25Gbps'`` -> bits / 8,
    ``'10GbE'`` -> 1.25e9, ``'3e9'`` or ``3e9`` -> 3e9, ``'inf'`` -> inf (module docstring: the convention).

    Raises ValueError naming ``text`` when it is not a positive rate in that notation.
    """
    value = _number(text, "rate")
    if value is None:
        if not isinstance(text, str):
            raise ValueError(f"cannot parse rate {text!r}: give a string such as 200GB/s or a number")
        s = text.strip()
        if s.lower() in _UNLIMITED:
            return math.inf
        m = _RATE_RE.fullmatch(s)
        if not m:
            raise ValueError(f"cannot parse rate {text!r} ({_RATE_EXAMPLES})")
        value = float(m.group(1)) * _rate_unit_scale(m.group(2), text)
    if not value > 0:  # also NaN
        raise ValueError(f"bad rate {text!r}: must be positive")
    return value


def _rate_unit_scale(unit: str, text) -> float:
    """Bytes per second that one ``unit`` is."""
    if not unit:
        return 1.0
    if unit.lower() == "gbe":
        return 1e9 / 8
    m = _RATE_UNIT_RE.fullmatch(unit)
    if not m:
        raise ValueError(f"unknown rate unit {unit!r} in {text!r} ({_RATE_EXAMPLES})")
    base = m.group("base")
    bits = base.lower().startswith("bit") or base[0] == "b"
    return _PREFIXES[m.group("prefix").lower()] / (8 if bits else 1)


def parse_tc_rate(text: Optional[str]) -> Optional[float]:
    """**Bits** per second of a tc rate (``100mbit``, ``1gbit``, ``500kbit``, ``1gibit``, ``10mbps``),
    read as tc(8) reads it: ``bit`` is bits, ``bps`` is BYTES per second, in any case; k/m/g/t are
    powers of 1000, ki/mi/gi/ti of 1024.

    None, ``"none"``, ``"unlimited"``, ``"unshaped"``, ``""`` and ``"0"`` mean an unshaped link and
    give None. A bare number is refused (tc would read bits, :func:`parse_rate` bytes): give a unit.
    Raises ValueError naming ``text`` otherwise.
    """
    if text is None or str(text).strip().lower() in _TC_UNSHAPED:
        return None
    m = _TC_RATE_RE.fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"bad rate {text!r}: use a tc rate such as 100mbit, 1gbit, 500kbit "
                         "or 'none' for an unshaped link")
    prefix, unit = m.group(2), m.group(3).lower()
    if not float(m.group(1)) > 0:
        raise ValueError(f"bad rate {text!r}: must be positive")
    # tc's units in this module's notation: <p>bit is <p>bit/s, <p>bps is <p>B/s (bytes).
    return 8 * parse_rate(f"{m.group(1)}{prefix}{'bit/s' if unit == 'bit' else 'B/s'}")


def parse_time(text: Union[str, Number]) -> float:
    """Seconds of a time: ``'5us'`` -> 5e-6, ``'1.5ms'`` -> 1.5e-3, ``'2'`` or ``2`` -> 2.0.

    Units ``s``, ``ms``, ``us`` (``µs``), ``ns``; raises ValueError naming ``text`` for anything
    else or a negative time.
    """
    value = _number(text, "time")
    if value is None:
        if not isinstance(text, str):
            raise ValueError(f"cannot parse time {text!r}: give a string such as 5us or a number")
        m = _TIME_RE.fullmatch(text.strip())
        if not m or m.group(2) not in _TIME_UNITS:
            raise ValueError(f"cannot parse time {text!r} (e.g. 20us, 1.5ms, 2s, 0.002)")
        value = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if not value >= 0:  # also NaN
        raise ValueError(f"bad time {text!r}: must not be negative")
    return value
