"""Megatron-LM's tokenizers, through megatron-core's ``megatron.core.tokenizers`` where it has them."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections import OrderedDict
from typing import List, Optional

from megatron_tawpipe.arguments.flags import SENTENCEPIECE_TOKENIZERS, SUPPORTED_TOKENIZERS
from megatron_tawpipe.arguments.run_config import DataConfig
from megatron_tawpipe.common.atomic import atomic_write_json

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------


def pad_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
    """Megatron's vocabulary padding: round up to a multiple of divisible_by * TP size."""
    multiple = max(1, int(divisible_by)) * max(1, int(tensor_parallel_size))
    return int(math.ceil(int(vocab_size) / multiple) * multiple)


class _SentencePieceFallbackTokenizer:  # also Megatron-LM's GPTSentencePieceTokenizer
    """SentencePiece tokenizer for megatron-core releases without ``megatron.core.tokenizers``.

    Same semantics as megatron-core's GPT SentencePiece tokenizer: ``eod`` is the model's
    end-of-sentence id, ``pad`` its pad id (-1 when the model has none).
    """

    def __init__(self, model_path: str) -> None:
        import sentencepiece

        self.path = model_path
        self._sp = sentencepiece.SentencePieceProcessor()
        self._sp.Load(model_path)

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._sp.decode_ids(list(ids))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What megatron-core's dataset cache keys on."""
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("tokenizer_path", self.path)])


class _Llama2Tokenizer(_SentencePieceFallbackTokenizer):
    """Megatron-LM's Llama2Tokenizer: the model's pieces, each document starting with its bos id."""

    def tokenize(self, text: str) -> List[int]:
        return [self._sp.bos_id()] + self._sp.encode_as_ids(text)


class _NullFallbackTokenizer:
    """Null tokenizer (text is space-separated integer ids, eod = vocab_size)."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size_without_eod = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return " ".join(str(int(x)) for x in ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def eod(self) -> int:
        return self._vocab_size_without_eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"),
             ("vocab_size", str(self._vocab_size_without_eod))]
        )


class _GPT2BPETokenizer:
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE (its pre-tokenising pattern, no prefix space)
    from a ``vocab.json`` and a ``merges.txt``; eod = ``<|endoftext|>``."""

    EOD = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        tokenizers = _require("tokenizers", "GPT2BPETokenizer")
        self.paths = (vocab_file, merge_file)
        self._tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = tokenizers.decoders.ByteLevel()
        self._eod = self._tok.token_to_id(self.EOD)
        if self._eod is None:
            raise ValueError(f"--vocab-file {vocab_file} has no {self.EOD} token (GPT2BPETokenizer's end of document)")

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("vocab_file", self.paths[0]), ("merge_file", self.paths[1])])


def _require(package: str, tokenizer_type: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs the {package} package "
                         f"(pip install {package}, or pip install -e \".[tokenizers]\")") from None


def _huggingface_tokenizer(tokenizer_model: str, include_special_tokens: bool = True, use_fast: bool = True):
    """A Hugging Face tokenizer from a local directory (or the directory of its tokenizer.json), through
    megatron-core; as Megatron-LM's HuggingFaceTokenizer: the tokenizer's own special tokens (a bos) are
    included unless --tokenizer-hf-no-include-special-tokens, eod = its eos token."""
    _require("transformers", "HuggingFaceTokenizer")
    path = os.path.abspath(tokenizer_model)
    directory = os.path.dirname(path) if os.path.isfile(path) else path
    if not os.path.isdir(directory):
        raise ValueError(f"--tokenizer-model {tokenizer_model}: no such directory or tokenizer.json (a Hugging Face "
                         "tokenizer is loaded from local files; download it first)")
    tok = _core_tokenizer(directory, "huggingface", include_special_tokens=include_special_tokens, use_fast=use_fast)
    if tok.eod is None:
        raise ValueError(f"--tokenizer-model {tokenizer_model} has no eos token (HuggingFaceTokenizer's end of "
                         "document): give it one in tokenizer_config.json")
    return tok


def _tiktoken_tokenizer(tokenizer_model: str, vocab_size: Optional[int], pattern: Optional[str],
                        num_special_tokens: int, special_tokens: Optional[List[str]]):
    """megatron-core's TikTokenizer on a local vocabulary file (Megatron's JSON list of ranks and token bytes).

    ``--vocab-size`` counts the special tokens too (default: Megatron-LM's 2**17, or all the file's tokens
    plus ``--tiktoken-num-special-tokens`` where that is fewer)."""
    _require("tiktoken", "TikTokenizer")
    path = os.path.abspath(tokenizer_model)
    try:
        with open(path, encoding="utf-8") as handle:
            entries = len(json.load(handle))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer-model {tokenizer_model}: not a readable TikTokenizer vocabulary ({exc})") from None
    # Megatron-LM's default is 2**17 ids (the vocabulary cut to fit); a smaller file is used whole.
    total = int(vocab_size) if vocab_size else min(2 ** 17, entries + num_special_tokens)
    if not num_special_tokens < total <= entries + num_special_tokens:
        raise ValueError(f"--vocab-size {total} for TikTokenizer must exceed --tiktoken-num-special-tokens "
                         f"{num_special_tokens} and be at most that plus the {entries} tokens of {tokenizer_model}")
    kwargs = {"pattern": pattern or "v2", "vocab_size": total, "num_special_tokens": num_special_tokens}
    if special_tokens:
        kwargs["special_tokens"] = list(special_tokens)
    return _core_tokenizer(path, "tiktoken", **kwargs)


def tokenizer_files(tokenizer_type: Optional[str], tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None) -> Optional[List[str]]:
    """The files that define a tokenizer (what the record beside preprocessed data fingerprints)."""
    if tokenizer_type == "GPT2BPETokenizer":
        return [vocab_file, merge_file] if vocab_file and merge_file else None
    if tokenizer_type == "HuggingFaceTokenizer" and tokenizer_model:
        path = os.path.abspath(tokenizer_model)
        directory = os.path.dirname(path) if os.path.isfile(path) else path
        main = os.path.join(directory, "tokenizer.json")
        if os.path.isfile(main):
            return [main]
        return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                      if os.path.isfile(os.path.join(directory, f))) if os.path.isdir(directory) else None
    if tokenizer_type in SENTENCEPIECE_TOKENIZERS + ("TikTokenizer",) and tokenizer_model:
        return [tokenizer_model]
    return None


def tokenizer_options(data) -> dict:
    """The keyword options of :func:`load_tokenizer` that the data flags give (a :class:`DataConfig` or the flags:
    :meth:`DataConfig.of`)."""
    data = DataConfig.of(data)
    special = data.tokenizer_special_tokens
    return {"vocab_file": data.vocab_file, "merge_file": data.merge_file, "tiktoken_pattern": data.tiktoken_pattern,
            "tiktoken_num_special_tokens": data.tiktoken_num_special_tokens,
            "tiktoken_special_tokens": None if special is None else list(special),
            "hf_include_special_tokens": not data.tokenizer_hf_no_include_special_tokens,
            "hf_use_fast": not data.tokenizer_hf_no_use_fast}


def _null_library() -> str:
    """megatron-core's name for the null tokenizer's library: "null", "null-text" from 0.17 on."""
    try:
        from megatron.core.tokenizers import megatron_tokenizer
    except ImportError:
        return "null"
    return "null-text" if "null-text" in getattr(megatron_tokenizer, "TEXT_LIBRARIES", ()) else "null"


def _core_tokenizer(tokenizer_path: Optional[str], library: str, **kwargs):
    """Load a megatron-core GPT tokenizer, or return None if this megatron-core has none.

    The metadata is handed over as a dict, so nothing is written next to the model (the
    model directory may be read-only).  Releases whose ``from_pretrained`` only takes a
    metadata file get one written under the temp dir instead.
    """
    try:
        from megatron.core.tokenizers import MegatronTokenizer
    except ImportError:
        return None
    metadata = {"library": library, "model_type": "gpt", "chat_template": None}
    try:
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=tokenizer_path, metadata_path=dict(metadata), **kwargs
        )
    except (TypeError, ValueError, AttributeError):
        pass
    key = hashlib.sha1(json.dumps([tokenizer_path, metadata]).encode()).hexdigest()[:16]
    meta_dir = os.path.join(tempfile.gettempdir(), "megatron_tawpipe_tokenizers", key)
    os.makedirs(meta_dir, exist_ok=True)
    meta_file = os.path.join(meta_dir, "tokenizer_metadata.json")
    atomic_write_json(meta_file, metadata)
    return MegatronTokenizer.from_pretrained(
        tokenizer_path=tokenizer_path, metadata_path=meta_file, **kwargs
    )


def load_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                   vocab_size: Optional[int] = None, *, vocab_file: Optional[str] = None,
                   merge_file: Optional[str] = None, tiktoken_pattern: Optional[str] = None,
                   tiktoken_num_special_tokens: int = 1000, tiktoken_special_tokens: Optional[List[str]] = None,
                   hf_include_special_tokens: bool = True, hf_use_fast: bool = True):
    """Load a tokenizer by Megatron-LM type name (no args namespace, no vocab padding)."""
    if tokenizer_type == "GPT2BPETokenizer":
        if not (vocab_file and merge_file):
            raise ValueError("--vocab-file and --merge-file are required with --tokenizer-type GPT2BPETokenizer")
        return _GPT2BPETokenizer(os.path.abspath(vocab_file), os.path.abspath(merge_file))
    if tokenizer_type in ("HuggingFaceTokenizer", "TikTokenizer") and not tokenizer_model:
        raise ValueError(f"--tokenizer-model is required with --tokenizer-type {tokenizer_type}")
    if tokenizer_type == "HuggingFaceTokenizer":
        return _huggingface_tokenizer(tokenizer_model, hf_include_special_tokens, hf_use_fast)
    if tokenizer_type == "TikTokenizer":
        return _tiktoken_tokenizer(tokenizer_model, vocab_size, tiktoken_pattern, int(tiktoken_num_special_tokens),
                                   tiktoken_special_tokens)
    if tokenizer_type in SENTENCEPIECE_TOKENIZERS:
        if not tokenizer_model:
            raise ValueError(f"--tokenizer-model is required with --tokenizer-type {tokenizer_type}")
        path = os.path.abspath(tokenizer_model)
        if tokenizer_type == "GPTSentencePieceTokenizer":
            return _SentencePieceFallbackTokenizer(path)
        if tokenizer_type == "Llama2Tokenizer":
            return _Llama2Tokenizer(path)
        tok = _core_tokenizer(path, "sentencepiece")
        return tok if tok is not None else _SentencePieceFallbackTokenizer(path)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--vocab-size is required with --tokenizer-type NullTokenizer")
        tok = _core_tokenizer(None, _null_library(), vocab_size=int(vocab_size))
        return tok if tok is not None else _NullFallbackTokenizer(int(vocab_size))
    raise ValueError(
        f"--tokenizer-type {tokenizer_type!r} is not supported; use one of {', '.join(SUPPORTED_TOKENIZERS)}"
    )


def build_tokenizer(args):
    """Build the tokenizer named by ``args.tokenizer_type`` and set ``args.padded_vocab_size``.

    ``SentencePieceTokenizer`` loads ``args.tokenizer_model`` (eod = the model's ``</s>`` id);
    ``NullTokenizer`` takes ``args.vocab_size`` ids plus one eod id (= ``args.vocab_size``),
    like Megatron-LM.  The padded size is a multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size``.
    """
    data = DataConfig.of(args)
    tok = load_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_size, **tokenizer_options(data))
    args.padded_vocab_size = pad_vocab_size(tok.vocab_size, data.make_vocab_size_divisible_by,
                                            data.tensor_model_parallel_size)
    logger.info(
        "tokenizer %s: vocab size %d padded to %d (eod id %d)",
        data.tokenizer_type, tok.vocab_size, args.padded_vocab_size, tok.eod,
    )
    return tok
