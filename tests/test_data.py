"""Tests of the data pipeline: preprocessing, tokenizers, GPT datasets, sampling, validation.

Everything is built from tiny corpora in tmp_path; expected token ids come from the
sentencepiece library itself or from the integers written into NullTokenizer text, never
from the code under test.
"""

import argparse
import importlib.util
import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy
import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import megatron_tawpipe  # noqa: F401
except ImportError:  # source checkout without installation
    sys.path.insert(0, REPO_ROOT)

from megatron_tawpipe import data  # noqa: E402
from megatron_tawpipe.data import default_corpus as default_data  # noqa: E402
from training_helpers import data_args_error  # noqa: E402


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(REPO_ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}) + "\n")
    return str(path)


def _english_texts():
    """Real English text without any file access: docstrings of a few stdlib modules."""
    import argparse as m1
    import collections as m2
    import json as m3
    import logging as m4
    import subprocess as m5
    import textwrap as m6
    import unittest as m7

    texts = []
    for module in (m1, m2, m3, m4, m5, m6, m7):
        texts.append(module.__doc__)
        for name in sorted(vars(module)):
            doc = getattr(getattr(module, name), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                texts.append(doc)
    return texts


def _raw_idx(prefix):
    """Parse a Megatron .idx by hand: (dtype code, sequence lengths, document indices)."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, nseq, ndoc = struct.unpack("<QBQQ", raw[9:34])
    assert version == 1
    off = 34
    lengths = numpy.frombuffer(raw, dtype=numpy.int32, count=nseq, offset=off)
    off += 4 * nseq
    pointers = numpy.frombuffer(raw, dtype=numpy.int64, count=nseq, offset=off)
    off += 8 * nseq
    docs = numpy.frombuffer(raw, dtype=numpy.int64, count=ndoc, offset=off)
    return code, lengths, pointers, docs


def _null_args(prefix, **kw):
    args = argparse.Namespace(
        tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_size=1000,
        data_path=[prefix] if prefix else None, mock_data=False, split="1,0,0",
        seq_length=16, seed=1234, global_batch_size=4, train_iters=10, eval_iters=0,
        eval_interval=10, data_cache_path=None, create_attention_mask_in_dataloader=False,
    )
    for k, v in kw.items():
        setattr(args, k, v)
    return args


# Documents of distinct integer ids: doc k holds ids 16*k+1 .. 16*k+len (len <= 11), vocab 1000.
NULL_DOCS = [[16 * k + 1 + i for i in range(3 + (k * 7) % 9)] for k in range(60)]


def _null_eod_follows_vocab() -> bool:
    """megatron-core's NullTokenizer: up to 0.18, --vocab-size V gives V + 1 ids with the eod V; from
    0.19 (it takes an eod_id) V ids with the eod V - 1, as Megatron-LM of each release."""
    import inspect

    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return "eod_id" not in inspect.signature(NullTokenizer.__init__).parameters


NULL_EOD = 1000 if _null_eod_follows_vocab() else 999


@pytest.fixture(scope="module")
def null_corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("null")
    jsonl = _write_jsonl(tmp / "docs.jsonl", [" ".join(map(str, d)) for d in NULL_DOCS])
    tool = _load_tool("preprocess_data")
    tool.main(["--input", jsonl, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
               "--append-eod", "--output-prefix", str(tmp / "null"), "--log-interval", "0"])
    return str(tmp / "null_text_document")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp")
    jsonl = _write_jsonl(tmp / "train.jsonl", _english_texts())
    tool = _load_tool("train_tokenizer")
    tool.main(["--input", jsonl, "--json-key", "text", "--vocab-size", "500",
               "--model-prefix", str(tmp / "tok"), "--model-type", "bpe"])
    return str(tmp / "tok.model")


# ---------------------------------------------------------------------------------------
# Preprocessing: the on-disk format and exact token ids
# ---------------------------------------------------------------------------------------


def test_preprocess_null_tokenizer_exact_ids(null_corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    expected = [d + [NULL_EOD] for d in NULL_DOCS]
    code, lengths, pointers, docs = _raw_idx(null_corpus)
    assert code == 8  # uint16 for a vocabulary below 65500
    assert lengths.tolist() == [len(d) for d in expected]
    assert docs.tolist() == list(range(len(expected) + 1))
    assert pointers.tolist() == list(numpy.cumsum([0] + [2 * len(d) for d in expected])[:-1])
    raw = numpy.fromfile(null_corpus + ".bin", dtype=numpy.uint16)
    assert raw.tolist() == [t for d in expected for t in d]

    ds = IndexedDataset(null_corpus)
    assert len(ds) == len(expected)
    for i, doc in enumerate(expected):
        assert ds[i].tolist() == doc
    assert ds.get(5, offset=1, length=2).tolist() == expected[5][1:3]


def test_preprocess_int32_for_large_vocab_and_multiple_keys(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path = tmp_path / "two.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"text": "70000 5 9", "title": "1 2"}) + "\n")
        f.write(json.dumps({"text": ["3 4", "", "69999"], "title": "7"}) + "\n")
        f.write(json.dumps({"text": "", "title": "8"}) + "\n")
    _load_tool("preprocess_data").main([
        "--input", str(path), "--json-keys", "text", "title", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "70001", "--output-prefix", str(tmp_path / "big"), "--log-interval", "0"])
    text = IndexedDataset(str(tmp_path / "big_text_document"))
    code, lengths, _, docs = _raw_idx(str(tmp_path / "big_text_document"))
    assert code == 4  # int32 from 65500 ids up
    # no --append-eod; a list is one document of several sequences; empty texts are skipped
    assert [text[i].tolist() for i in range(len(text))] == [[70000, 5, 9], [3, 4], [69999]]
    assert docs.tolist() == [0, 1, 3]
    title = IndexedDataset(str(tmp_path / "big_title_document"))
    assert [title[i].tolist() for i in range(len(title))] == [[1, 2], [7], [8]]


def test_preprocess_sentencepiece_cli_workers(tmp_path, sp_model):
    import sentencepiece

    texts = _english_texts()[:40] + ["naïve café — 東京 ☃"]
    jsonl = _write_jsonl(tmp_path / "docs.jsonl", texts)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
           "--append-eod", "--workers", "2", "--output-prefix", str(tmp_path / "w2")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(tmp_path / "w2_text_document") in proc.stdout

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    expected = [t for text in texts for t in sp.encode_as_ids(text) + [sp.eos_id()]]
    raw = numpy.fromfile(str(tmp_path / "w2_text_document.bin"), dtype=numpy.uint16)
    assert raw.tolist() == expected

    # one worker in-process gives byte-identical files
    data.write_indexed_dataset(data.iter_documents([jsonl]), str(tmp_path / "w1"),
                               "SentencePieceTokenizer", tokenizer_model=sp_model, workers=1,
                               log=lambda _: None)
    for ext in (".bin", ".idx"):
        with open(str(tmp_path / "w1_text_document") + ext, "rb") as a, \
                open(str(tmp_path / "w2_text_document") + ext, "rb") as b:
            assert a.read() == b.read()


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_megatron_lms_sentencepiece_tokenizers_preprocess_and_train(tokenizer_type, tmp_path, sp_model):
    """Megatron-LM's GPTSentencePieceTokenizer and Llama2Tokenizer: the model's own ids (Llama2 with its
    bos id first), eod = its eos id; data preprocessed with one trains with it, and only with it."""
    import sentencepiece

    from distributed_harness import run_ranks
    from training_helpers import data_args, train_rank

    texts = _english_texts()[:200]
    jsonl = _write_jsonl(tmp_path / "docs.jsonl", texts)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), "--input", jsonl,
           "--tokenizer-type", tokenizer_type, "--tokenizer-model", sp_model, "--append-eod",
           "--output-prefix", str(tmp_path / "corpus")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    bos = [sp.bos_id()] if tokenizer_type == "Llama2Tokenizer" else []
    expected = [t for text in texts for t in bos + sp.encode_as_ids(text) + [sp.eos_id()]]
    raw = numpy.fromfile(str(tmp_path / "corpus_text_document.bin"), dtype=numpy.uint16)
    assert raw.tolist() == expected

    argv = data_args(str(tmp_path / "corpus_text_document"), ["--tokenizer-type", tokenizer_type,
                                                              "--tokenizer-model", sp_model])
    (records,) = run_ranks(train_rank, 1, argv)
    assert len(records) == 2 and all(r["lm_loss"] > 0 for r in records)
    other = "Llama2Tokenizer" if tokenizer_type == "GPTSentencePieceTokenizer" else "GPTSentencePieceTokenizer"
    args = argparse.Namespace(tokenizer_type=other, tokenizer_model=sp_model, vocab_size=None,
                              data_path=[str(tmp_path / "corpus_text_document")], mock_data=False,
                              split="90,10,0")
    assert "is not the tokenizer that wrote" in data_args_error(args)


def test_preprocess_plain_text_modes(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("1 2\n3\n\n4 5 6\n\n\n7\n")
    lines = [r["text"] for r in data.iter_documents([str(path)])]
    paras = [r["text"] for r in data.iter_documents([str(path)], text_mode="paragraph")]
    whole = [r["text"] for r in data.iter_documents([str(path)], text_mode="file")]
    assert lines == ["1 2", "3", "4 5 6", "7"]
    assert paras == ["1 2\n3", "4 5 6", "7"]
    assert whole == ["1 2\n3\n\n4 5 6\n\n\n7\n"]


# ---------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------


def test_sentencepiece_tokenizer_roundtrip(sp_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    args = argparse.Namespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model,
                              vocab_size=None)
    tok = data.build_tokenizer(args)
    assert tok.vocab_size == sp.get_piece_size() == 500
    assert tok.eod == sp.eos_id() == 2
    assert args.padded_vocab_size == 512
    assert "tokenizer_path" in tok.unique_identifiers
    for text in ["Return a new dictionary.", "  two  spaces\tand a tab\n",
                 "naïve café — 東京 ☃ 12345", _english_texts()[0]]:
        ids = tok.tokenize(text)
        assert ids == sp.encode_as_ids(text)
        assert 0 not in ids  # byte fallback: nothing is unknown
        assert tok.detokenize(ids) == text
    assert tok.detokenize(torch.tensor(sp.encode_as_ids("hello world"))) == "hello world"

    fallback = data.tokenizers._SentencePieceFallbackTokenizer(sp_model)
    text = _english_texts()[3]
    assert fallback.tokenize(text) == tok.tokenize(text)
    assert (fallback.vocab_size, fallback.eod) == (tok.vocab_size, tok.eod)


def test_sentencepiece_training_is_deterministic(tmp_path, sp_model):
    jsonl = _write_jsonl(tmp_path / "train.jsonl", _english_texts())
    _load_tool("train_tokenizer").main(["--input", jsonl, "--vocab-size", "500",
                                        "--model-prefix", str(tmp_path / "again")])
    with open(sp_model, "rb") as a, open(tmp_path / "again.model", "rb") as b:
        assert a.read() == b.read()


def test_null_tokenizer_and_vocab_padding():
    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=1000,
                              make_vocab_size_divisible_by=100, tensor_model_parallel_size=3)
    tok = data.build_tokenizer(args)
    assert (tok.vocab_size, tok.eod) == ((1001, 1000) if _null_eod_follows_vocab() else (1000, 999))
    assert args.padded_vocab_size == 1200
    assert tok.tokenize("5 17 999") == [5, 17, 999]
    assert tok.detokenize([5, 17, 999]) == "5 17 999"
    fallback = data.tokenizers._NullFallbackTokenizer(1000)
    assert (fallback.vocab_size, fallback.eod, fallback.tokenize("5 17")) == (1001, 1000, [5, 17])

    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=128)
    data.build_tokenizer(args)
    # 129 ids -> the next multiple of 128; 128 ids stay
    assert args.padded_vocab_size == (256 if _null_eod_follows_vocab() else 128)
    assert data.pad_vocab_size(256, 128, 2) == 256
    assert data.pad_vocab_size(257, 128, 2) == 512


# ---------------------------------------------------------------------------------------
# GPT datasets
# ---------------------------------------------------------------------------------------


def _check_sample_follows_documents(sample, seq_length):
    """Every token pair of a sample is adjacent in a document, or an eod then a document start."""
    tokens, labels = sample["tokens"].tolist(), sample["labels"].tolist()
    assert len(tokens) == len(labels) == seq_length
    assert tokens[1:] == labels[:-1]
    starts = {d[0] for d in NULL_DOCS}
    nxt = {}
    for d in NULL_DOCS:
        full = d + [NULL_EOD]
        nxt.update({a: b for a, b in zip(full[:-1], full[1:])})
    window = tokens + labels[-1:]
    for a, b in zip(window[:-1], window[1:]):
        if a == NULL_EOD:
            assert b in starts
        else:
            assert nxt[a] == b


def test_gpt_dataset_samples_from_indexed_data(null_corpus, tmp_path):
    args = _null_args(null_corpus, data_cache_path=str(tmp_path / "cache"))
    data.validate_data_args(args)
    tok = data.build_tokenizer(args)
    train, valid, test = data.build_datasets(args, tok)
    assert valid is None and test is None  # split 1,0,0
    assert len(train) >= args.train_iters * args.global_batch_size
    seen = set()
    for i in range(len(train)):
        s = train[i]
        _check_sample_follows_documents(s, args.seq_length)
        assert set(s.keys()) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert s["loss_mask"].tolist() == [1.0] * args.seq_length
        assert s["position_ids"].tolist() == list(range(args.seq_length))
        seen.update(s["tokens"].tolist())
    all_ids = {t for d in NULL_DOCS for t in d} | {NULL_EOD}
    assert seen <= all_ids and len(seen) > 0.9 * len(all_ids)
    assert os.listdir(tmp_path / "cache")  # indices cached where asked

    # same seed -> same samples (now loaded from the cache); another seed -> another order
    again = data.build_datasets(args, tok)[0]
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(len(train)))
    other = data.build_datasets(_null_args(null_corpus, seed=7), tok)[0]
    assert any(not torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(len(train)))


def test_gpt_dataset_splits_and_masks(null_corpus):
    args = _null_args(null_corpus, split="80,15,5", eval_iters=2, eval_interval=5,
                      reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
                      create_attention_mask_in_dataloader=True)
    tok = data.build_tokenizer(args)
    train, valid, test = data.build_datasets(args, tok)
    assert data.dataset_sizes(args) == [40, (10 // 5 + 1) * 2 * 4, 2 * 4]
    assert len(train) >= 40 and len(valid) >= 24 and len(test) >= 8
    s = valid[0]
    tokens = s["tokens"]
    assert s["attention_mask"].shape == (1, args.seq_length, args.seq_length)
    eod_pos = (tokens == NULL_EOD).nonzero().flatten().tolist()
    assert s["loss_mask"][tokens == NULL_EOD].sum() == 0
    # position ids restart after each eod
    prev = 0
    for j, p in enumerate(s["position_ids"].tolist()):
        assert p == j - prev
        if j in eod_pos:
            prev = j + 1


def test_blended_data_single_process_with_cache(null_corpus, tmp_path):
    args = _null_args(None, data_path=["0.3", null_corpus, "0.7", null_corpus],
                      data_cache_path=str(tmp_path / "cache"))
    data.validate_data_args(args)
    train = data.build_datasets(args, data.build_tokenizer(args))[0]
    assert len(train) == args.train_iters * args.global_batch_size
    _check_sample_follows_documents(train[3], args.seq_length)


def test_mock_data():
    args = _null_args(None, mock_data=True, vocab_size=128, split="969,30,1", eval_iters=1)
    data.validate_data_args(args)
    tok = data.build_tokenizer(args)
    train, valid, test = data.build_datasets(args, tok)
    assert len(train) >= 40 and len(valid) >= 3 and len(test) >= 1
    it = data.build_data_iterator(train, 2, 0, 1, 0)
    tokens, labels, loss_mask, attention_mask, position_ids = data.get_batch(it, "cpu")
    assert tokens.shape == labels.shape == loss_mask.shape == position_ids.shape == (2, 16)
    assert attention_mask is None
    assert int(tokens.max()) < tok.vocab_size and int(tokens.min()) >= 0
    assert torch.equal(tokens[:, 1:], labels[:, :-1])


# ---------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------


def test_sampler_partitions_each_step():
    mbs, dp, total, consumed = 3, 4, 100, 7
    per_rank = [list(data.MicroBatchSampler(total, consumed, mbs, d, dp)) for d in range(dp)]
    steps = (total - consumed) // (mbs * dp)
    assert all(len(r) == steps for r in per_rank)
    for k in range(steps):
        start = consumed + k * mbs * dp
        assert sum((per_rank[d][k] for d in range(dp)), []) == list(range(start, start + mbs * dp))
        for d in range(dp):
            assert per_rank[d][k] == list(range(start + d * mbs, start + (d + 1) * mbs))
    cyc = data.MicroBatchSampler(10, 8, 2, 1, 2, cyclic=True)
    it = iter(cyc)
    assert [next(it) for _ in range(3)] == [[0, 1], [4, 5], [8, 9]]
    with pytest.raises(ValueError, match="consumed"):
        data.MicroBatchSampler(10, 10, 2, 0, 1)


def test_data_iterator_batches_and_resume(null_corpus):
    args = _null_args(null_corpus)
    train = data.build_datasets(args, data.build_tokenizer(args))[0]
    mbs, dp = 2, 2
    for d in range(dp):
        it = data.build_data_iterator(train, mbs, d, dp, 0)
        batches = [next(it) for _ in range(5)]
        for k, batch in enumerate(batches):
            idx = [k * mbs * dp + d * mbs + j for j in range(mbs)]
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert batch[key].shape[0] == mbs
                assert torch.equal(batch[key], torch.stack([train[i][key] for i in idx]))
        # resume after 2 global batches of mbs*dp samples: the same continuation
        resumed = data.build_data_iterator(train, mbs, d, dp, 2 * mbs * dp)
        for k in range(2, 5):
            assert torch.equal(next(resumed)["tokens"], batches[k]["tokens"])
        # worker processes give the same batches
        workers = data.build_data_iterator(train, mbs, d, dp, 2 * mbs * dp, num_workers=1)
        assert torch.equal(next(workers)["tokens"], batches[2]["tokens"])
    assert data.get_batch(None, "cpu") == (None,) * 5
    finite = data.build_data_iterator(train, 4, 0, 1, len(train) - 5)
    assert len(list(finite)) == 1


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


def test_validate_data_args_errors(null_corpus, sp_model, tmp_path):
    assert "--mock-data" in data_args_error(_null_args(None))
    assert "--data-path" in data_args_error(_null_args(None))

    missing = str(tmp_path / "nothere")
    msg = data_args_error(_null_args(missing))
    assert "--data-path" in msg and missing + ".bin" in msg
    only_bin = tmp_path / "half"
    (tmp_path / "half.bin").write_bytes(b"")
    msg = data_args_error(_null_args(str(only_bin)))
    assert "--data-path" in msg and str(only_bin) + ".idx" in msg
    msg = data_args_error(_null_args(null_corpus + ".bin"))
    assert "--data-path" in msg and "prefix" in msg

    for bad in ["a,b", "1,2,3,4", "-1,2", "0,0,0", ""]:
        msg = data_args_error(_null_args(null_corpus, split=bad))
        assert "--split" in msg
    msg = data_args_error(_null_args(null_corpus, split="995,4,1"))  # 60 docs: the valid share rounds to 0
    assert "--split" in msg and "valid" in msg and null_corpus in msg
    with pytest.raises(ValueError, match="--split"):  # the builder refuses it too (never hangs)
        args = _null_args(null_corpus, split="995,4,1")
        data.build_datasets(args, data.build_tokenizer(args))

    msg = data_args_error(_null_args(null_corpus, vocab_size=None))
    assert "--vocab-size" in msg

    sp = dict(tokenizer_type="SentencePieceTokenizer", vocab_size=None)
    assert "--tokenizer-model" in data_args_error(_null_args(null_corpus, tokenizer_model=None, **sp))
    gone = str(tmp_path / "gone.model")
    msg = data_args_error(_null_args(null_corpus, tokenizer_model=gone, **sp))
    assert "--tokenizer-model" in msg and gone in msg
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    msg = data_args_error(_null_args(null_corpus, tokenizer_model=str(junk), **sp))
    assert "--tokenizer-model" in msg and str(junk) in msg
    assert "--tokenizer-type" in data_args_error(_null_args(null_corpus, tokenizer_type="GPT2BPETokenizer"))

    msg = data_args_error(_null_args(None, data_path=["0.5", null_corpus, null_corpus, "x"]))
    assert "--data-path" in msg

    msg = data_args_error(_null_args(null_corpus, tokenizer_model=sp_model, **sp))  # ids of another tokenizer
    assert msg.startswith(f"--tokenizer-model {sp_model} has 500 tokens") and f"token id {NULL_EOD}" in msg

    # valid settings pass
    data.validate_data_args(_null_args(null_corpus))
    data.validate_data_args(_null_args(None, mock_data=True))


def test_parse_data_path():
    assert data.parse_data_path(["a"]) == (["a"], None)
    assert data.parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert data.parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert data.parse_data_path(["0.3 a 0.7 b"]) == (["a", "b"], [0.3, 0.7])
    assert data.parse_data_path(None) is None
    assert data.parse_split("969, 30, 1") == pytest.approx([0.969, 0.030, 0.001])
    assert data.parse_split("1") == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------
# torch.distributed: rank 0 builds and caches, the others load, nobody races
# ---------------------------------------------------------------------------------------


WORKER = textwrap.dedent(
    """
    import argparse, json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    rank, world, init_file, prefix, cache, out = sys.argv[1:]
    rank, world = int(rank), int(world)
    torch.distributed.init_process_group("gloo", init_method="file://" + init_file,
                                         rank=rank, world_size=world)
    from megatron_tawpipe import data
    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=1000,
        data_path=["0.6", prefix, "0.4", prefix], mock_data=False, split="90,10,0",
        seq_length=16, seed=5, global_batch_size=4, train_iters=10, eval_iters=1,
        eval_interval=10, data_cache_path=cache, create_attention_mask_in_dataloader=False)
    data.validate_data_args(args)
    train, valid, test = data.build_datasets(args, data.build_tokenizer(args))
    it = data.build_data_iterator(train, 2, rank, world, 0)
    batches = [next(it)["tokens"].tolist() for _ in range(3)]
    json.dump({"train0": train[0]["tokens"].tolist(), "valid0": valid[0]["tokens"].tolist(),
               "len": len(train), "batches": batches, "test": test is None},
              open(out, "w"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    """
)


def test_build_datasets_under_torch_distributed(null_corpus, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cache = str(tmp_path / "cache")
    outs = [str(tmp_path / f"out{r}.json") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(tmp_path / "init"),
                               null_corpus, cache, outs[r]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    res = [json.load(open(o)) for o in outs]
    assert res[0]["train0"] == res[1]["train0"] and res[0]["valid0"] == res[1]["valid0"]
    assert res[0]["len"] == res[1]["len"] == 40 and res[0]["test"]
    # data-parallel ranks see different halves of each global batch
    assert all(a != b for a, b in zip(res[0]["batches"], res[1]["batches"]))
    cached = os.listdir(cache)
    assert any("BlendedDataset" in name for name in cached)
    assert any("GPTDataset" in name for name in cached)


# ---------------------------------------------------------------------------------------
# The default corpus (on a small stand-in for the standard library)
# ---------------------------------------------------------------------------------------


def test_default_corpus_pipeline(tmp_path):
    import shutil
    import sentencepiece

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    stdlib = default_data.stdlib_dir()
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    for name in ("argparse.py", "textwrap.py", "subprocess.py", "typing.py"):
        shutil.copy(os.path.join(stdlib, name), root / name)
    dup = '"""Shared docstring appearing twice."""\n\ndef f():\n    """Shared docstring appearing twice."""\n'
    (root / "pkg" / "__init__.py").write_text(dup + 'class K:\n    """Only once, in a class."""\n')
    (root / "broken.py").write_text("def (:\n")  # not Python: skipped
    (root / "site-packages").mkdir()
    (root / "site-packages" / "other.py").write_text('"""Not the standard library."""\n')

    docs = list(default_data.iter_stdlib_documents(str(root)))
    sources = [d["source"] for d in docs]
    assert sources == ["stdlib:argparse", "stdlib:pkg", "stdlib:subprocess", "stdlib:textwrap",
                       "stdlib:typing"]
    assert docs[1]["text"] == "Shared docstring appearing twice.\n\nOnly once, in a class."
    assert docs == list(default_data.iter_stdlib_documents(str(root), workers=2))

    out = tmp_path / "out"
    logs = []
    corpus = default_data.build_default_corpus(str(out), vocab_size=400, source_root=str(root),
                                               workers=1, log=logs.append)
    assert corpus.num_documents == len(docs)
    assert corpus.flags()[:2] == ["--data-path", corpus.data_prefix]
    sp = sentencepiece.SentencePieceProcessor(model_file=corpus.tokenizer_model)
    assert sp.get_piece_size() == 400
    ds = IndexedDataset(corpus.data_prefix)
    assert len(ds) == len(docs)
    assert ds[1].tolist() == sp.encode_as_ids(docs[1]["text"]) + [sp.eos_id()]
    assert corpus.num_tokens == int(ds.sequence_lengths.sum())

    # second call: every step is skipped, files untouched
    mtimes = {p: os.path.getmtime(out / p) for p in os.listdir(out)}
    logs2 = []
    again = default_data.build_default_corpus(str(out), vocab_size=400, source_root=str(root),
                                              workers=1, log=logs2.append)
    assert logs2 == [] and again == corpus
    assert {p: os.path.getmtime(out / p) for p in os.listdir(out)} == mtimes


def test_cyclic_sampler_is_megatron_lms_random_sampler():
    """Each epoch visits every sample of the cut dataset once, in an order that changes with the epoch;
    resuming from any consumed count continues the uninterrupted sequence."""
    import itertools

    total, mbs, dp = 53, 2, 3  # 53 samples -> 48 used (a multiple of mbs * dp), 8 per rank per epoch

    def steps(consumed, count):
        ranks = [iter(data.RandomMicroBatchSampler(total, consumed, mbs, d, dp)) for d in range(dp)]
        return [[next(r) for r in ranks] for _ in range(count)]

    epoch0, epoch1 = steps(0, 8), steps(48, 8)
    for epoch in (epoch0, epoch1):
        seen = [i for step in epoch for batch in step for i in batch]
        assert sorted(seen) == list(range(48))
        for d in range(dp):  # each rank stays in its own bucket of 16
            assert all(16 * d <= i < 16 * (d + 1) for step in epoch for i in step[d])
    assert epoch0 != epoch1
    uninterrupted = steps(0, 20)
    assert uninterrupted[:8] == epoch0 and uninterrupted[8:16] == epoch1
    assert steps(6 * 5, 15) == uninterrupted[5:]  # consumed 30 samples = 5 steps of 6
    assert list(itertools.islice(iter(data.RandomMicroBatchSampler(total, 0, mbs, 1, dp)), 1)) == [epoch0[0][1]]


def test_cyclic_dataloader_trains_equally_under_every_schedule_and_resumes(tmp_path):
    from distributed_harness import run_ranks
    from training_helpers import assert_close_rel, losses, tiny_args, train_rank

    # (Megatron-LM's random sampler gives each data-parallel rank a bucket of the dataset: the batches depend
    # on the data-parallel size, 2 here for native megatron and for tawpipe alike.)
    cyclic = ["--dataloader-type", "cyclic"]
    native = run_ranks(train_rank, 2, tiny_args(*cyclic, train_iters=4))[-1]
    single = run_ranks(train_rank, 2, tiny_args(train_iters=4))[-1]
    assert losses(native) != losses(single)  # another order of the samples
    tawpipe = run_ranks(train_rank, 2, tiny_args(*cyclic, "--pipeline-schedule", "tawpipe", train_iters=4))[0]
    assert_close_rel(losses(tawpipe), losses(native), 1e-5)
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 2, tiny_args(*cyclic, "--save", save, "--exit-interval", "2", train_iters=4))
    resumed = run_ranks(train_rank, 2, tiny_args(*cyclic, "--load", save, train_iters=4))[-1]
    assert losses(resumed) == losses(native[2:])
