"""Megatron-LM's knobs of megatron-core's own pipeline schedules and DDP (``--pipeline-schedule 1f1b`` /
``interleaved``): passed to megatron-core's config as Megatron-LM passes them. The weight-passing schedules
send no activations between pipeline stages and run no megatron DDP, so there these knobs change nothing
and each given gets one notice."""

from __future__ import annotations

import argparse
from typing import List

from megatron_tawpipe.arguments.choices import non_negative_int, positive_int
from megatron_tawpipe.arguments.weight_passing import is_weight_passing

# flag -> (dest, Megatron-LM's default): what a weight-passing run notices when given.
NATIVE_PIPELINE_FLAGS = {
    "--no-overlap-p2p-communication": ("overlap_p2p_comm", True),
    "--overlap-p2p-communication": ("overlap_p2p_comm", True),
    "--overlap-p2p-communication-warmup-flush": ("overlap_p2p_comm_warmup_flush", False),
    "--defer-embedding-wgrad-compute": ("defer_embedding_wgrad_compute", False),
    "--wgrad-deferral-limit": ("wgrad_deferral_limit", 0),
    "--no-align-grad-reduce": ("align_grad_reduce", True),
    "--disable-align-grad-reduce": ("align_grad_reduce", True),
    "--no-align-param-gather": ("align_param_gather", True),
    "--microbatch-group-size-per-virtual-pipeline-stage": ("microbatch_group_size_per_vp_stage", None),
}


def add_native_pipeline_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("native pipeline schedules (megatron-core's 1F1B / interleaved; Megatron-LM's "
                                  "flags and defaults)")
    g.add_argument("--no-overlap-p2p-communication", "--overlap-p2p-communication", dest="overlap_p2p_comm",
                   nargs=0, action=_OverlapP2P, default=True,
                   help="interleaved: overlap the stages' sends and receives with compute (default on; "
                        "--no-overlap-p2p-communication batches them instead, which needs pipeline size > 2)")
    g.add_argument("--overlap-p2p-communication-warmup-flush", dest="overlap_p2p_comm_warmup_flush",
                   action="store_true", help="interleaved: overlap p2p also in warmup and flush")
    g.add_argument("--defer-embedding-wgrad-compute", action="store_true",
                   help="native pipelines: compute the output layer's weight gradient during the pipeline flush "
                        "(needs CUDA's fused gradient accumulation)")
    g.add_argument("--wgrad-deferral-limit", type=non_negative_int, default=0,
                   help="with --defer-embedding-wgrad-compute: micro-batches deferred at most (0: all)")
    g.add_argument("--no-align-grad-reduce", "--disable-align-grad-reduce", dest="align_grad_reduce",
                   action="store_false", default=True,
                   help="with --overlap-grad-reduce: every pipeline stage starts its gradient reduction on its "
                        "own instead of together")
    g.add_argument("--no-align-param-gather", dest="align_param_gather", action="store_false", default=True,
                   help="interleaved with --overlap-param-gather: every model chunk gathers its weights on its own "
                        "instead of the schedule starting them together")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", dest="microbatch_group_size_per_vp_stage",
                   type=positive_int, default=None,
                   help="interleaved: micro-batches run per model chunk in a row (default: the pipeline size)")


class _OverlapP2P(argparse.Action):
    """--overlap-p2p-communication (Megatron-DeepSpeed's spelling) on, --no-overlap-p2p-communication off."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))


def native_pipeline_notices(args: argparse.Namespace) -> List[str]:
    """One notice per native-pipeline knob given (not at its default) under a weight-passing schedule;
    under the native schedules, the combinations megatron-core refuses, as one ValueError line."""
    changed = [flag for flag, (dest, default) in NATIVE_PIPELINE_FLAGS.items()
               if getattr(args, dest) != default and flag.startswith(("--no-", "--disable-")) ==
               (default is True)]
    if is_weight_passing(args.pipeline_schedule):
        return [f"{flag}: a knob of megatron-core's own pipeline schedules and DDP; --pipeline-schedule "
                f"{args.pipeline_schedule} sends weights, not activations, and reduces gradients itself"
                for flag in _given_spelling(changed)]
    interleaved = args.pipeline_schedule == "interleaved"
    if args.overlap_p2p_comm_warmup_flush and not (interleaved and args.overlap_p2p_comm):
        raise ValueError("--overlap-p2p-communication-warmup-flush needs --pipeline-schedule interleaved with p2p "
                         "overlap (no --no-overlap-p2p-communication)")
    if interleaved and not args.overlap_p2p_comm and args.pipeline_model_parallel_size <= 2:
        raise ValueError(f"--no-overlap-p2p-communication with --pipeline-schedule interleaved needs "
                         f"--pipeline-model-parallel-size > 2 (Megatron-LM's rule), got "
                         f"{args.pipeline_model_parallel_size}")
    if args.defer_embedding_wgrad_compute and args.pipeline_model_parallel_size == 1:
        raise ValueError("--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1 with "
                         "--pipeline-schedule 1f1b or interleaved")
    return []


def _given_spelling(flags: List[str]) -> List[str]:
    """One flag per knob (the --no-/--disable- spellings of one dest name the same change)."""
    out, dests = [], set()
    for flag in flags:
        dest = NATIVE_PIPELINE_FLAGS[flag][0]
        if dest not in dests:
            dests.add(dest)
            out.append(flag)
    return out
