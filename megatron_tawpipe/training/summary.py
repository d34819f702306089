"""The closing summary of a training job, printed once (by the rank that writes the metrics) when it ends.

It says how far the job got and with what loss, where its metrics and checkpoints are, the exact command
that resumes it from its last checkpoint, and what to try next. The resume command is the job's own
command with ``--load`` (and, when every iteration ran, a longer ``--train-iters`` continuing on the
checkpoint's LR schedule): the command a launch script names in ``TAWPIPE_LAUNCH_COMMAND``, else the one
rebuilt from torchrun's environment and ``sys.argv``. A launch script may name the next things to try in
``TAWPIPE_NEXT_STEPS`` (one per line).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from typing import Dict, List, Optional, Sequence

from megatron_tawpipe.common.launcher import local_world_size

LAUNCH_COMMAND_ENV = "TAWPIPE_LAUNCH_COMMAND"
NEXT_STEPS_ENV = "TAWPIPE_NEXT_STEPS"
_ENTRY_SCRIPT = "pretrain_llama.py"
# Flags the resume command sets itself: (flag spellings, takes a value).
_RESUME_FLAGS = ((("--load",), True), (("--train-iters",), True),
                 (("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"), False))


def _python() -> str:
    """The interpreter as a user would type it: its name when that is the one on PATH, else its path."""
    name = os.path.basename(sys.executable)
    found = shutil.which(name)
    same = found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)
    return name if same else sys.executable


def _without_resume_flags(argv: Sequence[str]) -> List[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        for spellings, takes_value in _RESUME_FLAGS:
            if arg in spellings:
                skip = takes_value
                break
            if takes_value and any(arg.startswith(s + "=") for s in spellings):
                break
        else:
            out.append(arg)
    return out


def _shell_join(words: Sequence[str]) -> str:
    """shlex.join, keeping leading ``NAME=value`` words assignments (only the value quoted)."""
    out, leading = [], True
    for word in words:
        name, eq, value = word.partition("=")
        if leading and eq and name.isidentifier():
            out.append(name + "=" + shlex.quote(value))
            continue
        leading = False
        out.append(shlex.quote(word))
    return " ".join(out)


def launch_command(environ: Optional[Dict[str, str]] = None, argv: Optional[Sequence[str]] = None) -> Optional[str]:
    """The command that started this job, as a shell line; None when it cannot be known (the training
    was called in-process, not through ``pretrain_llama.py``)."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    if environ.get(LAUNCH_COMMAND_ENV):   # a launch script's command: the flags the resume line sets come off
        return _shell_join(_without_resume_flags(shlex.split(environ[LAUNCH_COMMAND_ENV])))
    if not argv or os.path.basename(argv[0]) != _ENTRY_SCRIPT:
        return None
    script = os.path.relpath(argv[0]) if not os.path.relpath(argv[0]).startswith("..") else argv[0]
    rest = _without_resume_flags(list(argv[1:]))
    if "TORCHELASTIC_RUN_ID" not in environ:   # one process, started directly
        return shlex.join([_python(), script] + rest)
    nodes = int(environ.get("GROUP_WORLD_SIZE", "1"))
    per_node = str(local_world_size(environ=environ))
    launcher = [_python(), "-m", "torch.distributed.run"]
    if nodes == 1:
        launcher += ["--standalone", "--nproc-per-node", per_node]
    else:   # every node runs it; node 0's address is the rendezvous point
        endpoint = f"{environ.get('MASTER_ADDR', 'localhost')}:{environ.get('MASTER_PORT', '29500')}"
        launcher += ["--nnodes", str(nodes), "--nproc-per-node", per_node, "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", endpoint]
    return shlex.join(launcher + [script] + rest)


def resume_command(args, finished: bool, environ: Optional[Dict[str, str]] = None,
                   argv: Optional[Sequence[str]] = None) -> Optional[str]:
    """The command that resumes from the last checkpoint (None without ``--save``): the job's command with
    ``--load``; when every iteration ran, with twice the iterations, on the checkpoint's LR schedule
    (``--use-checkpoint-opt_param-scheduler``: the run goes on at the minimum LR it decayed to)."""
    if not args.save:
        return None
    extra = ["--load", args.save]
    if finished:
        extra += ["--train-iters", str(2 * args.train_iters), "--use-checkpoint-opt_param-scheduler"]
    command = launch_command(environ, argv)
    if command is None:
        return "this job's command with " + shlex.join(extra) + (" and without --finetune" if args.finetune else "")
    if args.finetune:   # the resume goes on from the saved state, not from the weights only
        command = shlex.join(word for word in shlex.split(command) if word != "--finetune")
    return command + " " + shlex.join(extra)


def next_steps(args, environ: Optional[Dict[str, str]] = None) -> List[str]:
    """What to try next: the launch script's suggestions, else ones that follow from this run's flags."""
    environ = os.environ if environ is None else environ
    if environ.get(NEXT_STEPS_ENV):
        return [line.strip() for line in environ[NEXT_STEPS_ENV].splitlines() if line.strip()]
    schedule = args.pipeline_schedule
    if schedule in ("tawpipe", "weipipe"):
        other = "weipipe" if schedule == "tawpipe" else "tawpipe"
        steps = ["native megatron-core on the same model and data: --pipeline-schedule 1f1b "
                 "--pipeline-model-parallel-size 1, then tools/compare_metrics.py on the two metrics files",
                 f"the other weight-passing schedule: --pipeline-schedule {other}"]
    elif getattr(args, "context_parallel_size", 1) > 1:
        steps = ["a weight-passing schedule with the same --context-parallel-size on the same model and data: "
                 "--pipeline-schedule tawpipe --pipeline-model-parallel-size 1 (docs/long-context.md)",
                 "the strategies priced for this model, sequence and cluster: tools/simulate.py --advise"]
    else:
        steps = ["a weight-passing schedule on the same model and data: --pipeline-schedule tawpipe "
                 "--pipeline-model-parallel-size 1, then tools/compare_metrics.py on the two metrics files"]
    steps.append("several machines: examples/pretrain_llama_multinode.sh (docs/pretrain-llama-and-megatron-lm.md)")
    return steps


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def closing_summary(args, records: Sequence, iteration: int, exit_reason: Optional[str], started: float,
                    environ: Optional[Dict[str, str]] = None, argv: Optional[Sequence[str]] = None) -> str:
    """The summary's lines. ``records``: this job's iteration records (``lm_loss``, ``iteration``,
    ``extra``); ``iteration``: the last one reached; ``exit_reason``: why it stopped early, or None."""
    finished = exit_reason is None and iteration >= args.train_iters
    ran = len(records)
    first = iteration - ran + 1
    if ran:
        how_far = (f"iterations {first}-{iteration} of {args.train_iters} in {_duration(time.time() - started)}"
                   + (f" (stopped early: {exit_reason})" if exit_reason else ""))
    else:
        how_far = f"no iteration ran: the job started at iteration {iteration} of {args.train_iters}"
    world = _world_size()
    lines = [" " + "-" * 30 + " summary of this run " + "-" * 30,
             f" trained      {how_far}; --pipeline-schedule {args.pipeline_schedule}, "
             f"{world} rank{'s' if world != 1 else ''}"]
    if ran:
        last = records[-1]
        loss = f"lm loss {last.lm_loss:.6E} at iteration {last.iteration}"
        validated = [r for r in records if r.extra.get("validation_lm_loss") is not None]
        if validated:
            loss += (f"; validation lm loss {validated[-1].extra['validation_lm_loss']:.6E} "
                     f"at iteration {validated[-1].iteration}")
        lines.append(f" final loss   {loss}")
    lines.append(f" metrics      {args.metrics_file}" if args.metrics_file
                 else " metrics      none written (--metrics-file PATH: one JSON line per iteration)")
    if args.save:
        lines.append(f" checkpoints  {args.save} (latest: iteration {iteration})")
        lines.append(f" resume       {resume_command(args, finished, environ, argv)}")
    elif args.loaded_checkpoint:
        lines.append(f" checkpoints  loaded {args.loaded_checkpoint}; none saved (--save DIR --save-interval N keeps them)")
    else:
        lines.append(" checkpoints  none (--save DIR --save-interval N keeps them; --load DIR resumes)")
    steps = next_steps(args, environ)
    for i, step in enumerate(steps):
        lines.append(f" {'next' if i == 0 else '':<12} {step}")
    return "\n".join(lines)


def print_closing_summary(args, records: Sequence, iteration: int, exit_reason: Optional[str], started: float,
                          is_writer: bool) -> None:
    """Print :func:`closing_summary` on the one rank that writes the metrics (``is_writer``)."""
    if is_writer:
        print(closing_summary(args, records, iteration, exit_reason, started), flush=True)
