"""What every checkpoint format shares: errors, atomic files, RNG states, the model signature,
the LR schedule and the per-parameter state a trainer hands over.

A trainer exposes ``named_master_parameters()`` (global name, model parameter, fp32 master or a
stand-in that copies its own slice), ``optimizer_state_for`` / ``set_optimizer_state``,
``writes_checkpoint()``, ``skip_in_checkpoint(name)``, optionally ``gathered_masters()`` (whole
tensors gathered for the writing rank), ``checkpoint_shape`` / ``checkpoint_slice`` (a rank holding
a slice of each whole tensor), ``checkpoint_fragments`` / ``checkpoint_replica`` (torch_dist: a
slice written and read as pieces of the whole tensor, and which copy of an unsplit one is written),
the grad scaler's state and ``after_parameters_loaded()``; where it has them, megatron-core's own model chunks
and optimizer (``megatron_model_chunks()``, ``megatron_optimizer()``: :mod:`.megatron_state`). Every checkpoint
file is read through :func:`load_file`.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_tawpipe.arguments import plain_arguments
from megatron_tawpipe.common.atomic import atomic_write_text, fsync_dir
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
logger = logging.getLogger(__name__)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def load_file(path: str, *, weights_only: bool = True, mmap: bool = True):
    """``torch.load`` of one checkpoint file onto the host; a missing, truncated or corrupt file is a
    CheckpointError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing") from exc
    except Exception as exc:  # truncated or corrupt file
        raise CheckpointError(f"checkpoint file {path} is unreadable or truncated: {exc}") from exc


def saved_arguments(args, consumed_samples: int) -> argparse.Namespace:
    """The run's arguments as Megatron-LM stores them (``consumed_train_samples`` included)."""
    saved = argparse.Namespace(**plain_arguments(args))
    saved.consumed_train_samples = consumed_samples
    saved.consumed_valid_samples = 0
    return saved


def rng_device_type() -> str:
    """The device type whose generators this process's RNG states hold: ``cuda`` on a GPU machine (the CUDA
    generator, megatron-core's RNG tracker of CUDA states), ``cpu`` without CUDA (the CPU compatibility layer
    makes the tracker hold CPU generator states)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def saved_rng_device(state: dict) -> str:
    """The device type a saved RNG state comes from: its ``device`` entry, or for states saved before it
    was recorded, ``cuda`` when it carries a CUDA generator state (only a GPU machine saved one)."""
    device = state.get("device")
    if device is None:
        return "cuda" if "cuda" in state else "cpu"
    if device not in ("cpu", "cuda"):
        raise CheckpointError(f"the saved RNG state comes from device type {device!r}; expected cpu or cuda")
    return device


_MACHINE = {"cpu": "CPU", "cuda": "GPU (cuda)"}


def rng_state() -> dict:
    """This rank's RNG states: Python, NumPy and torch's CPU generator, the CUDA generator on a GPU
    machine, megatron-core's RNG tracker (dropout), and the device type they were taken on."""
    # Only tensors and plain Python values, so that weights_only loading works.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    device = rng_device_type()
    state = {
        "device": device,
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # Host tensors (a CUDA generator's state is one already): the object unpickles without a GPU.
    state["tracker"] = {name: value.cpu() if isinstance(value, torch.Tensor) else value
                        for name, value in get_cuda_rng_tracker().get_states().items()}
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`'s states, also from a state saved on the other device type.

    The Python, NumPy and torch CPU generators are restored whatever the device. The CUDA generator and
    megatron-core's tracker states are restored only where they were saved on the same device type: a
    CUDA generator state does not fit the CPU generator the tracker forks on a CPU machine, nor a CPU
    state a GPU's. Across device types these keep the states seeded from ``--seed`` at start-up (the same
    on every run), and one line says so.
    """
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    saved, here = saved_rng_device(state), rng_device_type()
    if saved != here:
        if rank() == 0:
            kept = "megatron's RNG tracker (dropout) keeps" if here == "cpu" else \
                "the CUDA generator and megatron's RNG tracker (dropout) keep"
            logger.warning("RNG state saved on a %s machine, restored on a %s machine: Python, NumPy and torch's "
                           "CPU generator restored; %s the states seeded from --seed at start-up",
                           _MACHINE[saved], _MACHINE[here], kept)
        return
    if here == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(state["tracker"])


def tied_alias(name: str, tied: bool) -> Optional[str]:
    """With tied embeddings, a later pipeline stage's output layer is a replica of the embeddings."""
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return None


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def writer_entries(trainer):
    """``(name, fp32 master, optimizer state)`` this rank writes.

    A trainer that shards parameters or optimizer state over ranks gathers them in
    ``gathered_masters()``: every rank calls it (collectives), the writing rank gets the whole
    tensors. Otherwise the writing ranks read their own masters.
    """
    gathered = trainer.gathered_masters()
    if gathered is not None:
        return gathered if trainer.writes_checkpoint() else []
    if not trainer.writes_checkpoint():
        return []
    return ((name, master, trainer.optimizer_state_for(master))
            for name, _param, master in trainer.named_master_parameters())


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


def saved_signature(saved: dict) -> dict:
    """A checkpoint's model signature, completed with what older checkpoints implied."""
    completed = dict(saved)
    for key, legacy in ARCHITECTURE_KEYS.items():
        if key not in completed:
            completed[key] = saved["hidden_size"] // saved["num_attention_heads"] if key == "kv_channels" else legacy
    return completed


RELEASE = "release"  # Megatron-LM's tracker text for a released (converted) checkpoint, in SAVE/release/


def is_release(root: str) -> bool:
    """Whether the tracker under ``root`` names Megatron-LM's ``release`` checkpoint (weights, iteration 0)."""
    tracker = os.path.join(root, TRACKER_FILE)
    return os.path.isfile(tracker) and open(tracker, encoding="utf-8").read().strip() == RELEASE


def checkpoint_dir(root: str) -> Optional[str]:
    """The directory the tracker under ``root`` names (``iter_NNNNNNN`` or ``release``); None without a tracker."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    return os.path.join(root, RELEASE) if is_release(root) else iteration_dir(root, iteration)


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the tracker under ``root`` names (0 for Megatron-LM's ``release``); None without one."""
    tracker = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker, encoding="utf-8").read().strip()
    if text == RELEASE:
        return 0
    try:
        return int(text)
    except ValueError as exc:
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}") from exc


def load_scheduler(scheduler, common: dict, directory: str) -> None:
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


def restore_optimizer_state(trainer, master: torch.Tensor, saved: dict) -> None:
    """Copies (never views of the memory-mapped file) beside the master; step counts stay on the host."""
    if not saved:
        return
    restored = {key: value.to(master.device, copy=True) if value.dim() else value.clone()
                for key, value in saved.items()}
    trainer.set_optimizer_state(master, restored)


SIGNATURE_FLAGS = {"add_bias_linear": "--disable-bias-linear",
                   # The padding is a multiple of --make-vocab-size-divisible-by x the tensor-parallel size
                   # (as in Megatron-LM): another tensor-parallel size can pad the same tokenizer differently.
                   "padded_vocab_size": "(the tokenizer's size padded to a multiple of --make-vocab-size-divisible-by "
                                        "x --tensor-model-parallel-size)",
                    "use_rope_scaling": "--use-rope-scaling"}


# Settings that change no tensor's shape and only how the weights are used: a run that starts afresh from a
# checkpoint's weights (--finetune, --no-load-optim) takes them from its own flags, as Megatron-LM does (its
# checkpoint-args check is skipped under --finetune): a Llama 3 model converted with rope base 10000 recorded
# trains with --rotary-base 500000, a context extension changes the rope base or scaling. Norm epsilon and
# dropout are never part of the signature.
RUN_SETTINGS = ("rotary_base", "use_rope_scaling", "rope_scaling_factor")


def starts_afresh(args) -> bool:
    """Whether the run takes only the checkpoint's weights (--finetune or --no-load-optim)."""
    return bool(args.finetune or args.no_load_optim)


def check_signature(saved_model: dict, args, directory: str) -> None:
    """Refuse (exit status 2) a checkpoint whose model differs from the one the flags describe, naming the
    flag; under --finetune / --no-load-optim the run's own :data:`RUN_SETTINGS` are used, in one line."""
    saved = saved_signature(saved_model)
    current = model_signature(args)
    afresh, taken = starts_afresh(args), []
    for key, value in current.items():
        if saved.get(key) != value:
            flag = SIGNATURE_FLAGS.get(key, "--" + key.replace("_", "-"))
            if afresh and key in RUN_SETTINGS:
                taken.append(f"{flag} {value} (checkpoint: {key}={saved.get(key)})")
                continue
            hint = (" (it changes no tensor's shape: with --finetune or --no-load-optim this run's value is used)"
                    if key in RUN_SETTINGS else "")
            raise CheckpointSetupError(
                f"{directory}: checkpoint has {key}={saved.get(key)}, this run {flag} gives {value}{hint}")
    if taken and rank() == 0:
        print(f" {directory}: the checkpoint's weights with this run's " + ", ".join(taken)
              + " (--finetune / --no-load-optim: settings that change no shape come from the flags)", flush=True)


def start_checkpoint_dir(root: str, iteration: int):
    """``(temporary, final)`` directories of a checkpoint being written; rank 0 makes the (empty)
    temporary one and every rank waits for it."""
    import shutil

    tmp_dir, final_dir = iteration_dir(root, iteration) + ".tmp", iteration_dir(root, iteration)
    if rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
    barrier()
    return tmp_dir, final_dir


def promote_checkpoint_dir(tmp_dir: str, final_dir: str, root: str, iteration: int,
                           retain_interval: Optional[int] = None) -> None:
    """Rank 0, once every file is written and fsynced: rename the temporary directory into place, then
    replace the tracker (a run killed before this leaves the previous checkpoint as the latest); then, with
    ``--save-retain-interval``, delete the previous latest checkpoint if its iteration is not retained."""
    import shutil

    from megatron_tawpipe.checkpoint import retention

    try:
        previous = latest_iteration(root)
    except CheckpointError:
        previous = None
    fsync_dir(tmp_dir)
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(tmp_dir, final_dir)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, TRACKER_FILE), f"{iteration}\n", durable=True)
    if retention.expendable(previous, iteration, retain_interval):
        retention.delete_checkpoint(root, previous, latest=iteration)
