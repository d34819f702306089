"""Checkpoints that any schedule can resume from.

Three formats, chosen with ``--ckpt-format`` when saving and recognised by their files when loading, each an
object of :mod:`.formats`' registry that the functions here dispatch through:

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

from megatron_tawpipe.checkpoint import async_save, formats
from megatron_tawpipe.checkpoint.load_record import LoadRecord
from megatron_tawpipe.checkpoint.state import (ARCHITECTURE_KEYS, SHAPE_KEYS, TRACKER_FILE, checkpoint_dir,
                                                is_release, iteration_dir, latest_iteration, model_signature, rank)
from megatron_tawpipe.common.checkpointable import Checkpointable, ReferenceFactory
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError


def save_checkpoint(root: str, iteration: int, consumed_samples: int, trainer: Checkpointable, scheduler,
                    args, legacy_reference: Optional[ReferenceFactory] = None) -> str:
    """Collectively write a checkpoint of ``trainer`` in ``--ckpt-format`` (every rank must call it).
    ``legacy_reference``: a weight-passing run's builder of megatron-core's objects at tensor/pipeline size 1, through
    which ``--ckpt-format torch`` writes its optimizer state (:mod:`.legacy_reference`)."""
    fmt = formats.named(args.ckpt_format)
    return fmt.save(root, iteration, consumed_samples, trainer, scheduler, args, legacy_reference)


def finalize_async_saves(blocking: bool = False) -> None:
    """``--async-save``: make the background saves that are done on every rank visible (all of them, waiting,
    with ``blocking``); collective, called by every rank at the same points of the training loop."""
    async_save.finalize(blocking)


def close_async_saves(abort: bool) -> None:
    """End of training: finalize pending background saves, or with ``abort`` (a failed run) drop them unfinished."""
    async_save.close(abort)


def checkpoint_format(directory: str) -> str:
    """``torch_dist``, ``torch`` or ``tawpipe``, from the files in a checkpoint directory."""
    return formats.recognise(directory).name


def load_checkpoint(root: str, trainer: Checkpointable, scheduler, args,
                    legacy_reference: Optional[ReferenceFactory] = None) -> Tuple[int, int]:
    """Load the latest checkpoint under ``root`` in whichever format it was written;
    returns ``(iteration, consumed_samples)``, ``(0, 0)`` when there is none. Rank 0 prints one line: the
    directory, format, iteration, and what was and was not restored; ``args.loaded_checkpoint`` names the
    directory for the run's summary. ``legacy_reference`` as for :func:`save_checkpoint`."""
    iteration = latest_iteration(root)
    if iteration is None:
        return 0, 0
    directory = checkpoint_dir(root)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{root}: the tracker names iteration {iteration}, but {directory} is missing")
    fmt = formats.recognise(directory)
    report = LoadRecord(directory, fmt.name, release=is_release(root), iteration=iteration)
    position = fmt.load(root, trainer, scheduler, args, report, legacy_reference)
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
    fmt = formats.recognise(directory)
    try:
        return fmt.saved_arguments(directory)
    except (OSError, KeyError, RuntimeError, EOFError) as exc:
        path = os.path.join(directory, fmt.arguments_file) if fmt.arguments_file else directory
        raise CheckpointError(f"{path}: cannot read the checkpoint's arguments: {exc}") from exc


def read_parameters(directory: str) -> Dict[str, torch.Tensor]:
    """Every parameter of the checkpoint in ``directory``, whole, on the host, without process groups: the
    fp32 masters where the checkpoint has them. Names are global (``decoder.layers.3.<...>``); a torch_dist
    checkpoint names them by megatron-core's keys (a local layer's norms under Transformer Engine's names)."""
    return formats.recognise(directory).read_parameters(directory)


__all__ = ["ARCHITECTURE_KEYS", "CHECKPOINT_ARGS", "TRACKER_FILE", "CheckpointError", "CheckpointSetupError",
           "checkpoint_arguments", "checkpoint_format", "close_async_saves", "finalize_async_saves", "iteration_dir",
           "latest_iteration", "load_checkpoint", "model_signature", "read_parameters", "save_checkpoint",
           "saved_run_arguments"]
