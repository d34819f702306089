"""Where a run's data come from, read as Megatron-LM reads its data flags.

Either one blend cut into train/valid/test by ``--split``: ``--data-path`` (or ``--data-args-path``, a file
holding that list), or one blend per split: ``--train-data-path``, ``--valid-data-path``, ``--test-data-path``
(or ``--per-split-data-args-path``, a JSON file with keys ``train``, ``valid``, ``test``), each a prefix, a list
of prefixes (weighted by their sizes) or ``W1 P1 W2 P2 ...``. megatron-core's ``BlendedMegatronDatasetConfig``
takes the first as ``blend`` with ``split`` and the second as ``blend_per_split`` (each split's dataset is the
whole of its prefixes, no ``--split``). :func:`check_data_sources` refuses, in one line naming the flags, what
Megatron-LM refuses: more than one source (``--mock-data`` counts as one), a list given both inline and by
file, and ``--split`` with per-split data (megatron-core's config refuses that pairing).
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence, Tuple

from megatron_tawpipe.arguments.run_config import DataConfig

SPLIT_NAMES = ("train", "valid", "test")
PER_SPLIT_FLAGS = tuple(f"--{name}-data-path" for name in SPLIT_NAMES)

Blend = Tuple[List[str], Optional[List[float]]]


def _split_lists(data: DataConfig) -> Tuple:
    """The ``--train-data-path``, ``--valid-data-path`` and ``--test-data-path`` lists (None where not given)."""
    return data.train_data_path, data.valid_data_path, data.test_data_path


def uses_per_split_data(data: DataConfig) -> bool:
    """Whether the run has one blend per split (``--*-data-path`` or ``--per-split-data-args-path``)."""
    return any(words is not None for words in _split_lists(data)) or data.per_split_data_args_path is not None


def check_data_sources(data: DataConfig) -> None:
    """Refuse conflicting data flags (ValueError, one line naming them); reads no file."""
    given = []
    if data.mock_data:
        given.append("--mock-data")
    if data.data_path is not None:
        given.append("--data-path")
    if data.data_args_path is not None:
        given.append("--data-args-path")
    given += [flag for flag, words in zip(PER_SPLIT_FLAGS, _split_lists(data)) if words is not None]
    if data.per_split_data_args_path is not None:
        given.append("--per-split-data-args-path")
    if "--data-path" in given and "--data-args-path" in given:
        raise ValueError("--data-path and --data-args-path both give the data: use one of them")
    per_split = [flag for flag in given if flag in PER_SPLIT_FLAGS]
    if per_split and "--per-split-data-args-path" in given:
        raise ValueError(f"{' and '.join(per_split)} and --per-split-data-args-path both give the per-split data: "
                         "use the flags or the file")
    sources = ["--mock-data" in given, bool({"--data-path", "--data-args-path"} & set(given)),
               uses_per_split_data(data)]
    if sum(sources) > 1:
        raise ValueError(f"{', '.join(given)}: give a single data source: --mock-data, --data-path (split by --split), "
                         "or --train-data-path/--valid-data-path/--test-data-path (a dataset per split)")
    if sources[2] and data.split is not None:
        raise ValueError(f"--split {data.split} cuts --data-path; with {(per_split or ['--per-split-data-args-path'])[0]} "
                         "each split has its own data: leave out --split")


def read_data_args_file(path: str) -> List[str]:
    """``--data-args-path``: the file's whitespace-separated words, a ``--data-path`` list."""
    if not os.path.isfile(path):
        raise ValueError(f"--data-args-path: file not found: {path}")
    with open(path, "r", encoding="utf-8") as f:
        words = f.read().split()
    if not words:
        raise ValueError(f"--data-args-path {path} is empty: it must hold the --data-path list (W1 P1 W2 P2 ...)")
    return words


def read_per_split_file(path: str) -> List[Optional[List[str]]]:
    """``--per-split-data-args-path``: a JSON object with keys train, valid, test; each value a list of words
    or one string (split at whitespace), or null for a split without data."""
    flag = f"--per-split-data-args-path {path}"
    if not os.path.isfile(path):
        raise ValueError(f"--per-split-data-args-path: file not found: {path}")
    try:
        with open(path, "r", encoding="utf-8") as f:
            content = json.load(f)
    except ValueError as exc:
        raise ValueError(f"{flag} is not JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(content, dict) or any(name not in content for name in SPLIT_NAMES):
        raise ValueError(f"{flag} must hold a JSON object with the keys train, valid and test")
    lists = []
    for name in SPLIT_NAMES:
        value = content[name]
        if isinstance(value, str):
            value = value.split()
        elif value is not None and not (isinstance(value, list) and all(isinstance(v, (str, int, float))
                                                                         for v in value)):
            raise ValueError(f"{flag}: {name} must be a list of weights and prefixes, a string or null")
        lists.append(None if value is None else [str(v) for v in value])
    return lists


def data_sources(data: DataConfig, parse) -> List[Tuple[str, Blend]]:
    """``(flag, blend)`` of every blend given, in split order for per-split data; ``parse(list, flag)`` reads a
    Megatron blend list (:func:`megatron_tawpipe.data.validation.parse_data_path`)."""
    blend, per_split = data_blends(data, parse)
    if per_split is None:
        return [] if blend is None else [(_data_flag(data), blend)]
    return [(flag, b) for flag, b in zip(_per_split_flag_names(data), per_split) if b is not None]


def _data_flag(data: DataConfig) -> str:
    return "--data-path" if data.data_args_path is None else f"--data-args-path {data.data_args_path}"


def _per_split_flag_names(data: DataConfig) -> Sequence[str]:
    if data.per_split_data_args_path is not None:
        return [f"--per-split-data-args-path {data.per_split_data_args_path} ({name})" for name in SPLIT_NAMES]
    return PER_SPLIT_FLAGS


def data_blends(data: DataConfig, parse) -> Tuple[Optional[Blend], Optional[List[Optional[Blend]]]]:
    """``(blend, blend_per_split)`` for megatron-core's ``BlendedMegatronDatasetConfig``, as Megatron-LM derives
    them from its flags: at most one is not None (both None: no data flag)."""
    if data.data_path is not None or data.data_args_path is not None:
        words = data.data_path if data.data_args_path is None else read_data_args_file(data.data_args_path)
        return _parse(parse, words, _data_flag(data)), None
    if not uses_per_split_data(data):
        return None, None
    if data.per_split_data_args_path is not None:
        lists = read_per_split_file(data.per_split_data_args_path)
    else:
        lists = _split_lists(data)
    return None, [_parse(parse, words, flag) for words, flag in zip(lists, _per_split_flag_names(data))]


def _parse(parse, words, flag: str) -> Optional[Blend]:
    if words is None:
        return None
    blend = parse(words, flag)
    if blend is None:
        raise ValueError(f"{flag} is given without a dataset prefix")
    return blend
