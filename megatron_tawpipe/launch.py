"""The command-line entry of a training run: validate, train, turn known failures into one line.

Flags are checked before any process group exists (exit 2), and training-time failures (a dead peer, a
NaN, a bad checkpoint) end with one ``PROG: error: ...`` line and exit 1.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional


def run_training(argv: Optional[List[str]] = None, prog: str = "pretrain_llama.py",
                 check: Optional[Callable] = None, trainer_factory: Optional[Callable] = None) -> int:
    import time

    started = time.time()  # --exit-duration-in-mins counts start-up, as Megatron-LM does
    from megatron_tawpipe.arguments import ArgumentError, parse_args, validate_args
    from megatron_tawpipe.data import validate_data_args

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

    from megatron_tawpipe.checkpoint import CheckpointError, CheckpointSetupError
    from megatron_tawpipe.initialize import DistributedSetupError, destroy
    from megatron_tawpipe.runtime.executor import ExecutionError
    from megatron_tawpipe.training import TrainingError, pretrain

    try:
        pretrain(args, trainer_factory=trainer_factory)
    except (DistributedSetupError, CheckpointSetupError) as exc:  # the same command cannot succeed
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (TrainingError, ExecutionError, CheckpointError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        destroy()
    return 0
