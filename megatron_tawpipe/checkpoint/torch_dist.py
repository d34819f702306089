"""Megatron-LM's checkpoint format, ``--ckpt-format torch_dist``, for every schedule.

A checkpoint is what megatron-core's ``dist_checkpointing.save`` writes, in Megatron-LM's layout::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/   .metadata, __R_T.distcp (tensors), common.pt (everything else), metadata.json

Tensors live under megatron-core's *model-space* keys: ``embedding.word_embeddings.weight``,
``decoder.layers.mlp.linear_fc1.weight`` (the layers stacked on a leading axis of
``--num-layers``), ``optimizer.state.fp32_param.<key>`` (fp32 masters under --bf16/--fp16),
``optimizer.state.exp_avg.<key>`` and ``optimizer.state.exp_avg_sq.<key>``. These keys do not
depend on how the model is partitioned, so that:

* the native schedules save exactly as Megatron-LM does: ``model.sharded_state_dict()`` and the
  megatron optimizer's ``sharded_state_dict()`` (the distributed optimizer in its
  ``fully_reshardable`` form, which is model-space too);
* the weight-passing schedules and the FSDP2 baselines save each whole parameter under the same
  keys, from the rank that owns it, with the common part (``args``, ``iteration``,
  ``opt_param_scheduler``, the optimizer's ``param_groups`` and ``common_step``) laid out as
  megatron-core's non-distributed optimizer lays it out;
* every trainer loads through one reader: each rank asks ``dist_checkpointing.load`` for the whole
  tensors of the parameters it holds (or for the slice of them it holds, through the trainer's
  stand-in), wherever they were written from.

Beside Megatron-LM's entries the common part carries this project's record (``tawpipe``: the model
signature, schedule, world size, consumed samples, grad scaler) and each rank's RNG states as a
sharded object. A checkpoint written by Megatron-LM itself (no record) is checked against its
``args``. Writes are atomic as for every format here: into ``iter_XXXXXXX.tmp``, files fsynced,
renamed, the tracker replaced last.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_tawpipe.common.device import current_device
from megatron_tawpipe.common.atomic import fsync_file
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError
from megatron_tawpipe.checkpoint import async_save, megatron_state
from megatron_tawpipe.checkpoint.load_record import note_training_state
from megatron_tawpipe.checkpoint.model_space import (CHECKPOINT_VERSION, CONTENT_METADATA, MOMENTS, RECORD_KEY,
                                                      RNG_KEY, SAVE_STRATEGY, layer_extra_states, layer_keys_map,
                                                      model_space_key, rng_object, sharded_pieces, sharded_tensor)
from megatron_tawpipe.checkpoint.state import (ARCHITECTURE_KEYS, SHAPE_KEYS,
                                                barrier, check_signature, checkpoint_dir,
                                                latest_iteration, load_scheduler, model_signature,
                                                promote_checkpoint_dir, rank, restore_optimizer_state, rng_state,
                                                saved_arguments, set_rng_state, start_checkpoint_dir, tied_alias,
                                                world, writer_entries)

# ---- saving ---------------------------------------------------------------------------------

def _param_group_descriptions(trainer) -> List[dict]:
    """The optimizer's groups without their parameters, the same on every rank (a rank of a
    weight-passing schedule holds only some kinds of parameters: the union over ranks)."""
    local = [{key: value for key, value in group.items() if key != "params"} for group in trainer.optimizer.param_groups]
    parts = [None] * world()
    if dist.is_initialized():
        dist.all_gather_object(parts, local)
    else:
        parts = [local]
    from megatron.core.optimizer.optimizer import param_group_identifier_keys  # how megatron-core matches groups

    seen: Dict[tuple, dict] = {}
    for part in parts:
        for group in part:
            seen.setdefault(tuple(group.get(key) for key in param_group_identifier_keys), group)
    order = lambda g: (-(g.get("wd_mult") or 0.0), bool(g.get("is_decoupled_lr")))  # noqa: E731
    return sorted(seen.values(), key=order)


def _common_step(entries) -> Optional[torch.Tensor]:
    """The optimizer's step count, agreed by every rank (ranks that write nothing contribute 0)."""
    step = 0.0
    for _name, _master, state in entries:
        if "step" in state:
            step = max(step, float(state["step"]))
    total = torch.tensor([step], dtype=torch.float64, device=current_device())
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return torch.tensor(float(total[0]), dtype=torch.float32) if float(total[0]) > 0 else None


def whole_parameter_state(trainer, args, with_optimizer: bool) -> dict:
    """``model`` and ``optimizer`` entries for a trainer that hands over whole parameters.

    Each parameter is written once, by the rank that holds it (``skip_in_checkpoint`` leaves out
    the replicas); the optimizer's common part has megatron-core's non-distributed layout
    (``Float16OptimizerWithFloat16Params`` under --bf16/--fp16, ``FP32Optimizer`` otherwise).
    """
    tied = not args.untie_embeddings_and_output_weights
    low_precision = bool(args.bf16 or args.fp16)
    model_dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    entries = [entry for entry in writer_entries(trainer)
               if tied_alias(entry[0], tied) is None and not trainer.skip_in_checkpoint(entry[0])]
    model, masters, moments, layers = {}, {}, {}, set()
    keys_map = layer_keys_map(args)
    for name, master, state in entries:
        key, layer = model_space_key(name, keys_map)
        if layer is not None:
            layers.add(layer)
        # A tensor-parallel rank writes its slice of the whole tensor, and a copy of what tensor
        # parallelism does not split only from the group's first rank (replica 0).
        fragments, replica = trainer.checkpoint_fragments(name, master), trainer.checkpoint_replica(name, master)
        master = master.detach()

        def pieces(prefix: str, tensor: torch.Tensor, where: dict, entry: str) -> None:
            for suffix, sharded in sharded_pieces(prefix + key, tensor, layer, args.num_layers, fragments, replica).items():
                where[entry + suffix] = sharded

        pieces("", master.to(model_dtype).clone() if low_precision else master, model, name)
        if not with_optimizer:
            continue
        if low_precision:
            pieces("optimizer.state.fp32_param.", master.float(), masters, name)
        moments[name] = {}
        for moment in MOMENTS:
            if moment in state:
                pieces(f"optimizer.state.{moment}.", state[moment].detach(), moments[name], moment)
    layer_module = trainer.checkpoint_layer_module()
    if layer_module is not None:
        replica = trainer.checkpoint_replica("", None)   # extra state: like a tensor that tensor parallelism does not split
        for layer in sorted(layers):
            model.update(layer_extra_states(layer_module, layer, args.num_layers, replica))
    result = {"model": model}
    if not with_optimizer:
        return result
    step = _common_step(entries)
    groups = _param_group_descriptions(trainer)
    for group in groups:  # what fused Adam (Transformer Engine's, Apex's) reads from a group
        group.setdefault("bias_correction", True)
        if step is not None:
            group["step"] = int(step)
    torch_state = {"state": {} if step is None else {"common_step": step}, "param_groups": groups}
    if low_precision:
        result["optimizer"] = {"optimizer": torch_state, "grad_scaler": trainer.grad_scaler_state()}
    else:
        result["optimizer"] = torch_state
    # Tensors apart from the common part (their place in the structure is not persisted).
    result["optimizer_tensors"] = {"fp32_param": masters, "moments": moments}
    return result


def _comparable_common(common: dict) -> dict:
    """The common part every rank must agree on: a weight-passing rank's (empty) containers of the tensors
    it wrote are its own, and so are the arguments' per-rank values (rank 0's are written)."""
    return {key: value for key, value in common.items() if key not in ("model", "optimizer_tensors", "args")}


def save_checkpoint(root: str, iteration: int, consumed_samples: int, trainer, scheduler, args) -> str:
    """Collectively write ``iter_XXXXXXX`` under ``root`` with megatron-core's dist_checkpointing."""
    from megatron.core import dist_checkpointing

    async_save.use_results_queue(args)
    async_save.finalize(blocking=True)  # a background save still pending completes first (--async-save)
    tmp_dir, final_dir = start_checkpoint_dir(root, iteration)
    with_optimizer = not args.no_save_optim
    state = megatron_state.sharded_state_dict(trainer, with_optimizer)
    if state is None:
        state = whole_parameter_state(trainer, args, with_optimizer)
    state.update({
        "args": saved_arguments(args, consumed_samples),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        RECORD_KEY: {
            "pipeline_schedule": args.pipeline_schedule,
            "world_size": world(),
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "model": model_signature(args),
            "consumed_samples": consumed_samples,
            "optimizer_saved": with_optimizer,
            "scheduler_units": "samples",
            "grad_scaler": trainer.grad_scaler_state() if with_optimizer else None,
        },
    })
    if with_optimizer and scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    if not args.no_save_rng:
        state[RNG_KEY] = rng_object(rng_state())
    retain = args.save_retain_interval

    def make_visible() -> None:
        """Every rank, once every rank's files are written: rank 0 fsyncs and promotes the checkpoint."""
        barrier()
        if rank() == 0:
            for name in os.listdir(tmp_dir):
                fsync_file(os.path.join(tmp_dir, name))
            promote_checkpoint_dir(tmp_dir, final_dir, root, iteration, retain)
        barrier()

    # (The strategy object, not its (backend, version) name: megatron-core's async path needs an instance.)
    request = dist_checkpointing.save(state, tmp_dir, sharded_strategy=_save_strategy(),
                                      content_metadata=dict(CONTENT_METADATA),
                                      preprocess_common_before_consistancy_check=_comparable_common,
                                      async_sharded_save=async_save.enabled(args), **_mcore_async_writer())
    if request is None:
        make_visible()
    else:  # --async-save: written in the background; visible once finalized (async_save.finalize)
        request.add_finalize_fn(make_visible)
        async_save.schedule(request, args)
    return final_dir


def _mcore_async_writer() -> dict:
    """megatron-core's own background writer: from 0.19 ``dist_checkpointing.save`` defaults to
    nvidia-resiliency-ext's (``async_strategy="nvrx"``), which is not installed here; earlier releases
    have only their own and no such argument."""
    import inspect

    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters else {}


def _save_strategy():
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    # The backend only: megatron-core 0.19 dropped the version argument (1, the default, before).
    return get_default_save_sharded_strategy(SAVE_STRATEGY[0])


# ---- loading --------------------------------------------------------------------------------

def _saved_model_signature(common: dict, directory: str) -> dict:
    record = common.get(RECORD_KEY)
    if record is not None:
        return record["model"]
    saved_args = common.get("args")
    if saved_args is None:
        raise CheckpointError(f"{directory}: the checkpoint holds neither its arguments nor this project's record")
    # Megatron-LM's own arguments carry the same names; what they lack is completed as for old checkpoints.
    return {key: getattr(saved_args, key) for key in SHAPE_KEYS + tuple(ARCHITECTURE_KEYS) if hasattr(saved_args, key)}


def _find(tree, key: str):
    """The first value stored under ``key`` anywhere in a nested dict/list (None if absent)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        children = tree.values()
    elif isinstance(tree, (list, tuple)):
        children = tree
    else:
        return None
    for child in children:
        found = _find(child, key)
        if found is not None:
            return found
    return None


def _saved_step(optimizer_common) -> Optional[torch.Tensor]:
    """megatron-core keeps Adam's step as ``common_step`` (non-distributed optimizers) or in each
    parameter group (the distributed optimizer)."""
    step = _find(optimizer_common, "common_step")
    if step is None:
        groups = _find(optimizer_common, "param_groups") or []
        steps = [group["step"] for group in groups if isinstance(group, dict) and "step" in group]
        step = steps[0] if steps else None
    return None if step is None else torch.tensor(float(step), dtype=torch.float32)


class _Request:
    """The whole tensors one rank reads, each key and layer asked for once."""

    def __init__(self, metadata: dict, num_layers: int):
        self.metadata = metadata
        self.num_layers = num_layers
        self.items: Dict[str, object] = {}

    def ask(self, key: str, layer: Optional[int], fragments=None):
        """Ask for ``key`` (one layer of it if stacked), whole or the pieces ``fragments`` of it
        (``(axis, index, count)``: a tensor-parallel slice); the request's id (a tuple of ids for
        pieces), or None if not in the checkpoint."""
        meta = self.metadata.get(key)
        if meta is None:
            return None
        shape = list(meta.global_shape[1:] if layer is not None else meta.global_shape)
        idents = []
        for fragment in fragments or [None]:
            ident = f"{key}@{layer}" + ("" if fragment is None else "#{}.{}.{}".format(*fragment))
            if ident not in self.items:
                piece = list(shape)
                if fragment is not None:
                    piece[fragment[0]] //= fragment[2]
                self.items[ident] = sharded_tensor(key, torch.empty(piece, dtype=meta.dtype), layer, self.num_layers,
                                                   fragment=fragment)
            idents.append(ident)
        return tuple(idents) if fragments else idents[0]


def _value(loaded: dict, ident, name: str, param, local) -> torch.Tensor:
    """A loaded tensor as the rank holds it: its pieces joined (a tensor-parallel slice read as pieces),
    or this rank's part of a whole one (``local``: the trainer's ``checkpoint_slice``)."""
    if isinstance(ident, tuple):
        return loaded[ident[0]] if len(ident) == 1 else torch.cat([loaded[i] for i in ident], dim=0)
    return local(name, param, loaded[ident])


def optimizer_before_first_step(metadata: dict, step: Optional[torch.Tensor]) -> bool:
    """Whether the checkpoint holds Adam's state before its first step: no step count (megatron-core writes
    ``common_step`` only once it is positive; it creates Adam's moments lazily, at the first step taken) and no
    moment of any parameter. fp16 runs skip their first steps while the loss scale overflows, and a checkpoint
    saved then is such a one: Adam's state is known exactly (zero moments, step 0), and resuming leaves it
    to be created at the first step, as in the uninterrupted run."""
    if step is not None and float(step) > 0:
        return False
    return not any(key.startswith(f"optimizer.state.{moment}.") for key in metadata for moment in MOMENTS)


def _requested(trainer, args, metadata: dict, directory: str, restore_optimizer: bool, initial: bool = False):
    """The tensors this rank reads (a request) and where each goes: ``(name, param, master, value id,
    {moment: id})`` per parameter. Raises CheckpointError naming what the checkpoint lacks. ``initial``:
    the checkpoint holds Adam's state before its first step (:func:`optimizer_before_first_step`), nothing
    to read."""
    request = _Request(metadata, args.num_layers)
    tied = not args.untie_embeddings_and_output_weights
    targets = []
    keys_map = layer_keys_map(args)
    # A tensor-parallel rank holds a slice of each whole tensor read (native schedules).
    for name, param, master in trainer.named_master_parameters():
        source = tied_alias(name, tied) or name
        key, layer = model_space_key(source, keys_map)
        if key not in metadata:
            raise CheckpointError(f"{directory}: parameter {source} ({key}) is missing from the checkpoint")
        saved_shape = list(metadata[key].global_shape[1:] if layer is not None else metadata[key].global_shape)
        whole = trainer.checkpoint_shape(name, param)
        model_shape = list(master.shape if whole is None else whole)
        if saved_shape != model_shape:
            raise CheckpointError(f"{directory}: parameter {source} has shape {saved_shape}, the model {model_shape}")
        # A weight-passing rank with tensor parallelism reads just its slice (pieces of the whole tensor).
        fragments = trainer.checkpoint_fragments(name, master)
        # fp32 masters: the non-distributed optimizers' fp32_param, the distributed optimizer's param.
        value = (request.ask("optimizer.state.fp32_param." + key, layer, fragments)
                 or request.ask("optimizer.state.param." + key, layer, fragments) or request.ask(key, layer, fragments))
        moments = {}
        if restore_optimizer and not initial:
            for moment in MOMENTS:
                moments[moment] = request.ask(f"optimizer.state.{moment}.{key}", layer, fragments)
                if moments[moment] is None:
                    raise CheckpointSetupError(f"{directory}: no optimizer state ({moment}) for {source}; pass "
                                               "--no-load-optim (or --finetune) to start the optimizer afresh")
        targets.append((name, param, master, value, moments))
    return request, targets


def _agree(problem: Optional[CheckpointError], directory: str) -> None:
    """Every rank raises if any rank cannot load its part, before anyone enters the collective load."""
    kind = 0.0 if problem is None else (2.0 if isinstance(problem, CheckpointSetupError) else 1.0)
    if dist.is_initialized():
        flag = torch.tensor([kind], device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        kind = max(kind, float(flag[0]))
    if problem is not None:
        raise problem
    if kind:
        error = CheckpointSetupError if kind == 2.0 else CheckpointError
        raise error(f"{directory}: another rank cannot load its part of the checkpoint (its message names why)")


def load_checkpoint(root: str, trainer, scheduler, args, report=None) -> Tuple[int, int]:
    """Load the latest torch_dist checkpoint under ``root`` into ``trainer``; ``(iteration, consumed_samples)``
    (what was restored goes into ``report``, a :class:`~.load_record.LoadRecord`)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    directory = checkpoint_dir(root)
    try:
        common = dist_checkpointing.load_common_state_dict(directory)
        metadata = dist_checkpointing.load_tensors_metadata(directory)
    except Exception as exc:  # missing or truncated files
        raise CheckpointError(f"{directory}: unreadable torch_dist checkpoint: {exc}") from exc
    check_signature(_saved_model_signature(common, directory), args, directory)
    record = common.get(RECORD_KEY, {})
    restore_optimizer = not (args.no_load_optim or args.finetune)
    if restore_optimizer and not record.get("optimizer_saved", "optimizer" in common):
        raise CheckpointSetupError(f"{directory} was saved with --no-save-optim: it has no optimizer state to resume "
                                   "from; pass --no-load-optim (or --finetune) to start the optimizer afresh")
    step = _saved_step(common.get("optimizer")) if restore_optimizer else None
    initial = restore_optimizer and optimizer_before_first_step(metadata, step)
    problem = None
    try:
        request, targets = _requested(trainer, args, metadata, directory, restore_optimizer, initial)
    except CheckpointError as exc:
        problem = exc
    _agree(problem, directory)
    same_layout = (record.get("world_size") == world() and record.get("pipeline_schedule") == args.pipeline_schedule
                   and record.get("tensor_model_parallel_size", 1) == args.tensor_model_parallel_size)
    load_rng = same_layout and not args.no_load_rng and not args.finetune and RNG_KEY in metadata_objects(directory)
    if load_rng:
        request.items[RNG_KEY] = rng_object(None)
    try:
        loaded = dist_checkpointing.load(request.items, directory, validate_access_integrity=False)
    except (Exception, CheckpointException) as exc:  # a truncated or missing tensor file
        raise CheckpointError(f"{directory}: reading its tensors failed: {_last_line(exc)}") from exc
    with torch.no_grad():
        for name, param, master, value, moments in targets:
            whole = _value(loaded, value, name, param, trainer.checkpoint_slice)
            master.copy_(whole.to(device=master.device, dtype=torch.float32))
            if param is not master:
                param.copy_(whole.to(device=param.device, dtype=param.dtype))
            if restore_optimizer and not initial:
                state = {moment: _value(loaded, ident, name, param, trainer.checkpoint_slice).float()
                         for moment, ident in moments.items()}
                if step is not None:
                    state["step"] = step
                restore_optimizer_state(trainer, master, state)
    trainer.after_parameters_loaded()  # (--finetune too: replicas and low-precision copies follow the masters)
    if args.finetune:
        note_training_state(report, args, optimizer=False, scheduler=False, rng=False, rng_why=None, iteration=0,
                            consumed=0)
        return 0, 0
    consumed = record.get("consumed_samples", getattr(common.get("args"), "consumed_train_samples", 0))
    saved_iteration = common.get("iteration", iteration)
    with_schedule = scheduler is not None and common.get("opt_param_scheduler") is not None and not args.no_load_optim
    if with_schedule:
        load_scheduler(scheduler, {"scheduler": common["opt_param_scheduler"], "scheduler_units": "samples",
                                   "iteration": saved_iteration, "consumed_samples": consumed}, directory)
    scaler = record.get("grad_scaler") if record else _find(common.get("optimizer"), "grad_scaler")
    if not args.no_load_optim and scaler is not None:
        trainer.load_grad_scaler_state(scaler)
    if load_rng:
        set_rng_state(loaded[RNG_KEY])
    note_training_state(report, args, optimizer=restore_optimizer, scheduler=with_schedule, rng=load_rng, rng_why=None,
                        iteration=saved_iteration, consumed=consumed)
    return saved_iteration, consumed


def _last_line(exc: BaseException) -> str:
    """torch's CheckpointException carries each rank's traceback: its last line is the cause."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def metadata_objects(directory: str) -> set:
    """Keys of the sharded objects (not tensors) a checkpoint holds."""
    from torch.distributed.checkpoint import FileSystemReader

    names = set()
    for fqn in FileSystemReader(directory).read_metadata().state_dict_metadata:
        names.add(fqn.split("/", 1)[0])
    return names


def read_parameters(directory: str) -> Dict[str, torch.Tensor]:
    """Every parameter in ``directory``, whole, without process groups (torch's checkpoint reader in one
    process): the fp32 masters (``fp32_param``, the distributed optimizer's ``param``) where present,
    the stacked decoder keys split into ``decoder.layers.<i>.<...>``."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(directory)
    tensors = {key: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata)}
    sources = {key: next((source for source in ("optimizer.state.fp32_param." + key, "optimizer.state.param." + key)
                          if source in tensors), key)
               for key in tensors if not key.startswith("optimizer.")}
    state = {source: torch.empty(tuple(tensors[source].size), dtype=tensors[source].properties.dtype)
             for source in sources.values()}
    load(state, storage_reader=reader, no_dist=True)
    params = {}
    for key, source in sources.items():
        value = state[source].float()
        if key.startswith("decoder.layers."):  # stacked over the layers
            rest = key[len("decoder.layers."):]
            params.update({f"decoder.layers.{i}.{rest}": value[i] for i in range(value.shape[0])})
        else:
            params[key] = value
    return params
