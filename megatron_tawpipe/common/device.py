"""This rank's device."""

from __future__ import annotations

import torch


def current_device() -> torch.device:
    """This rank's device: its GPU, or the host (NCCL reduces device tensors only)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
