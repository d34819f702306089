"""megatron-core's own pipeline schedule function for a layout, across megatron-core releases.

``get_forward_backward_func`` takes ``(pp_size=None, vp_size=None)`` from 0.16 through 0.18 and adds
``schedule_pg_collection=None`` in 0.19 (used there only to pick the multi-module bridge schedule); with no
arguments every release reads the sizes from ``parallel_state``.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional


def layout_keywords(megatron_get: Callable, pp_size: Optional[int], vp_size: Optional[int]) -> dict:
    """The keywords to pass to megatron's ``get_forward_backward_func`` for a pipeline layout.

    Sizes go in explicitly where the function takes ``pp_size`` and ``vp_size`` (0.16 and
    later); otherwise, or when no size is given, it reads them from ``parallel_state``.
    ``schedule_pg_collection`` (0.19+) is left out: it only selects the multi-module schedule.
    """
    if pp_size is None and vp_size is None:
        return {}
    parameters = inspect.signature(megatron_get).parameters
    if "pp_size" in parameters and "vp_size" in parameters:
        return {"pp_size": pp_size, "vp_size": vp_size}
    return {}


def megatron_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None) -> Callable:
    """megatron-core's schedule function for a pipeline of ``pp_size`` stages (``vp_size`` virtual)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_get

    return megatron_get(**layout_keywords(megatron_get, pp_size, vp_size))
