"""Megatron-LM's separate data paths: --train/valid/test-data-path, --data-args-path,
--per-split-data-args-path, --num-dataset-builder-threads.

Three small corpora are built with the project's preprocess tool, each from its own range of NullTokenizer ids,
so every sample tells which corpus it came from without asking the code under test.
"""

import argparse
import importlib.util
import json
import os

import pytest

from megatron_tawpipe import data
from megatron_tawpipe.arguments import parse_args
from distributed_harness import run_ranks
from training_helpers import data_args_error, tiny_args, train_rank

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Corpus name -> its token ids (documents of 4..11 ids drawn in order from the range).
RANGES = {"a": range(1, 200), "b": range(200, 400), "c": range(400, 600)}


def _write_corpus(directory, name):
    ids = list(RANGES[name])
    docs, k = [], 0
    for n in range(40):
        length = 4 + n % 8
        docs.append([ids[(k + i) % len(ids)] for i in range(length)])
        k += length
    path = directory / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n" for d in docs))
    spec = importlib.util.spec_from_file_location("tool_preprocess", os.path.join(REPO_ROOT, "tools", "preprocess_data.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["--input", str(path), "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--append-eod",
               "--output-prefix", str(directory / name), "--log-interval", "0"])
    return str(directory / f"{name}_text_document")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpora")
    return {name: _write_corpus(directory, name) for name in RANGES}


def _source(tokens):
    """The corpus a sample's ids come from (the eod id >= 600 belongs to none); None if it mixes corpora."""
    names = {name for t in tokens for name, r in RANGES.items() if t in r}
    return names.pop() if len(names) == 1 else None


def _args(**kw):
    args = argparse.Namespace(tokenizer_type="NullTokenizer", tokenizer_model=None, vocab_size=1000, data_path=None,
                              mock_data=False, split=None, seq_length=16, seed=1234, global_batch_size=4,
                              train_iters=10, eval_iters=2, eval_interval=5, data_cache_path=None,
                              create_attention_mask_in_dataloader=False)
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _samples(dataset):
    return [dataset[i]["tokens"].tolist() for i in range(len(dataset))]


def test_each_split_is_built_from_its_own_path_with_its_weights(corpora):
    args = _args(train_data_path=["0.75", corpora["a"], "0.25", corpora["b"]], valid_data_path=[corpora["c"]],
                 num_dataset_builder_threads=2)
    data.validate_data_args(args)
    config = data.dataset_builder.build_dataset_config(args, data.build_tokenizer(args))
    assert config.split is None and config.blend is None and config.num_dataset_builder_threads == 2
    train, valid, test = data.build_datasets(args, data.build_tokenizer(args))
    assert test is None
    train_sources = [_source(s) for s in _samples(train)]
    assert len(train_sources) == 40   # train_iters x global batch
    assert set(train_sources) == {"a", "b"}
    # megatron-core's blending gives each dataset its weight's share of samples, to within one sample
    assert abs(train_sources.count("a") - 0.75 * len(train_sources)) <= 1
    valid_sources = {_source(s) for s in _samples(valid)}
    # a single dataset is built in whole epochs: at least the samples evaluation takes
    assert valid_sources == {"c"} and len(valid) >= (10 // 5 + 1) * 2 * 4


def test_data_args_files_give_the_same_datasets(corpora, tmp_path):
    tok = data.build_tokenizer(_args(data_path=[corpora["a"]]))
    inline = _args(train_data_path=["0.6", corpora["a"], "0.4", corpora["b"]], valid_data_path=[corpora["c"]],
                   test_data_path=[corpora["b"]])
    per_split = tmp_path / "per_split.json"
    per_split.write_text(json.dumps({"train": f"0.6 {corpora['a']} 0.4 {corpora['b']}", "valid": [corpora["c"]],
                                     "test": [corpora["b"]]}))
    from_file = _args(per_split_data_args_path=str(per_split))
    data.validate_data_args(from_file)
    assert [_samples(d) for d in data.build_datasets(inline, tok)] == [_samples(d) for d in
                                                                       data.build_datasets(from_file, tok)]

    blend = tmp_path / "blend.txt"
    blend.write_text(f"0.5 {corpora['a']}\n0.5 {corpora['c']}\n")
    listed = _args(data_args_path=str(blend), split="90,10,0")
    data.validate_data_args(listed)
    direct = _args(data_path=["0.5", corpora["a"], "0.5", corpora["c"]], split="90,10,0")
    assert _samples(data.build_datasets(listed, tok)[0]) == _samples(data.build_datasets(direct, tok)[0])


def test_flags_parse_as_megatron_lm_reads_them(corpora):
    argv = [a for a in tiny_args() if a != "--mock-data"] + [
        "--train-data-path", "3", corpora["a"], "1", corpora["b"], "--valid-data-path", corpora["c"],
        "--num-dataset-builder-threads", "3"]
    args = parse_args(argv)
    assert args.train_data_path == ["3", corpora["a"], "1", corpora["b"]] and args.test_data_path is None
    assert args.split is None and args.num_dataset_builder_threads == 3
    args.vocab_size = 1000
    data.validate_data_args(args)
    assert data.validation.data_blends(args) == (None, [([corpora["a"], corpora["b"]], [3.0, 1.0]),
                                                        ([corpora["c"]], None), None])
    with pytest.raises(SystemExit):
        parse_args(argv + ["--num-dataset-builder-threads", "0"])


def test_bad_combinations_are_refused_before_anything_is_built(corpora, tmp_path, capsys):
    a, b = corpora["a"], corpora["b"]
    cases = [
        (dict(data_path=[a], train_data_path=[a]), "single data source"),
        (dict(mock_data=True, valid_data_path=[a], train_data_path=[a]), "single data source"),
        (dict(train_data_path=[a], split="90,10,0"), "leave out --split"),
        (dict(data_path=[a], data_args_path=str(tmp_path / "x")), "--data-path and --data-args-path"),
        (dict(train_data_path=[a], per_split_data_args_path=str(tmp_path / "x")), "use the flags or the file"),
        (dict(valid_data_path=[a]), "--train-data-path"),
        (dict(train_data_path=[str(tmp_path / "gone")]), "--train-data-path: "),
        (dict(train_data_path=[a], valid_data_path=[a + ".bin"]), "--valid-data-path takes the prefix"),
        (dict(train_data_path=["0.5", a, b, "x"]), "--train-data-path"),
        (dict(train_data_path=[]), "--train-data-path is given without a dataset prefix"),
        (dict(data_args_path=str(tmp_path / "none.txt")), "--data-args-path: file not found"),
    ]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text(json.dumps({"train": [a], "valid": [b]}))
    cases.append((dict(per_split_data_args_path=str(bad_json)), "keys train, valid and test"))
    for overrides, expected in cases:
        message = data_args_error(_args(**overrides))
        assert expected in message, (overrides, message)

    # The command line refuses them with status 2 before any process group exists.
    from megatron_tawpipe.cli.pretrain import run_training

    argv = tiny_args("--train-data-path", a)   # tiny_args has --mock-data
    assert run_training(argv) == 2
    assert "single data source" in capsys.readouterr().err


def _recording_rank(rank, argv):
    """Train; return the records and the token ids every training and evaluation forward step saw."""
    from megatron_tawpipe.training.forward_step import gpt_forward_step

    seen = {"train": set(), "eval": set()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        seen["train" if model.training else "eval"].update(batch["tokens"].flatten().tolist())
        return gpt_forward_step(iter([batch]), model)

    records = train_rank(rank, argv, forward_step)
    return records, {k: sorted(v) for k, v in seen.items()}


def test_training_reads_train_and_validation_from_their_paths(corpora):
    argv = [a for a in tiny_args(train_iters=2) if a != "--mock-data"]
    i = argv.index("--vocab-size")
    argv[i + 1] = "1000"
    argv += ["--train-data-path", corpora["a"], "--valid-data-path", corpora["b"], "--eval-iters", "1",
             "--eval-interval", "1"]
    ((records, seen),) = run_ranks(_recording_rank, 1, argv)
    assert len(records) == 2 and all("validation_lm_loss" in r for r in records)
    assert {_source([t]) for t in seen["train"]} - {None} == {"a"}
    assert {_source([t]) for t in seen["eval"]} - {None} == {"b"}
