"""The error every plan check raises."""

from __future__ import annotations

from typing import Optional

from . import actions as A


class PlanError(Exception):
    """A plan is unsound.  ``rank``, ``step`` and ``action`` name the place to
    blame when there is one; the message then starts ``rank R, step S, Action(...)``."""

    def __init__(self, message: str, rank: Optional[int] = None, step: Optional[int] = None,
                 action=None):
        self.rank, self.step, self.action = rank, step, action
        if rank is not None:
            where = f"rank {rank}, step {step}"
            if action is not None:
                where += f", {A.describe(action)}"
            message = f"{where}: {message}"
        super().__init__(message)
