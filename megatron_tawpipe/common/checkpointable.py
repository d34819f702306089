"""The interface a trainer offers the checkpoint formats (:mod:`megatron_tawpipe.checkpoint`).

Every trainer (weight passing, megatron-core's own schedules, FSDP2) implements :class:`Checkpointable`;
:class:`CheckpointDefaults` gives the optional hooks their plain meaning (whole tensors, nothing gathered, no
tensor-parallel slices), so a trainer overrides only what differs. A trainer exposes state only (masters, Adam
state, loss scaler, megatron-core's own objects where it has them); how each format lays it out is the checkpoint
code's, which calls these methods directly and never probes a trainer for what it happens to have.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple

import torch


class Checkpointable(Protocol):
    """What the checkpoint code reads from and writes into a trainer."""

    optimizer: object

    def named_master_parameters(self) -> Iterator[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``(global name, parameter, fp32 master)`` for every parameter this rank updates."""

    def optimizer_state_for(self, master: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The Adam state of ``master`` (``exp_avg``, ``exp_avg_sq``, ``step``)."""

    def set_optimizer_state(self, master: torch.Tensor, state: Dict[str, torch.Tensor]) -> None:
        """Restore the Adam state of ``master``."""

    def writes_checkpoint(self) -> bool:
        """Whether this rank writes the parameters it holds (or gathered)."""

    def skip_in_checkpoint(self, name: str) -> bool:
        """Whether this rank leaves ``name`` to another rank that holds the same tensor."""

    def grad_scaler_state(self) -> Optional[dict]:
        """The loss scaler's state (None without one)."""

    def load_grad_scaler_state(self, state: Optional[dict]) -> None:
        """Restore the loss scaler's state."""

    def after_parameters_loaded(self) -> None:
        """Masters were loaded: copy them wherever the trainer keeps working copies."""

    def gathered_masters(self) -> Optional[Iterable[Tuple[str, torch.Tensor, Dict[str, torch.Tensor]]]]:
        """Collective (every rank calls it): ``(name, whole master, whole Adam state)`` on the writing rank,
        for a trainer that shards parameters or optimizer state over ranks; None when it does not."""

    def checkpoint_shape(self, name: str, param: torch.Tensor) -> Optional[Tuple[int, ...]]:
        """The whole tensor's shape in a checkpoint; None when it is the master's own shape."""

    def checkpoint_slice(self, name: str, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's (tensor-parallel) slice of a whole tensor read from a checkpoint."""

    def checkpoint_fragments(self, name: str, master: torch.Tensor) -> Optional[List[Tuple[int, int, int]]]:
        """Where this rank's slice lies in the whole tensor, as ``(axis, index, count)`` pieces; None for whole."""

    def checkpoint_replica(self, name: str, master: Optional[torch.Tensor]) -> int:
        """0 where this rank's copy of ``name`` is the one written."""

    def checkpoint_layer_module(self) -> Optional[torch.nn.Module]:
        """A decoder layer whose extra state goes into torch_dist checkpoints; None when there is none."""

    def megatron_model_chunks(self) -> Optional[List[torch.nn.Module]]:
        """megatron-core's own model chunks (unwrapped, the last step's parameter gather finished), whose state
        Megatron-LM's formats write as megatron-core gives it; None where the trainer has none."""

    def megatron_optimizer(self) -> Optional[object]:
        """megatron-core's own optimizer (``get_megatron_optimizer``'s), whose state Megatron-LM's formats write
        and read as megatron-core gives and takes it; None where the trainer has none."""


# Builds (collectively, on every rank) megatron-core's own model and non-distributed optimizer at tensor/pipeline
# size 1 beside a weight-passing run: Megatron-LM's legacy files hold its optimizer state through them.
ReferenceFactory = Callable[[], Checkpointable]


class CheckpointDefaults:
    """The optional hooks of :class:`Checkpointable` with their plain meaning."""

    def gathered_masters(self):
        return None

    def checkpoint_shape(self, name: str, param: torch.Tensor) -> Optional[Tuple[int, ...]]:
        return None

    def checkpoint_slice(self, name: str, param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        return whole

    def checkpoint_fragments(self, name: str, master: torch.Tensor) -> Optional[List[Tuple[int, int, int]]]:
        return None

    def checkpoint_replica(self, name: str, master: Optional[torch.Tensor]) -> int:
        return 0

    def checkpoint_layer_module(self) -> Optional[torch.nn.Module]:
        return None

    def megatron_model_chunks(self) -> Optional[List[torch.nn.Module]]:
        return None

    def megatron_optimizer(self) -> Optional[object]:
        return None
