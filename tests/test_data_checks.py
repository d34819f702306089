"""Bad input data: corrupt or truncated .bin/.idx files and a tokenizer that does not fit the data.

Each case must give one line naming the flag and the file, from ``validate_data_args`` (so
``pretrain_llama.py`` reports it before any process group exists) and from ``build_datasets``.
"""

import argparse
import os
import shutil
import struct

import numpy
import pytest
import torch.distributed as dist

from megatron_tawpipe import data

from megatron_tawpipe.data import checks as data_checks

from training_helpers import data_args_error, tiny_args

# Documents of integer ids for the NullTokenizer; the largest id is 999. The eod is megatron-core's:
# the vocab size up to 0.18 (vocab + 1 ids), the vocab size - 1 from 0.19 (vocab ids).
DOCS = [[(37 * k + 11 * i) % 1000 for i in range(2 + k % 7)] for k in range(40)] + [[999, 1, 2]]
OTHER_DOCS = [[5, 6, 7, 8, 9, 10, 11] for _ in range(25)]


def _quiet(_msg):
    pass


def _null(vocab_size):
    """The installed megatron-core's NullTokenizer for ``--vocab-size vocab_size``."""
    return data.load_tokenizer("NullTokenizer", None, vocab_size)


def _write_null(prefix, docs, vocab_size=1000):
    records = ({"text": " ".join(map(str, d))} for d in docs)
    out = data.write_indexed_dataset(records, str(prefix), "NullTokenizer", vocab_size=vocab_size, log=_quiet)
    return out["text"]


def _args(prefix, **kw):
    args = argparse.Namespace(
        tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_size=1000,
        data_path=[prefix] if isinstance(prefix, str) else prefix, mock_data=False, split="1,0,0",
        seq_length=8, seed=1234, global_batch_size=2, train_iters=2, eval_iters=0,
        eval_interval=10, data_cache_path=None, create_attention_mask_in_dataloader=False,
    )
    for key, value in kw.items():
        setattr(args, key, value)
    return args


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A pristine dataset; tests copy it before damaging it."""
    return _write_null(tmp_path_factory.mktemp("good") / "good", DOCS)


@pytest.fixture
def copy(good, tmp_path):
    """A fresh copy of the good dataset under tmp_path."""
    prefix = str(tmp_path / "copy_text_document")
    for ext in (".bin", ".idx"):
        shutil.copyfile(good + ext, prefix + ext)
    return prefix


def _header(prefix):
    with open(prefix + ".idx", "rb") as f:
        return struct.unpack("<9sQBQQ", f.read(34))


def _poke(path, offset, payload):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(payload)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


# ---------------------------------------------------------------------------------------
# Structure of the .bin/.idx pair
# ---------------------------------------------------------------------------------------


def test_good_dataset_passes(good):
    data.validate_data_args(_args(good))
    info = data_checks.check_indexed_dataset(good)
    assert info.sequence_count == len(DOCS) and info.document_count == len(DOCS) + 1
    assert info.num_tokens == sum(len(d) + 1 for d in DOCS)  # each document ends with eod
    assert info.bin_bytes == os.path.getsize(good + ".bin") and info.dtype is numpy.uint16
    eod = _null(1000).eod
    assert data_checks.token_id_range(info) == (0, max(999, eod), True)
    assert max(999, eod) == _null(1000).vocab_size - 1   # the largest id is the last valid one of --vocab-size 1000
    data.validate_data_args(_args(good, vocab_size=1000))
    # a blend naming it twice, with weights
    data.validate_data_args(_args(["0.5", good, "0.5", good]))


def test_truncated_bin(copy):
    full = os.path.getsize(copy + ".bin")
    _truncate(copy + ".bin", full - 6)
    msg = data_args_error(_args(copy))
    assert msg == (f"--data-path {copy}: {copy}.bin is {full - 6} bytes but {copy}.idx describes "
                   f"{full} bytes (truncated or from another dataset)")


def test_bin_of_another_dataset(copy, tmp_path):
    described = os.path.getsize(copy + ".bin")
    smaller = _write_null(tmp_path / "other", OTHER_DOCS)
    shutil.copyfile(smaller + ".bin", copy + ".bin")
    size = os.path.getsize(copy + ".bin")
    assert size < described
    assert data_args_error(_args(copy)) == (f"--data-path {copy}: {copy}.bin is {size} bytes but {copy}.idx describes "
                                   f"{described} bytes (truncated or from another dataset)")
    larger = _write_null(tmp_path / "big", DOCS + DOCS)
    shutil.copyfile(larger + ".bin", copy + ".bin")
    size = os.path.getsize(copy + ".bin")
    assert data_args_error(_args(copy)) == (f"--data-path {copy}: {copy}.bin is {size} bytes but {copy}.idx describes "
                                   f"{described} bytes (from another dataset or corrupt)")


def test_truncated_idx(copy):
    size = os.path.getsize(copy + ".idx")
    _, _, _, nseq, ndoc = _header(copy)
    _truncate(copy + ".idx", size - 8)
    msg = data_args_error(_args(copy))
    assert msg == (f"--data-path {copy}: {copy}.idx is {size - 8} bytes but its header describes "
                   f"{nseq} sequences and {ndoc} document boundaries in {size} bytes (truncated)")
    _truncate(copy + ".idx", 20)
    msg = data_args_error(_args(copy))
    assert msg == (f"--data-path {copy}: {copy}.idx is 20 bytes, shorter than the 34-byte index header "
                   f"(truncated or not a Megatron index)")
    _truncate(copy + ".idx", 0)
    assert f"{copy}.idx is 0 bytes" in data_args_error(_args(copy))


def test_garbage_idx_header(copy):
    _poke(copy + ".idx", 0, b"GARBAGE!!")
    msg = data_args_error(_args(copy))
    assert msg == (f"--data-path {copy}: {copy}.idx is not a Megatron indexed-dataset index "
                   f"(bad magic bytes b'GARBAGE!!')")


def _damaged_copy(good, prefix, offset, payload):
    """A copy of the ``good`` dataset whose .idx has ``payload`` written at ``offset``."""
    for ext in (".bin", ".idx"):
        shutil.copyfile(good + ext, prefix + ext)
    _poke(prefix + ".idx", offset, payload)
    return prefix


def test_bad_version_and_dtype_code(good, tmp_path):
    def damaged(name, offset, payload):
        return _damaged_copy(good, str(tmp_path / name), offset, payload)

    p = damaged("version", 9, struct.pack("<Q", 7))
    assert data_args_error(_args(p)) == f"--data-path {p}: {p}.idx has index version 7; only version 1 is supported"
    p = damaged("code", 17, struct.pack("<B", 42))
    assert data_args_error(_args(p)) == f"--data-path {p}: {p}.idx has an unknown token dtype code 42 (corrupt header)"
    p = damaged("float", 17, struct.pack("<B", 7))
    assert data_args_error(_args(p)) == f"--data-path {p}: {p}.idx stores float32 values, not integer token ids"
    # a sequence count that does not match the file: the index is reported, not read past its end
    p = damaged("count", 18, struct.pack("<Q", 10**12))
    msg = data_args_error(_args(p))
    assert msg.startswith(f"--data-path {p}: {p}.idx is {os.path.getsize(p + '.idx')} bytes but its header "
                          f"describes 1000000000000 sequences")
    assert msg.endswith("(truncated)")


def test_inconsistent_index_entries(good, tmp_path):
    _, _, _, nseq, ndoc = _header(good)
    lengths_at, pointers_at, docs_at = 34, 34 + 4 * nseq, 34 + 12 * nseq

    def damaged(name, offset, payload):
        return _damaged_copy(good, str(tmp_path / name), offset, payload)

    p = damaged("negative", lengths_at + 4 * 3, struct.pack("<i", -5))
    assert data_args_error(_args(p)) == f"--data-path {p}: {p}.idx is corrupt: sequence 3 has negative length -5"
    p = damaged("pointer", pointers_at + 8 * 5, struct.pack("<q", 12345))
    msg = data_args_error(_args(p))
    assert msg.startswith(f"--data-path {p}: {p}.idx is corrupt: sequence 5 starts at byte 12345 but sequence 4 ends at byte ")
    p = damaged("first", pointers_at, struct.pack("<q", 2))
    assert data_args_error(_args(p)) == f"--data-path {p}: {p}.idx is corrupt: the first sequence starts at byte 2, not 0"
    p = damaged("lastdoc", docs_at + 8 * (ndoc - 1), struct.pack("<q", nseq - 1))
    assert data_args_error(_args(p)) == (f"--data-path {p}: {p}.idx is corrupt: document boundaries run from 0 to "
                                f"{nseq - 1}, expected 0 to {nseq} (the sequence count)")
    p = damaged("order", docs_at + 8 * 4, struct.pack("<q", 1))
    assert data_args_error(_args(p)) == (f"--data-path {p}: {p}.idx is corrupt: document boundary 4 (1) is "
                                f"before boundary 3 (3)")


def test_large_index_is_checked_in_sampled_chunks(good, tmp_path, monkeypatch):
    monkeypatch.setattr(data_checks, "_INDEX_FULL_CHECK_ENTRIES", 8)
    monkeypatch.setattr(data_checks, "_INDEX_CHUNK", 4)
    info = data_checks.check_indexed_dataset(good)  # a good index passes the sampled check
    assert info.sequence_count == len(DOCS)
    _, _, _, nseq, _ = _header(good)
    prefix = str(tmp_path / "sampled")
    for ext in (".bin", ".idx"):
        shutil.copyfile(good + ext, prefix + ext)
    _poke(prefix + ".idx", 34 + 4 * (nseq - 2), struct.pack("<i", -1))  # in the last chunk
    with pytest.raises(ValueError, match=f"sequence {nseq - 2} has negative length -1"):
        data_checks.check_indexed_dataset(prefix)


def test_multimodal_index_and_empty_dataset(tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32, multimodal=True)
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), [2, 3], modes=[0, 1])
    builder.finalize(prefix + ".idx")
    info = data_checks.check_indexed_dataset(prefix)
    assert info.multimodal and info.num_tokens == 5 and info.dtype is numpy.int32

    empty = _write_null(tmp_path / "empty", [])
    info = data_checks.check_indexed_dataset(empty)
    assert info.num_tokens == 0 and data_checks.token_id_range(info) == (None, None, True)


def test_file_replaced_after_a_check_is_checked_again(copy):
    data.validate_data_args(_args(copy))
    full = os.path.getsize(copy + ".bin")
    _truncate(copy + ".bin", full - 2)
    assert "truncated" in data_args_error(_args(copy))


def test_blend_names_the_bad_prefix(good, copy):
    _truncate(copy + ".bin", 10)
    msg = data_args_error(_args(["0.7", good, "0.3", copy]))
    assert msg.startswith(f"--data-path {copy}: {copy}.bin is 10 bytes")
    msg = data_args_error(_args([good, copy]))
    assert msg.startswith(f"--data-path {copy}: {copy}.bin is 10 bytes")


def test_mock_data_reads_no_file_and_is_the_only_source(copy):
    _poke(copy + ".idx", 0, b"GARBAGE!!")
    data.validate_data_args(_args(None, mock_data=True, vocab_size=10))
    # Megatron-LM's rule: one data source in training; --mock-data beside --data-path is refused, not preferred.
    with pytest.raises(ValueError, match="--mock-data, --data-path: give a single data source"):
        data.validate_data_args(_args(copy, mock_data=True, vocab_size=10))


# ---------------------------------------------------------------------------------------
# Tokenizer vocabulary against the token ids in the data
# ---------------------------------------------------------------------------------------


def test_null_tokenizer_smaller_than_the_data(good):
    msg = data_args_error(_args(good, vocab_size=500))
    small, largest = _null(500), max(999, _null(1000).eod)
    assert msg == (f"--vocab-size 500 gives the NullTokenizer {small.vocab_size} token ids "
                   f"(0..{small.vocab_size - 1}, eod {small.eod}) but "
                   f"{good}.bin contains token id {largest}: the data was tokenized with another "
                   f"tokenizer or a larger --vocab-size")
    # the largest id of the data is the last id of --vocab-size 1000, one more than --vocab-size 999 has
    assert f"contains token id {largest}" in data_args_error(_args(good, vocab_size=999))


def _texts():
    import argparse as m1
    import collections as m2
    import json as m3
    import logging as m4
    import shutil as m5

    texts = []
    for module in (m1, m2, m3, m4, m5):
        for obj in [module] + [getattr(module, n) for n in dir(module)]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40 and doc not in texts:
                texts.append(doc)
    return texts


@pytest.fixture(scope="module")
def sp_pair(tmp_path_factory):
    """(small model, large model, data prefix tokenized with the large model)."""
    tmp = tmp_path_factory.mktemp("sp")
    texts = _texts()
    small = data.train_sentencepiece(texts, str(tmp / "small"), vocab_size=400)
    large = data.train_sentencepiece(texts, str(tmp / "large"), vocab_size=900)
    records = ({"text": t} for t in texts)
    prefix = data.write_indexed_dataset(records, str(tmp / "corpus"), "SentencePieceTokenizer",
                                        tokenizer_model=large, log=_quiet)["text"]
    return small, large, prefix


def test_sentencepiece_model_of_another_vocabulary(sp_pair):
    small, large, prefix = sp_pair
    sp = dict(tokenizer_type="SentencePieceTokenizer", vocab_size=None, split="1,0,0")
    data.validate_data_args(_args(prefix, tokenizer_model=large, **sp))
    info = data_checks.check_indexed_dataset(prefix)
    top = data_checks.token_id_range(info)[1]
    assert 400 <= top < 900
    msg = data_args_error(_args(prefix, tokenizer_model=small, **sp))
    assert msg == (f"--tokenizer-model {small} has 400 tokens but {prefix}.bin contains token id {top}: "
                   f"the data was tokenized with another tokenizer")


def test_larger_tokenizer_is_refused_by_the_record_preprocessing_left(sp_pair, tmp_path):
    """Every id of data written with the small model is valid in the large one: only the record tells."""
    small, large, _ = sp_pair
    prefix = data.write_indexed_dataset(({"text": t} for t in _texts()), str(tmp_path / "small_corpus"),
                                        "SentencePieceTokenizer", tokenizer_model=small, log=_quiet)["text"]
    record = prefix + data_checks.TOKENIZER_RECORD_SUFFIX
    assert os.path.exists(record)
    sp = dict(tokenizer_type="SentencePieceTokenizer", vocab_size=None, split="1,0,0")
    data.validate_data_args(_args(prefix, tokenizer_model=small, **sp))
    msg = data_args_error(_args(prefix, tokenizer_model=large, **sp))
    assert msg.startswith(f"--tokenizer-model {large} (SentencePieceTokenizer with 900 token ids, model sha256 ")
    assert f"is not the tokenizer that wrote --data-path {prefix}: {record} records SentencePieceTokenizer " \
           "with 400 token ids" in msg
    # A copy of the right model (same bytes, another path) is the same tokenizer.
    same = tmp_path / "copy.model"
    shutil.copyfile(small, same)
    data.validate_data_args(_args(prefix, tokenizer_model=str(same), **sp))
    # NullTokenizer data read with a larger --vocab-size.
    null_prefix = data.write_indexed_dataset(({"text": "1 2 3 4"} for _ in range(40)), str(tmp_path / "null"),
                                             "NullTokenizer", vocab_size=100, log=_quiet)["text"]
    data.validate_data_args(_args(null_prefix, vocab_size=100, split="1,0,0"))
    msg = data_args_error(_args(null_prefix, vocab_size=5000, split="1,0,0"))
    assert msg.startswith(f"--vocab-size 5000 (NullTokenizer with {_null(5000).vocab_size} token ids) is not the "
                          "tokenizer that wrote")
    assert f"records NullTokenizer with {_null(100).vocab_size} token ids" in msg


def test_build_datasets_refuses_too(sp_pair, copy):
    small, large, prefix = sp_pair
    args = _args(prefix, tokenizer_type="SentencePieceTokenizer", tokenizer_model=small, vocab_size=None)
    with pytest.raises(ValueError, match=f"--tokenizer-model {small} has 400 tokens"):
        data.build_datasets(args, data.build_tokenizer(args))
    args = _args(copy)
    tokenizer = data.build_tokenizer(args)
    _truncate(copy + ".idx", 30)
    with pytest.raises(ValueError, match="shorter than the 34-byte index header"):
        data.build_datasets(args, tokenizer)


def test_large_bin_is_scanned_in_sampled_windows(tmp_path, monkeypatch):
    docs = [[k % 50 for k in range(j, j + 40)] for j in range(200)]  # every document ends with the eod
    prefix = _write_null(tmp_path / "sampled", docs)
    monkeypatch.setattr(data_checks, "FULL_SCAN_BYTES", 1024)
    monkeypatch.setattr(data_checks, "SAMPLE_WINDOWS", 4)
    monkeypatch.setattr(data_checks, "SAMPLE_WINDOW_BYTES", 64)
    info = data_checks.check_indexed_dataset(prefix)
    assert info.bin_bytes > 1024
    low, high, complete = data_checks.token_id_range(info)
    eod = _null(1000).eod
    assert not complete and low == 0 and high == eod  # the eod of --vocab-size 1000
    assert f"contains token id {eod}" in data_args_error(_args(prefix, vocab_size=800))


# ---------------------------------------------------------------------------------------
# pretrain_llama.py: one line on stderr, exit code 2, no process group
# ---------------------------------------------------------------------------------------


def _maindata_args_error(argv, capsys, monkeypatch):
    import pretrain_llama

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert pretrain_llama.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert not dist.is_initialized()
    return err[0]


def _cli(prefix, *extra):
    return [a for a in tiny_args() if a != "--mock-data"] + ["--data-path", prefix, "--split", "1,0,0"] + list(extra)


def test_pretrain_reports_a_truncated_bin(copy, capsys, monkeypatch):
    full = os.path.getsize(copy + ".bin")
    _truncate(copy + ".bin", full // 2)
    line = _maindata_args_error(_cli(copy, "--vocab-size", "1000"), capsys, monkeypatch)
    assert line == (f"pretrain_llama.py: error: --data-path {copy}: {copy}.bin is {full // 2} bytes but "
                    f"{copy}.idx describes {full} bytes (truncated or from another dataset)")


def test_pretrain_reports_a_garbage_idx(copy, capsys, monkeypatch):
    _poke(copy + ".idx", 0, b"\x00" * 34)
    line = _maindata_args_error(_cli(copy, "--vocab-size", "1000"), capsys, monkeypatch)
    assert f"--data-path {copy}: {copy}.idx is not a Megatron indexed-dataset index" in line


def test_pretrain_reports_a_vocabulary_mismatch(good, capsys, monkeypatch):
    line = _maindata_args_error(_cli(good), capsys, monkeypatch)  # tiny_args has --vocab-size 200
    small, largest = _null(200), max(999, _null(1000).eod)
    assert line == (f"pretrain_llama.py: error: --vocab-size 200 gives the NullTokenizer {small.vocab_size} token "
                    f"ids (0..{small.vocab_size - 1}, eod {small.eod}) but {good}.bin contains token id {largest}: "
                    f"the data was tokenized with another tokenizer or a larger --vocab-size")


def test_pretrain_reports_a_sentencepiece_mismatch(sp_pair, capsys, monkeypatch):
    small, _, prefix = sp_pair
    argv = [a for a in _cli(prefix) if a != "NullTokenizer"]
    argv[argv.index("--tokenizer-type") + 1:argv.index("--tokenizer-type") + 1] = ["SentencePieceTokenizer"]
    argv += ["--tokenizer-model", small]
    line = _maindata_args_error(argv, capsys, monkeypatch)
    assert line.startswith(f"pretrain_llama.py: error: --tokenizer-model {small} has 400 tokens but {prefix}.bin")
    assert line.endswith("the data was tokenized with another tokenizer")
