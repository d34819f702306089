"""This project's own checkpoint format (``--ckpt-format tawpipe``): schedule-independent, atomic.

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
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_tawpipe.common.atomic import atomic_torch_save, atomic_write_text
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError
from megatron_tawpipe.checkpoint.load_record import note_training_state
from megatron_tawpipe.checkpoint.state import (barrier, check_signature, checkpoint_dir,
                                                latest_iteration, load_file, load_scheduler, model_signature, rank,
                                                promote_checkpoint_dir, restore_optimizer_state, rng_state, set_rng_state,
                                                start_checkpoint_dir, tied_alias, world, writer_entries)

FORMAT_VERSION = 1


def _collect_local_state(entries, trainer, tied: bool,
                         with_optimizer: bool = True) -> Tuple[Dict[str, torch.Tensor], Dict[str, dict]]:
    params: Dict[str, torch.Tensor] = {}
    optim: Dict[str, dict] = {}
    for name, master, state in entries:
        if tied_alias(name, tied) is not None or trainer.skip_in_checkpoint(name):
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
    this_rank, world_size = rank(), world()
    tmp_dir, final_dir = start_checkpoint_dir(root, iteration)

    tied = not args.untie_embeddings_and_output_weights
    index_part: Dict[str, Tuple[list, str]] = {}
    entries = writer_entries(trainer)
    if trainer.writes_checkpoint():
        params, optim = _collect_local_state(entries, trainer, tied, with_optimizer=not args.no_save_optim)
        filename = f"params_rank{this_rank:05d}.pt"
        atomic_torch_save({"params": params, "optimizer": optim}, os.path.join(tmp_dir, filename))
        index_part = {name: (list(t.shape), filename) for name, t in params.items()}
    if not args.no_save_rng:
        atomic_torch_save(rng_state(), os.path.join(tmp_dir, f"rng_rank{this_rank:05d}.pt"))

    parts = [None] * world_size
    if dist.is_initialized():
        dist.all_gather_object(parts, index_part)
    else:
        parts = [index_part]
    if this_rank == 0:
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
            "world_size": world_size,
            "model": model_signature(args),
        }
        atomic_torch_save(common, os.path.join(tmp_dir, "common.pt"))
        summary = {k: v for k, v in common.items() if k not in ("scheduler", "grad_scaler", "index")}
        summary["num_parameters"] = len(index)
        atomic_write_text(os.path.join(tmp_dir, "metadata.json"), json.dumps(summary, indent=1), durable=True)
        promote_checkpoint_dir(tmp_dir, final_dir, root, iteration, args.save_retain_interval)
    barrier()
    return final_dir


# (name in the checkpoint, model param, fp32 master) for every parameter a rank loads
_Target = Tuple[str, torch.Tensor, torch.Tensor]


def _targets_by_file(trainer, index: dict, tied: bool, directory: str) -> Dict[str, List[_Target]]:
    """This rank's parameters, grouped by the checkpoint file that holds each."""
    by_file: Dict[str, List[_Target]] = {}
    for name, param, master in trainer.named_master_parameters():
        source = tied_alias(name, tied) or name
        if source not in index:
            raise CheckpointError(f"{directory}: parameter {source} is missing from the checkpoint")
        _shape, filename = index[source]
        by_file.setdefault(filename, []).append((source, param, master))
    return by_file


def _load_parameters_from(path: str, targets: List[_Target], trainer, restore_optimizer: bool) -> None:
    contents = load_file(path)
    directory, filename = os.path.split(path)
    # A tensor-parallel rank (native schedules) holds a slice of each whole tensor.
    for source, param, master in targets:
        tensor = contents["params"].get(source)
        if tensor is None:
            raise CheckpointError(f"{path}: parameter {source} is missing")
        whole = trainer.checkpoint_shape(source, param)
        expected = list(master.shape if whole is None else whole)
        if list(tensor.shape) != expected:
            raise CheckpointError(f"{directory}: parameter {source} has shape {list(tensor.shape)}, the model {expected}")
        master.copy_(trainer.checkpoint_slice(source, param, tensor))
        if param is not master:
            param.copy_(trainer.checkpoint_slice(source, param, tensor))
        if restore_optimizer:
            saved = contents["optimizer"].get(source, {})
            restore_optimizer_state(trainer, master, {key: trainer.checkpoint_slice(source, param, value) if value.dim() else value
                                                      for key, value in saved.items()})


def load_checkpoint(root: str, trainer, scheduler, args, report=None) -> Tuple[int, int]:
    """Load the latest checkpoint under ``root``; returns ``(iteration, consumed_samples)``.

    ``(0, 0)`` when ``root`` holds no checkpoint yet (a fresh run with ``--load`` set).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        return 0, 0
    directory = checkpoint_dir(root)
    common = load_file(os.path.join(directory, "common.pt"))
    _check_format(common, args, directory)
    tied = not args.untie_embeddings_and_output_weights
    by_file = _targets_by_file(trainer, common["index"], tied, directory)
    restore_optimizer = not (args.no_load_optim or args.finetune)
    if restore_optimizer and not common.get("optimizer_saved", True):
        raise CheckpointSetupError(f"{directory} was saved with --no-save-optim: it has no optimizer state to resume "
                              "from; pass --no-load-optim (or --finetune) to start the optimizer afresh")
    with torch.no_grad():
        for filename in sorted(by_file):
            _load_parameters_from(os.path.join(directory, filename), by_file[filename], trainer, restore_optimizer)
    trainer.after_parameters_loaded()  # (--finetune too: replicas and low-precision copies follow the masters)
    if args.finetune:
        note_training_state(report, args, optimizer=False, scheduler=False, rng=False, rng_why=None, iteration=0,
                            consumed=0)
        return 0, 0
    with_schedule = scheduler is not None and common["scheduler"] is not None and not args.no_load_optim
    if with_schedule:
        load_scheduler(scheduler, common, directory)
    if not args.no_load_optim and common["grad_scaler"] is not None:
        trainer.load_grad_scaler_state(common["grad_scaler"])
    rng_file = os.path.join(directory, f"rng_rank{rank():05d}.pt")
    same_layout = common["world_size"] == world() and common["pipeline_schedule"] == args.pipeline_schedule
    load_rng = same_layout and not args.no_load_rng and os.path.isfile(rng_file)
    if load_rng:
        set_rng_state(load_file(rng_file))
    note_training_state(report, args, optimizer=restore_optimizer, scheduler=with_schedule, rng=load_rng, rng_why=None,
                        iteration=common["iteration"], consumed=common["consumed_samples"])
    return common["iteration"], common["consumed_samples"]


def _check_format(common: dict, args, directory: str) -> None:
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: unknown checkpoint format {common.get('format_version')!r}")
    check_signature(common["model"], args, directory)



def read_parameters(directory: str) -> Dict[str, torch.Tensor]:
    """Every parameter's fp32 master in ``directory`` (see :func:`megatron_tawpipe.checkpoint.read_parameters`)."""
    index = load_file(os.path.join(directory, "common.pt"))["index"]
    files: Dict[str, dict] = {}
    params = {}
    for name, (_shape, filename) in index.items():
        if filename not in files:
            files[filename] = load_file(os.path.join(directory, filename))["params"]
        params[name] = files[filename][name]
    return params
