"""The error every plan check raises (defined with the package's other errors)."""

from megatron_tawpipe.common.errors import PlanError

__all__ = ["PlanError"]
