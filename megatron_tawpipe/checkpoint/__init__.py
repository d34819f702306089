"""Checkpoints that any schedule can resume from.

Three formats, chosen with ``--ckpt-format`` when saving and recognised by their files when loading:

* ``torch_dist`` (the default, Megatron-LM's): megatron-core's ``dist_checkpointing``, tensors under
  megatron-core's model-space keys (:mod:`.torch_dist`), written in the background with ``--async-save``
  (:mod:`.async_save`);
* ``torch``: Megatron-LM's legacy per-rank files, weights (:mod:`.legacy_torch`);
* ``tawpipe``: this project's earlier per-parameter files (:mod:`.per_parameter`), still loadable.

``--save-retain-interval`` applies to all of them (:mod:`.retention`). Megatron-LM's older model's names
(``language_model.*``, its converter's default saver) are read under megatron-core's (:mod:`.legacy_names`);
Hugging Face weights come in and go out through :mod:`.hf_convert` (``tools/hf_checkpoint.py``). A load
prints one line of what it restored (:mod:`.load_record`).
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch

from megatron_tawpipe.checkpoint import async_save, legacy_torch, per_parameter
from megatron_tawpipe.checkpoint.load_record import LoadRecord
from megatron_tawpipe.checkpoint.state import (ARCHITECTURE_KEYS, SHAPE_KEYS, TRACKER_FILE, checkpoint_dir,
                                                is_release, iteration_dir, latest_iteration, model_signature, rank)
from megatron_tawpipe.common.checkpointable import Checkpointable
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError

def save_checkpoint(root: str, iteration: int, consumed_samples: int, trainer: Checkpointable, scheduler,
                    args) -> str:
    """Collectively write a checkpoint of ``trainer`` in ``--ckpt-format`` (every rank must call it)."""
    if getattr(args, "ckpt_format", "torch_dist") == "tawpipe":
        return per_parameter.save_checkpoint(root, iteration, consumed_samples, trainer, scheduler, args)
    from megatron_tawpipe.checkpoint import torch_dist

    if args.ckpt_format == "torch":
        return legacy_torch.save_checkpoint(root, iteration, consumed_samples, trainer, scheduler, args,
                                            torch_dist.saved_arguments(args, consumed_samples))

    return torch_dist.save_checkpoint(root, iteration, consumed_samples, trainer, scheduler, args)


def finalize_async_saves(blocking: bool = False) -> None:
    """``--async-save``: make the background saves that are done on every rank visible (all of them, waiting,
    with ``blocking``); collective, called by every rank at the same points of the training loop."""
    async_save.finalize(blocking)


def close_async_saves(abort: bool) -> None:
    """End of training: finalize pending background saves, or with ``abort`` (a failed run) drop them unfinished."""
    async_save.close(abort)


def checkpoint_format(directory: str) -> str:
    """``torch_dist``, ``torch`` or ``tawpipe``, from the files in a checkpoint directory."""
    if os.path.isfile(os.path.join(directory, ".metadata")):
        return "torch_dist"
    if os.path.isfile(os.path.join(directory, "common.pt")):
        return "tawpipe"
    if legacy_torch.is_legacy_dir(directory):
        return "torch"
    raise CheckpointError(f"{directory}: neither a torch_dist checkpoint (.metadata), Megatron-LM's legacy torch "
                          "format (mp_rank_*/model_optim_rng.pt) nor this project's per-parameter format (common.pt)")


def load_checkpoint(root: str, trainer: Checkpointable, scheduler, args) -> Tuple[int, int]:
    """Load the latest checkpoint under ``root`` in whichever format it was written;
    returns ``(iteration, consumed_samples)``, ``(0, 0)`` when there is none. Rank 0 prints one line: the
    directory, format, iteration, and what was and was not restored; ``args.loaded_checkpoint`` names the
    directory for the run's summary."""
    iteration = latest_iteration(root)
    if iteration is None:
        return 0, 0
    directory = checkpoint_dir(root)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{root}: the tracker names iteration {iteration}, but {directory} is missing")
    kind = checkpoint_format(directory)
    report = LoadRecord(directory, kind, release=is_release(root), iteration=iteration)
    if kind == "tawpipe":
        position = per_parameter.load_checkpoint(root, trainer, scheduler, args, report)
    elif kind == "torch":
        position = legacy_torch.load_checkpoint(root, trainer, scheduler, args, report)
    else:
        from megatron_tawpipe.checkpoint import torch_dist

        position = torch_dist.load_checkpoint(root, trainer, scheduler, args, report)
    args.loaded_checkpoint = directory
    if rank() == 0:
        print(report.line(root), flush=True)
    return position


# What --use-checkpoint-args takes from a checkpoint (Megatron-LM's list, as far as this project has the flags).
CHECKPOINT_ARGS = tuple(key for key in SHAPE_KEYS if key != "padded_vocab_size") + tuple(ARCHITECTURE_KEYS) + (
    "seq_length", "max_position_embeddings", "group_query_attention", "vocab_size", "tokenizer_type",
    "tokenizer_model", "make_vocab_size_divisible_by")


def checkpoint_arguments(root: str) -> Optional[Tuple[str, Dict[str, object]]]:
    """``(directory, {argument: value})`` of the model arguments the latest checkpoint under ``root``
    was trained with; None when ``root`` holds no checkpoint."""
    if latest_iteration(root) is None:
        return None
    directory = checkpoint_dir(root)
    saved = saved_run_arguments(directory)
    return directory, {key: saved[key] for key in CHECKPOINT_ARGS if key in saved}


def saved_run_arguments(directory: str) -> Dict[str, object]:
    """The arguments the checkpoint in ``directory`` was saved with (Megatron-LM's ``args``; for this project's
    per-parameter format, its model signature only)."""
    path = os.path.join(directory, "common.pt")
    try:
        kind = checkpoint_format(directory)
        if kind == "torch":
            return dict(vars(legacy_torch.saved_args(directory)))
        if kind == "torch_dist":
            # Megatron-LM stores its argparse namespace in the common part: common.pt up to megatron-core
            # 0.18, an object inside the .distcp files from 0.19 (megatron-core reads either).
            from megatron.core import dist_checkpointing

            path = directory
            return dict(vars(dist_checkpointing.load_common_state_dict(directory)["args"]))
        return dict(torch.load(path, map_location="cpu", weights_only=True)["model"])
    except (OSError, KeyError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint's arguments: {exc}") from exc


def read_parameters(directory: str) -> Dict[str, torch.Tensor]:
    """Every parameter of the checkpoint in ``directory``, whole, on the host, without process groups: the
    fp32 masters where the checkpoint has them. Names are global (``decoder.layers.3.<...>``); a torch_dist
    checkpoint names them by megatron-core's keys (a local layer's norms under Transformer Engine's names)."""
    kind = checkpoint_format(directory)
    if kind == "tawpipe":
        return per_parameter.read_parameters(directory)
    if kind == "torch":
        return legacy_torch.read_parameters(directory)
    from megatron_tawpipe.checkpoint import torch_dist

    return torch_dist.read_parameters(directory)


__all__ = ["ARCHITECTURE_KEYS", "CHECKPOINT_ARGS", "TRACKER_FILE", "CheckpointError", "CheckpointSetupError",
           "checkpoint_arguments", "checkpoint_format", "close_async_saves", "finalize_async_saves", "iteration_dir",
           "latest_iteration", "load_checkpoint", "model_signature", "read_parameters", "save_checkpoint",
           "saved_run_arguments"]
