"""Integrity checks of Megatron indexed datasets (``.bin``/``.idx``) before training.

megatron-core only ``assert``s a few properties of an index when it loads it and reads
the ``.bin`` lazily, so a truncated file or a file pair from two different runs shows up
as an assertion, a hang or a crash deep inside training.  The checks here run up front
and raise ``ValueError`` with one line naming the flag and the file:

* :func:`check_indexed_dataset` validates the ``.idx`` header (magic bytes, version,
  token dtype), that its size matches the counts in the header, that sequence lengths
  and byte pointers are consistent, that document boundaries are ordered, and that the
  ``.bin`` has exactly the size the index describes.  It reads the ``.idx`` (memory
  mapped, in chunks) and only the size of the ``.bin``.
* :func:`check_token_ids` checks that every token id in the ``.bin`` is a valid id of
  the tokenizer (``0 <= id < vocab size``).  This needs the ids themselves: ``.bin``
  files up to :data:`FULL_SCAN_BYTES` are scanned completely (in chunks), larger ones in
  :data:`SAMPLE_WINDOWS` evenly spaced windows, which is deterministic and finds a
  mismatched tokenizer in practice (its ids are spread over the whole corpus), though
  not a single stray id.

The on-disk layout (megatron-core ``_IndexWriter``, version 1, little endian)::

    b"MMIDIDX\\x00\\x00"     9 bytes magic
    version                 uint64 (1)
    dtype code              uint8  (DType: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                    6 float64, 7 float32, 8 uint16)
    sequence count S        uint64
    document count D        uint64 (number of document boundaries, S documents + 1)
    sequence lengths        int32[S]   (tokens)
    sequence pointers       int64[S]   (byte offsets into the .bin)
    document indices        int64[D]   (0, ..., S: sequence index where each document starts)
    sequence modes          int8[S]    (multimodal datasets only)

Results are memoised per file identity (path, size, mtime, inode), so checking the same
prefix twice (a blend naming it twice, ``validate_data_args`` then ``build_datasets``)
costs nothing.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy

from megatron_tawpipe.common.atomic import atomic_write_json

__all__ = [
    "IndexInfo",
    "check_indexed_dataset",
    "check_token_ids",
    "token_id_range",
    "FULL_SCAN_BYTES",
    "check_tokenizer_record",
    "tokenizer_fingerprint",
    "write_tokenizer_record",
]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8

# megatron.core.datasets.indexed_dataset.DType codes.
_DTYPE_CODES = {
    1: numpy.uint8,
    2: numpy.int8,
    3: numpy.int16,
    4: numpy.int32,
    5: numpy.int64,
    6: numpy.float64,
    7: numpy.float32,
    8: numpy.uint16,
}

# Every entry of an index with at most this many sequences (documents) is checked; larger
# indices are checked in _INDEX_SAMPLE_CHUNKS evenly spaced chunks plus both ends.
_INDEX_FULL_CHECK_ENTRIES = 1 << 25
_INDEX_CHUNK = 1 << 22
_INDEX_SAMPLE_CHUNKS = 16

# .bin files up to this size are scanned completely for the token id range; larger ones
# are sampled in SAMPLE_WINDOWS windows of SAMPLE_WINDOW_BYTES (256 MiB read in all).
FULL_SCAN_BYTES = 2 << 30
SAMPLE_WINDOWS = 64
SAMPLE_WINDOW_BYTES = 4 << 20
_SCAN_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class IndexInfo:
    """What a valid ``.idx`` says about its dataset."""

    prefix: str
    dtype: type
    sequence_count: int
    document_count: int
    num_tokens: int
    multimodal: bool

    @property
    def bin_bytes(self) -> int:
        return self.num_tokens * numpy.dtype(self.dtype).itemsize


_index_cache: Dict[Tuple, IndexInfo] = {}
_range_cache: Dict[Tuple, Tuple[Optional[int], Optional[int], bool]] = {}


def _identity(path: str) -> Tuple:
    st = os.stat(path)
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)


def _chunks(count: int, chunk: int, full_limit: int):
    """[lo, hi) ranges covering 0..count, or evenly spaced ones (with both ends) if count is large."""
    if count <= full_limit:
        starts = range(0, count, chunk)
    else:
        step = (count - chunk) / (_INDEX_SAMPLE_CHUNKS - 1)
        starts = sorted({int(i * step) for i in range(_INDEX_SAMPLE_CHUNKS)})
    for lo in starts:
        yield lo, min(count, lo + chunk)


def _read_header(idx_path: str, flag: str, prefix: str):
    size = os.path.getsize(idx_path)
    where = f"{flag} {prefix}: {idx_path}"
    if size < HEADER_BYTES:
        raise ValueError(
            f"{where} is {size} bytes, shorter than the {HEADER_BYTES}-byte index header "
            f"(truncated or not a Megatron index)"
        )
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if header[:9] != INDEX_MAGIC:
        raise ValueError(
            f"{where} is not a Megatron indexed-dataset index (bad magic bytes {header[:9]!r})"
        )
    version, code, seq_count, doc_count = struct.unpack("<QBQQ", header[9:HEADER_BYTES])
    if version != INDEX_VERSION:
        raise ValueError(f"{where} has index version {version}; only version {INDEX_VERSION} is supported")
    if code not in _DTYPE_CODES:
        raise ValueError(f"{where} has an unknown token dtype code {code} (corrupt header)")
    dtype = _DTYPE_CODES[code]
    if numpy.dtype(dtype).kind == "f":
        raise ValueError(f"{where} stores {numpy.dtype(dtype).name} values, not integer token ids")
    return size, dtype, seq_count, doc_count


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> IndexInfo:
    """Validate ``prefix.idx`` and the size of ``prefix.bin``; raise a one-line ValueError."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise ValueError(f"{flag}: {path} not found")
    key = (_identity(idx_path), _identity(bin_path))
    if key in _index_cache:
        return _index_cache[key]

    where = f"{flag} {prefix}: {idx_path}"
    size, dtype, seq_count, doc_count = _read_header(idx_path, flag, prefix)
    expected = HEADER_BYTES + 12 * seq_count + 8 * doc_count
    multimodal = size == expected + seq_count and seq_count > 0
    if size != expected and not multimodal:
        kind = "truncated" if size < expected else "corrupt"
        raise ValueError(
            f"{where} is {size} bytes but its header describes {seq_count} sequences and "
            f"{doc_count} document boundaries in {expected} bytes ({kind})"
        )
    if doc_count < 1:
        raise ValueError(f"{where} has no document boundaries (corrupt)")

    itemsize = numpy.dtype(dtype).itemsize
    mm = numpy.memmap(idx_path, dtype=numpy.uint8, mode="r")
    try:
        lengths = numpy.frombuffer(mm, dtype=numpy.int32, count=seq_count, offset=HEADER_BYTES)
        pointers = numpy.frombuffer(mm, dtype=numpy.int64, count=seq_count,
                                    offset=HEADER_BYTES + 4 * seq_count)
        documents = numpy.frombuffer(mm, dtype=numpy.int64, count=doc_count,
                                     offset=HEADER_BYTES + 12 * seq_count)

        num_tokens = 0
        if seq_count:
            if pointers[0] != 0:
                raise ValueError(f"{where} is corrupt: the first sequence starts at byte {int(pointers[0])}, not 0")
            for lo, hi in _chunks(seq_count, _INDEX_CHUNK, _INDEX_FULL_CHECK_ENTRIES):
                lens = lengths[lo:hi].astype(numpy.int64)
                bad = numpy.flatnonzero(lens < 0)
                if bad.size:
                    i = lo + int(bad[0])
                    raise ValueError(f"{where} is corrupt: sequence {i} has negative length {int(lengths[i])}")
                # pointers[i + 1] must equal pointers[i] + lengths[i] * itemsize
                top = min(hi + 1, seq_count)
                ends = pointers[lo:top - 1] + lens[: top - 1 - lo] * itemsize
                bad = numpy.flatnonzero(pointers[lo + 1:top] != ends)
                if bad.size:
                    i = lo + 1 + int(bad[0])
                    raise ValueError(
                        f"{where} is corrupt: sequence {i} starts at byte {int(pointers[i])} but "
                        f"sequence {i - 1} ends at byte {int(ends[bad[0]])}"
                    )
            bin_expected = int(pointers[-1]) + int(lengths[-1]) * itemsize
            num_tokens = bin_expected // itemsize

        if documents[0] != 0 or documents[-1] != seq_count:
            raise ValueError(
                f"{where} is corrupt: document boundaries run from {int(documents[0])} to "
                f"{int(documents[-1])}, expected 0 to {seq_count} (the sequence count)"
            )
        for lo, hi in _chunks(doc_count, _INDEX_CHUNK, _INDEX_FULL_CHECK_ENTRIES):
            top = min(hi + 1, doc_count)
            bad = numpy.flatnonzero(numpy.diff(documents[lo:top]) < 0)
            if bad.size:
                i = lo + 1 + int(bad[0])
                raise ValueError(
                    f"{where} is corrupt: document boundary {i} ({int(documents[i])}) is "
                    f"before boundary {i - 1} ({int(documents[i - 1])})"
                )
    finally:
        del mm

    info = IndexInfo(prefix, dtype, int(seq_count), int(doc_count), int(num_tokens), multimodal)
    bin_size = os.path.getsize(bin_path)
    if bin_size != info.bin_bytes:
        kind = "truncated or from another dataset" if bin_size < info.bin_bytes else "from another dataset or corrupt"
        raise ValueError(
            f"{flag} {prefix}: {bin_path} is {bin_size} bytes but {idx_path} describes "
            f"{info.bin_bytes} bytes ({kind})"
        )
    _index_cache[key] = info
    return info


def token_id_range(info: IndexInfo) -> Tuple[Optional[int], Optional[int], bool]:
    """(smallest id, largest id, whether every token was read) of a checked dataset.

    Full chunked scan up to FULL_SCAN_BYTES of .bin, else a deterministic sample of
    SAMPLE_WINDOWS evenly spaced windows.  (None, None, True) for a dataset without tokens.
    """
    bin_path = info.prefix + ".bin"
    key = _identity(bin_path) + (numpy.dtype(info.dtype).str,)
    if key in _range_cache:
        return _range_cache[key]
    if info.num_tokens == 0:
        return None, None, True
    itemsize = numpy.dtype(info.dtype).itemsize
    tokens = numpy.memmap(bin_path, dtype=info.dtype, mode="r", shape=(info.num_tokens,))
    try:
        if info.bin_bytes <= FULL_SCAN_BYTES:
            chunk = max(1, _SCAN_CHUNK_BYTES // itemsize)
            windows = [(lo, min(info.num_tokens, lo + chunk)) for lo in range(0, info.num_tokens, chunk)]
            complete = True
        else:
            width = max(1, SAMPLE_WINDOW_BYTES // itemsize)
            step = (info.num_tokens - width) / (SAMPLE_WINDOWS - 1)
            windows = [(int(i * step), int(i * step) + width) for i in range(SAMPLE_WINDOWS)]
            complete = False
        lo_id = hi_id = None
        for lo, hi in windows:
            part = tokens[lo:hi]
            a, b = int(part.min()), int(part.max())
            lo_id = a if lo_id is None else min(lo_id, a)
            hi_id = b if hi_id is None else max(hi_id, b)
    finally:
        del tokens
    result = (lo_id, hi_id, complete)
    _range_cache[key] = result
    return result


def check_token_ids(info: IndexInfo, vocab_size: int, tokenizer_desc: str,
                    hint: str = "the data was tokenized with another tokenizer",
                    flag: str = "--data-path") -> None:
    """Refuse data whose token ids are not all in ``[0, vocab_size)``.

    ``tokenizer_desc`` starts the message, e.g. ``"--tokenizer-model t.model has 8000 tokens"``.
    """
    lo_id, hi_id, _ = token_id_range(info)
    if lo_id is None:
        return
    bin_path = info.prefix + ".bin"
    if lo_id < 0:
        raise ValueError(f"{flag} {info.prefix}: {bin_path} contains the negative token id {lo_id} (corrupt)")
    if hi_id >= int(vocab_size):
        raise ValueError(f"{tokenizer_desc} but {bin_path} contains token id {hi_id}: {hint}")


# ---- which tokenizer wrote the data ------------------------------------------------------
#
# Token ids alone cannot tell a larger tokenizer from the right one (every id of the data
# is valid in both), so the preprocessing tool leaves ``{prefix}.tokenizer.json`` beside
# the ``.bin``/``.idx``: the tokenizer type, its number of ids and, for SentencePiece, the
# SHA-256 of the model file.  Training compares it with its own tokenizer.

TOKENIZER_RECORD_SUFFIX = ".tokenizer.json"


def tokenizer_fingerprint(tokenizer_type: str, tokenizer_model, num_token_ids: int) -> Dict[str, object]:
    """``tokenizer_model``: the file (or list of files, e.g. GPT-2's vocab and merges) defining the tokenizer."""
    record: Dict[str, object] = {"tokenizer_type": tokenizer_type, "num_token_ids": int(num_token_ids)}
    files = [tokenizer_model] if isinstance(tokenizer_model, str) else list(tokenizer_model or [])
    if files:
        import hashlib

        digests = []
        for path in files:
            with open(path, "rb") as f:
                digests.append(hashlib.sha256(f.read()).hexdigest())
        # One file: its own digest (as records written before several files were possible).
        record["model_sha256"] = digests[0] if len(digests) == 1 else hashlib.sha256(
            "".join(digests).encode()).hexdigest()
    return record


def write_tokenizer_record(prefix: str, fingerprint: Dict[str, object]) -> str:
    path = prefix + TOKENIZER_RECORD_SUFFIX
    atomic_write_json(path, fingerprint, indent=1, sort_keys=True, newline=True)
    return path


def _describe_fingerprint(fp: Dict[str, object]) -> str:
    text = f"{fp.get('tokenizer_type')} with {fp.get('num_token_ids')} token ids"
    if fp.get("model_sha256"):
        text += f", model sha256 {str(fp['model_sha256'])[:12]}"
    return text


def check_tokenizer_record(prefix: str, fingerprint: Dict[str, object], tokenizer_desc: str) -> None:
    """Refuse data written with another tokenizer than ``fingerprint`` (no record: nothing to check)."""
    import json

    path = prefix + TOKENIZER_RECORD_SUFFIX
    if not os.path.exists(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--data-path {prefix}: unreadable tokenizer record {path} ({exc})") from None
    keys = ("tokenizer_type", "num_token_ids", "model_sha256")
    if all(recorded.get(k) == fingerprint.get(k) for k in keys if k in recorded or k in fingerprint):
        return
    raise ValueError(f"{tokenizer_desc} ({_describe_fingerprint(fingerprint)}) is not the tokenizer that wrote "
                     f"--data-path {prefix}: {path} records {_describe_fingerprint(recorded)}; "
                     "train with that tokenizer or re-tokenize the data (tools/preprocess_data.py)")
