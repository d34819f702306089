"""The rules of Megatron-LM's ``--use-precision-aware-optimizer`` and its dtype flags, on the flags' strings alone
(no torch: checking a command line does not import it); :mod:`.precision_aware` maps them to torch."""

from __future__ import annotations

import importlib.util
import inspect
from typing import Optional

from megatron_tawpipe.arguments.run_config import PrecisionConfig

DTYPE_FLAGS = (("--main-grads-dtype", "main_grads_dtype"), ("--main-params-dtype", "main_params_dtype"),
               ("--exp-avg-dtype", "exp_avg_dtype"), ("--exp-avg-sq-dtype", "exp_avg_sq_dtype"))
MOMENT_DTYPES = ("fp32", "fp16", "bf16")   # what PrecisionAwareAdamW stores


def transformer_engine_fused_adam() -> bool:
    """Whether Transformer Engine's FusedAdam with the precision-aware arguments is installed (megatron-core's
    requirement for its precision-aware optimizer)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception:   # noqa: BLE001 - a broken install is as good as none
        return False
    names = inspect.signature(FusedAdam).parameters
    return all(n in names for n in ("master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "use_decoupled_grad"))


def precision_refusal(args, weight_passing: bool, fused_adam=transformer_engine_fused_adam) -> Optional[str]:
    """One line refusing the precision flags as given, or None (megatron-core's and Megatron-LM's rules, and
    what this runtime implements). ``fused_adam()`` says whether Transformer Engine's FusedAdam is there."""
    precision = PrecisionConfig.from_args(args)
    chosen = [f"{flag} {getattr(precision, dest)}" for flag, dest in DTYPE_FLAGS if getattr(precision, dest) != "fp32"]
    if not precision.use_precision_aware_optimizer:
        if chosen:
            return (f"{chosen[0]} needs --use-precision-aware-optimizer (without it megatron-core keeps main "
                    "gradients, main parameters and Adam's moments in fp32)")
        return None
    if args.optimizer != "adam":
        return f"--use-precision-aware-optimizer applies to --optimizer adam only, got --optimizer {args.optimizer}"
    if args.main_grads_dtype == "bf16":
        if not args.bf16:
            return ("--main-grads-dtype bf16 needs --bf16 (the main gradients accumulate bf16 compute's "
                    "gradients; fp32 and fp16 training keep gradients in the parameters' dtype)")
        if args.accumulate_allreduce_grads_in_fp32:
            return ("--main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32 (fp32 gradient "
                    "accumulation and reduction); drop one")
    if args.main_params_dtype != "fp32" and not (args.bf16 or args.fp16):
        return (f"--main-params-dtype {args.main_params_dtype} needs --bf16 or --fp16 (in fp32 training the "
                "parameters are the main parameters)")
    if weight_passing:
        for flag, dest in DTYPE_FLAGS[2:]:
            if getattr(precision, dest) not in MOMENT_DTYPES:
                return (f"{flag} {getattr(precision, dest)} (Transformer Engine's scaled fp8 storage) is not implemented "
                        f"for --pipeline-schedule {args.pipeline_schedule}: its Adam stores moments in "
                        f"{', '.join(MOMENT_DTYPES)}")
        return None
    if args.use_torch_fsdp2:
        return ("--use-precision-aware-optimizer is megatron-core's distributed optimizer's; --use-torch-fsdp2 "
                "steps torch's AdamW on fp32 shards (--grad-reduce-in-bf16 gives it bf16 gradient reduction)")
    if not args.use_distributed_optimizer:
        return "--use-precision-aware-optimizer needs --use-distributed-optimizer (megatron-core's rule)"
    if not fused_adam():
        return (f"--use-precision-aware-optimizer with --pipeline-schedule {args.pipeline_schedule} needs Transformer "
                "Engine's FusedAdam (megatron-core's precision-aware optimizer), which is not installed; without it "
                "--grad-reduce-in-bf16 gives megatron's DDP bf16 gradient buffers and reduction")
    return None
