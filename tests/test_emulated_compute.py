"""Emulated compute (sleeps instead of layers, real tensors on the links) and the calibration tool."""

import json
import os
import subprocess
import sys

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.emulation.compute import ComputeTimes, load_compute_times
from training_helpers import tiny_args, train_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMES = {"layer_forward": 0.004, "layer_backward": 0.008, "layer_recompute": 0.004,
         "head_forward": 0.002, "head_backward": 0.004, "comment": "test"}


@pytest.fixture
def times_file(tmp_path):
    path = tmp_path / "times.json"
    path.write_text(json.dumps(TIMES))
    return str(path)


def test_compute_times_file_errors_name_flag_and_file(tmp_path):
    def error(content):
        path = tmp_path / "t.json"
        path.write_text(content)
        with pytest.raises(ValueError) as info:
            load_compute_times(str(path))
        message = str(info.value)
        assert message.startswith(f"--emulated-compute-times {path}: ") and "\n" not in message
        return message

    assert "not JSON" in error("{")
    assert "missing layer_backward" in error('{"layer_forward": 1}')
    assert "unknown keys ['layer_fwd']" in error('{"layer_fwd": 1, "layer_forward": 1, "layer_backward": 2}')
    assert "head_forward must be a number of seconds >= 0" in error(
        '{"layer_forward": 1, "layer_backward": 2, "head_forward": -1}')
    with pytest.raises(ValueError, match="cannot read it"):
        load_compute_times(str(tmp_path / "absent.json"))
    times = ComputeTimes(layer_forward=1, layer_backward=2, layer_recompute=1, head_forward=0.5, head_backward=1)
    assert times.forward_s(2, head=True) == 2.5
    assert times.backward_s(2, head=False, recompute=True) == 6
    assert times.backward_s(2, head=True, recompute=False) == 5


def test_bad_times_file_is_a_flag_error(tmp_path):
    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    path = tmp_path / "t.json"
    path.write_text('{"layer_forward": "fast", "layer_backward": 1}')
    with pytest.raises(ArgumentError, match="--emulated-compute-times .*layer_forward must be a number"):
        validate_args(parse_args(tiny_args("--emulated-compute-times", str(path))), world_size=1)


# 8 layers, global batch 8 on 4 ranks: 2 micro-batches per rank (weight passing, FSDP) or 8 per pipeline (1f1b).
def _compute_per_rank(schedule):
    t = TIMES
    layer = t["layer_forward"] + t["layer_backward"]
    head = t["head_forward"] + t["head_backward"]
    if schedule in ("tawpipe", "weipipe"):  # every rank runs its 2 micro-batches through all 8 layers, recomputing
        return 2 * (8 * (layer + t["layer_recompute"]) + head)
    if schedule in ("fsdp", "hsdp", "distopt-node", "hfsdp"):
        return 2 * (8 * layer + head)
    return 8 * 2 * layer  # 1f1b, middle stage: 8 micro-batches through its 2 layers


@pytest.mark.parametrize("schedule", ["tawpipe", "weipipe", "1f1b", "fsdp", "hsdp", "distopt-node", "hfsdp"])
def test_every_schedule_runs_emulated(schedule, times_file):
    # the weight-passing runs pinned to recompute (which the bounds below count; by default the run decides)
    extra = {"tawpipe": ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-recompute", "on"],
             "weipipe": ["--pipeline-schedule", "weipipe", "--tawpipe-num-groups", "2", "--tawpipe-recompute", "on"],
             "1f1b": ["--pipeline-schedule", "1f1b", "--pipeline-model-parallel-size", "4"],
             "fsdp": ["--use-torch-fsdp2"],
             "hsdp": ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "2"],
             "distopt-node": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                              "--num-distributed-optimizer-instances", "2"],
             "hfsdp": ["--use-megatron-fsdp", "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather", "--outer-dp-sharding-strategy", "optim",
                       "--num-distributed-optimizer-instances", "2"]}[schedule]
    argv = tiny_args(*extra, "--emulated-compute-times", times_file, train_iters=2)
    records = run_ranks(train_rank, 4, argv)
    last = records[-1]
    assert len(last) == 2
    for record in last:
        assert record["compute"] == "emulated"
        assert record["lm_loss"] == 0.0  # no loss is computed
        # Slept compute bounds the iteration from below; the busy fraction is that share.
        assert record["elapsed_ms"] / 1000 >= 0.95 * _compute_per_rank(schedule)
        assert 0.0 < record["compute_busy_fraction"] <= 1.0
    if schedule in ("tawpipe", "weipipe"):
        # Real sizes on the links: the executor sent exactly what the plan moves.
        for record in last:
            assert record["inter_group_bytes"] == record["planned_inter_group_bytes"] > 0
            assert record["intra_group_bytes"] == record["planned_intra_group_bytes"]
            # where the iteration went: the plan, then the optimizer step, within the step's time
            assert record["plan_seconds"] >= 0.95 * _compute_per_rank(schedule)
            assert 0.0 < record["optimizer_seconds"] and \
                record["plan_seconds"] + record["optimizer_seconds"] <= 1.05 * record["elapsed_ms"] / 1000


def _collectives_rank(rank, argv):
    """Train, recording every gradient collective (kind, elements, group) FSDP2 issues."""
    import torch.distributed as dist

    seen = []
    originals = {"all_reduce": dist.all_reduce, "reduce_scatter_tensor": dist.reduce_scatter_tensor}

    def recording(kind):
        def call(tensor, *args, group=None, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else "world"
            seen.append((kind, tensor.numel(), ranks))
            return originals[kind](tensor, *args, group=group, **kwargs)
        return call

    try:
        for kind in originals:
            setattr(dist, kind, recording(kind))
        train_rank(rank, argv)
    finally:
        for kind, fn in originals.items():
            setattr(dist, kind, fn)
    # Not the loss and norm scalars, nor the one-rank tensor-parallel group of the real loss.
    return [entry for entry in seen if entry[1] > 2 and (entry[2] == "world" or len(entry[2]) > 1)]


def test_emulated_hsdp_moves_what_real_compute_moves(times_file):
    """Emulated layers hand their gradients to the parameters FSDP2 gathered: the same
    reduce-scatters inside a replica and all-reduces across replicas as a real run."""
    hsdp = ["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "2"]
    real = run_ranks(_collectives_rank, 4, tiny_args(*hsdp, train_iters=2))
    emulated = run_ranks(_collectives_rank, 4, tiny_args(*hsdp, "--emulated-compute-times", times_file, train_iters=2))
    for rank in range(4):
        assert sorted(emulated[rank]) == sorted(real[rank])
    across = [entry for entry in real[0] if entry[0] == "all_reduce" and entry[2] == (0, 2)]
    assert len(across) == 2 * 9  # 2 iterations x (8 layers + the root), once per iteration each


def test_calibration_from_cost_model_and_measured(tmp_path):
    from megatron_tawpipe.arguments import LLAMA_FLAGS
    from megatron_tawpipe.bench.calibrate import main
    from megatron_tawpipe.sim.costmodel import CostModel

    shape = list(LLAMA_FLAGS) + [
        "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "1", "--vocab-size", "256", "--num-layers", "2"]
    out = tmp_path / "model.json"
    assert main(["--output", str(out), "--from-cost-model", "--peak-tflops", "0.5", "--efficiency", "0.5"] + shape) == 0
    written = json.loads(out.read_text())
    cost = CostModel.from_flops(hidden_size=64, seq_length=64, micro_batch_size=1, ffn_hidden_size=192,
                                vocab_size=256, num_attention_heads=4, num_query_groups=4, peak_tflops=0.5,
                                efficiency=0.5)
    assert written["layer_forward"] == pytest.approx(cost.layer_forward)
    assert written["head_backward"] == pytest.approx(cost.head_backward)
    assert load_compute_times(str(out)).layer_backward == pytest.approx(2 * cost.layer_forward)

    # Measuring creates a process group and applies the CPU layer: in its own process, as users run it.
    measured = tmp_path / "measured.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "calibrate.py"), "--output", str(measured),
                    "--repeats", "2", "--warmup", "1", "--scale", "2"] + shape, check=True, timeout=300,
                   stdout=subprocess.DEVNULL)
    data = json.loads(measured.read_text())
    assert data["device"].startswith("cpu") and data["dtype"] == "fp32" and data["attention"] == "sdpa"
    assert data["hidden_size"] == 64 and data["seq_length"] == 64 and "scaled by 2" in data["comment"]
    times = load_compute_times(str(measured))
    # Differences of timings: non-negative by construction; a whole model's time is not zero.
    assert min(times.to_json().values()) >= 0
    assert times.layer_forward + times.head_forward > 0 and times.layer_backward + times.head_backward > 0
    # The simulator reads the same file.
    simulated = CostModel.from_flops(hidden_size=64, seq_length=64).with_measured(str(measured))
    assert simulated.layer_backward == pytest.approx(times.layer_backward)


def test_calibration_flag_errors(tmp_path, capsys):
    from megatron_tawpipe.bench.calibrate import main

    with pytest.raises(SystemExit):
        main(["--output", str(tmp_path / "x.json"), "--from-cost-model", "--hidden-size", "64",
              "--num-attention-heads", "4", "--vocab-size", "256", "--num-layers", "2", "--seq-length", "64"])
    assert "--from-cost-model needs --peak-tflops" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--output", str(tmp_path / "x.json"), "--hidden-size", "64", "--num-attention-heads", "4",
              "--num-layers", "2", "--seq-length", "64"])
    assert "--vocab-size is required" in capsys.readouterr().err


def _tensor_parallel_collectives_rank(rank, argv):
    """Train; count the hidden-state-sized collectives on this rank's tensor-parallel group."""
    import torch.distributed as dist

    seen = []
    names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    originals = {name: getattr(dist, name) for name in names}

    def recording(kind):
        def call(*args, group=None, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else "world"
            seen.append((kind, ranks, args[0].numel()))
            return originals[kind](*args, group=group, **kwargs)
        return call

    try:
        for name in names:
            setattr(dist, name, recording(name))
        records = train_rank(rank, argv)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    group = (rank - rank % 2, rank - rank % 2 + 1)
    return records, [(kind, size) for kind, ranks, size in seen if ranks == group]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_emulated_tensor_parallelism_runs_megatrons_collectives(times_file, sequence_parallel):
    """T = 2 on 4 ranks: 1/2 of the times slept, and per micro-batch and layer two hidden-state
    all-reduces (all-gather + reduce-scatter pairs under --sequence-parallel) forward, two backward,
    two in the recompute, one each way for the output layer; plan bytes as planned."""
    extra = ["--sequence-parallel"] if sequence_parallel else []
    argv = tiny_args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tensor-model-parallel-size",
                     "2", *extra, "--emulated-compute-times", times_file, "--tawpipe-recompute", "on", train_iters=2)
    results = run_ranks(_tensor_parallel_collectives_rank, 4, argv)
    hidden = 32 * 1 * 64                       # seq x micro-batch x hidden of tiny_args
    micro_batches, layers = 8 // 2, 8          # per virtual rank; all layers visited once each way
    per_iteration = micro_batches * (2 * layers + 1 + 2 * 2 * layers + 1)
    for records, seen in results:
        if sequence_parallel:
            assert seen.count(("all_gather_into_tensor", hidden)) == 2 * per_iteration
            assert seen.count(("reduce_scatter_tensor", hidden // 2)) == 2 * per_iteration
        else:
            assert seen.count(("all_reduce", hidden)) == 2 * per_iteration
        for record in records:
            assert record["compute"] == "emulated"
            # Half of a rank's layer times per micro-batch: 2 virtual ranks each run all 8 layers.
            slept = micro_batches * (8 * (0.004 + 0.008 + 0.004) + 0.002 + 0.004) / 2
            assert record["elapsed_ms"] / 1000 >= 0.95 * slept
            assert record["inter_group_bytes"] == record["planned_inter_group_bytes"] > 0


def test_emulated_compute_scales_with_micro_batch_size(tmp_path):
    """One times file serves every micro-batch size: times recorded for micro-batches of 2 samples are
    halved for 1 and doubled for 4, in the emulation and in the simulator alike; another sequence length
    is refused, naming the flag, the file and the length to calibrate at."""
    from megatron_tawpipe.emulation.compute import EmulatedCompute
    from megatron_tawpipe.sim.costmodel import CostModel

    path = tmp_path / "times.json"
    path.write_text(json.dumps({**TIMES, "micro_batch_size": 2, "seq_length": 64}))
    for mbs, factor in ((1, 0.5), (2, 1.0), (4, 2.0)):
        times = load_compute_times(str(path), micro_batch_size=mbs, seq_length=64)
        for key in ("layer_forward", "layer_backward", "layer_recompute", "head_forward", "head_backward"):
            assert times.to_json()[key] == pytest.approx(factor * TIMES[key])
        cost = CostModel.from_flops(hidden_size=64, seq_length=64, micro_batch_size=mbs).with_measured(
            str(path), micro_batch_size=mbs, seq_length=64)
        assert cost.layer_backward == pytest.approx(factor * TIMES["layer_backward"])
    args = type("Args", (), {"emulated_compute_times": str(path), "micro_batch_size": 4, "seq_length": 64})()
    clock = EmulatedCompute.from_args(args, recompute=False)
    assert clock.times.forward_s(3, head=True) == pytest.approx(2 * (3 * TIMES["layer_forward"] + TIMES["head_forward"]))
    with pytest.raises(ValueError, match=rf"--emulated-compute-times {path}: the times were measured at "
                                         r"seq_length 64, the run has 128.*calibrate at --seq-length 128"):
        load_compute_times(str(path), micro_batch_size=1, seq_length=128)
    # Without a recorded size the times are the run's own (files written before sizes were recorded).
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(TIMES))
    assert load_compute_times(str(plain), micro_batch_size=4, seq_length=64).layer_forward == TIMES["layer_forward"]


def _count_collectives(rank, argv):
    """Train, counting calls and input bytes of megatron DDP's bucket all-gathers and reduce-scatters
    (the functions megatron-core's param_and_grad_buffer bound when it was imported)."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    counted = {}
    for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
        original = getattr(buffers, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            tensor = args[1] if len(args) > 1 else next(iter(kwargs.values()))
            calls, nbytes = counted.get(_name, (0, 0))
            counted[_name] = (calls + 1, nbytes + tensor.numel() * tensor.element_size())
            return _original(*args, **kwargs)

        setattr(buffers, name, wrapper)
    train_rank(rank, argv)
    return counted


def test_emulated_distributed_optimizer_gathers_its_parameters_as_real_compute_does(times_file):
    """megatron's DDP dispatches each parameter all-gather bucket from a module's forward pre-hook: emulated
    layers run their submodules as modules, so the distributed optimizer gathers exactly what it gathers
    with real compute (it gathered nothing when only the layers ran)."""
    argv = tiny_args("--num-layers", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--overlap-param-gather", "--ddp-bucket-size", "20000", train_iters=2, global_batch=16)
    real = run_ranks(_count_collectives, 4, argv)
    emulated = run_ranks(_count_collectives, 4, argv + ["--emulated-compute-times", times_file])
    assert emulated == real and real[0]["dist_all_gather_func"][0] > 0


@pytest.mark.parametrize("deferred", [False, True])
def test_emulated_split_backward_sleeps_where_the_weight_gradient_kernels_run(deferred):
    """A split backward's input pass sleeps the whole backward and its weight pass nothing, as the runtime
    computes both gradients in the input pass; with --emulated-deferred-weight-gradients the weight pass
    sleeps the weight-gradient half (as the simulator's cost model prices the two cases)."""
    from types import SimpleNamespace

    import torch

    from megatron_tawpipe.arguments.defaults import complete_args
    from megatron_tawpipe.emulation.compute import EmulatedCompute
    from megatron_tawpipe.plan import build_plan
    from megatron_tawpipe.sim.costmodel import CostModel

    plan = build_plan("weipipe-zb1", num_ranks=2, num_layers=4, num_microbatches=1)
    times = ComputeTimes(**{k: v for k, v in TIMES.items() if k != "comment"})
    clock = EmulatedCompute(times, recompute=False, deferred_weight_gradients=deferred)
    args = complete_args(SimpleNamespace(hidden_size=8, seq_length=4, micro_batch_size=1, ffn_hidden_size=16,
                                         num_attention_heads=2))
    model = SimpleNamespace(plan=plan, tensor_parallel_size=1, recompute=False, args=args,
                            compute_dtype=torch.bfloat16,
                            replicated_grads=lambda part: [torch.zeros(3)], microbatches=None)
    compute = clock.shard_compute(model)
    compute.backward_input(0, 1, torch.zeros(4))
    after_input = clock.take_slept_s()
    # deferred kernels: the store (each linear layer's input and output gradient, bf16, two layers) is held
    held = sum(t.numel() for t in compute._store.values())
    assert held == (2 * 4 * ((3 * 8 + 16) + (3 * 8 + 2 * 8 + 2 * 16)) * 2 if deferred else 0)
    compute.backward_weight(0, 1, torch.zeros(4), torch.zeros(4))
    after_weight = clock.take_slept_s()
    assert not compute._store
    whole = 2 * TIMES["layer_backward"] + TIMES["head_backward"]    # shard 1: two layers and the head
    half = TIMES["layer_backward"] if deferred else 0.0       # half of its layers' backward
    assert after_input == pytest.approx(whole - half) and after_weight == pytest.approx(half)
    cost = CostModel(layer_forward=TIMES["layer_forward"], layer_backward=TIMES["layer_backward"],
                     head_backward=TIMES["head_backward"], deferred_weight_gradients=deferred)
    assert cost.backward_input_time(plan, 1) + cost.backward_weight_time(plan, 1) == pytest.approx(whole)
    assert cost.backward_weight_time(plan, 1) == pytest.approx(TIMES["layer_backward"] if deferred else 0.0)
