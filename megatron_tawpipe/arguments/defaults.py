"""The one place where flags that did not come from the parser are completed: a namespace a tool or a test
builds with a few fields, or the saved flags of an older checkpoint, read as ``pretrain_llama.py`` would have
parsed them. Everything else reads the parsed flags (``args.flag``) or the records of :mod:`.run_config`."""

from __future__ import annotations

import argparse
import copy
import functools

from megatron_tawpipe.arguments.flags import build_parser


@functools.lru_cache(maxsize=1)
def _parser_defaults() -> dict:
    return vars(build_parser().parse_args([]))     # no flag is required: every default, the run values' too


def parser_defaults() -> dict:
    """Every flag's default and the run values (:data:`~.flags.RUN_VALUES`) of ``pretrain_llama.py``'s parser."""
    return copy.deepcopy(_parser_defaults())


def complete_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the parser's default for every flag it lacks:
    the boundary for flags not parsed by ``pretrain_llama.py`` (tools, tests, an older release's saved flags).
    The parser's defaults apply as given (no derived default of :func:`~.flags.fill_defaults`)."""
    return argparse.Namespace(**{**parser_defaults(), **vars(args)})
