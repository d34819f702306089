"""The command-line entry of a training run: validate, train, turn known failures into one line.

Flags are checked before any process group exists (exit 2), and training-time failures end with one
``PROG: error: ...`` line: exit 1 for a lost peer (a restart can help), 3 for a failure that recurs from
the same checkpoint (a NaN, a checkpoint that does not load). Refusals and repeatable failures are also
recorded for the launch scripts (:mod:`megatron_tawpipe.common.exit_record`).
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional

from megatron_tawpipe.common.exit_record import EXIT_STATUS, REFUSED, REPEATABLE, STOPPED, record_exit


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
        if args.pipeline_schedule == "auto":   # the run picks the strategy (collective: the process group is made)
            from megatron_tawpipe.cli.auto_schedule import choose_schedule

            argv = choose_schedule(list(sys.argv[1:] if argv is None else argv))
            args = parse_args(argv)
        args.program_start_time = started
        validate_args(args)
        validate_data_args(args)
        if check is not None:
            check(args)
    except (ArgumentError, ValueError, FileNotFoundError) as exc:
        from megatron_tawpipe.distributed.initialize import destroy

        destroy()   # --pipeline-schedule auto may have made the process group
        return _fail(prog, exc, REFUSED)

    from megatron_tawpipe.common.errors import (CheckpointError, CheckpointSetupError, DistributedSetupError,
                                                ExecutionError, PeerFailure, TrainingError)
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.training import pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step

    try:
        records = pretrain(args, forward_step_func or gpt_forward_step, trainer_factory=trainer_factory)
    except (DistributedSetupError, CheckpointSetupError) as exc:  # the same command cannot succeed
        return _fail(prog, exc, REFUSED)
    except PeerFailure as exc:   # a peer stopped or is unreachable: a restart can fix it (nothing recorded)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except (TrainingError, ExecutionError, CheckpointError) as exc:   # recurs from the same checkpoint
        return _fail(prog, exc, REPEATABLE)
    finally:
        destroy()
    reason = getattr(records, "stop_reason", None)
    if reason:   # stopped on request: status 0, recorded so that the launch scripts do not restart it
        last = records[-1].iteration if records else None
        record_exit(STOPPED, f"stopped after iteration {last}: {reason}")
    return EXIT_STATUS[STOPPED] if reason else 0


def _fail(prog: str, exc: BaseException, kind: str) -> int:
    """Print the one error line and record why this rank ends (for the launch scripts); the exit status."""
    line = f"{prog}: error: {exc}"
    if not record_exit(kind, line):
        print(line, file=sys.stderr)
    return EXIT_STATUS[kind]
