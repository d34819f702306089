"""Checks of the data and tokenizer flags, and the parsers of ``--data-path`` and ``--split``.

:func:`validate_data_args` runs before any process group exists and builds nothing: it checks the
tokenizer flags and that each ``--data-path`` prefix is an intact Megatron ``.bin``/``.idx`` pair whose
token ids fit the tokenizer (:func:`check_data_files`) and whose ``--split`` shares are not empty.
Errors are ValueErrors of one line naming the flag and the file.
"""

from __future__ import annotations

import math
import os
import re
from typing import List, Optional, Sequence, Tuple

from megatron_tawpipe.arguments.run_config import DataConfig
from megatron_tawpipe.data import blends
from megatron_tawpipe.data.checks import (check_indexed_dataset, check_token_ids, check_tokenizer_record,
                                          tokenizer_fingerprint)
from megatron_tawpipe.data.tokenizers import SENTENCEPIECE_TOKENIZERS, SUPPORTED_TOKENIZERS, load_tokenizer, tokenizer_files

DEFAULT_SPLIT = DataConfig.DEFAULT_SPLIT


def parse_data_path(data_path: Optional[Sequence[str]],
                    flag: str = "--data-path") -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Megatron blend syntax -> (prefixes, weights or None); errors name ``flag``.

    ``["prefix"]`` or ``["p1", "p2"]`` -> weights None (proportional to dataset sizes);
    ``["w1", "p1", "w2", "p2"]`` -> explicit weights.  Items may also hold several
    whitespace-separated tokens (``["0.3 p1 0.7 p2"]``).
    """
    if data_path is None:
        return None
    if isinstance(data_path, str):
        data_path = [data_path]
    items = [tok for item in data_path for tok in str(item).split()]
    if not items:
        return None

    def as_float(s):
        try:
            return float(s)
        except ValueError:
            return None

    if len(items) % 2 == 1:
        return items, None
    weights = [as_float(w) for w in items[0::2]]
    if all(w is None for w in weights):
        return items, None
    if any(w is None for w in weights):
        raise ValueError(
            f"{flag} {' '.join(items)!r} mixes weights and prefixes; use 'prefix ...' or 'w1 prefix1 w2 prefix2 ...'"
        )
    if any(w <= 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"{flag} weights must be positive numbers, got {items[0::2]}")
    return list(items[1::2]), weights


def parse_split(split: str) -> List[float]:
    """'969,30,1' -> normalized [train, valid, test] fractions (missing entries are 0)."""
    # Megatron-LM reads the numbers and ignores the rest, so a script's quoted "'99,1,0'" works.
    text = str(split).strip().strip("'\"")
    parts = [p.strip() for p in re.split(r"[,/]", text)] if text else []
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = None
    if (not values or len(values) > 3 or any(not math.isfinite(v) or v < 0 for v in values)
            or sum(values) <= 0):
        raise ValueError(
            f"--split {split!r} is invalid: expected 1-3 non-negative comma-separated weights "
            f"with a positive sum, e.g. {DEFAULT_SPLIT}"
        )
    values = values + [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def _split_bookends(split: List[float]) -> List[Optional[Tuple[float, float]]]:
    ends, acc = [], 0.0
    for v in split:
        ends.append(None if v == 0 else (acc, acc + v))
        acc += v
    return ends


def _idx_counts(prefix: str) -> Tuple[int, int]:
    """(sequence count, document count) of a Megatron .idx, after checking the .bin/.idx pair."""
    info = check_indexed_dataset(prefix, "--data-path")
    return info.sequence_count, info.document_count


def _tokenizer_vocab(data: DataConfig, vocab_size: Optional[int] = None) -> Optional[Tuple[int, str, str]]:
    """(number of token ids, message start naming the flag, hint) for the tokenizer of ``data``.

    ``vocab_size`` is the built tokenizer's size when there is one; otherwise it is read
    from the flags (SentencePiece: pieces in the model; NullTokenizer: --vocab-size ids
    plus the eod id --vocab-size).  None when neither gives a size.
    """
    if data.tokenizer_type in SENTENCEPIECE_TOKENIZERS:
        model = data.tokenizer_model
        if vocab_size is None:
            import sentencepiece

            vocab_size = sentencepiece.SentencePieceProcessor(model_file=model).get_piece_size()
        return (int(vocab_size), f"--tokenizer-model {model} has {int(vocab_size)} tokens",
                "the data was tokenized with another tokenizer")
    null_vocab = data.vocab_size
    if data.tokenizer_type != "NullTokenizer" or null_vocab is None:
        if vocab_size is None:
            return None
        return (int(vocab_size), f"the tokenizer has {int(vocab_size)} tokens",
                "the data was tokenized with another tokenizer")
    null_vocab = int(null_vocab)
    # megatron-core's null tokenizer: --vocab-size ids plus the eod --vocab-size up to 0.18,
    # --vocab-size ids with the eod --vocab-size - 1 from 0.19 (as Megatron-LM of each release).
    null = load_tokenizer("NullTokenizer", None, null_vocab)
    if vocab_size is None:
        vocab_size = null.vocab_size
    return (int(vocab_size),
            f"--vocab-size {null_vocab} gives the NullTokenizer {int(vocab_size)} token ids "
            f"(0..{int(vocab_size) - 1}, eod {null.eod})",
            "the data was tokenized with another tokenizer or a larger --vocab-size")


def data_blends(data):
    """``(blend, blend_per_split)`` of the data flags (a :class:`DataConfig` or the flags: :meth:`DataConfig.of`),
    as megatron-core's dataset config takes them (:mod:`megatron_tawpipe.data.blends`)."""
    return blends.data_blends(DataConfig.of(data), parse_data_path)


def check_data_files(data, vocab_size: Optional[int] = None) -> None:
    """Check each prefix of the data flags: an intact .bin/.idx pair whose ids fit the tokenizer.

    Raises ValueError with one line naming the flag and file (see ``data_checks``).  A
    no-op for --mock-data.  ``vocab_size`` overrides the tokenizer size read from the flags. ``data``: a
    :class:`DataConfig` or the flags (:meth:`DataConfig.of`).
    """
    data = DataConfig.of(data)
    if data.mock_data:
        return
    sources = blends.data_sources(data, parse_data_path)
    infos = [check_indexed_dataset(prefix, flag)
             for prefix, flag in {p: f for f, blend in sources for p in blend[0]}.items()]
    if not infos:
        return
    vocab = _tokenizer_vocab(data, vocab_size)
    if vocab is not None:
        tokenizer_type = data.tokenizer_type
        files = tokenizer_files(tokenizer_type, data.tokenizer_model, data.vocab_file, data.merge_file)
        fingerprint = tokenizer_fingerprint(tokenizer_type, files, vocab[0])
        flag = (f"--vocab-file {data.vocab_file}" if tokenizer_type == "GPT2BPETokenizer" else
                f"--tokenizer-model {data.tokenizer_model}" if files else
                f"--vocab-size {data.vocab_size}" if tokenizer_type == "NullTokenizer" else "the tokenizer")
        for info in infos:
            check_token_ids(info, *vocab)  # the most concrete message first: an id the tokenizer lacks
            check_tokenizer_record(info.prefix, fingerprint, flag)  # also catches a larger tokenizer


def _check_splits_nonempty(prefixes: Sequence[str], split_text: str) -> None:
    """Refuse a split that has a share in --split but no documents.

    megatron-core's GPTDataset never terminates when asked for samples from an empty
    document range (it keeps adding epochs of zero tokens), so catch it here.
    """
    split = parse_split(split_text)
    for prefix in prefixes:
        num_sequences, _ = _idx_counts(prefix)
        for name, bookend in zip(("train", "valid", "test"), _split_bookends(split)):
            if bookend is None:
                continue
            beg = int(round(bookend[0] * num_sequences))
            end = int(round(bookend[1] * num_sequences))
            if end <= beg:
                raise ValueError(
                    f"--split {split_text!r} leaves the {name} split of {prefix} empty "
                    f"({num_sequences} documents); give it a larger share or 0"
                )


def validate_data_args(data) -> None:
    """Check the data/tokenizer flags; raise ValueError with one line naming the flag/file.

    Runs without torch.distributed and without building anything.  Each --data-path
    prefix must be an intact .bin/.idx pair whose token ids fit the tokenizer
    (``check_data_files``); --mock-data skips the data checks. ``data``: a :class:`DataConfig` or the flags
    (:meth:`DataConfig.of`).
    """
    data = DataConfig.of(data)
    ttype = data.tokenizer_type
    if ttype not in SUPPORTED_TOKENIZERS:
        raise ValueError(
            f"--tokenizer-type {ttype!r} is not supported; use one of {', '.join(SUPPORTED_TOKENIZERS)}"
        )
    if ttype in SENTENCEPIECE_TOKENIZERS:
        model = data.tokenizer_model
        if not model:
            raise ValueError(f"--tokenizer-model is required with --tokenizer-type {ttype}")
        if not os.path.isfile(model):
            raise ValueError(f"--tokenizer-model: file not found: {model}")
        if not os.access(model, os.R_OK):
            raise ValueError(f"--tokenizer-model: file is not readable: {model}")
        try:
            import sentencepiece

            sentencepiece.SentencePieceProcessor(model_file=model)
        except Exception:
            raise ValueError(f"--tokenizer-model: not a valid SentencePiece model: {model}") from None
    elif ttype == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", data.vocab_file), ("--merge-file", data.merge_file)):
            if not path:
                raise ValueError(f"{flag} is required with --tokenizer-type GPT2BPETokenizer")
            if not os.path.isfile(path):
                raise ValueError(f"{flag}: file not found: {path}")
    elif ttype in ("HuggingFaceTokenizer", "TikTokenizer"):
        model = data.tokenizer_model
        if not model:
            raise ValueError(f"--tokenizer-model is required with --tokenizer-type {ttype}")
        if not os.path.exists(model):
            raise ValueError(f"--tokenizer-model: not found: {model} (tokenizers are read from local files)")
    else:
        vocab = data.vocab_size
        if vocab is None:
            raise ValueError("--vocab-size is required with --tokenizer-type NullTokenizer")
        if int(vocab) <= 0:
            raise ValueError(f"--vocab-size must be positive, got {vocab}")

    blends.check_data_sources(data)
    if data.mock_data:
        return
    blend, per_split = data_blends(data)
    if blend is None and per_split is None:
        raise ValueError("no training data: give --data-path PREFIX (Megatron .bin/.idx), --train-data-path PREFIX "
                         "(with --valid-data-path, --test-data-path) or --mock-data")
    if per_split is not None and per_split[0] is None:
        raise ValueError(f"no training data: {blends.PER_SPLIT_FLAGS[0]} (or the train entry of "
                         "--per-split-data-args-path) is required with per-split data")
    if blend is not None:
        parse_split(data.split_or_default)
    sources = blends.data_sources(data, parse_data_path)
    for flag, source in sources:
        _check_prefix_files(flag, source[0])
    check_data_files(data)
    if blend is not None:
        _check_splits_nonempty(blend[0], data.split_or_default)
    for flag, source in sources if per_split is not None else ():
        for prefix in source[0]:
            if _idx_counts(prefix)[0] == 0:
                raise ValueError(f"{flag}: {prefix} holds no documents")


def _check_prefix_files(flag: str, prefixes: Sequence[str]) -> None:
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if prefix.endswith(ext):
                raise ValueError(
                    f"{flag} takes the prefix without {ext}: use {prefix[: -len(ext)]}"
                )
        for ext in (".bin", ".idx"):
            path = prefix + ext
            if not os.path.isfile(path):
                raise ValueError(f"{flag}: {path} not found")
            if not os.access(path, os.R_OK):
                raise ValueError(f"{flag}: {path} is not readable")
