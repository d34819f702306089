"""Megatron-LM's flags that this project accepts without acting on them, or refuses with a reason.

A Megatron-LM launch script must run here with only ``--pipeline-schedule`` changed, or stop
at once with one line that says which flag is the problem and what it needs. The flags that
this project implements, with Megatron-LM's meaning and default, are defined in
:mod:`megatron_tawpipe.arguments`. This module holds the rest:

* :data:`NO_EFFECT` — accepted; when given, one notice says why nothing changes here
  (a GPU profiler hook, a flag Megatron-LM itself ignores, a DeepSpeed switch);
* :data:`REFUSED` — refused before any process group exists, in one line that says what
  the flag needs or what to use instead (fp8/fp4, Megatron-FSDP's fp8 options, mixture of experts, ...);
* every other flag of Megatron-LM's own parser (``megatron_lm_flags.txt``): refused in one
  line as a Megatron-LM flag this project does not implement, never argparse's bare
  "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_lm_flags.txt")


@dataclasses.dataclass(frozen=True)
class CompatFlag:
    """A Megatron-LM flag parsed only to be answered: ``kwargs`` go to ``add_argument``."""

    flag: str
    kwargs: dict
    reason: str
    # Refused (or noticed) only for the values this returns True for; default: any value given.
    applies: Optional[Callable[[object], bool]] = None

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flag[2:].replace("-", "_")

    def given(self, value) -> bool:
        if value is None or value is False:
            return False
        return True if self.applies is None else bool(self.applies(value))


SWITCH = {"action": "store_true"}
VALUE = {"default": None}
INT = {"type": int, "default": None}

_PROFILER = "no profiler hooks here: run under nsys, or --timeline-file for the weight-passing schedules"
_TENSORBOARD = ("not written to TensorBoard (--metrics-file has the memory fields); the loss, learning rate, "
                "gradient norm, loss scale, timings and validation are")
_DEEPSPEED = ("DeepSpeed is not used: training runs on megatron-core, with batch sizes and precision from "
              "the flags (no DeepSpeed config file is read)")

NO_EFFECT: Sequence[CompatFlag] = (
    CompatFlag("--use-mcore-models", dict(SWITCH, dest="deprecated_use_mcore_models"),
               "megatron-core models are the only kind (Megatron-LM ignores this flag too)"),
    CompatFlag("--use-flash-attn", SWITCH,
               "Megatron-LM no longer reads it; the attention kernel follows --attention-backend"),
    CompatFlag("--no-async-tensor-model-parallel-allreduce", SWITCH,
               "Megatron-LM removed it; it never changed results"),
    CompatFlag("--use-contiguous-parameters-in-local-ddp", SWITCH,
               "megatron-core's DDP always keeps parameters and gradients in contiguous buffers"),
    CompatFlag("--manual-gc", SWITCH, "Python's garbage collector stays automatic"),
    CompatFlag("--manual-gc-interval", INT, "Python's garbage collector stays automatic"),
    CompatFlag("--empty-unused-memory-level", dict(type=int, default=0, choices=(0, 1, 2)),
               "the CUDA caching allocator is not flushed between steps", applies=lambda v: v != 0),
    CompatFlag("--profile", SWITCH, _PROFILER),
    CompatFlag("--use-pytorch-profiler", SWITCH, _PROFILER),
    CompatFlag("--profile-step-start", INT, _PROFILER),
    CompatFlag("--profile-step-end", INT, _PROFILER),
    CompatFlag("--profile-ranks", dict(nargs="+", type=int, default=None), _PROFILER),
    CompatFlag("--timing-log-level", dict(type=int, default=0, choices=(0, 1, 2)),
               "no per-phase timers: the log line has the iteration time, --timeline-file the weight-passing "
               "schedules' phases", applies=lambda v: v != 0),
    CompatFlag("--log-memory-to-tensorboard", SWITCH, _TENSORBOARD),
    CompatFlag("--log-world-size-to-tensorboard", SWITCH, _TENSORBOARD),
    CompatFlag("--log-params-norm", SWITCH, "the parameter norm is not computed (the gradient norm is logged)"),
    CompatFlag("--log-num-zeros-in-grad", SWITCH, "zeros in the gradient are not counted"),
    CompatFlag("--ckpt-fully-parallel-save", SWITCH,
               "deprecated in Megatron-LM; checkpoints are written by every rank in parallel anyway"),
    CompatFlag("--async-save", SWITCH, "checkpoints are written synchronously (and atomically)"),
    CompatFlag("--dist-ckpt-strictness", VALUE, "loading asks for exactly the tensors the model needs and names any "
               "that is missing; other entries of a checkpoint are ignored"),
    CompatFlag("--auto-detect-ckpt-format", SWITCH, "the format of a checkpoint is always detected when loading"),
    CompatFlag("--deterministic-mode", SWITCH,
               "CPU kernels are deterministic; on GPUs non-deterministic kernels are not forbidden"),
    CompatFlag("--data-impl", VALUE, "Megatron-LM removed it: .bin/.idx data are memory-mapped "
               "(--no-mmap-bin-files reads them instead)"),
    CompatFlag("--no-query-key-layer-scaling", SWITCH,
               "query-key layer scaling is off unless --apply-query-key-layer-scaling, as in Megatron-LM"),
    CompatFlag("--zero-stage", {"type": float, "default": None},
               "DeepSpeed's ZeRO is not used; for sharded optimizer state use --use-distributed-optimizer "
               "(stages 1-2), --use-torch-fsdp2 or --pipeline-schedule tawpipe (stage 3): the arithmetic is "
               "the same"),
    CompatFlag("--rampup-batch-size", dict(nargs=3, default=None),
               "deprecated, and ignored by Megatron-LM since megatron-core 0.18 as it is here: the global batch "
               "is --global-batch-size throughout (--step-batch-size-schedule ramps it)"),
    CompatFlag("--deepspeed", SWITCH, _DEEPSPEED),
    CompatFlag("--deepspeed_config", VALUE, _DEEPSPEED),
    CompatFlag("--deepspeed-activation-checkpointing", SWITCH,
               "DeepSpeed is not used; --recompute-granularity full recomputes activations"),
)

# Megatron-LM's fp8 / fp4 flags (Transformer Engine recipes).
_LOW_PRECISION_FLAGS = (
    ("--fp8-format", {"default": None, "metavar": "{e4m3,hybrid}"}),
    ("--fp8-recipe", {"default": None, "metavar": "{tensorwise,delayed,mxfp8,blockwise,custom}"}),
    ("--fp8-param-gather", SWITCH),
    ("--fp8-margin", INT),
    ("--fp8-interval", INT),
    ("--fp8-amax-history-len", INT),
    ("--fp8-amax-compute-algo", {"default": None, "metavar": "{most_recent,max}"}),
    ("--no-fp8-wgrad", SWITCH),
    ("--fp8-dot-product-attention", SWITCH),
    ("--fp8-multi-head-attention", SWITCH),
    ("--first-last-layers-bf16", SWITCH),
    ("--keep-fp8-weight-transpose-cache-te", SWITCH),
    ("--fp4-format", {"default": None, "metavar": "{e2m1}"}),
    ("--fp4-recipe", {"default": None, "metavar": "{nvfp4,custom}"}),
    ("--fp4-param-gather", SWITCH),
)
LOW_PRECISION: Sequence[CompatFlag] = tuple(
    CompatFlag(flag, kwargs, f"{'fp4' if flag.startswith('--fp4') else 'fp8'} training is not supported yet; "
                             "train in fp32 (default), --bf16 or --fp16")
    for flag, kwargs in _LOW_PRECISION_FLAGS)

_FSDP = ("Megatron-FSDP's fp8 / double-buffer options are not supported; --use-megatron-fsdp runs without them")
_NOT_YET = "not supported yet"

REFUSED: Sequence[CompatFlag] = LOW_PRECISION + (
    CompatFlag("--use-legacy-models", SWITCH,
               "legacy models are gone from Megatron-LM; this project trains megatron-core's GPTModel"),
    CompatFlag("--fsdp-double-buffer", SWITCH, _FSDP),
    CompatFlag("--keep-fp8-transpose-cache", SWITCH, _FSDP),
    CompatFlag("--num-experts", INT, "mixture-of-experts models are not supported (dense decoder layers only)",
               applies=lambda v: v != 0),
    CompatFlag("--tp-comm-overlap", SWITCH, "needs tensor parallelism with Transformer Engine's userbuffers on GPUs"),
)

COMPAT_FLAGS: Sequence[CompatFlag] = tuple(NO_EFFECT) + tuple(REFUSED)


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """Register the NO_EFFECT and REFUSED flags (hidden from --help)."""
    for entry in COMPAT_FLAGS:
        parser.add_argument(entry.flag, help=argparse.SUPPRESS, **entry.kwargs)


def _shown(entry: CompatFlag, value) -> str:
    if value is True:
        return entry.flag
    if isinstance(value, (list, tuple)):
        return f"{entry.flag} {' '.join(str(v) for v in value)}"
    return f"{entry.flag} {value}"


def compat_refusal(args: argparse.Namespace) -> Optional[str]:
    """The one-line reason for the first REFUSED flag given, or None."""
    for entry in REFUSED:
        value = getattr(args, entry.dest, None)
        if entry.given(value):
            return f"{_shown(entry, value)}: {entry.reason}"
    return None


def compat_notices(args: argparse.Namespace) -> List[str]:
    """One notice per NO_EFFECT flag given."""
    return [f"{_shown(entry, getattr(args, entry.dest))}: {entry.reason}" for entry in NO_EFFECT
            if entry.given(getattr(args, entry.dest, None))]


@functools.lru_cache(maxsize=1)
def megatron_lm_flags() -> Dict[str, str]:
    """Every flag of Megatron-LM's (and Megatron-DeepSpeed's) parser -> where it comes from."""
    flags: Dict[str, str] = {}
    with open(_TABLE, encoding="utf-8") as table:
        for line in table:
            if line.startswith("#") or not line.strip():
                continue
            fields = line.split()
            flags[fields[0]] = fields[2] if len(fields) > 2 else "megatron-lm"
    return flags


@functools.lru_cache(maxsize=1)
def installed_megatron_lm_parser() -> Optional[argparse.ArgumentParser]:
    """Megatron-LM's own parser where the installed megatron-core ships ``megatron.training``
    (0.17 and later), else None. It is the authority on which Megatron-LM flags exist, how many
    values each takes and what its default is, for the version installed."""
    try:
        from megatron.training.arguments import add_megatron_arguments
    except Exception:   # 0.16 ships no megatron.training; a broken optional import must not stop training
        return None
    parser = argparse.ArgumentParser(prog="Megatron-LM", allow_abbrev=False, add_help=False)
    try:
        return add_megatron_arguments(parser) or parser
    except Exception:
        return None


class _ParserError(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    def error(self, message):
        raise _ParserError(message)


def settle_megatron_lm_flags(unknown: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Split the words this project's parser did not take, using the installed Megatron-LM parser:
    ``(still unknown, notices)``. A Megatron-LM flag this project does not implement, given with
    Megatron-LM's default value, changes nothing and is accepted with a notice; given with another
    value, it stays unknown (and is refused by :func:`explain_unknown`)."""
    parser = installed_megatron_lm_parser()
    if parser is None or not unknown:
        return list(unknown), []
    quiet = _QuietParser(allow_abbrev=False, add_help=False)
    for action in parser._actions:
        quiet._add_action(action)
    unset = object()   # argparse fills in a default only where the namespace has no value yet
    namespace = argparse.Namespace(**{action.dest: unset for action in parser._actions})
    try:
        parsed, rest = quiet.parse_known_args(list(unknown), namespace)
    except _ParserError as exc:   # a Megatron-LM flag with a value Megatron-LM itself refuses
        raise ValueError(f"Megatron-LM's parser: {exc}") from None
    defaults = {action.dest: action.default for action in parser._actions}
    kept, notices = [], []
    for dest, value in vars(parsed).items():
        if value is unset:
            continue
        flags = [f for a in parser._actions if a.dest == dest for f in a.option_strings]
        shown = next((f for f in flags if any(w.split("=", 1)[0] == f for w in unknown)), flags[0] if flags else dest)
        if value == defaults.get(dest):
            notices.append(f"{shown}: Megatron-LM's default value; nothing to do here")
        else:
            kept.append(shown)
    return kept + list(rest), notices


def explain_unknown(unknown: Sequence[str]) -> str:
    """The one-line error for command-line words the parser did not take."""
    known = dict(megatron_lm_flags())
    parser = installed_megatron_lm_parser()
    if parser is not None:
        known.update({flag: "megatron-lm" for action in parser._actions for flag in action.option_strings})
    for word in unknown:
        flag = word.split("=", 1)[0]
        if flag.startswith("--moe-"):
            return f"{flag}: mixture-of-experts models are not supported (dense decoder layers only)"
        if flag in known:
            origin = "Megatron-DeepSpeed" if known[flag] == "megatron-deepspeed" else "Megatron-LM"
            return (f"{flag} is a {origin} flag this project does not implement (docs/pretrain-llama-and-"
                    "megatron-lm.md, 'Coming from Megatron-LM', lists what carries over)")
    return f"unrecognized arguments: {' '.join(unknown)}"
