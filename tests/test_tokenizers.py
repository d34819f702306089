"""Megatron-LM's HuggingFaceTokenizer, GPT2BPETokenizer and TikTokenizer: tools/preprocess_data.py writes the
ids an independent tokenizer gives, and training runs on the data (tokenizer files built offline here)."""

import base64
import json
import math
import os
import subprocess
import sys

import numpy
import pytest

from distributed_harness import run_ranks
from training_helpers import data_args, train_rank

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"document {i}: the quick brown fox jumps over the lazy dog, {i * 7} times; hello world."
         for i in range(120)]
EOT = "<|endoftext|>"
NUM_SPECIAL = 16


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A byte-level BPE (tokenizer.json + tokenizer_config.json; the same model as GPT-2 vocab.json/merges.txt)
    and a TikTokenizer vocabulary (the 256 bytes and a few merges, Megatron's JSON layout)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = tmp_path_factory.mktemp("tokenizers")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXTS, trainer)
    (root / "gpt2").mkdir()
    bpe.model.save(str(root / "gpt2"))
    # The Hugging Face tokenizer starts every text with its bos (as Llama's do).
    bpe.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, bpe.token_to_id(EOT))])
    (root / "hf").mkdir()
    bpe.save(str(root / "hf" / "tokenizer.json"))
    (root / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT, "bos_token": EOT}))
    merges = [b"th", b"the", b" t", b" the", b"qu", b"ow"]
    ranks = [bytes([i]) for i in range(256)] + merges
    (root / "tiktoken.json").write_text(json.dumps([
        {"rank": i, "token_bytes": base64.b64encode(b).decode(), "token_str": b.decode("latin-1")}
        for i, b in enumerate(ranks)]))
    return {"root": root, "bpe": bpe, "num_ranks": len(ranks)}


def _flags(kind, files):
    root = files["root"]
    if kind == "HuggingFaceTokenizer":
        return ["--tokenizer-type", kind, "--tokenizer-model", str(root / "hf")]
    if kind == "GPT2BPETokenizer":
        return ["--tokenizer-type", kind, "--vocab-file", str(root / "gpt2" / "vocab.json"),
                "--merge-file", str(root / "gpt2" / "merges.txt")]
    return ["--tokenizer-type", kind, "--tokenizer-model", str(root / "tiktoken.json"),
            "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", str(NUM_SPECIAL)]


def _expected_ids(kind, files, tokenizer):
    """Each text's ids from an independent tokenizer, and the end-of-document id."""
    if kind in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        bpe = files["bpe"]  # the Hugging Face tokenizer's own special tokens (its bos) are included
        special = kind == "HuggingFaceTokenizer"
        return [bpe.encode(text, add_special_tokens=special).ids for text in TEXTS], bpe.token_to_id(EOT)
    import tiktoken

    vocab = json.loads((files["root"] / "tiktoken.json").read_text())
    ranks = {base64.b64decode(entry["token_bytes"]): entry["rank"] for entry in vocab}
    pattern = r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    encoding = tiktoken.Encoding(name="test", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    return [[NUM_SPECIAL + i for i in encoding.encode(text)] for text in TEXTS], tokenizer.eod


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer"])
def test_tokenizer_preprocesses_exact_ids_and_trains(kind, tokenizer_files, tmp_path):
    from megatron_tawpipe.data import load_tokenizer, tokenizer_options
    from megatron_tawpipe.arguments import parse_args

    flags = _flags(kind, tokenizer_files)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), "--input",
                           str(jsonl), "--append-eod", "--output-prefix", str(tmp_path / "corpus")] + flags,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    argv = data_args(str(tmp_path / "corpus_text_document"), flags)
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size, **tokenizer_options(args))
    expected, eod = _expected_ids(kind, tokenizer_files, tokenizer)
    assert tokenizer.eod == eod and all(ids for ids in expected)
    raw = numpy.fromfile(str(tmp_path / "corpus_text_document.bin"), dtype=numpy.uint16)
    assert raw.tolist() == [t for ids in expected for t in ids + [eod]]
    if kind == "TikTokenizer":
        assert tokenizer.vocab_size == NUM_SPECIAL + tokenizer_files["num_ranks"]
    else:  # (megatron-core 0.16's TikTokenizer cannot detokenize its own ids; training does not need it)
        assert tokenizer.detokenize(expected[3]).replace(EOT, "") == TEXTS[3]
    if kind == "HuggingFaceTokenizer":
        assert expected[0][0] == eod  # the bos
        plain = load_tokenizer(kind, args.tokenizer_model, hf_include_special_tokens=False)
        assert plain.tokenize(TEXTS[0]) == expected[0][1:]

    (records,) = run_ranks(train_rank, 1, argv)
    assert len(records) == 2 and all(math.isfinite(r["lm_loss"]) and r["lm_loss"] > 0 for r in records)


def test_missing_tokenizer_files_are_named():
    from megatron_tawpipe.data import load_tokenizer

    with pytest.raises(ValueError, match="--vocab-file and --merge-file are required"):
        load_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="--tokenizer-model /nonexistent: no such directory"):
        load_tokenizer("HuggingFaceTokenizer", "/nonexistent")
    with pytest.raises(ValueError, match="not a readable TikTokenizer vocabulary"):
        load_tokenizer("TikTokenizer", "/nonexistent.json")
