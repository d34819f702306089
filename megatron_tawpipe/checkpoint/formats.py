"""The checkpoint formats, one object each, registered by their ``--ckpt-format`` name.

:mod:`megatron_tawpipe.checkpoint` saves, loads and reads through them: ``--ckpt-format`` names the format a save
writes, :func:`recognise` tells a directory's format by its marker files (the first registered format that
recognises it: ``torch_dist`` before ``tawpipe``, as megatron-core up to 0.18 writes a ``common.pt`` too), and a
directory no format recognises is refused naming every format's markers.
"""

from __future__ import annotations

import abc
import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron_tawpipe.checkpoint import legacy_torch, per_parameter
from megatron_tawpipe.common.checkpointable import Checkpointable, ReferenceFactory
from megatron_tawpipe.common.errors import CheckpointError, CheckpointSetupError


class CheckpointFormat(abc.ABC):
    """One format: its name, the files that tell it, and how it saves, loads and reads a checkpoint.

    ``save`` and ``load`` are collective (every rank calls them); ``legacy_reference`` builds megatron-core's own
    objects at tensor/pipeline size 1 for a weight-passing run, through which Megatron-LM's legacy files hold the
    optimizer state (the other formats do without)."""

    name: str
    description: str              # how a refusal of an unrecognised directory names it, with its marker files
    arguments_file: Optional[str] = None   # the file named when the saved arguments are unreadable (else the dir)

    @abc.abstractmethod
    def recognises(self, directory: str) -> bool:
        """Whether ``directory`` holds a checkpoint of this format (by its marker files)."""

    @abc.abstractmethod
    def save(self, root: str, iteration: int, consumed_samples: int, trainer: Checkpointable, scheduler, args,
             legacy_reference: Optional[ReferenceFactory] = None) -> str:
        """Write ``iter_XXXXXXX`` under ``root``; its final directory."""

    @abc.abstractmethod
    def load(self, root: str, trainer: Checkpointable, scheduler, args, report,
             legacy_reference: Optional[ReferenceFactory] = None) -> Tuple[int, int]:
        """Load the checkpoint the tracker under ``root`` names; ``(iteration, consumed_samples)``."""

    @abc.abstractmethod
    def saved_arguments(self, directory: str) -> Dict[str, object]:
        """The arguments the checkpoint in ``directory`` was saved with."""

    @abc.abstractmethod
    def read_parameters(self, directory: str) -> Dict[str, torch.Tensor]:
        """Every parameter in ``directory``, whole, on the host, under global names."""


class TorchDistFormat(CheckpointFormat):
    """Megatron-LM's default, megatron-core's ``dist_checkpointing`` (:mod:`.torch_dist`, imported when used)."""

    name, description = "torch_dist", "a torch_dist checkpoint (.metadata)"

    def recognises(self, directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, ".metadata"))

    def save(self, root, iteration, consumed_samples, trainer, scheduler, args, legacy_reference=None) -> str:
        from megatron_tawpipe.checkpoint import torch_dist

        return torch_dist.save_checkpoint(root, iteration, consumed_samples, trainer, scheduler, args)

    def load(self, root, trainer, scheduler, args, report, legacy_reference=None) -> Tuple[int, int]:
        from megatron_tawpipe.checkpoint import torch_dist

        return torch_dist.load_checkpoint(root, trainer, scheduler, args, report)

    def saved_arguments(self, directory: str) -> Dict[str, object]:
        # Megatron-LM stores its argparse namespace in the common part: common.pt up to megatron-core
        # 0.18, an object inside the .distcp files from 0.19 (megatron-core reads either).
        from megatron.core import dist_checkpointing

        return dict(vars(dist_checkpointing.load_common_state_dict(directory)["args"]))

    def read_parameters(self, directory: str) -> Dict[str, torch.Tensor]:
        from megatron_tawpipe.checkpoint import torch_dist

        return torch_dist.read_parameters(directory)


class LegacyTorchFormat(CheckpointFormat):
    """Megatron-LM's legacy per-rank files (:mod:`.legacy_torch`)."""

    name, description = "torch", "Megatron-LM's legacy torch format (mp_rank_*/model_optim_rng.pt)"

    def recognises(self, directory: str) -> bool:
        return legacy_torch.is_legacy_dir(directory)

    def save(self, root, iteration, consumed_samples, trainer, scheduler, args, legacy_reference=None) -> str:
        return legacy_torch.save_checkpoint(root, iteration, consumed_samples, trainer, scheduler, args,
                                            legacy_reference)

    def load(self, root, trainer, scheduler, args, report, legacy_reference=None) -> Tuple[int, int]:
        return legacy_torch.load_checkpoint(root, trainer, scheduler, args, report, legacy_reference)

    def saved_arguments(self, directory: str) -> Dict[str, object]:
        return dict(vars(legacy_torch.saved_args(directory)))

    def read_parameters(self, directory: str) -> Dict[str, torch.Tensor]:
        return legacy_torch.read_parameters(directory)


class PerParameterFormat(CheckpointFormat):
    """This project's earlier per-parameter files (:mod:`.per_parameter`)."""

    name, description = "tawpipe", "this project's per-parameter format (common.pt)"
    arguments_file = "common.pt"

    def recognises(self, directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, "common.pt"))

    def save(self, root, iteration, consumed_samples, trainer, scheduler, args, legacy_reference=None) -> str:
        return per_parameter.save_checkpoint(root, iteration, consumed_samples, trainer, scheduler, args)

    def load(self, root, trainer, scheduler, args, report, legacy_reference=None) -> Tuple[int, int]:
        return per_parameter.load_checkpoint(root, trainer, scheduler, args, report)

    def saved_arguments(self, directory: str) -> Dict[str, object]:
        """Its model signature only."""
        return dict(torch.load(os.path.join(directory, "common.pt"), map_location="cpu", weights_only=True)["model"])

    def read_parameters(self, directory: str) -> Dict[str, torch.Tensor]:
        return per_parameter.read_parameters(directory)


_REGISTERED: Dict[str, CheckpointFormat] = {}


def register(fmt: CheckpointFormat) -> CheckpointFormat:
    """Add ``fmt`` after the formats registered so far; a second format of the same name is refused."""
    if fmt.name in _REGISTERED:
        raise ValueError(f"checkpoint format {fmt.name!r} is registered already")
    _REGISTERED[fmt.name] = fmt
    return fmt


def registered() -> List[CheckpointFormat]:
    """The formats, in the order :func:`recognise` tries them."""
    return list(_REGISTERED.values())


def named(name: str) -> CheckpointFormat:
    """The format ``--ckpt-format name`` writes."""
    try:
        return _REGISTERED[name]
    except KeyError:
        raise CheckpointSetupError(f"--ckpt-format {name}: not a format this project writes "
                                   f"({', '.join(_REGISTERED)})") from None


def recognise(directory: str) -> CheckpointFormat:
    """The format of the checkpoint in ``directory``, from its files; a CheckpointError naming every format's
    markers when none recognises it."""
    for fmt in _REGISTERED.values():
        if fmt.recognises(directory):
            return fmt
    kinds = [fmt.description for fmt in _REGISTERED.values()]
    listed = f"neither {', '.join(kinds[:-1])} nor {kinds[-1]}" if len(kinds) > 1 else f"not {kinds[0]}"
    raise CheckpointError(f"{directory}: {listed}")


TORCH_DIST = register(TorchDistFormat())
LEGACY_TORCH = register(LegacyTorchFormat())
PER_PARAMETER = register(PerParameterFormat())
