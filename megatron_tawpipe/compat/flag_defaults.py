"""A refused flag given at Megatron-LM's own default value: accepted with one notice.

Most refused flags that take a value tune a feature this project does not have, which another flag
switches on: ``--fp8-recipe`` tunes ``--fp8-format``, ``--moe-router-topk`` tunes ``--num-experts``,
``--activation-offload-fraction`` tunes activation offloading. Given at the value Megatron-LM's parser
takes when the flag is absent, such a flag asks for exactly what Megatron-LM does without it, and
published launch scripts pass these values. The rule, from the defaults recorded from Megatron-LM's own
parsers (the ``default`` column of ``flag_data/raw_<release>.tsv``), not from a list of values:

    a refused flag that takes a value (nargs not 0), given the value that is its recorded default in a
    release the table covers, is accepted with one notice: "X is Megatron-LM's default for --flag; it has
    no effect here because <the flag's refusal reason>".

:func:`accepted_defaults` computes those values when the table is written (the table's
``accepted_defaults`` column); :func:`matches` compares at run time: as numbers where the value given and
the default both read as numbers (``1`` == ``1.0`` == ``1e0``), as strings otherwise; a flag taking
several values matches when given as many values, each equal to the default's. Not covered:

* switches (nargs 0): their default is a state (``false``), not a value to give;
* a default that is unknown (``?``, as for the flags recorded without defaults), None or empty: there is
  no such value to give;
* a release whose recorded nargs is not the table's: the flag meant something else there;
* :data:`DEFAULT_ASKS_FOR`: flags whose Megatron-LM default itself asks for what this project does not do
  (a behaviour on by default, or a setting of a feature this project runs its own way).

The values of :mod:`megatron_tawpipe.compat.flag_values` come first: where a hand-written rule accepts a
value (with its own reason) that rule answers.

Defaults that differ between releases: the rule accepts the default of every covered release. That is
safe only for a flag that tunes a feature refused in every release (so no value of it changes anything
here); each flag whose recorded defaults differ is therefore reviewed and named in
:data:`DIFFERING_DEFAULTS` (accepted) or in :data:`DEFAULT_ASKS_FOR` (refused), and :func:`problems`
(``tools/megatron_lm_flags.py table --check``) fails while one is not.
"""

from __future__ import annotations

import json
import math
import shlex
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from megatron_tawpipe.compat import flag_values
from megatron_tawpipe.compat.flag_rules import REFUSED

UNKNOWN = "?"
SINGLE = ("1", "?")     # nargs whose value argparse gives as one string (the others give a list)

_FSDP_DTYPE = ("sets a dtype of --use-megatron-fsdp, which runs here with dtypes that follow --bf16; Megatron-LM's "
               "default for it is not known to be what is done here")

# Flags whose Megatron-LM default asks for what this project does not do: refused at that value too.
DEFAULT_ASKS_FOR: Dict[str, str] = {
    "--rerun-mode": ("Megatron-LM's default (validate_results) reruns an iteration to check a NaN or spiky result; "
                     "here each iteration runs once (--rerun-mode disabled)"),
    "--megatron-fsdp-grad-comm-dtype": _FSDP_DTYPE,
    "--megatron-fsdp-main-grads-dtype": _FSDP_DTYPE,
    "--megatron-fsdp-main-params-dtype": _FSDP_DTYPE,
}

# Flags whose recorded defaults differ between releases, reviewed: every release's default is accepted.
DIFFERING_DEFAULTS: Dict[str, str] = {
    "--moe-deepep-num-sms": "20 in 0.16, unset in 0.19: a mixture-of-experts setting (refused in every release)",
    "--moe-hybridep-num-sms": "16 in 0.16, unset in 0.19: a mixture-of-experts setting (refused in every release)",
}


# ---- writing the table ---------------------------------------------------------------------------------

def _word(value) -> Optional[str]:
    """One default value as written on a command line; None for what cannot be given (None, a switch's
    state, an empty string, a mapping)."""
    if isinstance(value, bool) or value is None or value == "":
        return None
    if isinstance(value, (int, float, str)):
        return str(value)
    return None


def command_line_value(default: str, nargs: str):
    """A recorded default (JSON text) as the value a command line gives: a string for a flag taking one
    value, a list of strings for one taking several; None where there is no such value."""
    if default == UNKNOWN:
        return None
    value = json.loads(default)
    if nargs in SINGLE:
        return _word(value)
    items = value if isinstance(value, list) else [value]
    words = [_word(item) for item in items]
    return words if words and None not in words else None


def release_defaults(flag: str, nargs: str, raw_entries: Sequence) -> List[str]:
    """The recorded defaults (JSON text) of ``flag`` in the releases that record one with ``nargs`` values
    (``raw_entries``: its flag_table.RawFlag per release, None where a release lacks it)."""
    return [entry.default for entry in raw_entries
            if entry is not None and entry.nargs == nargs and entry.default != UNKNOWN]


def accepted_defaults(flag: str, nargs: str, cls: str, raw_entries: Sequence) -> list:
    """The values the rule accepts for ``flag``: Megatron-LM's defaults in the covered releases, each once."""
    if cls != REFUSED or nargs == "0" or flag in DEFAULT_ASKS_FOR:
        return []
    found = []
    for default in release_defaults(flag, nargs, raw_entries):
        value = command_line_value(default, nargs)
        if value is not None and value not in found:
            found.append(value)
    return found


# ---- answering a command line --------------------------------------------------------------------------

def _number(text: str):
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _equal(given: str, default: str) -> bool:
    """Numbers by value (``1`` == ``1.0``), other words exactly."""
    a, b = _number(given), _number(default)
    if a is not None and b is not None:
        return a == b
    return given == default


def matches(values, accepted: Sequence) -> bool:
    """Whether ``values`` (one string, or a list for a flag taking several) are one of the ``accepted``
    defaults (strings, or lists of strings)."""
    if values is None:
        return False
    if isinstance(values, (list, tuple)):
        given = [str(v) for v in values]
        return any(isinstance(a, list) and len(a) == len(given) and all(map(_equal, given, a)) for a in accepted)
    return any(isinstance(a, str) and _equal(str(values), a) for a in accepted)


def shown(value) -> str:
    """A value (or a list of values) as a command line writes it."""
    if isinstance(value, (list, tuple)):
        return " ".join(shlex.quote(str(v)) for v in value)
    return shlex.quote(str(value))


def _because(flag: str, reason: str) -> str:
    """The refusal reason as the end of "it has no effect here because ..."."""
    if reason.startswith(("a ", "an ", "not ")):
        return f"{flag} is {reason}"
    if reason.startswith(("needs ", "applies ", "changes ", "sets ", "names ")):
        return f"{flag} {reason}"
    return reason


def notice(flag: str, values, reason: str) -> str:
    """The one notice for ``flag`` given at Megatron-LM's default (``reason``: the flag's refusal)."""
    return (f"{shown(values)} is Megatron-LM's default for {flag}; it has no effect here because "
            f"{_because(flag, reason)}")


# ---- keeping the rule honest -----------------------------------------------------------------------------

def problems(rows: Iterable, raw: Mapping[str, Sequence]) -> List[str]:
    """What ``tools/megatron_lm_flags.py table --check`` reports (``rows``: the table's rows; ``raw``: the
    recorded releases' flags): a flag whose recorded defaults differ between releases and that is not
    reviewed, a stale entry of :data:`DEFAULT_ASKS_FOR` or :data:`DIFFERING_DEFAULTS`, and a value rule's
    'on' example that is Megatron-LM's default (the rule accepts it)."""
    rows = {row.flag: row for row in rows}
    by_release = [{entry.flag: entry for entry in entries} for entries in raw.values()]
    differing = set()
    for flag, row in rows.items():
        if row.cls == REFUSED and row.nargs != "0":
            defaults = release_defaults(flag, row.nargs, [release.get(flag) for release in by_release])
            if len({json.dumps(command_line_value(d, row.nargs)) for d in defaults}) > 1:
                differing.add(flag)
    found = [f"{flag}: Megatron-LM's default differs between releases -- name it in flag_defaults."
             "DIFFERING_DEFAULTS (every release's default is safe here) or DEFAULT_ASKS_FOR"
             for flag in sorted(differing - set(DIFFERING_DEFAULTS) - set(DEFAULT_ASKS_FOR))]
    for flag in sorted(DEFAULT_ASKS_FOR):
        row = rows.get(flag)
        if row is None or row.cls != REFUSED or row.nargs == "0" or row.default in (UNKNOWN, "null"):
            found.append(f"{flag}: DEFAULT_ASKS_FOR names it, but it is not a refused flag of the table that takes "
                         "a value with a recorded default")
    found += [f"{flag}: DIFFERING_DEFAULTS names it, but its recorded defaults do not differ"
              for flag in sorted(set(DIFFERING_DEFAULTS) - differing)]
    for flag, rule in sorted(flag_values.VALUE_RULES.items()):
        row = rows.get(flag)
        if row is not None and matches(rule.on, row.megatron_defaults):
            found.append(f"{flag}: the value rule's 'on' example {rule.on!r} is Megatron-LM's default, which is "
                         "accepted; give another")
    return found
