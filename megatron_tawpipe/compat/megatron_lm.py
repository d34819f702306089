"""Megatron-LM's flags that this project accepts without acting on them, or refuses with a reason.

A Megatron-LM launch script must run here with only ``--pipeline-schedule`` changed, or stop at once with
one line that says which flag is the problem and what it needs. The answers come from the committed flag
table (:mod:`megatron_tawpipe.compat.flag_table`, ``flag_data/megatron_lm_flags.tsv``), never from the
installed megatron-core, so they are the same under every release:

* ``implemented`` flags are defined by :mod:`megatron_tawpipe.arguments` itself, with Megatron-LM's
  meaning and default;
* every other flag of the table is registered by :func:`add_compat_args` with its number of values and
  answered by :func:`settle_compat_flags`: a ``no-effect`` flag gives one notice per job saying why, a
  ``refused`` flag one line saying what it needs or what to use instead -- unless its value is one the
  table accepts for it (a value asking for what this project does, such as ``--rerun-mode disabled``, or
  Megatron-LM's own default for it, such as ``--activation-offload-fraction 1.0``), which gives one
  notice; the refusal names those values;
* a word the table does not know stays argparse's "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import shlex
from typing import Dict, List, Sequence

from megatron_tawpipe.compat import flag_defaults, flag_values
from megatron_tawpipe.compat.flag_rules import REFUSED
from megatron_tawpipe.compat.flag_table import IMPLEMENTED, Row, read_table

GIVEN = "megatron_lm_flags_given"     # where the table's flags put what they were given (only when given)
NOTICES = "megatron_lm_notices"       # the notices parse_args leaves for validate_args to print


class TableFlagAction(argparse.Action):
    """A flag of Megatron-LM's answered from the table: records (flag, values) and nothing else."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = list(getattr(namespace, GIVEN, []))
        given.append((option_string, values))
        setattr(namespace, GIVEN, given)


def _nargs(row: Row):
    if row.nargs == "1":
        return None
    if row.nargs.isdigit():
        return int(row.nargs)
    return row.nargs


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """Register the table's no-effect and refused flags that ``parser`` does not define itself (hidden
    from --help). A flag the parser defines wins over the table, so a flag implemented after the table
    was written is the parser's."""
    for flag, row in read_table().items():
        if row.cls == IMPLEMENTED or flag in parser._option_string_actions:
            continue
        parser.add_argument(flag, dest=GIVEN, action=TableFlagAction, nargs=_nargs(row), default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)


def project_flags(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """The option strings ``parser`` defines itself (not answered from the table) -> their actions."""
    return {flag: action for flag, action in parser._option_string_actions.items()
            if not isinstance(action, TableFlagAction) and flag.startswith("--") and flag != "--help"}


def _shown(flag: str, values) -> str:
    """The flag as given: with its values, if it takes any."""
    if values is None:
        return flag
    if isinstance(values, (list, tuple)):
        return " ".join([flag] + [shlex.quote(str(v)) for v in values])
    return f"{flag} {shlex.quote(str(values))}"


def refusal(flag: str, values, row: Row) -> str:
    """The one line that refuses a flag (naming the values the table accepts for it, if any)."""
    if row.reason.startswith("a Megatron"):      # no rule names it: the generic refusal
        line = f"{flag} is {row.reason}"
    else:
        line = f"{_shown(flag, values)}: {row.reason}"
    accepted = [f"{flag} {shlex.quote(value)}" for value in row.accepted_values]
    accepted += [f"{flag} {flag_defaults.shown(value)} (Megatron-LM's default)" for value in row.megatron_defaults
                 if not flag_values.matches(value, row.accepted_values)]
    if accepted:
        line += "; accepted: " + " or ".join(accepted)
    return line


def settle_compat_flags(args: argparse.Namespace) -> List[str]:
    """Answer the table's flags given in ``args`` (removing them): raise ValueError with one line for the
    first refused (flag, value), else return one notice per flag given (each flag once; at Megatron-LM's
    default the notice is the sentence that says so)."""
    given = vars(args).pop(GIVEN, [])
    table = read_table()
    answers = [(flag, values) + table[flag].answer(values) for flag, values in given]
    for flag, values, cls, _reason in answers:
        if cls == REFUSED:
            raise ValueError(refusal(flag, values, table[flag]))
    notices, seen = [], set()
    for flag, values, _cls, reason in answers:
        if flag not in seen:
            seen.add(flag)
            by_default = table[flag].is_megatron_default(values)
            notices.append(reason if by_default else f"{_shown(flag, values)}: {reason}")
    return notices


def explain_unknown(unknown: Sequence[str]) -> str:
    """The one-line error for command-line words the parser did not take."""
    table = read_table()
    for word in unknown:
        flag = word.split("=", 1)[0]
        row = table.get(flag)
        if row is not None and row.cls == IMPLEMENTED:   # the table is older than the parser
            return (f"{flag} is a Megatron-LM flag this project does not implement (the flag table is out of "
                    "date: python tools/megatron_lm_flags.py table)")
    return f"unrecognized arguments: {' '.join(unknown)}"
