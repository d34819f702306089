"""Megatron-LM's legacy checkpoint format, ``--ckpt-format torch`` (what its Hugging Face converters write).

Layout, as Megatron-LM's ``get_checkpoint_name`` makes it::

    SAVE/latest_checkpointed_iteration.txt          the iteration, or ``release``
    SAVE/iter_0000100/mp_rank_TT/model_optim_rng.pt          (one pipeline stage)
    SAVE/iter_0000100/mp_rank_TT_PPP/model_optim_rng.pt      (pipeline stage PPP)
    SAVE/release/...                                          (a converted checkpoint)

TT is the tensor-parallel rank (two digits), PPP the pipeline rank (three; a third ``_EEE`` is the
expert-parallel rank). Each file is a ``torch.save`` of ``{args, checkpoint_version (3.0), iteration,
model (model0, model1, ... with virtual stages), optimizer, opt_param_scheduler, rng_state,
num_floating_point_operations_so_far}``: ``model`` is the stage's ``state_dict_for_save_checkpoint()`` (its
own tensor-parallel slices, decoder layers numbered within the stage), ``optimizer`` megatron-core's per-rank
optimizer ``state_dict`` (indexed by that rank's parameter order), ``rng_state`` a list of per-rank RNG dicts.

Loading reads the weights under any schedule: every file of the checkpoint, memory-mapped; the layers of
each stage (and virtual stage) numbered over the whole model; tensor-parallel slices joined into whole
tensors (column-parallel weights along rows, SwiGLU's [gate; up] halves rank by rank, row-parallel ones along
columns); then each rank takes what it holds, as for torch_dist. The optimizer state (indexed by each rank's
parameter order in megatron-core's optimizer) loads as Megatron-LM loads it, into megatron-core's own optimizer
(the native schedules) at the layout that saved it: each rank's ``optimizer.load_state_dict`` of its own file,
then the distributed optimizer's ``load_parameter_state`` of ``distrib_optim.pt``, the LR schedule and the RNG
states; under the weight-passing schedules a tensor/pipeline-size-1 file through megatron-core's optimizer of that
layout (:mod:`.legacy_reference`); elsewhere loading needs ``--no-load-optim`` or ``--finetune`` (a ``release``
checkpoint is loaded as Megatron-LM does: weights, iteration 0). Saving with the optimizer state writes one file
per tensor- and pipeline-parallel rank as Megatron-LM does (the native schedules), or the weight-passing run's state
as a native run at tensor/pipeline size 1 with the non-distributed optimizer writes it (:mod:`.legacy_reference`);
with ``--no-save-optim`` (any schedule) the weights
as one tensor- and pipeline-parallel rank, ``mp_rank_00/``, gathered on rank 0: a file Megatron-LM loads with
``--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1`` (or reshards with its converter). Written
atomically like every format here.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_tawpipe.arguments import is_weight_passing, virtual_pipeline_size
from megatron_tawpipe.common.atomic import atomic_torch_save, fsync_dir, fsync_file
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError
from megatron_tawpipe.common.checkpointable import ReferenceFactory
from megatron_tawpipe.checkpoint import legacy_names, megatron_state
from megatron_tawpipe.checkpoint.legacy_reference import (load_reference_optimizer, reference_state,
                                                           rng_states_of_every_rank)
from megatron_tawpipe.checkpoint.load_record import note_training_state
from megatron_tawpipe.checkpoint.state import (ARCHITECTURE_KEYS, SHAPE_KEYS, barrier, check_signature,
                                                checkpoint_dir, is_release, load_file, load_scheduler,
                                                promote_checkpoint_dir, rank, rng_state, saved_arguments,
                                                set_rng_state, start_checkpoint_dir, tied_alias, world,
                                                writer_entries)

FILE = "model_optim_rng.pt"
DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"   # Megatron-LM's, beside FILE, with --use-distributed-optimizer
CHECKPOINT_VERSION = 3.0
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron-core's local layer names and Transformer Engine's for the same norms (a checkpoint may use either).
_NORM_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
               ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
_ROWS = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
         "word_embeddings.weight", "output_layer.weight")   # column-parallel: slices stacked along rows
_COLUMNS = ("linear_proj.weight", "linear_fc2.weight")       # row-parallel: slices side by side


def is_legacy_dir(directory: str) -> bool:
    return os.path.isdir(directory) and any(
        _RANK_DIR.match(name) and os.path.isfile(os.path.join(directory, name, FILE)) for name in os.listdir(directory))


def _rank_files(directory: str) -> Dict[Tuple[int, int], str]:
    files = {}
    for name in sorted(os.listdir(directory)):
        match = _RANK_DIR.match(name)
        if not match or not os.path.isfile(os.path.join(directory, name, FILE)):
            continue
        if match.group(3) is not None:
            raise CheckpointError(f"{directory}: {name} is an expert-parallel rank's file; this project's models "
                                  "have no experts")
        files[(int(match.group(1)), int(match.group(2) or 0))] = os.path.join(directory, name, FILE)
    tp, pp = 1 + max(t for t, _ in files), 1 + max(p for _, p in files)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in files]
    if missing:
        raise CheckpointError(f"{directory}: the files of tensor/pipeline ranks {missing} are missing "
                              f"(the others describe {tp} x {pp} ranks)")
    return files


def _load(path: str) -> dict:
    # Megatron-LM's files hold its argparse namespace (and enums): not loadable with weights_only
    return load_file(path, weights_only=False)


def _merge(name: str, slices: List[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """The whole tensor from its tensor-parallel slices (rank order)."""
    if len(slices) == 1:
        return slices[0]
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and swiglu:
        halves = [piece.chunk(2, dim=0) for piece in slices]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if name.endswith(_ROWS):
        return torch.cat(slices, dim=0)
    if name.endswith(_COLUMNS):
        return torch.cat(slices, dim=1)
    return slices[0]  # replicated over tensor-parallel ranks (norms, row-parallel biases)


def split_for_rank(name: str, whole: torch.Tensor, rank: int, size: int, swiglu: bool) -> torch.Tensor:
    """Tensor-parallel rank ``rank``'s slice of ``whole`` as Megatron-LM's files hold it: the inverse of
    :func:`_merge` (SwiGLU's fc1: its share of the gate rows, then of the up rows)."""
    if size == 1:
        return whole
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and swiglu:
        gate, up = whole.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0).clone()
    if name.endswith(_ROWS):
        return whole.chunk(size, dim=0)[rank].clone()
    if name.endswith(_COLUMNS):
        return whole.chunk(size, dim=1)[rank].clone()
    return whole  # replicated over tensor-parallel ranks (norms, row-parallel biases)


class LegacyCheckpoint:
    """The weights of a ``--ckpt-format torch`` checkpoint under global names, joined when asked for."""

    def __init__(self, directory: str, swiglu: bool):
        self.directory, self.swiglu = directory, swiglu
        files = _rank_files(directory)
        tp = 1 + max(t for t, _ in files)
        pp = 1 + max(p for _, p in files)
        loaded = {key: _load(path) for key, path in files.items()}
        self.common = {key: value for key, value in loaded[(0, 0)].items() if not key.startswith("model")}
        chunks = sorted((key for key in loaded[(0, 0)] if re.fullmatch(r"model\d*", key)),
                        key=lambda key: int(key[5:] or 0))
        if not chunks:
            raise CheckpointError(f"{files[(0, 0)]}: no model weights (model or model0, model1, ...)")
        self.slices: Dict[str, List[torch.Tensor]] = {}
        offset = 0
        for chunk in chunks:              # virtual stages in order, each over the pipeline stages
            for stage in range(pp):
                parts = [loaded[(t, stage)].get(chunk) for t in range(tp)]
                if any(part is None for part in parts):
                    raise CheckpointError(f"{directory}: pipeline stage {stage} lacks {chunk!r}")
                if legacy_names.is_legacy_model(parts[0]):   # Megatron-LM's older model: megatron-core's names
                    legacy_names.check_legacy_args(self.common.get("args"), self.common.get("checkpoint_version"),
                                                   directory)
                    parts = [legacy_names.core_state(part, files[(t, stage)]) for t, part in enumerate(parts)]
                local_layers = set()
                for name, value in parts[0].items():
                    if not isinstance(value, torch.Tensor) or name.endswith("_extra_state"):
                        continue
                    match = _LAYER.match(name)
                    if match:
                        local_layers.add(int(match.group(1)))
                        name = f"decoder.layers.{offset + int(match.group(1))}.{match.group(2)}"
                    self.slices.setdefault(name, [part[_orig(name, match)] for part in parts])
                offset += len(local_layers)
        self.num_layers = offset
        if not any(name.startswith(("embedding.", "decoder.")) for name in self.slices):
            raise CheckpointError(f"{directory}: no model weights (embedding.*, decoder.*, or the older model's "
                                  "language_model.*)")

    def tensor(self, name: str) -> Optional[torch.Tensor]:
        """The whole tensor of parameter ``name`` (this project's global name), or None if absent."""
        for candidate in spellings(name):
            if candidate in self.slices:
                return _merge(candidate, self.slices[candidate], self.swiglu)
        return None

    def names(self) -> List[str]:
        return sorted(self.slices)


def _orig(name: str, match) -> str:
    """The name a stage's file uses for ``name`` (the layer numbered within the stage)."""
    return name if match is None else f"decoder.layers.{match.group(1)}.{match.group(2)}"


def spellings(name: str) -> List[str]:
    """``name`` and its other layer-norm spelling (megatron-core's local layer / Transformer Engine's)."""
    match = _LAYER.match(name)
    if not match:
        return [name]
    head, rest = f"decoder.layers.{match.group(1)}.", match.group(2)
    result = [name]
    for local, fused in _NORM_NAMES:
        if rest.startswith(local):
            result.append(head + fused + rest[len(local):])
        elif rest.startswith(fused):
            result.append(head + local + rest[len(fused):])
    return result


def saved_model_signature(common: dict, directory: str) -> dict:
    saved_args = common.get("args")
    if saved_args is None:
        raise CheckpointError(f"{directory}: the checkpoint holds no args")
    return {key: getattr(saved_args, key) for key in SHAPE_KEYS + tuple(ARCHITECTURE_KEYS) if hasattr(saved_args, key)}


def _piece(whole: torch.Tensor, fragments) -> torch.Tensor:
    """A weight-passing tensor-parallel rank's slice: its pieces ``(axis, index, count)`` of the whole, joined."""
    pieces = [whole.chunk(count, dim=axis)[index] for axis, index, count in fragments]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def load_checkpoint(root: str, trainer, scheduler, args, report=None,
                    legacy_reference: Optional[ReferenceFactory] = None) -> Tuple[int, int]:
    """Load the weights of the ``--ckpt-format torch`` checkpoint the tracker under ``root`` names (under a
    weight-passing schedule the optimizer state goes through ``legacy_reference``'s objects:
    :mod:`.legacy_reference`)."""
    directory = checkpoint_dir(root)
    release = is_release(root)
    source = LegacyCheckpoint(directory, swiglu=bool(args.swiglu))
    common = source.common
    check_signature(saved_model_signature(common, directory), args, directory)
    restore_optimizer = not (args.no_load_optim or args.finetune or release)
    if restore_optimizer:
        why = ("it holds no optimizer state (weights only, as Megatron-LM's converters write it)"
               if "optimizer" not in common else _optimizer_layout_problem(common.get("args"), args))
        if why is not None:
            raise CheckpointSetupError(f"{directory} is a --ckpt-format torch checkpoint: {why}; pass "
                                       "--no-load-optim (or --finetune) to load its weights and start the optimizer "
                                       "afresh")
    tied = not args.untie_embeddings_and_output_weights
    with torch.no_grad():
        for name, param, master in trainer.named_master_parameters():
            wanted = tied_alias(name, tied) or name
            whole = source.tensor(wanted)
            if whole is None:
                raise CheckpointError(f"{directory}: parameter {wanted} is missing from the checkpoint")
            expected = list(trainer.checkpoint_shape(name, param) or master.shape)
            if list(whole.shape) != expected:
                raise CheckpointError(f"{directory}: parameter {wanted} has shape {list(whole.shape)}, "
                                      f"the model {expected}")
            fragments = trainer.checkpoint_fragments(name, master)
            value = _piece(whole, fragments) if fragments else trainer.checkpoint_slice(name, param, whole)
            master.copy_(value.to(device=master.device, dtype=torch.float32))
            if param is not master:
                param.copy_(value.to(device=param.device, dtype=param.dtype))
    weight_passing = is_weight_passing(args.pipeline_schedule)
    own = _own_file(directory, private=not weight_passing or rank() == 0) if restore_optimizer else None
    if own is not None and weight_passing:   # megatron-core's optimizer on rank 0 reads it, hands each rank its part
        load_reference_optimizer(own["state"]["optimizer"] if rank() == 0 else None, trainer, args,
                                 _reference_factory(legacy_reference))
    elif own is not None:
        megatron_state.load_legacy_optimizer(trainer, own["state"]["optimizer"], own["parameter_state"])
    trainer.after_parameters_loaded()
    if args.finetune or release:
        note_training_state(report, args, optimizer=False, scheduler=False, rng=False, rng_why=None, iteration=0,
                            consumed=0, release=release)
        return 0, 0
    saved_args = common.get("args")
    iteration, consumed = int(common.get("iteration", 0)), int(getattr(saved_args, "consumed_train_samples", 0) or 0)
    with_schedule = own is not None and scheduler is not None and own["state"].get("opt_param_scheduler") is not None
    if with_schedule:
        load_scheduler(scheduler, {"scheduler": own["state"]["opt_param_scheduler"], "scheduler_units": "samples",
                                   "iteration": iteration, "consumed_samples": consumed}, directory)
    same_schedule = getattr(saved_args, "pipeline_schedule", "1f1b") == args.pipeline_schedule or not (
        weight_passing or is_weight_passing(getattr(saved_args, "pipeline_schedule", "1f1b")))
    states = None
    if "rng_state" in common and not args.no_load_rng:
        states = own["state"].get("rng_state") if own is not None and same_schedule else None
        if states:   # one per rank from a weight-passing run (Megatron-LM's list, as with data-parallel random init)
            _set_megatron_rng_state(states[rank()] if weight_passing and len(states) == world() else states[0])
        elif rank() == 0:
            print(f" {directory}: the RNG states of a --ckpt-format torch checkpoint are restored only at the layout "
                  "that saved them, with its optimizer state: dropout continues from --seed", flush=True)
    note_training_state(report, args, optimizer=own is not None, scheduler=with_schedule, rng=bool(states),
                        rng_why=None, iteration=iteration, consumed=consumed)
    return iteration, consumed


def _optimizer_layout_problem(saved, args) -> Optional[str]:
    """Why this run cannot take the checkpoint's optimizer state (None when it can): it is megatron-core's
    per-rank ``optimizer.state_dict()``, indexed by the parameter order of each rank of the saving layout, so it
    loads into megatron-core's own optimizer at the same layout (as Megatron-LM loads it)."""
    if is_weight_passing(args.pipeline_schedule) and args.tensor_model_parallel_size == 1:
        return _reference_layout_problem(saved, args)
    if is_weight_passing(args.pipeline_schedule) or args.use_torch_fsdp2 or args.use_megatron_fsdp:
        return ("its optimizer state is megatron-core's per-rank optimizer.state_dict(), which loads into "
                "megatron-core's own optimizer (the native schedules without FSDP, and the weight-passing ones at "
                "--tensor-model-parallel-size 1), not under "
                f"--pipeline-schedule {args.pipeline_schedule}" + (" with FSDP" if not is_weight_passing(
                    args.pipeline_schedule) else ""))
    differing = []
    here = dict(vars(args), virtual_pipeline_model_parallel_size=virtual_pipeline_size(args))
    for key, default in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
                         ("virtual_pipeline_model_parallel_size", None), ("decoder_first_pipeline_num_layers", None),
                         ("decoder_last_pipeline_num_layers", None), ("pipeline_model_parallel_layout", None),
                         ("data_parallel_size", None), ("use_distributed_optimizer", False), ("fp16", False),
                         ("bf16", False)):
        value = getattr(saved, key, default)
        if key == "data_parallel_size" and (value is None or not getattr(saved, "use_distributed_optimizer", False)):
            continue     # the non-distributed optimizer's state is the same on every data-parallel rank
        if value != here.get(key, default):
            differing.append(f"{key}={value} (this run: {here.get(key, default)})")
    if differing:
        return ("its optimizer state is megatron-core's per-rank optimizer.state_dict(), indexed by the parameter "
                "order of the layout that saved it, which differs: " + ", ".join(differing))
    return None


def _reference_layout_problem(saved, args) -> Optional[str]:
    """A weight-passing run takes the optimizer state of a file as a native run at tensor/pipeline size 1 with
    megatron-core's non-distributed optimizer writes it (what a weight-passing run writes)."""
    differing = [f"{key}={getattr(saved, key, default)}" for key, default in (
        ("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
        ("virtual_pipeline_model_parallel_size", None), ("use_distributed_optimizer", False))
        if getattr(saved, key, default) != default]
    here = {"fp16": args.fp16, "bf16": args.bf16}
    differing += [f"{key}={getattr(saved, key, False)} (this run: {value})" for key, value in here.items()
                  if bool(getattr(saved, key, False)) != bool(value)]
    if differing:
        return ("its optimizer state is megatron-core's optimizer.state_dict() of the layout that saved it; under "
                f"--pipeline-schedule {args.pipeline_schedule} it loads from tensor/pipeline size 1 with the "
                "non-distributed optimizer only, which differs: " + ", ".join(differing))
    return None


def _own_file(directory: str, private: bool = True) -> dict:
    """This rank's file of the checkpoint (a private copy unless not ``private``: memory-mapped) and its
    ``distrib_optim.pt``."""
    from megatron.core import parallel_state as mpu

    pipelined = mpu.get_pipeline_model_parallel_world_size() > 1
    rank_dir = os.path.join(directory, _rank_dir_name(mpu.get_tensor_model_parallel_rank(),
                                                      mpu.get_pipeline_model_parallel_rank(), pipelined))
    path = os.path.join(rank_dir, FILE)
    state = load_file(path, weights_only=False, mmap=not private)
    if "optimizer" not in state:
        raise CheckpointSetupError(f"{path} holds no optimizer state; pass --no-load-optim (or --finetune)")
    parameter_state = os.path.join(rank_dir, DISTRIBUTED_OPTIMIZER_FILE)
    return {"state": state, "parameter_state": parameter_state if os.path.isfile(parameter_state) else None}


def _megatron_rng_state() -> dict:
    """This rank's RNG states (:func:`~megatron_tawpipe.checkpoint.state.rng_state`) under Megatron-LM's keys
    (``get_rng_state``'s dict), with the device type they were taken on (``device``, this project's entry:
    without a GPU the tracker holds CPU generator states)."""
    state = rng_state()
    return {"random_rng_state": state["python"], "np_rng_state": np.random.get_state(),
            "torch_rng_state": state["torch"], "cuda_rng_state": state.get("cuda", state["torch"]),
            "rng_tracker_states": state["tracker"], "device": state["device"]}


def _set_megatron_rng_state(state: dict) -> None:
    """Restore :func:`_megatron_rng_state`'s states through :func:`~megatron_tawpipe.checkpoint.state.set_rng_state`
    (the CUDA generator and the tracker only on the device type that saved them; a file without ``device``
    counts as a GPU's, as Megatron-LM writes it)."""
    kind, keys, pos, has_gauss, cached = state["np_rng_state"]
    set_rng_state({"device": state.get("device", "cuda"), "python": state["random_rng_state"],
                   "numpy": [kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), pos, has_gauss, cached],
                   "torch": state["torch_rng_state"], "cuda": state["cuda_rng_state"],
                   "tracker": state["rng_tracker_states"]})


def _reference_factory(legacy_reference: Optional[ReferenceFactory]) -> ReferenceFactory:
    """A weight-passing run's optimizer state in legacy files goes through megatron-core's objects at
    tensor/pipeline size 1, which the caller builds (the training loop passes its factory)."""
    if legacy_reference is None:
        raise CheckpointSetupError("--ckpt-format torch with the optimizer state under a weight-passing schedule "
                                   "needs megatron-core's model and optimizer at tensor/pipeline size 1, which the "
                                   "caller builds (legacy_reference); pass --no-save-optim / --no-load-optim or use "
                                   "--ckpt-format torch_dist")
    return legacy_reference


def _rank_dir_name(tp_rank: int, pp_rank: int, pipelined: bool) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" if pipelined else f"mp_rank_{tp_rank:02d}"


def save_checkpoint(root: str, iteration: int, consumed_samples: int, trainer, scheduler, args,
                    legacy_reference: Optional[ReferenceFactory] = None) -> str:
    """Collectively write Megatron-LM's legacy files: with the optimizer state (megatron-core's own schedules),
    one file per tensor- and pipeline-parallel rank as Megatron-LM writes them (a weight-passing run through
    ``legacy_reference``'s megatron-core objects); with --no-save-optim, the weights gathered as one rank,
    ``mp_rank_00/model_optim_rng.pt`` (from one tensor-parallel rank)."""
    saved_args = saved_arguments(args, consumed_samples)
    if not args.no_save_optim:
        return _save_per_rank(root, iteration, trainer, scheduler, args, saved_args, legacy_reference)
    tmp_dir, final_dir = start_checkpoint_dir(root, iteration)
    tied = not args.untie_embeddings_and_output_weights
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    local = {name: master.detach().to(dtype).cpu().clone() for name, master, _state in writer_entries(trainer)
             if tied_alias(name, tied) is None and not trainer.skip_in_checkpoint(name)}
    parts = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.gather_object(local, parts if rank() == 0 else None, dst=0)
    else:
        parts = [local]
    rng = _megatron_rng_state() if not args.no_save_rng else None
    if rank() == 0:
        model: Dict[str, torch.Tensor] = {}
        for part in parts:
            for name, tensor in part.items():
                model.setdefault(name, tensor)
        saved_args.tensor_model_parallel_size = saved_args.pipeline_model_parallel_size = 1  # the files' layout
        saved_args.virtual_pipeline_model_parallel_size = None
        saved_args.ckpt_format = "torch"
        state = {"args": saved_args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                 "model": dict(sorted(model.items())), "num_floating_point_operations_so_far": 0}
        if rng is not None:
            state["rng_state"] = [rng]
        rank_dir = os.path.join(tmp_dir, "mp_rank_00")
        os.makedirs(rank_dir)
        atomic_torch_save(state, os.path.join(rank_dir, FILE))
        fsync_dir(rank_dir)
        promote_checkpoint_dir(tmp_dir, final_dir, root, iteration, args.save_retain_interval)
    barrier()
    return final_dir


def _save_per_rank(root: str, iteration: int, trainer, scheduler, args, saved_args,
                   legacy_reference: Optional[ReferenceFactory]) -> str:
    """Each tensor- and pipeline-parallel rank's ``mp_rank_TT[_PPP]/model_optim_rng.pt``, written by its
    data-parallel rank 0: its model chunks, megatron-core's ``optimizer.state_dict()``, the LR schedule, its RNG
    states; with the distributed optimizer also ``distrib_optim.pt`` (megatron-core's ``save_parameter_state``)."""
    from megatron.core import parallel_state as mpu

    tmp_dir, final_dir = start_checkpoint_dir(root, iteration)
    weight_passing = is_weight_passing(args.pipeline_schedule)
    pipelined = mpu.get_pipeline_model_parallel_world_size() > 1 and not weight_passing
    rank_dir = os.path.join(tmp_dir, "mp_rank_00" if weight_passing else _rank_dir_name(
        mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(), pipelined))
    writer = rank() == 0 if weight_passing else mpu.get_data_parallel_rank(with_context_parallel=True) == 0
    if writer:
        os.makedirs(rank_dir, exist_ok=True)
    barrier()
    parameter_state = None
    if weight_passing:   # megatron-core's own objects at tensor/pipeline size 1 write it, on rank 0
        state = reference_state(trainer, args, _reference_factory(legacy_reference))
        rng = (rng_states_of_every_rank(_megatron_rng_state()) if not args.no_save_rng else None)
    else:
        if args.use_distributed_optimizer:
            parameter_state = os.path.join(rank_dir, DISTRIBUTED_OPTIMIZER_FILE)
        state = megatron_state.legacy_state_dict(trainer, True, parameter_state)
        rng = [_megatron_rng_state()] if not args.no_save_rng else None
    if state is None and writer:   # (validate_args refuses this case)
        raise CheckpointSetupError("--ckpt-format torch with the optimizer state is written from megatron-core's own "
                                   "optimizer only; pass --no-save-optim or use --ckpt-format torch_dist")
    if writer:
        saved_args.ckpt_format = "torch"
        saved_args.virtual_pipeline_model_parallel_size = virtual_pipeline_size(args)   # (Megatron-LM's argument)
        if weight_passing:   # the files' layout: a native run's at tensor/pipeline size 1, non-distributed optimizer
            saved_args.tensor_model_parallel_size = saved_args.pipeline_model_parallel_size = 1
            saved_args.use_distributed_optimizer = False
        state.update({"args": saved_args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                      "num_floating_point_operations_so_far": 0})
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
        if rng is not None:
            state["rng_state"] = rng
        atomic_torch_save(state, os.path.join(rank_dir, FILE))
        if parameter_state is not None:
            fsync_file(parameter_state)
        fsync_dir(rank_dir)
    barrier()
    if rank() == 0:
        promote_checkpoint_dir(tmp_dir, final_dir, root, iteration, args.save_retain_interval)
    barrier()
    return final_dir


def saved_args(directory: str):
    """The argparse namespace the checkpoint in ``directory`` was saved with (its first rank's file)."""
    return _load(_rank_files(directory)[(0, 0)]).get("args")


def read_parameters(directory: str) -> Dict[str, torch.Tensor]:
    """Every weight of the checkpoint in ``directory``, whole, as fp32, under global names (SwiGLU is read from
    the checkpoint's args)."""
    source = LegacyCheckpoint(directory, bool(getattr(saved_args(directory), "swiglu", False)))
    return {name: source.tensor(name).float() for name in source.names()}
