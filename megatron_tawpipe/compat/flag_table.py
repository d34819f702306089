"""The table of Megatron-LM's flags this project answers from: every flag of Megatron-LM's parser in the
recorded releases, how many values it takes, Megatron-LM's default, the releases that have it and one class:

* ``implemented`` -- ``pretrain_llama.py``'s parser defines it (same name, meaning and default);
* ``no-effect`` -- accepted; when given, one notice per job says why nothing changes;
* ``refused`` -- one line says what it needs or what to use instead.

A refused flag that takes a value may list the values that ask for what this project does
(``no_effect_values``, a JSON list, with ``no_effect_reason``; :mod:`megatron_tawpipe.compat.flag_values`
has the rules) and Megatron-LM's own defaults for it (``accepted_defaults``, a JSON list;
:mod:`megatron_tawpipe.compat.flag_defaults` has the rule): those values take the ``no-effect`` class,
every other value the flag's class.

The raw flag lists (``flag_data/raw_<source>.tsv``) are what Megatron-LM's own parsers define, recorded by
``tools/megatron_lm_flags.py record``; :func:`build_table` classifies them with the rules of
:mod:`megatron_tawpipe.compat.flag_rules` and the flags the project's parser implements, and
``tools/megatron_lm_flags.py table`` writes ``flag_data/megatron_lm_flags.tsv``, the committed table the
runtime reads (:func:`read_table`): the same answers under every megatron-core release.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import os
from typing import Dict, Iterable, List, Mapping, Sequence

from megatron_tawpipe.compat import flag_defaults, flag_values
from megatron_tawpipe.compat.flag_rules import NO_EFFECT, REFUSED, classify

IMPLEMENTED = "implemented"
CLASSES = (IMPLEMENTED, NO_EFFECT, REFUSED)
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flag_data")
TABLE_PATH = os.path.join(DATA_DIR, "megatron_lm_flags.tsv")
# The recorded sources, oldest first: Megatron-LM's parser at core_v0.16.1 and in the megatron-core 0.19.2
# wheel (both run), and an earlier list of Megatron-LM main's and Megatron-DeepSpeed's flags (names and value
# counts only).
SOURCES = ("0.16", "0.19", "main")
DEEPSPEED = "megatron-deepspeed"
UNKNOWN = "?"
_COLUMNS = ("flag", "nargs", "default", "releases", "class", "reason", "accepted_defaults", "no_effect_values",
            "no_effect_reason")
_ROW_LENGTHS = (6, 7, 9)    # a row ends after the reason, after accepted_defaults, or has every column


def raw_path(source: str) -> str:
    return os.path.join(DATA_DIR, f"raw_{source}.tsv")


@dataclasses.dataclass(frozen=True)
class RawFlag:
    flag: str
    nargs: str          # 0, 1, N, '+', '*', '?'
    default: str        # JSON text, or '?' where not recorded
    origin: str = ""    # '' (Megatron-LM) or 'megatron-deepspeed'


@dataclasses.dataclass(frozen=True)
class Row:
    flag: str
    nargs: str
    default: str
    releases: str
    cls: str
    reason: str
    accepted_defaults: str = "[]"   # JSON list: Megatron-LM's defaults, accepted (refused flags only)
    no_effect_values: str = "[]"    # JSON list: the values that take the no-effect class (refused flags only)
    no_effect_reason: str = ""

    @property
    def default_value(self):
        """Megatron-LM's default as a Python value; ``UNKNOWN`` where the table records none."""
        return UNKNOWN if self.default == UNKNOWN else json.loads(self.default)

    @property
    def accepted_values(self) -> List[str]:
        """The values of a refused flag that are accepted with a notice (empty for the other classes)."""
        return json.loads(self.no_effect_values)

    @property
    def megatron_defaults(self) -> list:
        """Megatron-LM's defaults of a refused flag, accepted with a notice (strings, or lists of strings for a
        flag taking several values; empty for the other classes)."""
        return json.loads(self.accepted_defaults)

    def is_megatron_default(self, values) -> bool:
        """Whether ``values`` are accepted as Megatron-LM's default (and no value rule accepts them)."""
        return (self.cls == REFUSED and not flag_values.matches(values, self.accepted_values)
                and flag_defaults.matches(values, self.megatron_defaults))

    def answer(self, values):
        """(class, reason) for the flag given ``values`` (a string, a list, or None for no value); at
        Megatron-LM's default the reason is the whole notice."""
        if self.cls == REFUSED and flag_values.matches(values, self.accepted_values):
            return NO_EFFECT, self.no_effect_reason
        if self.is_megatron_default(values):
            return NO_EFFECT, flag_defaults.notice(self.flag, values, self.reason)
        return self.cls, self.reason


# ---- reading Megatron-LM's parser -------------------------------------------------------------------

def action_nargs(action: argparse.Action) -> str:
    """How many values an argparse action takes, in the table's notation."""
    if action.nargs is None:
        return "1"
    return str(action.nargs)


def json_default(value) -> str:
    """A default as JSON text; enums by name; '?' for what JSON cannot hold (a type, a function)."""
    if isinstance(value, enum.Enum):
        value = value.name
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return UNKNOWN


def record_parser(parser: argparse.ArgumentParser) -> List[RawFlag]:
    """Every option string of ``parser`` with its value count and default."""
    flags = {}
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag not in ("--help",):
                flags[flag] = RawFlag(flag, action_nargs(action), json_default(action.default))
    return [flags[flag] for flag in sorted(flags)]


def format_raw(flags: Iterable[RawFlag], header: str) -> str:
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines.append("# flag\tnargs\tdefault\torigin")
    lines += ["\t".join((f.flag, f.nargs, f.default, f.origin)).rstrip("\t") for f in flags]
    return "\n".join(lines) + "\n"


def read_raw(source: str) -> List[RawFlag]:
    flags = []
    with open(raw_path(source), encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("#") or not line.strip():
                continue
            fields = line.rstrip("\n").split("\t")
            flags.append(RawFlag(fields[0], fields[1], fields[2], fields[3] if len(fields) > 3 else ""))
    return flags


def read_all_raw() -> Dict[str, List[RawFlag]]:
    return {source: read_raw(source) for source in SOURCES}


# ---- classifying -------------------------------------------------------------------------------------

def _releases(flag: str, raw: Mapping[str, Sequence[RawFlag]], by_source) -> str:
    names = []
    for source in SOURCES:
        entry = by_source[source].get(flag)
        if entry is None:
            continue
        names.append(DEEPSPEED if entry.origin == DEEPSPEED else source)
    return ",".join(names)


def build_table(raw: Mapping[str, Sequence[RawFlag]], implemented: Iterable[str]) -> List[Row]:
    """One row per flag of the recorded lists. ``implemented``: the option strings the project's parser
    defines itself (``build_parser()`` less the table's own flags)."""
    implemented = set(implemented)
    by_source = {source: {f.flag: f for f in raw.get(source, ())} for source in SOURCES}
    rows = []
    for flag in sorted(set().union(*(by_source[s] for s in SOURCES))):
        newest_first = [by_source[s][flag] for s in reversed(SOURCES) if flag in by_source[s]]
        nargs = next(f.nargs for f in newest_first)
        default = next((f.default for f in newest_first if f.default != UNKNOWN), UNKNOWN)
        releases = _releases(flag, raw, by_source)
        if flag in implemented:
            cls, reason = IMPLEMENTED, ""
        else:
            cls, reason = classify(flag, deepspeed_only=releases == DEEPSPEED)
        rule = flag_values.VALUE_RULES.get(flag) if cls == REFUSED and nargs != "0" else None
        defaults = flag_defaults.accepted_defaults(flag, nargs, cls, [by_source[s].get(flag) for s in SOURCES])
        values = dict(no_effect_values=json.dumps(list(rule.values)), no_effect_reason=rule.reason) if rule else {}
        rows.append(Row(flag, nargs, default, releases, cls, reason, accepted_defaults=json.dumps(defaults), **values))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    counts = {cls: sum(1 for r in rows if r.cls == cls) for cls in CLASSES}
    valued = [r for r in rows if r.accepted_values]
    header = [
        "# Megatron-LM's flags and how pretrain_llama.py answers each: written by",
        "#   python tools/megatron_lm_flags.py table",
        "# from the recorded parsers (flag_data/raw_*.tsv), the rules (megatron_tawpipe/compat/flag_rules.py)",
        "# and the flags build_parser() implements. Do not edit by hand: change the rules and regenerate.",
        f"# {len(rows)} flags: " + ", ".join(f"{counts[c]} {c}" for c in CLASSES) + ".",
        "# nargs: values the flag takes; default: Megatron-LM's (JSON, '?' unknown); releases: 0.16 (Megatron-LM",
        "# core_v0.16.1), 0.19 (megatron-core 0.19.2), main (an earlier list of Megatron-LM main's flags),",
        f"# {DEEPSPEED} (Megatron-DeepSpeed's own).",
        "# accepted_defaults (JSON): Megatron-LM's defaults of a refused flag in the recorded releases, accepted",
        "# with one notice (megatron_tawpipe/compat/flag_defaults.py). no_effect_values (JSON) and",
        "# no_effect_reason: the values of a refused flag that ask for what pretrain_llama.py does (a feature",
        "# off, a count of zero, a mode it implements), accepted with one notice. Every other value takes the",
        "# flag's class. Rows end after reason, or after accepted_defaults, where the later columns are empty.",
        f"# {sum(len(r.accepted_values) for r in valued)} (flag, value) rules over {len(valued)} flags "
        "(megatron_tawpipe/compat/flag_values.py);",
        f"# Megatron-LM's default accepted for {sum(1 for r in rows if r.megatron_defaults)} flags "
        "(megatron_tawpipe/compat/flag_defaults.py).",
        "\t".join(_COLUMNS),
    ]
    lines = ["\t".join(_fields(r)) for r in rows]
    return "\n".join(header + lines) + "\n"


def _fields(row: Row) -> tuple:
    """A row's columns; a row ends after the reason, or after accepted_defaults, where the rest is empty."""
    fields = dataclasses.astuple(row)
    if row.accepted_values:
        return fields
    return fields[:_ROW_LENGTHS[1]] if row.megatron_defaults else fields[:_ROW_LENGTHS[0]]


def parse_table(text: str) -> Dict[str, Row]:
    rows = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip() or line.startswith("flag\t"):
            continue
        fields = line.split("\t")
        if len(fields) not in _ROW_LENGTHS:
            raise ValueError(f"{TABLE_PATH}: malformed row {line!r}")
        row = Row(*fields)
        if row.cls not in CLASSES:
            raise ValueError(f"{TABLE_PATH}: {row.flag} has class {row.cls!r}, not one of {CLASSES}")
        rows[row.flag] = row
    return rows


@functools.lru_cache(maxsize=1)
def read_table() -> Dict[str, Row]:
    """The committed table: flag -> Row."""
    with open(TABLE_PATH, encoding="utf-8") as handle:
        return parse_table(handle.read())


def counts(rows: Iterable[Row]) -> Dict[str, int]:
    rows = list(rows)
    return {cls: sum(1 for r in rows if r.cls == cls) for cls in CLASSES}
