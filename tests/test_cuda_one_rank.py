"""One rank on one CUDA device (``gpu`` tests: skipped without one; ``python -m pytest -m gpu tests``).

What one GPU can check of the runtime (NCCL refuses two ranks on one GPU): a one-rank TawPipe plan
run through ``pretrain()`` on CUDA with an NCCL world of one against native megatron-core without
pipelining (the single-process reference) in fp32 and bf16, the same run against the CPU, initial
weights built on CUDA against those built on the CPU, and the data loader's pinned batches.

Each case runs in a new interpreter (:func:`run_in_fresh_process`): this test process never initialises
CUDA, and a crash or hang stays in the case's own process. Sizes are small: seconds per case on a GPU.
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import queue as queue_module
import time
import traceback
from typing import Dict, Optional

import pytest
import torch

# Relative tolerances of the one-rank TawPipe run against native megatron-core on the same GPU.
# fp32: the same kernels in another order (recompute, shard-by-shard backward, gradient accumulation);
# at these sizes the gradient norms of the two differ by up to 3.5e-4 on the CPU as well (their losses by 1e-7).
# bf16: tools/gpu_check.py's loss tolerance; the gradient norm looser.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 1e-2}
GRAD_NORM_RTOL = {"fp32": 1e-3, "bf16": 5e-2}
# CUDA against the CPU, fp32 (other attention and matmul kernels, other reduction orders).
CPU_LOSS_RTOL = 1e-3


# ---- running a case in its own interpreter ---------------------------------------------------------


def _fresh_child(fn, args, results) -> None:
    try:
        # Serialised here: tensors put on the queue as they are would travel as shared-memory handles,
        # gone once this process has exited.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((True, buffer.getvalue()))
    except BaseException:  # report everything, SystemExit included
        results.put((False, traceback.format_exc()))


def run_in_fresh_process(fn, *args, env: Optional[Dict[str, str]] = None, timeout: float = 300.0):
    """``fn(*args)`` in a spawned interpreter (module-level ``fn``; a picklable result); ``env`` is
    added to that interpreter's environment only. A failure there raises here with its traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_fresh_child, args=(fn, args, results))
    saved = {key: os.environ.get(key) for key in (env or {})}
    os.environ.update(env or {})
    try:
        proc.start()  # the child copies the environment now
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                ok, payload = results.get(timeout=1.0)
                break
            except queue_module.Empty:
                if not proc.is_alive():  # died before reporting (at start-up, or killed)
                    ok, payload = False, f"the process ended with exit code {proc.exitcode} and no result"
                    break
                if time.monotonic() > deadline:
                    ok, payload = False, f"no result within {timeout:.0f} s"
                    break
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if not ok:
        raise AssertionError(f"{fn.__name__}{args} failed in its own process:\n{payload}")
    return torch.load(io.BytesIO(payload), weights_only=False)


HIDE_CUDA = {"CUDA_VISIBLE_DEVICES": ""}


# ---- the cases (run in the child) ------------------------------------------------------------------


def _small_run(dtype: str, **overrides):
    from tawpipe_lab.one_rank import LlamaRun

    fields = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=1024,
                  micro_batch_size=1, global_batch_size=4, train_iters=4, dtype=dtype, attention_backend="sdpa")
    fields.update(overrides)
    return LlamaRun(**fields)


def _initial_weights(dtype: str) -> dict:
    """The model's initial parameters as built by the runtime on this process's device (on the host)."""
    import torch.distributed as dist

    from tawpipe_lab.one_rank import one_rank_process_group, parsed_args
    from megatron_tawpipe.models.llama import build_llama_model, llama_config

    args = parsed_args(_small_run(dtype, num_layers=2, hidden_size=128))
    with one_rank_process_group(args):
        model = build_llama_model(args, llama_config(args))
        weights = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
        devices = sorted({str(p.device.type) for p in model.parameters()})
        backend = dist.get_backend()
    return {"weights": weights, "devices": devices, "backend": backend}


class _Capture:
    """A ``trainer_factory`` that notes the process group's backend and where the trainer keeps its model."""

    def __init__(self):
        self.seen = {}

    def __call__(self, args, forward_step_func, run=None):
        import torch.distributed as dist

        from megatron_tawpipe.training import build_trainer

        trainer = build_trainer(args, forward_step_func, run)
        device = getattr(trainer, "device", None)
        if device is None:
            device = next(trainer.model[0].parameters()).device
        self.seen = {"backend": dist.get_backend(), "device": torch.device(device).type}
        return trainer


def _train(dtype: str, *schedules: str) -> dict:
    """One-rank runs of ``schedules`` ("tawpipe", "native") through pretrain(): records, backend, device."""
    from tawpipe_lab.one_rank import NATIVE_1F1B_FLAGS, TAWPIPE_FLAGS, train_one_rank

    flags = {"tawpipe": TAWPIPE_FLAGS, "native": NATIVE_1F1B_FLAGS}
    out = {}
    for schedule in schedules:
        capture = _Capture()
        records = train_one_rank(_small_run(dtype).argv(*flags[schedule]), trainer_factory=capture)
        out[schedule] = {"records": records, **capture.seen}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


class _TokenDataset(torch.utils.data.Dataset):
    """Samples shaped like the GPT datasets' (tokens, labels, loss mask, positions), sample i filled with i."""

    def __init__(self, samples: int, seq_length: int):
        self.samples, self.seq_length = samples, seq_length

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        tokens = torch.full((self.seq_length,), i, dtype=torch.int64)
        return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(self.seq_length),
                "position_ids": torch.arange(self.seq_length)}


def _loader_case() -> dict:
    from megatron_tawpipe.data import build_data_iterator
    from megatron_tawpipe.data.iterators import get_batch

    device = torch.device("cuda", torch.cuda.current_device())
    dataset = _TokenDataset(samples=16, seq_length=32)
    out = {}
    for workers in (0, 2):
        iterator = build_data_iterator(dataset, 2, 0, 1, 4, num_workers=workers)  # from sample 4 on
        batch = next(iterator)
        out[f"pinned_workers{workers}"] = {key: t.is_pinned() for key, t in batch.items()}
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(iterator, device)  # samples 6, 7
        torch.cuda.synchronize()
        out[f"batch_workers{workers}"] = {
            "devices": sorted({t.device.type for t in (tokens, labels, loss_mask, position_ids)}),
            "attention_mask": attention_mask,
            "tokens": tokens[:, 0].tolist(), "labels": labels[:, -1].tolist(),
            "loss_mask_sum": float(loss_mask.sum()), "positions": position_ids[0, -1].item()}
    unpinned = build_data_iterator(dataset, 2, 0, 1, 0, pin_memory=False)
    out["pin_memory_false"] = any(t.is_pinned() for t in next(unpinned).values())
    return out


# ---- the tests --------------------------------------------------------------------------------------


def _environment_and_value(name, value):
    if value == "raise":
        raise ValueError("raised in the child")
    return os.environ.get(name), value * 2


def test_run_in_fresh_process_returns_the_result_and_passes_the_environment(monkeypatch):
    """The helper itself (on any machine): the result comes back, ``env`` reaches the child and only it,
    and a failure there raises here with the child's traceback."""
    monkeypatch.delenv("TAWPIPE_TEST_FRESH", raising=False)
    assert run_in_fresh_process(_environment_and_value, "TAWPIPE_TEST_FRESH", 21,
                                env={"TAWPIPE_TEST_FRESH": "yes"}) == ("yes", 42)
    assert "TAWPIPE_TEST_FRESH" not in os.environ
    with pytest.raises(AssertionError, match=r"(?s)_environment_and_value.*ValueError: raised in the child"):
        run_in_fresh_process(_environment_and_value, "X", "raise")


@pytest.mark.gpu
def test_initial_weights_built_on_cuda_equal_those_built_on_the_cpu():
    """Initial weights are a function of (seed, name), whichever device the model is built on: a CUDA
    generator draws other numbers (and they depend on the GPU model), so the draws must come from the host."""
    for dtype in ("fp32", "bf16"):
        on_cuda = run_in_fresh_process(_initial_weights, dtype)
        on_cpu = run_in_fresh_process(_initial_weights, dtype, env=HIDE_CUDA)
        assert on_cuda["devices"] == ["cuda"] and on_cuda["backend"] == "nccl", on_cuda["devices"]
        assert on_cpu["devices"] == ["cpu"] and on_cpu["backend"] == "gloo"
        ours, reference = on_cuda["weights"], on_cpu["weights"]
        assert set(ours) == set(reference) and len(ours) > 10
        different = {name: (ours[name].float() - reference[name].float()).abs().max().item()
                     for name in reference if not torch.equal(ours[name], reference[name])}
        assert not different, f"{dtype}: built on CUDA, these start from other weights than on the CPU " \
                              f"(max abs difference): {different}"
        assert {name: t.dtype for name, t in ours.items()} == {name: t.dtype for name, t in reference.items()}
        wanted = torch.bfloat16 if dtype == "bf16" else torch.float32
        assert ours["embedding.word_embeddings.weight"].dtype == wanted


@pytest.fixture(scope="module")
def cuda_runs():
    cache = {}

    def get(dtype):
        if dtype not in cache:
            cache[dtype] = run_in_fresh_process(_train, dtype, "tawpipe", "native")
        return cache[dtype]

    return get


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.gpu
def test_one_rank_tawpipe_on_cuda_matches_native_megatron(dtype, cuda_runs):
    """The one-rank TawPipe plan on CUDA, NCCL world of one, against megatron-core without pipelining
    on the same GPU: loss and gradient norm of every iteration."""
    runs = cuda_runs(dtype)
    for schedule in ("tawpipe", "native"):
        assert runs[schedule]["backend"] == "nccl" and runs[schedule]["device"] == "cuda", (schedule, runs[schedule])
    ours, reference = runs["tawpipe"]["records"], runs["native"]["records"]
    assert len(ours) == len(reference) == 4
    for mine, theirs in zip(ours, reference):
        assert math.isfinite(mine["lm_loss"]) and math.isfinite(mine["grad_norm"]), mine
        loss_diff = abs(mine["lm_loss"] - theirs["lm_loss"]) / abs(theirs["lm_loss"])
        norm_diff = abs(mine["grad_norm"] - theirs["grad_norm"]) / abs(theirs["grad_norm"])
        assert loss_diff <= LOSS_RTOL[dtype], (dtype, mine["iteration"], mine["lm_loss"], theirs["lm_loss"])
        assert norm_diff <= GRAD_NORM_RTOL[dtype], (dtype, mine["iteration"], mine["grad_norm"], theirs["grad_norm"])
        assert mine["peak_memory_bytes"] > 0  # torch.cuda.max_memory_allocated on a GPU
    assert ours[-1]["lm_loss"] < ours[0]["lm_loss"]  # it trains


@pytest.mark.gpu
def test_one_rank_tawpipe_on_cuda_follows_the_same_run_on_the_cpu(cuda_runs):
    """fp32: the same one-rank TawPipe run on the CPU (CUDA hidden, gloo) gives the same losses."""
    on_cuda = cuda_runs("fp32")["tawpipe"]
    on_cpu = run_in_fresh_process(_train, "fp32", "tawpipe", env=HIDE_CUDA)["tawpipe"]
    assert on_cpu["backend"] == "gloo" and on_cpu["device"] == "cpu"
    for mine, theirs in zip(on_cuda["records"], on_cpu["records"]):
        assert abs(mine["lm_loss"] - theirs["lm_loss"]) <= CPU_LOSS_RTOL * abs(theirs["lm_loss"]), \
            (mine["iteration"], mine["lm_loss"], theirs["lm_loss"])


@pytest.mark.gpu
def test_data_loader_pins_batches_for_cuda_and_get_batch_moves_them():
    """Batches for a GPU come pinned (so get_batch's non_blocking copies overlap with compute), with and
    without loader workers; get_batch puts the right samples on the GPU; pin_memory=False is honoured."""
    out = run_in_fresh_process(_loader_case)
    for workers in (0, 2):
        pinned = out[f"pinned_workers{workers}"]
        assert all(pinned.values()), f"{workers} workers: batches not pinned for CUDA: {pinned}"
        batch = out[f"batch_workers{workers}"]
        assert batch["devices"] == ["cuda"] and batch["attention_mask"] is None
        assert batch["tokens"] == [6, 7] and batch["labels"] == [7, 8]
        assert batch["loss_mask_sum"] == 64.0 and batch["positions"] == 31
    assert out["pin_memory_false"] is False
