"""Tokenizer training and preprocessing into Megatron's indexed format (used by tools/ and the default corpus)."""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import numpy

from megatron_tawpipe.data.checks import (tokenizer_fingerprint, write_tokenizer_record)

logger = logging.getLogger(__name__)

from megatron_tawpipe.data.tokenizers import load_tokenizer, tokenizer_files
from megatron_tawpipe.common.atomic import atomic_write_bytes

# ---------------------------------------------------------------------------------------
# Tokenizer training and preprocessing (used by tools/ and the default corpus)
# ---------------------------------------------------------------------------------------


def _read_records(path: str, json_keys: Sequence[str], input_format: str = "auto",
                  text_mode: str = "line") -> Iterator[Dict[str, object]]:
    """Records ({key: text}) from a jsonl file or a plain text file.

    jsonl: one JSON object per line, the texts under ``json_keys`` (a string, or a list of
    strings stored as one document of several sequences).  Plain text: the text goes under
    the first key; ``text_mode`` picks one document per non-empty line ("line"), per
    blank-line-separated block ("paragraph") or per file ("file").
    """
    fmt = input_format
    if fmt == "auto":
        fmt = "jsonl" if path.endswith((".jsonl", ".json", ".jsonl.txt")) else "text"
    with open(path, "r", encoding="utf-8") as f:
        if fmt == "jsonl":
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
                missing = [k for k in json_keys if k not in obj]
                if missing:
                    raise ValueError(f"{path}:{lineno}: missing JSON key(s) {missing}")
                yield {k: obj[k] for k in json_keys}
        elif fmt == "text":
            key = json_keys[0]
            if text_mode == "line":
                for line in f:
                    line = line.rstrip("\n")
                    if line.strip():
                        yield {key: line}
            elif text_mode == "paragraph":
                block: List[str] = []
                for line in f:
                    if line.strip():
                        block.append(line.rstrip("\n"))
                    elif block:
                        yield {key: "\n".join(block)}
                        block = []
                if block:
                    yield {key: "\n".join(block)}
            elif text_mode == "file":
                text = f.read()
                if text.strip():
                    yield {key: text}
            else:
                raise ValueError(f"unknown text mode {text_mode!r}")
        else:
            raise ValueError(f"unknown input format {input_format!r}")


def iter_documents(paths: Sequence[str], json_keys: Sequence[str] = ("text",),
                   input_format: str = "auto", text_mode: str = "line") -> Iterator[Dict[str, object]]:
    """Records from several files, in the order given."""
    for path in paths:
        yield from _read_records(path, json_keys, input_format, text_mode)


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe", seed: int = 1234, num_threads: int = 1,
                        max_sentence_length: int = 16384,
                        character_coverage: float = 0.9995) -> str:
    """Train a SentencePiece model on ``texts`` and return the ``.model`` path.

    Llama-style settings: byte fallback (no unknown characters), digits split, whitespace
    kept as is, ``<unk>``=0, ``<s>``=1, ``</s>``=2 (the end-of-document id), no pad.
    Each non-empty line of each text is one training sentence.  Deterministic: the same
    input and settings give a byte-identical model.  Writes ``{model_prefix}.model`` and
    ``{model_prefix}.vocab`` (piece<TAB>score), each under a temporary name first.
    """
    import io

    import sentencepiece

    def sentences():
        for text in texts:
            for line in text.split("\n"):
                if line.strip():
                    yield line

    out_dir = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(out_dir, exist_ok=True)
    writer = io.BytesIO()
    sentencepiece.set_random_generator_seed(int(seed))
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sentences(),
        model_writer=writer,
        vocab_size=int(vocab_size),
        model_type=model_type,
        character_coverage=character_coverage,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        max_sentence_length=int(max_sentence_length),
        input_sentence_size=0,
        shuffle_input_sentence=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=int(num_threads),
        minloglevel=2,
    )
    proto = writer.getvalue()
    sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    for path, payload in ((model_prefix + ".vocab", vocab.encode("utf-8")),
                          (model_prefix + ".model", proto)):
        atomic_write_bytes(path, payload)
    return model_prefix + ".model"


def indexed_dataset_path(output_prefix: str, key: str = "text", level: str = "document") -> str:
    """Megatron-LM's naming of preprocessed data: ``{output_prefix}_{key}_{level}``."""
    return f"{output_prefix}_{key}_{level}"


class _Encoder:
    """Turns a record into token ids per key (one instance per worker process)."""

    tokenizer = None

    def __init__(self, tokenizer_type, tokenizer_model, vocab_size, json_keys, append_eod, options=None):
        self.tokenizer_type = tokenizer_type
        self.tokenizer_model = tokenizer_model
        self.vocab_size = vocab_size
        self.json_keys = list(json_keys)
        self.append_eod = append_eod
        self.options = dict(options or {})

    def initializer(self):
        _Encoder.tokenizer = load_tokenizer(self.tokenizer_type, self.tokenizer_model, self.vocab_size, **self.options)

    def encode(self, record):
        tok = _Encoder.tokenizer
        out = {}
        nbytes = 0
        for key in self.json_keys:
            value = record[key]
            pieces = value if isinstance(value, list) else [value]
            ids: List[int] = []
            lengths: List[int] = []
            for piece in pieces:
                nbytes += len(piece)
                if not piece.strip():
                    continue  # blank text is no document (and NullTokenizer cannot parse it)
                piece_ids = tok.tokenize(piece)
                if len(piece_ids) > 0:
                    ids.extend(piece_ids)
                    lengths.append(len(piece_ids))
            if ids and self.append_eod:
                ids.append(tok.eod)
                lengths[-1] += 1
            out[key] = (ids, lengths)
        return out, nbytes


def write_indexed_dataset(records: Iterable[Dict[str, object]], output_prefix: str,
                          tokenizer_type: str, tokenizer_model: Optional[str] = None,
                          vocab_size: Optional[int] = None, json_keys: Sequence[str] = ("text",),
                          append_eod: bool = True, workers: int = 1, log_interval: int = 0,
                          log: Callable[[str], None] = print, **tokenizer_options) -> Dict[str, str]:
    """Tokenize records and write Megatron .bin/.idx files, one pair per JSON key.

    Output files are ``{output_prefix}_{key}_document.bin/.idx`` (Megatron-LM's layout);
    token dtype is uint16 when the vocabulary has fewer than 65500 ids, else int32.
    Each record is one document; with ``append_eod`` the tokenizer's eod id ends it.
    Blank texts and documents that tokenize to nothing are skipped.  Order is preserved with ``workers``
    > 1.  Files are written under temporary names and renamed when complete.
    ``tokenizer_options``: :func:`load_tokenizer`'s keywords (``vocab_file``, ``merge_file``, ``tiktoken_*``).
    Returns {key: dataset prefix}.
    """
    import torch  # noqa: F401  (IndexedDatasetBuilder works on numpy arrays / tensors)
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    encoder = _Encoder(tokenizer_type, tokenizer_model, vocab_size, json_keys, append_eod, tokenizer_options)
    encoder.initializer()
    dtype = DType.optimal_dtype(_Encoder.tokenizer.vocab_size)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {key: indexed_dataset_path(output_prefix, key) for key in json_keys}
    tmp_prefixes = {key: f"{p}.tmp{os.getpid()}" for key, p in prefixes.items()}
    builders = {key: IndexedDatasetBuilder(tmp_prefixes[key] + ".bin", dtype=dtype)
                for key in json_keys}

    pool = None
    if workers > 1:
        import multiprocessing

        pool = multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, records, 32)
    else:
        encoded = map(encoder.encode, records)

    ndocs = ntokens = nbytes = 0
    try:
        for doc, size in encoded:
            nbytes += size
            for key, (ids, lengths) in doc.items():
                if not ids:
                    continue
                builders[key].add_document(ids, lengths)
                ntokens += len(ids)
            ndocs += 1
            if log_interval and ndocs % log_interval == 0:
                log(f"processed {ndocs} documents, {nbytes / 1e6:.1f} MB, {ntokens} tokens")
        for key in json_keys:
            builders[key].finalize(tmp_prefixes[key] + ".idx")
    except BaseException:
        for key in json_keys:
            builders[key].data_file.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(tmp_prefixes[key] + ext):
                    os.remove(tmp_prefixes[key] + ext)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    files = tokenizer_files(tokenizer_type, tokenizer_model, tokenizer_options.get("vocab_file"),
                            tokenizer_options.get("merge_file"))
    fingerprint = tokenizer_fingerprint(tokenizer_type, files, _Encoder.tokenizer.vocab_size)
    for key in json_keys:
        os.replace(tmp_prefixes[key] + ".bin", prefixes[key] + ".bin")
        os.replace(tmp_prefixes[key] + ".idx", prefixes[key] + ".idx")
        write_tokenizer_record(prefixes[key], fingerprint)
    log(f"wrote {ndocs} documents, {ntokens} tokens ({numpy.dtype(dtype).name}) to "
        + ", ".join(prefixes[k] + ".{bin,idx}" for k in json_keys))
    return prefixes

