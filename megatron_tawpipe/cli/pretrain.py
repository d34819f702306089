"""The command-line entry of a training run: validate, train, turn known failures into one line.

Flags are checked before any process group exists (exit 2), and training-time failures (a dead peer, a
NaN, a bad checkpoint) end with one ``PROG: error: ...`` line and exit 1.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional


def run_training(argv: Optional[List[str]] = None, prog: str = "pretrain_llama.py",
                 check: Optional[Callable] = None, trainer_factory: Optional[Callable] = None,
                 forward_step_func: Optional[Callable] = None) -> int:
    """Parse and validate ``argv``, then train with ``forward_step_func`` (the GPT forward step by default);
    returns the exit status."""
    import time

    started = time.time()  # --exit-duration-in-mins counts start-up, as Megatron-LM does
    from megatron_tawpipe.compat.extensions import missing_extension_warnings_once

    missing_extension_warnings_once()
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.common.errors import ArgumentError
    from megatron_tawpipe.data import validate_data_args
    from megatron_tawpipe.training.validate_args import validate_args

    try:
        args = parse_args(argv)
        args.program_start_time = started
        validate_args(args)
        validate_data_args(args)
        if check is not None:
            check(args)
    except (ArgumentError, ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2

    from megatron_tawpipe.common.errors import (CheckpointError, CheckpointSetupError, DistributedSetupError,
                                                ExecutionError, TrainingError)
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.training import pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step

    try:
        pretrain(args, forward_step_func or gpt_forward_step, trainer_factory=trainer_factory)
    except (DistributedSetupError, CheckpointSetupError) as exc:  # the same command cannot succeed
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (TrainingError, ExecutionError, CheckpointError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        destroy()
    return 0
