"""Schedule-independent, atomic checkpoints.

A checkpoint stores every parameter under its *global* name (decoder layers
numbered over the whole model) with its fp32 master value and optimizer state,
so that a run saved under one schedule (no pipelining, 1F1B with any pipeline
size, interleaved, or a weight-passing schedule) resumes under any other.

Layout of ``SAVE/iter_0000100/``::

    common.pt            iteration, consumed samples, LR scheduler, loss scaler,
                         the parameter index {name: (shape, file)} and arguments
    params_rank00003.pt  {"params": {name: tensor}, "optimizer": {name: {key: tensor}}}
                         written by each rank that owns parameters
    rng_rank00003.pt     that rank's RNG states
    metadata.json        human-readable summary

Writes are atomic: everything goes to ``iter_0000100.tmp/``, each file is
fsynced, the directory is renamed into place, and ``latest_checkpointed_iteration.txt``
is replaced last. A run killed mid-save leaves the previous checkpoint as the
latest one.

Loading opens only what a rank needs: ``common.pt`` (the index), the parameter
files that hold its own parameters, one at a time, and its RNG file; each with
``torch.load(mmap=True, weights_only=True)``, so only the bytes of its own
tensors are read from disk and copied into place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

TRACKER_FILE = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model."""


class CheckpointSetupError(CheckpointError):
    """The flags do not fit the checkpoint (retrying the same command cannot help: exit status 2)."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_torch_save(obj, path: str) -> None:
    tmp = path + ".partial"
    torch.save(obj, tmp)
    _fsync_file(tmp)
    os.replace(tmp, path)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".partial"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _rng_state() -> dict:
    # Only tensors and plain Python values, so that weights_only loading works.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(state["tracker"])


def _tied_alias(name: str, tied: bool) -> Optional[str]:
    """With tied embeddings, a later pipeline stage's output layer is a replica of the embeddings."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _entries(trainer):
    """``(name, fp32 master, optimizer state)`` this rank writes.

    A trainer that shards parameters or optimizer state over ranks gathers them in
    ``gathered_masters()``: every rank calls it (collectives), the writing rank gets the whole
    tensors. Otherwise the writing ranks read their own masters.
    """
    gather = getattr(trainer, "gathered_masters", None)
    gathered = gather() if gather is not None else None
    if gathered is not None:
        return gathered if trainer.writes_checkpoint() else []
    if not trainer.writes_checkpoint():
        return []
    return ((name, master, trainer.optimizer_state_for(master))
            for name, _param, master in trainer.named_master_parameters())


def _collect_local_state(entries, trainer, tied: bool,
                         with_optimizer: bool = True) -> Tuple[Dict[str, torch.Tensor], Dict[str, dict]]:
    params: Dict[str, torch.Tensor] = {}
    optim: Dict[str, dict] = {}
    for name, master, state in entries:
        if _tied_alias(name, tied) is not None or trainer.skip_in_checkpoint(name):
            continue
        params[name] = master.detach().float().cpu().clone()
        if not with_optimizer:
            continue
        optim[name] = {
            key: (value.detach().cpu().clone() if torch.is_tensor(value) else torch.tensor(value))
            for key, value in state.items()
        }
    return params, optim


def save_checkpoint(root: str, iteration: int, consumed_samples: int, trainer, scheduler, args) -> str:
    """Collectively write a checkpoint of ``trainer`` (every rank must call it)."""
    rank, world = _rank(), _world()
    tmp_dir = iteration_dir(root, iteration) + ".tmp"
    final_dir = iteration_dir(root, iteration)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
    _barrier()

    tied = not args.untie_embeddings_and_output_weights
    index_part: Dict[str, Tuple[list, str]] = {}
    entries = _entries(trainer)
    if trainer.writes_checkpoint():
        params, optim = _collect_local_state(entries, trainer, tied, with_optimizer=not args.no_save_optim)
        filename = f"params_rank{rank:05d}.pt"
        _atomic_torch_save({"params": params, "optimizer": optim}, os.path.join(tmp_dir, filename))
        index_part = {name: (list(t.shape), filename) for name, t in params.items()}
    if not args.no_save_rng:
        _atomic_torch_save(_rng_state(), os.path.join(tmp_dir, f"rng_rank{rank:05d}.pt"))

    parts = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(parts, index_part)
    else:
        parts = [index_part]
    if rank == 0:
        index: Dict[str, Tuple[list, str]] = {}
        for part in parts:
            for name, entry in part.items():
                index.setdefault(name, entry)
        common = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            # --no-save-optim leaves out what the optimizer needs to continue: its state, the LR
            # schedule and the loss scaler (as Megatron-LM does).
            "optimizer_saved": not args.no_save_optim,
            "scheduler": scheduler.state_dict() if scheduler is not None and not args.no_save_optim else None,
            "scheduler_units": "samples",
            "grad_scaler": None if args.no_save_optim else trainer.grad_scaler_state(),
            "index": {name: [shape, file] for name, (shape, file) in sorted(index.items())},
            "pipeline_schedule": args.pipeline_schedule,
            "world_size": world,
            "model": model_signature(args),
        }
        _atomic_torch_save(common, os.path.join(tmp_dir, "common.pt"))
        summary = {k: v for k, v in common.items() if k not in ("scheduler", "grad_scaler", "index")}
        summary["num_parameters"] = len(index)
        _atomic_write_text(os.path.join(tmp_dir, "metadata.json"), json.dumps(summary, indent=1))
        _fsync_dir(tmp_dir)
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        _fsync_dir(root)
        _atomic_write_text(os.path.join(root, TRACKER_FILE), f"{iteration}\n")
    _barrier()
    return final_dir


SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "padded_vocab_size", "untie_embeddings_and_output_weights")
# Architecture choices that change the numbers, and what checkpoints written before they were
# recorded were trained with (the model was always a Llama then).
ARCHITECTURE_KEYS = {"normalization": "RMSNorm", "swiglu": True, "squared_relu": False, "add_bias_linear": False,
                     "add_qkv_bias": False, "position_embedding_type": "rope", "kv_channels": None,
                     "rotary_base": 10000, "rotary_percent": 1.0, "use_rope_scaling": False,
                     "rope_scaling_factor": 8.0, "apply_layernorm_1p": False, "qk_layernorm": False}


def model_signature(args) -> dict:
    """Model arguments that a checkpoint must agree with to be loaded."""
    keys = SHAPE_KEYS + tuple(ARCHITECTURE_KEYS)
    return {key: getattr(args, key) for key in keys}


def _saved_signature(saved: dict) -> dict:
    """A checkpoint's model signature, completed with what older checkpoints implied."""
    completed = dict(saved)
    for key, legacy in ARCHITECTURE_KEYS.items():
        if key not in completed:
            completed[key] = saved["hidden_size"] // saved["num_attention_heads"] if key == "kv_channels" else legacy
    return completed


def latest_iteration(root: str) -> Optional[int]:
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker, encoding="utf-8").read().strip()
    try:
        return int(text)
    except ValueError as exc:
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}") from exc


def _load(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing") from exc
    except Exception as exc:  # truncated or corrupt file
        raise CheckpointError(f"checkpoint file {path} is unreadable or truncated: {exc}") from exc


# (name in the checkpoint, model param, fp32 master) for every parameter a rank loads
_Target = Tuple[str, torch.Tensor, torch.Tensor]


def _targets_by_file(trainer, index: dict, tied: bool, directory: str) -> Dict[str, List[_Target]]:
    """This rank's parameters, grouped by the checkpoint file that holds each."""
    by_file: Dict[str, List[_Target]] = {}
    for name, param, master in trainer.named_master_parameters():
        source = _tied_alias(name, tied) or name
        if source not in index:
            raise CheckpointError(f"{directory}: parameter {source} is missing from the checkpoint")
        _shape, filename = index[source]
        by_file.setdefault(filename, []).append((source, param, master))
    return by_file


def _load_parameters_from(path: str, targets: List[_Target], trainer, restore_optimizer: bool) -> None:
    contents = _load(path)
    directory, filename = os.path.split(path)
    for source, param, master in targets:
        tensor = contents["params"].get(source)
        if tensor is None:
            raise CheckpointError(f"{path}: parameter {source} is missing")
        if list(tensor.shape) != list(master.shape):
            raise CheckpointError(
                f"{directory}: parameter {source} has shape {list(tensor.shape)}, the model {list(master.shape)}")
        master.copy_(tensor)
        if param is not master:
            param.copy_(tensor)
        if restore_optimizer:
            _restore_optimizer_state(trainer, master, contents["optimizer"].get(source, {}))


def load_checkpoint(root: str, trainer, scheduler, args) -> Tuple[int, int]:
    """Load the latest checkpoint under ``root``; returns ``(iteration, consumed_samples)``.

    ``(0, 0)`` when ``root`` holds no checkpoint yet (a fresh run with ``--load`` set).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        return 0, 0
    directory = iteration_dir(root, iteration)
    common = _load(os.path.join(directory, "common.pt"))
    _check_signature(common, args, directory)
    tied = not args.untie_embeddings_and_output_weights
    by_file = _targets_by_file(trainer, common["index"], tied, directory)
    restore_optimizer = not (args.no_load_optim or args.finetune)
    if restore_optimizer and not common.get("optimizer_saved", True):
        raise CheckpointSetupError(f"{directory} was saved with --no-save-optim: it has no optimizer state to resume "
                              "from; pass --no-load-optim (or --finetune) to start the optimizer afresh")
    with torch.no_grad():
        for filename in sorted(by_file):
            _load_parameters_from(os.path.join(directory, filename), by_file[filename], trainer, restore_optimizer)
    if args.finetune:
        return 0, 0
    trainer.after_parameters_loaded()
    if scheduler is not None and common["scheduler"] is not None and not args.no_load_optim:
        _load_scheduler(scheduler, common, directory)
    if not args.no_load_optim and common["grad_scaler"] is not None:
        trainer.load_grad_scaler_state(common["grad_scaler"])
    rng_file = os.path.join(directory, f"rng_rank{_rank():05d}.pt")
    same_layout = common["world_size"] == _world() and common["pipeline_schedule"] == args.pipeline_schedule
    if same_layout and not args.no_load_rng and os.path.isfile(rng_file):
        _set_rng_state(_load(rng_file))
    return common["iteration"], common["consumed_samples"]


def _load_scheduler(scheduler, common: dict, directory: str) -> None:
    """megatron-core's LR schedule counts samples (as Megatron-LM's); checkpoints written before
    this counted iterations, which are converted with the checkpoint's global batch."""
    state = dict(common["scheduler"])
    if common.get("scheduler_units") != "samples" and common["iteration"]:
        batch = common["consumed_samples"] // common["iteration"]
        for key in ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"):
            if key in state:
                state[key] = state[key] * batch
    if state.get("wd_incr_style") == "constant" == scheduler.wd_incr_style:
        # A constant weight decay does not depend on its span (the run's length): a longer or shorter
        # --train-iters on resume is not a schedule change (Megatron-LM refuses it all the same).
        state["wd_incr_steps"] = scheduler.wd_incr_steps
    try:
        scheduler.load_state_dict(state)
    except AssertionError as exc:
        raise CheckpointSetupError(f"{directory}: the LR schedule (counted in samples) differs from this run's flags: "
                              f"{exc}; --override-opt_param-scheduler takes this run's, "
                              "--use-checkpoint-opt_param-scheduler the checkpoint's") from None


def _restore_optimizer_state(trainer, master: torch.Tensor, saved: dict) -> None:
    """Copies (never views of the memory-mapped file) beside the master; step counts stay on the host."""
    if not saved:
        return
    restored = {key: value.to(master.device, copy=True) if value.dim() else value.clone()
                for key, value in saved.items()}
    trainer.set_optimizer_state(master, restored)


def _check_signature(common: dict, args, directory: str) -> None:
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: unknown checkpoint format {common.get('format_version')!r}")
    saved = _saved_signature(common["model"])
    current = model_signature(args)
    for key, value in current.items():
        if saved.get(key) != value:
            flag = _SIGNATURE_FLAGS.get(key, "--" + key.replace("_", "-"))
            raise CheckpointSetupError(
                f"{directory}: checkpoint has {key}={saved.get(key)}, this run {flag} gives {value}")


_SIGNATURE_FLAGS = {"add_bias_linear": "--disable-bias-linear", "padded_vocab_size": "--vocab-size / tokenizer",
                    "use_rope_scaling": "--use-rope-scaling"}
