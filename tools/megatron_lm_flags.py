#!/usr/bin/env python
"""Megatron-LM's flags as data: record Megatron-LM's parsers, and write the table pretrain_llama.py answers from.

    python tools/megatron_lm_flags.py table            # regenerate flag_data/megatron_lm_flags.tsv
    python tools/megatron_lm_flags.py table --check    # exit 1 if the committed table is out of date or
                                                       # a refused flag's values are undecided (or its
                                                       # defaults unreviewed)
    python tools/megatron_lm_flags.py record 0.19      # re-record a release's parser (needs megatron.training)
    python tools/megatron_lm_flags.py missing          # flags of the installed Megatron-LM parser the table lacks

``record SOURCE`` runs ``megatron.training.arguments.add_megatron_arguments`` of the interpreter it runs in:
the megatron-core 0.19 wheel ships it; for 0.16, put a Megatron-LM checkout at ``core_v0.16.1`` first on
PYTHONPATH. ``table`` needs neither: it reads the recorded lists (``flag_data/raw_*.tsv``), the rules
(``megatron_tawpipe/compat/flag_rules.py``, ``flag_values.py`` for the values of refused flags that ask
for what this project does, ``flag_defaults.py`` for Megatron-LM's own defaults of refused flags, accepted)
and this project's parser (``build_parser()``). Both ``table`` and ``table --check`` fail while a refused
flag that takes a value is undecided (neither given accepted values nor said to have none), while a
refused flag's default differs between releases unreviewed, or while a value rule's refused example is
Megatron-LM's default.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.compat import flag_defaults, flag_table, flag_values  # noqa: E402
from megatron_tawpipe.compat.megatron_lm import project_flags  # noqa: E402


def implemented_flags():
    from megatron_tawpipe.arguments import build_parser

    return set(project_flags(build_parser()))


def generate() -> str:
    return flag_table.format_table(flag_table.build_table(flag_table.read_all_raw(), implemented_flags()))


def problems(rows) -> list:
    """What keeps the rules from covering the table: the value rules' and the default rule's problems."""
    return flag_values.problems(rows) + flag_defaults.problems(rows, flag_table.read_all_raw())


def installed_parser() -> argparse.ArgumentParser:
    import warnings

    warnings.simplefilter("ignore")
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(prog="Megatron-LM", allow_abbrev=False, add_help=False)
    return add_megatron_arguments(parser) or parser


def cmd_table(options) -> int:
    text = generate()
    rows = flag_table.parse_table(text)
    summary = ", ".join(f"{n} {cls}" for cls, n in flag_table.counts(rows.values()).items())
    summary += f"; {flag_values.rule_count()} (flag, value) rules"
    summary += f"; Megatron-LM's default accepted for {sum(1 for row in rows.values() if row.megatron_defaults)} flags"
    found = problems(rows.values())
    for problem in found:
        print(problem, file=sys.stderr)
    if options.check:
        if found:
            return 1
        with open(flag_table.TABLE_PATH, encoding="utf-8") as handle:
            if handle.read() != text:
                print(f"{flag_table.TABLE_PATH} is out of date: python tools/megatron_lm_flags.py table",
                      file=sys.stderr)
                return 1
        print(f"up to date: {len(rows)} flags ({summary})")
        return 0
    with open(flag_table.TABLE_PATH, "w", encoding="utf-8") as handle:
        handle.write(text)
    print(f"wrote {flag_table.TABLE_PATH}: {len(rows)} flags ({summary})")
    return 1 if found else 0


def cmd_record(options) -> int:
    import megatron.core

    flags = flag_table.record_parser(installed_parser())
    header = (f"Megatron-LM's parser (megatron.training.arguments.add_megatron_arguments, megatron-core "
              f"{getattr(megatron.core, '__version__', '?')}), recorded by python tools/megatron_lm_flags.py record "
              f"{options.source}.\nnargs: values the flag takes; default: JSON ('?' where JSON cannot hold it).")
    path = flag_table.raw_path(options.source)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(flag_table.format_raw(flags, header))
    print(f"wrote {path}: {len(flags)} flags")
    return 0


def cmd_missing(options) -> int:
    table = flag_table.read_table()
    missing = sorted(f.flag for f in flag_table.record_parser(installed_parser()) if f.flag not in table)
    for flag in missing:
        print(flag)
    return 1 if missing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    table = sub.add_parser("table", help="write (or --check) the flag table")
    table.add_argument("--check", action="store_true")
    record = sub.add_parser("record", help="record the installed Megatron-LM parser as flag_data/raw_SOURCE.tsv")
    record.add_argument("source", choices=flag_table.SOURCES[:-1])
    sub.add_parser("missing", help="flags of the installed Megatron-LM parser that the table lacks")
    options = parser.parse_args(argv)
    return {"table": cmd_table, "record": cmd_record, "missing": cmd_missing}[options.command](options)


if __name__ == "__main__":
    sys.exit(main())
