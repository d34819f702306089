"""Megatron-LM's logging switches: --log-progress (SAVE/progress.txt), the TensorBoard switches
(--no-log-loss-scale-to-tensorboard, --no-log-learnig-rate-to-tensorboard, --log-memory-to-tensorboard,
--log-world-size-to-tensorboard) and --logging-level."""

import datetime
import logging
import re

import pytest

from megatron_tawpipe.arguments import parse_args
from megatron_tawpipe.monitor import progress_log
from distributed_harness import run_ranks
from training_helpers import losses, tiny_args, train_rank

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\tJob ID: (\S*)\t# GPUs: (\d+)\t(.*)$")


def _scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return events


def test_defaults_are_megatron_lms():
    args = parse_args(tiny_args())
    assert args.log_progress is False and args.logging_level is None
    assert args.log_loss_scale_to_tensorboard is True and args.log_learning_rate_to_tensorboard is True
    assert args.log_memory_to_tensorboard is False and args.log_world_size_to_tensorboard is False
    args = parse_args(tiny_args("--disable-log-loss-scale-to-tensorboard", "--no-log-learnig-rate-to-tensorboard",
                                "--logging-level", "30"))
    assert args.log_loss_scale_to_tensorboard is False and args.log_learning_rate_to_tensorboard is False
    assert args.logging_level == 30


def test_tensorboard_switches(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    run_ranks(train_rank, 2, tiny_args("--tensorboard-dir", str(on), "--log-memory-to-tensorboard",
                                       "--log-world-size-to-tensorboard", "--pipeline-model-parallel-size", "2",
                                       train_iters=2))
    events = _scalars(on)
    tags = set(events.Tags()["scalars"])
    assert {"learning-rate", "loss-scale", "loss-scale vs samples", "world-size", "world-size vs samples"} <= tags
    assert [e.value for e in events.Scalars("loss-scale")] == [1.0, 1.0]   # no --fp16: Megatron-LM's 1.0
    assert [e.value for e in events.Scalars("world-size")] == [2.0, 2.0]
    assert [e.step for e in events.Scalars("world-size vs samples")] == [8, 16]
    assert all(e.value > 1e6 for e in events.Scalars("mem-max-allocated-bytes"))  # a CPU's peak resident set
    assert "mem-allocated-bytes" in tags

    (records,) = run_ranks(train_rank, 1, tiny_args("--tensorboard-dir", str(off),
                                                    "--no-log-loss-scale-to-tensorboard",
                                                    "--no-log-learnig-rate-to-tensorboard", train_iters=2))
    events = _scalars(off)
    tags = set(events.Tags()["scalars"])
    assert not {"learning-rate", "loss-scale", "world-size", "mem-allocated-bytes"} & {t.split(" vs")[0] for t in tags}
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx(losses(records))


def test_progress_file_is_written_as_megatron_lm_writes_it(tmp_path, monkeypatch):
    save = tmp_path / "ckpt"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run_ranks(train_rank, 2, tiny_args("--save", str(save), "--save-interval", "2", "--log-progress",
                                       "--exit-interval", "3", train_iters=4))
    # a resumed job with another world size: the cumulative count starts again
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    run_ranks(train_rank, 1, tiny_args("--save", str(save), "--load", str(save), "--log-progress", train_iters=4))
    lines = (save / "progress.txt").read_text().splitlines()
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [(m.group(2), m.group(3), m.group(4).split("\t")[0]) for m in parsed] == [
        ("4242", "2", "Starting job"), ("4242", "2", "Saved checkpoint"), ("4242", "2", "Saved checkpoint"),
        ("4243", "1", "Starting job"), ("4243", "1", "Saved checkpoint")]
    args = parse_args(tiny_args())
    from megatron_tawpipe.training.validate_args import validate_args

    validate_args(args, world_size=1)
    from megatron_tawpipe.data import build_tokenizer
    from megatron_tawpipe.monitor.metrics import model_flops_per_sample

    build_tokenizer(args)   # sets the padded vocabulary the output layer's FLOPs count

    from megatron_tawpipe.arguments.run_config import ModelConfig

    per_sample = model_flops_per_sample(ModelConfig.from_args(args))
    saved = [m.group(4).split("\t") for m in parsed if m.group(4).startswith("Saved")]
    fields = [dict(f.split(": ", 1) for f in row[1:]) for row in saved]
    assert [f["Iteration"] for f in fields] == ["2", "3", "4"]
    assert [f["Floating-point operations"] for f in fields] == [f"{per_sample * n:.2e}" for n in (16, 24, 32)]
    assert [f["Tokens (in billions)"] for f in fields] == ["0.00"] * 3
    for f in fields:
        assert re.fullmatch(r"\d+\.\d TFLOP/s/GPU", f["Job throughput"])
        assert re.fullmatch(r"\d+\.\d TFLOP/s/GPU", f["Cumulative throughput"])
    # Megatron-LM's reading of the file: the one-rank job's count starts at its own start, from the
    # operations of the checkpoint saved before it
    started, start_ops = progress_log.cumulative_start(str(save / "progress.txt"), 1)
    assert start_ops == float(fields[1]["Floating-point operations"])
    assert started == datetime.datetime.strptime(parsed[3].group(1), progress_log.TIME_FORMAT)

    # without --log-progress no file
    other = tmp_path / "plain"
    run_ranks(train_rank, 1, tiny_args("--save", str(other), train_iters=2))
    assert not (other / "progress.txt").exists()


def test_logging_level(monkeypatch):
    from megatron_tawpipe.arguments import ArgumentError
    from megatron_tawpipe.monitor.log_level import set_logging_level
    from megatron_tawpipe.training.validate_args import validate_args

    root = logging.getLogger()
    before = root.level
    try:
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "40")
        set_logging_level(parse_args(tiny_args()))
        assert root.level == 40
        set_logging_level(parse_args(tiny_args("--logging-level", "10")))   # the flag wins
        assert root.level == 10
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "loud")
        with pytest.raises(ArgumentError, match="MEGATRON_LOGGING_LEVEL='loud' must be an integer"):
            validate_args(parse_args(tiny_args()), world_size=1)
    finally:
        root.setLevel(before)
