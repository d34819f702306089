"""Megatron-LM's checkpoint companions: --save-retain-interval, --async-save (background torch_dist writes,
visible only once finalized), the legacy --ckpt-format torch layout, and the flags answered in one line."""

import argparse
import io
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from distributed_harness import free_port, run_ranks
from training_helpers import assert_close_rel, loaded_trainer, losses, tiny_args, train_rank, pinned_layout

ITERS = 6


@pytest.fixture(scope="module")
def uninterrupted():
    (records,) = run_ranks(train_rank, 1, tiny_args(train_iters=ITERS))
    return records


def _validate(*extra):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    return validate_args(parse_args(tiny_args(*extra)), world_size=1)


def _refusal(*extra) -> str:
    from megatron_tawpipe.common.errors import ArgumentError

    with pytest.raises(ArgumentError) as info:
        _validate(*extra)
    return str(info.value)


def test_flag_refusals_and_answers(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    assert "multiple of --save-interval 2" in _refusal("--save", save, "--save-interval", "2",
                                                       "--save-retain-interval", "3")
    assert "torch_dist only" in _refusal("--save", save, "--async-save", "--ckpt-format", "tawpipe")
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.common.errors import ArgumentError
    from megatron_tawpipe.training.validate_args import validate_args

    with pytest.raises(ArgumentError, match="from --tensor-model-parallel-size 1 only, not 2"):
        validate_args(parse_args(tiny_args("--save", save, "--ckpt-format", "torch", "--pipeline-schedule", "tawpipe",
                                           "--tensor-model-parallel-size", "2")), world_size=2)
    assert "I/O scheduling class" in _refusal("--async-ckpt-io-priority", "5")
    if not torch.cuda.is_available():     # the persistent worker needs a GPU: a forked writer per save instead
        args = _validate("--save", save, "--async-save", "--use-persistent-ckpt-worker")
        assert args.use_persistent_ckpt_worker is False
        assert "forks a writer per save instead" in capsys.readouterr().out
    args = _validate("--save", save, "--async-save", "--dist-ckpt-optim-fully-reshardable", "--use-dist-ckpt")
    assert args.async_strategy == "mcore"  # Megatron-LM's default nvrx is answered: megatron-core's writer
    out = capsys.readouterr()
    text = out.out + out.err
    assert "--async-strategy nvrx" in text and "fully_reshardable" in text and "--use-dist-ckpt is deprecated" in text


def test_retention_rule():
    from megatron_tawpipe.checkpoint import retention

    assert retention.expendable(previous=5, iteration=6, interval=3)
    assert not retention.expendable(previous=6, iteration=7, interval=3)   # a multiple: retained
    assert not retention.expendable(previous=7, iteration=7, interval=3)   # the one just written
    assert not retention.expendable(previous=None, iteration=1, interval=3)
    assert not retention.expendable(previous=5, iteration=6, interval=None)
    with pytest.raises(ValueError):
        retention.delete_checkpoint("/nonexistent", 4, latest=4)


@pytest.mark.parametrize("fmt", ["torch_dist", "tawpipe"])
def test_save_retain_interval_keeps_multiples_and_the_latest(tmp_path, fmt):
    save = str(tmp_path / "ckpt")
    run_ranks(train_rank, 1, tiny_args("--save", save, "--save-interval", "1", "--save-retain-interval", "3",
                                       "--ckpt-format", fmt, "--exit-interval", "7", train_iters=8))
    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000006", "iter_0000007",
                                        "latest_checkpointed_iteration.txt"]
    # The survivors are complete: resuming from the latest works.
    (resumed,) = run_ranks(train_rank, 1, tiny_args("--load", save, train_iters=8))
    assert [r["iteration"] for r in resumed] == [8]


def test_async_save_resumes_like_a_synchronous_save(tmp_path, uninterrupted):
    """tawpipe on 2 ranks saves in the background at iterations 2 and 4; the checkpoints equal the synchronous
    run's, and resuming from the last one continues the uninterrupted losses exactly."""
    from megatron_tawpipe.checkpoint import read_parameters

    async_dir, sync_dir = str(tmp_path / "async"), str(tmp_path / "sync")
    # one layout for both runs (compared bit for bit): with it decided, each run decides on what it measures
    common = ("--pipeline-schedule", "tawpipe", "--save-interval", "2", "--exit-interval", "4", *pinned_layout(1))
    first = run_ranks(train_rank, 2, tiny_args(*common, "--save", async_dir, "--async-save", train_iters=ITERS))[-1]
    run_ranks(train_rank, 2, tiny_args(*common, "--save", sync_dir, train_iters=ITERS))
    assert open(os.path.join(async_dir, "latest_checkpointed_iteration.txt")).read().strip() == "4"
    for iteration in (2, 4):
        ours, theirs = (read_parameters(os.path.join(root, f"iter_{iteration:07d}")) for root in (async_dir, sync_dir))
        assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    (rest,) = run_ranks(train_rank, 1, tiny_args("--load", async_dir, train_iters=ITERS))
    assert_close_rel(losses(first + rest), losses(uninterrupted), 1e-5)


def _slow_writer_job(save: str, marks: str) -> None:
    """A one-rank job (its own process group) whose background write of iteration 4 never ends; it notes each
    finished iteration in ``marks``."""
    os.setsid()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_tawpipe.monitor.metrics import MetricsWriter

    # The background writer's per-bucket write: ..._multiproc up to megatron-core 0.18, ..._multithread in 0.19.
    writer_name = next(name for name in ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")
                       if hasattr(FileSystemWriterAsync, name))
    original_write = getattr(FileSystemWriterAsync, writer_name)
    original_record = MetricsWriter.record

    def stalled_write(*args, **kwargs):
        if "iter_0000004" in repr(args):
            with open(os.path.join(marks, "writing_4"), "w"):
                pass
            time.sleep(600)
        return original_write(*args, **kwargs)

    def noted_record(self, iteration, *args, **kwargs):
        with open(os.path.join(marks, f"iteration_{iteration}"), "w"):
            pass
        return original_record(self, iteration, *args, **kwargs)

    setattr(FileSystemWriterAsync, writer_name, staticmethod(stalled_write))
    MetricsWriter.record = noted_record
    try:
        train_rank(0, tiny_args("--save", save, "--save-interval", "2", "--async-save", train_iters=ITERS))
    finally:
        os._exit(0)


def test_kill_during_a_background_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    save, marks = str(tmp_path / "ckpt"), str(tmp_path / "marks")
    os.makedirs(marks)
    job = mp.get_context("fork").Process(target=_slow_writer_job, args=(save, marks))
    job.start()
    try:
        deadline = time.time() + 240
        # Training goes on while iteration 4's files are being written in the background.
        while not (os.path.exists(os.path.join(marks, "writing_4")) and os.path.exists(os.path.join(marks, "iteration_6"))):
            assert job.is_alive() and time.time() < deadline, "the job ended or stalled before the background save"
            time.sleep(0.2)
        assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job and its background writer
        job.join()
    assert not os.path.exists(os.path.join(save, "iter_0000004"))
    (resumed,) = run_ranks(train_rank, 1, tiny_args("--load", save, train_iters=ITERS))
    assert [r["iteration"] for r in resumed] == [3, 4, 5, 6]
    assert losses(resumed) == losses(uninterrupted[2:])


# ---- Megatron-LM's legacy format --------------------------------------------------------------

_ROWS = ("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")
_COLUMNS = ("linear_proj.weight", "linear_fc2.weight")


def _tp_slice(name, whole, t, tp):
    """Megatron-LM's tensor-parallel slice ``t`` of ``tp`` of a whole tensor, by index arithmetic: rows
    [t*n/tp, (t+1)*n/tp) of a column-parallel weight (SwiGLU's fc1: those of its gate half, then of its up half),
    those columns of a row-parallel one, the rest whole. The reference the loader is checked against: written
    apart from the checkpoint code's own splitting (legacy_torch.split_for_rank), which it must not share."""
    if name.endswith("linear_fc1.weight"):
        half = whole.shape[0] // 2
        rows = half // tp
        return torch.cat([whole[t * rows:(t + 1) * rows], whole[half + t * rows:half + (t + 1) * rows]]).clone()
    if name.endswith(_ROWS):
        rows = whole.shape[0] // tp
        return whole[t * rows:(t + 1) * rows].clone()
    if name.endswith(_COLUMNS):
        columns = whole.shape[1] // tp
        return whole[:, t * columns:(t + 1) * columns].clone()
    return whole.clone()


def write_megatron_legacy(root, weights, args, tp, pp, tracker="release", iteration=0, optimizer=False):
    """Write ``weights`` (whole tensors under global names) exactly as Megatron-LM's ``--ckpt-format torch``
    lays them out: ``<dir>/mp_rank_TT[_PPP]/model_optim_rng.pt`` with ``args``, ``checkpoint_version``,
    ``iteration``, ``model`` (each stage's own layers numbered from 0, its tensor-parallel slices),
    ``rng_state``, and the tracker file naming ``release`` or the iteration."""
    import re

    layers = args.num_layers // pp
    args = argparse.Namespace(**vars(args))
    args.padded_vocab_size = weights["embedding.word_embeddings.weight"].shape[0]  # what Megatron-LM's args hold
    directory = os.path.join(root, "release" if tracker == "release" else f"iter_{iteration:07d}")
    for p in range(pp):
        for t in range(tp):
            model = {}
            for name, whole in weights.items():
                match = re.match(r"decoder\.layers\.(\d+)\.(.+)", name)
                if match:
                    layer = int(match.group(1))
                    if layer // layers != p:
                        continue
                    local = f"decoder.layers.{layer - p * layers}.{match.group(2)}"
                    model[local] = _tp_slice(name, whole, t, tp)
                    model[f"decoder.layers.{layer - p * layers}.self_attention.core_attention._extra_state"] = io.BytesIO()
                elif name.startswith("embedding.") and p == 0 or not name.startswith("embedding.") and p == pp - 1:
                    model[name] = _tp_slice(name, whole, t, tp)
            saved = argparse.Namespace(**vars(args))
            saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size = tp, pp
            state = {"args": saved, "checkpoint_version": 3.0, "iteration": iteration, "model": model,
                     "rng_state": [{"random_rng_state": None}], "num_floating_point_operations_so_far": 0}
            if optimizer:
                state["optimizer"] = {"state": {}, "param_groups": []}
            name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            os.makedirs(os.path.join(directory, name))
            torch.save(state, os.path.join(directory, name, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(tracker if tracker == "release" else str(iteration))


def _loaded_masters(rank, argv, expected=None):
    """Build the schedule's trainer, load --load into it; ``(iteration, consumed samples)`` and the names of the
    parameters this rank holds, each equal to ``expected``'s (under either layer-norm spelling)."""
    with loaded_trainer(argv) as (trainer, position):
        names = []
        for name, _param, master in trainer.named_master_parameters():
            if expected is not None:
                source = next(expected[s] for s in _spelled(name) if s in expected)
                assert torch.equal(master.detach(), source), name
            names.append(name)
        return position, names


@pytest.fixture(scope="module")
def source_weights(tmp_path_factory):
    """Random weights (not an initialisation) with the tiny model's names and shapes, as a torch_dist checkpoint
    names them (the layer norms under Transformer Engine's names, as Megatron-LM with TE writes them)."""
    from megatron_tawpipe.checkpoint import read_parameters

    save = str(tmp_path_factory.mktemp("shapes"))
    run_ranks(train_rank, 1, tiny_args("--save", save, "--exit-interval", "1", train_iters=2))
    generator = torch.Generator().manual_seed(3)
    return {name: torch.randn(value.shape, generator=generator)
            for name, value in read_parameters(os.path.join(save, "iter_0000001")).items()}


def _spelled(name):
    from megatron_tawpipe.checkpoint.legacy_torch import spellings

    return spellings(name)


@pytest.mark.parametrize("ranks,extra", [(1, []), (2, ["--pipeline-model-parallel-size", "2"]),
                                         (2, ["--pipeline-schedule", "tawpipe"]), (2, ["--pipeline-schedule", "weipipe"])])
def test_a_megatron_lm_legacy_checkpoint_loads_under_every_schedule(tmp_path, source_weights, ranks, extra):
    """A release checkpoint of 2 tensor- x 2 pipeline-parallel ranks (what Megatron-LM's converter writes)
    gives every schedule the same weights."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    root = str(tmp_path / "legacy")
    args = validate_args(parse_args(tiny_args()), world_size=1)
    write_megatron_legacy(root, source_weights, args, tp=2, pp=2)
    results = run_ranks(_loaded_masters, ranks, tiny_args("--load", root, *extra), source_weights)
    seen = set()
    for position, names in results:
        assert position == (0, 0)  # a release: weights, iteration 0 (as Megatron-LM)
        seen.update(names)
    assert len(seen) == 8 * 6 + 3


def test_legacy_checkpoint_with_optimizer_needs_no_load_optim(tmp_path, source_weights):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    root = str(tmp_path / "legacy")
    args = validate_args(parse_args(tiny_args()), world_size=1)
    args.consumed_train_samples = 40
    write_megatron_legacy(root, source_weights, args, tp=2, pp=1, tracker="iteration", iteration=5, optimizer=True)
    # megatron-core's per-rank optimizer state loads into megatron-core's own optimizer at the layout that saved it;
    # under a weight-passing schedule from tensor/pipeline size 1 only
    with pytest.raises(AssertionError, match="size 1 with the non-distributed optimizer only, which differs: "
                                             "tensor_model_parallel_size=2; pass --no-load-optim"):
        run_ranks(_loaded_masters, 2, tiny_args("--load", root, "--pipeline-schedule", "tawpipe"))
    ((position, _masters),) = run_ranks(_loaded_masters, 1, tiny_args("--load", root, "--no-load-optim"))
    assert position == (5, 40)


def test_legacy_save_and_load_round_trip(tmp_path):
    """tawpipe on 2 ranks writes Megatron-LM's legacy layout (weights gathered on rank 0): the same weights as
    its torch_dist checkpoint; native megatron loads them and trains on."""
    from megatron_tawpipe.checkpoint import read_parameters

    legacy, dist_ckpt = str(tmp_path / "legacy"), str(tmp_path / "dist")
    common = ("--pipeline-schedule", "tawpipe", "--no-save-optim", *pinned_layout(1))   # two runs, bit for bit
    run_ranks(train_rank, 2, tiny_args(*common, "--save", legacy, "--ckpt-format", "torch", train_iters=2))
    run_ranks(train_rank, 2, tiny_args(*common, "--save", dist_ckpt, train_iters=2))
    path = os.path.join(legacy, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    saved = torch.load(path, weights_only=False)
    assert {"args", "checkpoint_version", "iteration", "model", "rng_state"} <= set(saved)
    assert "optimizer" not in saved and saved["checkpoint_version"] == 3.0 and saved["iteration"] == 2
    assert saved["args"].consumed_train_samples == 16 and saved["args"].pipeline_model_parallel_size == 1
    assert "decoder.layers.7.mlp.linear_fc2.weight" in saved["model"]
    ours, theirs = read_parameters(os.path.dirname(os.path.dirname(path))), read_parameters(
        os.path.join(dist_ckpt, "iter_0000002"))
    assert len(ours) == len(theirs) == 8 * 6 + 3
    for name, value in ours.items():
        source = next(theirs[s] for s in _spelled(name) if s in theirs)
        assert torch.equal(value, source), name
    (resumed,) = run_ranks(train_rank, 1, tiny_args("--load", legacy, "--no-load-optim", train_iters=3))
    assert [r["iteration"] for r in resumed] == [3]


@pytest.mark.parametrize("extra", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
                                   ["--use-distributed-optimizer"]])
def test_legacy_format_with_the_optimizer_resumes_exactly(tmp_path, extra):
    """megatron-core's own schedules write Megatron-LM's legacy files with the optimizer state (one file per tensor-
    and pipeline-parallel rank: megatron-core's optimizer.state_dict(), the LR schedule, the RNG states; the
    distributed optimizer's distrib_optim.pt): resuming at the same layout continues the uninterrupted run exactly;
    another layout or schedule is refused, naming what differs."""
    from megatron_tawpipe.checkpoint import read_parameters

    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    argv = tiny_args(*extra, "--ckpt-format", "torch", "--save-interval", "2", train_iters=4)
    uninterrupted = run_ranks(train_rank, 2, argv + ["--save", whole])[-1]
    first = run_ranks(train_rank, 2, argv + ["--save", part, "--exit-interval", "2"])[-1]
    second = run_ranks(train_rank, 2, argv + ["--save", part, "--load", part])[-1]
    assert losses(first + second) == losses(uninterrupted)
    directory = os.path.join(part, "iter_0000002")
    ranks = sorted(os.listdir(directory))
    assert ranks == {"--tensor-model-parallel-size": ["mp_rank_00", "mp_rank_01"],
                     "--pipeline-model-parallel-size": ["mp_rank_00_000", "mp_rank_00_001"],
                     "--use-distributed-optimizer": ["mp_rank_00"]}[extra[0]]
    saved = torch.load(os.path.join(directory, ranks[0], "model_optim_rng.pt"), weights_only=False)
    assert {"args", "iteration", "model", "optimizer", "opt_param_scheduler", "rng_state"} <= set(saved)
    if extra[0] == "--use-distributed-optimizer":
        assert os.path.isfile(os.path.join(directory, ranks[0], "distrib_optim.pt"))
    else:
        assert saved["optimizer"]["state"] and "param_groups" in saved["optimizer"]
    ours, theirs = (read_parameters(os.path.join(root, "iter_0000004")) for root in (part, whole))
    assert set(ours) == set(theirs) and all(ours[name].equal(theirs[name]) for name in theirs)
    with pytest.raises(AssertionError, match="differs: .*(this run: 1)"):
        run_ranks(train_rank, 1, tiny_args("--load", part, train_iters=4))


def test_legacy_format_with_the_optimizer_under_tawpipe(tmp_path):
    """tawpipe writes Megatron-LM's legacy file with the optimizer state as native 1f1b at tensor/pipeline size 1
    writes it (megatron-core's optimizer.state_dict() of the whole model): tawpipe resumes from it exactly, native
    1f1b resumes from it exactly as from the same run's torch_dist checkpoint, and tawpipe resumes from native
    1f1b's file exactly as from native's torch_dist checkpoint."""
    tawpipe = ["--pipeline-schedule", "tawpipe", *pinned_layout(1)]   # separately launched runs, bit for bit
    legacy, dist_ckpt, native_legacy, native_dist = (str(tmp_path / name) for name in ("l", "d", "nl", "nd"))
    first = tiny_args("--save-interval", "2", "--exit-interval", "2", train_iters=3)
    uninterrupted = run_ranks(train_rank, 2, tiny_args(*tawpipe))[-1]
    before = run_ranks(train_rank, 2, first + tawpipe + ["--ckpt-format", "torch", "--save", legacy])[-1]
    after = run_ranks(train_rank, 2, tiny_args(*tawpipe, "--load", legacy))[-1]
    assert losses(before + after) == losses(uninterrupted)
    run_ranks(train_rank, 2, first + tawpipe + ["--save", dist_ckpt])
    run_ranks(train_rank, 2, first + ["--ckpt-format", "torch", "--save", native_legacy])
    ours = torch.load(os.path.join(legacy, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    theirs = torch.load(os.path.join(native_legacy, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"),
                        weights_only=False)
    assert sorted(os.listdir(os.path.join(legacy, "iter_0000002"))) == ["mp_rank_00"]
    assert set(ours) >= {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                         "rng_state"} and ours["iteration"] == 2 and ours["args"].tensor_model_parallel_size == 1
    assert set(ours["model"]) == set(theirs["model"])
    assert ours["opt_param_scheduler"] == theirs["opt_param_scheduler"]
    mine, native = ours["optimizer"], theirs["optimizer"]
    assert [group["params"] for group in mine["param_groups"]] == [group["params"] for group in native["param_groups"]]
    assert [group["lr"] for group in mine["param_groups"]] == [group["lr"] for group in native["param_groups"]]
    assert set(mine["state"]) == set(native["state"]) and all(
        mine["state"][i][key].shape == native["state"][i][key].shape for i in native["state"] for key in
        ("exp_avg", "exp_avg_sq"))
    native_from = {root: run_ranks(train_rank, 2, tiny_args("--load", root))[-1] for root in (legacy, dist_ckpt)}
    assert [r["iteration"] for r in native_from[legacy]] == [3]
    assert losses(native_from[legacy]) == losses(native_from[dist_ckpt])
    run_ranks(train_rank, 2, first + ["--save", native_dist])
    tawpipe_from = {root: run_ranks(train_rank, 2, tiny_args(*tawpipe, "--load", root))[-1]
                    for root in (native_legacy, native_dist)}
    assert losses(tawpipe_from[native_legacy]) == losses(tawpipe_from[native_dist])
