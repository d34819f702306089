"""``tools/gpu_check.py``: check and measure one rank on one GPU (or, for CI, on the CPU).

Checks, in order (``--checks`` picks a subset):

``compute``  the decoder layers' forward + backward as a weight-passing rank runs them against
             native megatron-core's on the same layers and weights: tokens/s of each, their
             ratio, and the same output and gradients within a dtype-derived tolerance.
``te``       Transformer Engine's layer spec against the local spec, same weights,
             bf16 and fp32: output, input gradient and weight gradients within tolerance.
``losses``   a one-rank ``--pipeline-schedule tawpipe`` run against native 1F1B with
             pipeline size 1 on a small Llama: losses per iteration within tolerance.
``wait``     host time per plan ``Wait`` in that TawPipe run, and a ``Wait`` behind a
             known amount of queued GPU work (does ``Wait`` block the host?).
``timings``  per-shard forward / backward / recompute times at a real size, written as
             the calibration JSON (``--times-output``).
``memory``   one rank's memory after a TawPipe run at the real size against the
             simulator's prediction for the same configuration.

A table (check, result, figures) goes to stdout; ``--json PATH`` writes everything.
The exit status is 1 when a correctness check (``compute``, ``te``, ``losses``) FAILED or a
check could not run, 0 otherwise (``differs`` in ``memory`` is a finding, not a failure).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import sys
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional

import torch

from tawpipe_lab.one_rank import LlamaRun
from megatron_tawpipe.common.atomic import atomic_write_json

PROG = "gpu_check.py"
CHECKS = ("compute", "te", "losses", "wait", "timings", "memory")
DEFAULT_LOSS_RTOL = {"bf16": 1e-2, "fp32": 1e-4}


@dataclass
class CheckRow:
    check: str
    result: str             # ok | FAILED | measured | differs | skipped: ... | error: ...
    figures: str
    details: Dict[str, object] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.result == "FAILED" or self.result.startswith("error")

    def to_json(self) -> dict:
        return {"check": self.check, "result": self.result, "figures": self.figures, "details": self.details}


# ---- flags ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Check and measure one rank on one GPU: weight-passing compute vs native megatron-core "
        "(tokens/s), TE layer spec vs local, TawPipe vs "
        "native 1F1B losses, host time per plan Wait, per-shard compute times (calibration JSON), memory "
        "against the simulator.", allow_abbrev=False)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default; refused without a GPU) or cpu (small sizes: checks the tool itself)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    p.add_argument("--times-output", metavar="PATH",
                   help="calibration JSON of --checks timings (default: PATH of --json with .times.json, "
                        "else gpu_check_times.json)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="compute dtype of the training runs and timings (the TE check runs both)")
    p.add_argument("--attention-backend", choices=("auto", "te", "sdpa", "local"), default="auto",
                   help="layer spec of the runs and timings (auto: TE when installed, else SDPA)")
    real = p.add_argument_group("real size (compute, timings, memory)")
    real.add_argument("--hidden-size", type=int, default=4096)
    real.add_argument("--num-attention-heads", type=int, default=32)
    real.add_argument("--num-query-groups", type=int, default=None, help="default: --num-attention-heads")
    real.add_argument("--ffn-hidden-size", type=int, default=None, help="default: Llama's 8H/3 rounded to 64")
    real.add_argument("--seq-length", type=int, default=16384)
    real.add_argument("--layers-per-shard", type=int, default=2)
    real.add_argument("--micro-batch-size", type=int, default=1)
    real.add_argument("--vocab-size", type=int, default=32000)
    real.add_argument("--repeats", type=int, default=5, help="timed runs per figure (the fastest counts)")
    real.add_argument("--warmup", type=int, default=2, help="untimed runs before them")
    real.add_argument("--compute-rtol", type=float, default=None,
                      help="relative tolerance of the compute check's output and gradients (default: from the "
                           "dtype, bf16 1.6e-2, fp32 1e-4)")
    real.add_argument("--memory-microbatches", type=int, default=2, help="micro-batches of the memory run")
    real.add_argument("--memory-rtol", type=float, default=0.25,
                      help="|measured / predicted - 1| up to which memory 'agrees'")
    small = p.add_argument_group("small Llama (te, losses, wait)")
    small.add_argument("--small-num-layers", type=int, default=4)
    small.add_argument("--small-hidden-size", type=int, default=1024)
    small.add_argument("--small-num-attention-heads", type=int, default=16)
    small.add_argument("--small-seq-length", type=int, default=2048)
    small.add_argument("--small-global-batch-size", type=int, default=4, help="micro-batch 1: the micro-batches")
    small.add_argument("--small-iters", type=int, default=5, help="training iterations (>= 2)")
    small.add_argument("--loss-rtol", type=float, default=None,
                       help=f"relative loss tolerance (default {DEFAULT_LOSS_RTOL})")
    small.add_argument("--te-rtol", type=float, default=None,
                       help="relative tolerance of the TE check (default: bf16 3e-2, fp32 2e-3)")
    wait = p.add_argument_group("wait probe")
    wait.add_argument("--wait-probe-ms", type=float, default=50.0, help="GPU work queued before the probed Wait")
    wait.add_argument("--wait-probe-matmul", type=int, default=4096, help="size of the square matmuls queued")
    wait.add_argument("--wait-probe-repeats", type=int, default=5)
    return p


def parse_tool_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    tool = parser.parse_args(argv)
    problem = _flag_problem(tool)
    if problem:
        parser.error(problem)
    tool.checks = [c.strip() for c in tool.checks.split(",") if c.strip()]
    problem = _model_flag_problem(tool)
    if problem:
        parser.error(problem)
    if tool.times_output is None:
        tool.times_output = (os.path.splitext(tool.json)[0] + ".times.json") if tool.json else "gpu_check_times.json"
    if tool.loss_rtol is None:
        tool.loss_rtol = DEFAULT_LOSS_RTOL[tool.dtype]
    return tool


def _flag_problem(tool: argparse.Namespace) -> Optional[str]:
    """The first bad flag, as one line naming it; None when all are fine."""
    unknown = [c for c in tool.checks.split(",") if c.strip() and c.strip() not in CHECKS]
    if unknown:
        return f"--checks: unknown {unknown}; choose from {','.join(CHECKS)}"
    positive = ("hidden_size", "num_attention_heads", "seq_length", "layers_per_shard", "micro_batch_size",
                "vocab_size", "repeats", "memory_microbatches", "small_num_layers", "small_hidden_size",
                "small_num_attention_heads", "small_seq_length", "small_global_batch_size",
                "wait_probe_matmul", "wait_probe_repeats")
    for name in positive:
        if getattr(tool, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(tool, name)}"
    if tool.warmup < 0:
        return f"--warmup must be >= 0, got {tool.warmup}"
    if tool.small_iters < 2:
        return f"--small-iters must be >= 2 (one warm-up iteration of the LR schedule), got {tool.small_iters}"
    for name in ("num_query_groups", "ffn_hidden_size"):
        if getattr(tool, name) is not None and getattr(tool, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(tool, name)}"
    for name in ("memory_rtol", "wait_probe_ms", "loss_rtol", "te_rtol", "compute_rtol"):
        value = getattr(tool, name)
        if value is not None and not value > 0:
            return f"--{name.replace('_', '-')} must be > 0, got {value}"
    for prefix, hidden, heads in (("--", tool.hidden_size, tool.num_attention_heads),
                                  ("--small-", tool.small_hidden_size, tool.small_num_attention_heads)):
        if hidden % heads:
            return f"{prefix}hidden-size {hidden} must be divisible by {prefix}num-attention-heads {heads}"
    return None


def _model_flag_problem(tool: argparse.Namespace) -> Optional[str]:
    """What pretrain_llama.py's own validation says about the two models (flag names are shared)."""
    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.training.validate_args import validate_args
    from tawpipe_lab.one_rank import TAWPIPE_FLAGS

    try:
        for run in (small_run(tool), real_run(tool)):
            validate_args(parse_args(run.argv(*TAWPIPE_FLAGS)), world_size=1)
    except ArgumentError as exc:
        return str(exc)
    return None


def device_problem(device: str) -> Optional[str]:
    """Why this process cannot run on ``device`` (one line), or None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return (f"checks one rank: run it with python, not under torchrun "
                f"(WORLD_SIZE={os.environ['WORLD_SIZE']}); multi-rank NCCL cannot share one GPU")
    if device == "cuda" and not torch.cuda.is_available():
        return ("no CUDA device is visible (torch.cuda.is_available() is False): run it on a GPU machine, "
                "or pass --device cpu with small sizes to check the tool itself on the CPU")
    if device == "cpu" and torch.cuda.is_available():
        return ("--device cpu, but this process sees a CUDA device and the runtime would use it: "
                "set CUDA_VISIBLE_DEVICES= (tools/gpu_check.py does so for --device cpu)")
    return None


# ---- run configurations ---------------------------------------------------------------------


def small_run(tool) -> LlamaRun:
    return LlamaRun(num_layers=tool.small_num_layers, hidden_size=tool.small_hidden_size,
                    num_attention_heads=tool.small_num_attention_heads, seq_length=tool.small_seq_length,
                    vocab_size=tool.vocab_size, micro_batch_size=1,
                    global_batch_size=tool.small_global_batch_size, train_iters=tool.small_iters,
                    dtype=tool.dtype, attention_backend=tool.attention_backend)


def real_run(tool) -> LlamaRun:
    """One rank's shard at the real size: world of one, so the model is one shard."""
    return LlamaRun(num_layers=tool.layers_per_shard, hidden_size=tool.hidden_size,
                    num_attention_heads=tool.num_attention_heads, seq_length=tool.seq_length,
                    vocab_size=tool.vocab_size, micro_batch_size=tool.micro_batch_size,
                    global_batch_size=tool.micro_batch_size * tool.memory_microbatches, train_iters=2,
                    dtype=tool.dtype, attention_backend=tool.attention_backend,
                    ffn_hidden_size=tool.ffn_hidden_size, num_query_groups=tool.num_query_groups)


def _device(tool) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if tool.device == "cuda" else torch.device("cpu")


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the checks ------------------------------------------------------------------------------


class Session:
    """State shared between checks (the TawPipe run's Wait samples)."""

    def __init__(self, tool):
        self.tool = tool
        self.device = _device(tool)
        self.tawpipe_waits = None        # WaitTimer of the small TawPipe run


def check_compute(session: Session) -> List[CheckRow]:
    from tawpipe_lab.compute_check import compare_compute, default_tolerance
    from tawpipe_lab.one_rank import TAWPIPE_FLAGS, one_rank_process_group, parsed_args
    from megatron_tawpipe.models.llama import params_dtype

    tool = session.tool
    args = parsed_args(real_run(tool), *TAWPIPE_FLAGS)
    tolerance = tool.compute_rtol or default_tolerance(params_dtype(args))
    with one_rank_process_group(args):
        comparison = compare_compute(args, tool.layers_per_shard, session.device, tool.repeats, tool.warmup,
                                     tolerance)
    _release_memory()
    return [CheckRow("compute", "ok" if comparison.passed else "FAILED", comparison.summary(),
                     comparison.to_json())]


def check_te(session: Session) -> List[CheckRow]:
    from tawpipe_lab.layer_specs import DEFAULT_TOLERANCE, compare_layer_specs, \
        transformer_engine_unavailable_reason
    from tawpipe_lab.one_rank import one_rank_process_group, parsed_args

    tool = session.tool
    reason = transformer_engine_unavailable_reason()
    if reason is None and tool.device == "cpu":
        reason = "Transformer Engine runs on CUDA only (--device cpu)"
    if reason is not None:
        return [CheckRow("te", f"skipped: {reason}", "TE layer spec vs local spec not compared")]
    rows = []
    for dtype in ("bf16", "fp32"):
        args = parsed_args(replace(small_run(tool), dtype=dtype, attention_backend="sdpa"))
        tolerance = tool.te_rtol or DEFAULT_TOLERANCE[dtype]
        with one_rank_process_group(args):
            comparison = compare_layer_specs(args, "sdpa", "te", session.device, tolerance)
        rows.append(CheckRow(f"te ({dtype})", "ok" if comparison.passed else "FAILED",
                             "TE spec vs local spec, " + comparison.summary(), comparison.to_json()))
        _release_memory()
    return rows


def _run_small_tawpipe(session: Session) -> List[dict]:
    """The small one-rank TawPipe run, with every plan Wait timed (kept for ``wait``)."""
    from tawpipe_lab.one_rank import TAWPIPE_FLAGS, train_one_rank
    from tawpipe_lab.waits import WaitTimer

    with WaitTimer(on_cuda=session.device.type == "cuda") as waits:
        records = train_one_rank(small_run(session.tool).argv(*TAWPIPE_FLAGS))
    session.tawpipe_waits = waits
    _release_memory()
    return records


def _run_small_native(session: Session) -> List[dict]:
    from tawpipe_lab.one_rank import NATIVE_1F1B_FLAGS, train_one_rank

    records = train_one_rank(small_run(session.tool).argv(*NATIVE_1F1B_FLAGS))
    _release_memory()
    return records


def check_losses(session: Session) -> List[CheckRow]:
    from tawpipe_lab.one_rank import relative_loss_differences

    tool = session.tool
    run = small_run(tool)
    tawpipe, native = _run_small_tawpipe(session), _run_small_native(session)
    ours, reference = [r["lm_loss"] for r in tawpipe], [r["lm_loss"] for r in native]
    differences = relative_loss_differences(ours, reference)
    finite = all(math.isfinite(x) for x in ours + reference + differences)
    worst = max(differences) if finite else float("nan")
    passed = finite and worst <= tool.loss_rtol and len(ours) == run.train_iters
    figures = (f"{len(ours)} iterations, {tool.dtype}, L={run.num_layers} H={run.hidden_size} S={run.seq_length}: "
               f"max relative difference {worst:.1e} (tolerance {tool.loss_rtol:.0e}); "
               f"last loss {ours[-1]:.4f} (tawpipe) vs {reference[-1]:.4f} (1f1b)")
    return [CheckRow("losses", "ok" if passed else "FAILED", figures,
                     {"tawpipe": ours, "native_1f1b": reference, "relative_differences": differences,
                      "tolerance": tool.loss_rtol, "argv": run.argv(),
                      "tawpipe_elapsed_ms": [r["elapsed_ms"] for r in tawpipe],
                      "native_elapsed_ms": [r["elapsed_ms"] for r in native]})]


def check_wait(session: Session) -> List[CheckRow]:
    from tawpipe_lab.one_rank import one_rank_process_group, parsed_args
    from tawpipe_lab.waits import probe_wait_behind_compute
    from megatron_tawpipe.models.llama import params_dtype

    tool = session.tool
    if session.tawpipe_waits is None:  # --checks without losses
        _run_small_tawpipe(session)
    stats = session.tawpipe_waits.stats()
    if stats is None:
        return [CheckRow("wait", "error: no plan Wait was recorded in the TawPipe run",
                         "the executor no longer dispatches Wait through PlanExecutor._wait")]
    args = parsed_args(small_run(tool))
    with one_rank_process_group(args):
        probe = probe_wait_behind_compute(session.device, params_dtype(args), tool.wait_probe_matmul,
                                          tool.wait_probe_ms / 1000.0, tool.wait_probe_repeats)
    _release_memory()
    samples = session.tawpipe_waits.samples
    issued = sum(1 for sample in samples if sample.issued)
    figures = (f"plan Waits of the 1-rank TawPipe run: {stats.count} ({issued} on a transfer), host "
               f"{stats.mean_s * 1e6:.0f} us mean, {stats.max_s * 1e6:.0f} us max; " + probe.summary())
    return [CheckRow("wait", "measured", figures,
                     {"plan_waits": stats.to_json(), "plan_waits_on_a_transfer": issued,
                      "plan_wait_transfers": sorted({sample.what for sample in samples}),
                      "probe": probe.to_json()})]


def check_timings(session: Session) -> List[CheckRow]:
    from tawpipe_lab.one_rank import TAWPIPE_FLAGS, one_rank_process_group, parsed_args
    from tawpipe_lab.shard_timing import calibration_record, measure_shard_times
    from megatron_tawpipe.bench.calibrate import write_times

    tool = session.tool
    args = parsed_args(real_run(tool), *TAWPIPE_FLAGS)
    with one_rank_process_group(args):
        shard = measure_shard_times(args, tool.layers_per_shard, session.device, tool.repeats, tool.warmup)
    _release_memory()
    record = calibration_record(args, shard, tool.layers_per_shard, session.device, tool.repeats, tool.warmup)
    write_times(record, tool.times_output)
    ms = {k: v * 1e3 for k, v in shard.items()}
    figures = (f"shard of {tool.layers_per_shard} layers, H={tool.hidden_size} S={tool.seq_length} "
               f"mb={tool.micro_batch_size} {tool.dtype}: forward {ms['shard_forward']:.2f} ms, recompute "
               f"{ms['shard_recompute']:.2f} ms, backward {ms['shard_backward']:.2f} ms, head "
               f"{ms['head_forward']:.2f}/{ms['head_backward']:.2f} ms -> {tool.times_output}")
    return [CheckRow("timings", "measured", figures,
                     {"shard_seconds": shard, "calibration": record, "times_output": tool.times_output})]


def check_memory(session: Session) -> List[CheckRow]:
    from megatron_tawpipe.bench.memory import MemoryComparison, held_bytes, predicted_memory
    from tawpipe_lab.one_rank import TAWPIPE_FLAGS, TrainerCapture, parsed_args, train_one_rank

    tool = session.tool
    run = real_run(tool)
    args = parsed_args(run, *TAWPIPE_FLAGS)
    predicted = predicted_memory(args, args.num_microbatches)
    capture = TrainerCapture()
    on_cuda = session.device.type == "cuda"
    _release_memory()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(session.device)
    before = torch.cuda.memory_allocated(session.device) if on_cuda else 0
    train_one_rank(run.argv(*TAWPIPE_FLAGS), trainer_factory=capture)
    peak = torch.cuda.max_memory_allocated(session.device) - before if on_cuda else None
    comparison = MemoryComparison(predicted, held_bytes(capture.trainer), peak, tool.memory_rtol)
    capture.trainer = None
    _release_memory()
    figures = (f"1-rank TawPipe, shard of {run.num_layers} layers, {args.num_microbatches} micro-batches: "
               + comparison.summary())
    return [CheckRow("memory", "ok" if comparison.agrees else "differs", figures, comparison.to_json())]


CHECK_FUNCTIONS: Dict[str, Callable[[Session], List[CheckRow]]] = {
    "compute": check_compute, "te": check_te, "losses": check_losses, "wait": check_wait, "timings": check_timings,
    "memory": check_memory,
}


def run_checks(tool) -> List[CheckRow]:
    """Every selected check in order; a check that raises becomes an ``error`` row, the others still run."""
    session = Session(tool)
    rows: List[CheckRow] = []
    for name in CHECKS:
        if name not in tool.checks:
            continue
        try:
            rows += CHECK_FUNCTIONS[name](session)
        except Exception as exc:  # report and go on: one broken check must not hide the others
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            rows.append(CheckRow(name, f"error: {type(exc).__name__}: {first}", "",
                                 {"traceback": traceback.format_exc()}))
            _release_memory()
    return rows


# ---- output ----------------------------------------------------------------------------------


def format_table(rows: List[CheckRow]) -> str:
    head = ("check", "result", "figures")
    cells = [(r.check, r.result, r.figures) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head[:2])]
    lines = [f"{head[0]:<{widths[0]}}  {head[1]:<{widths[1]}}  {head[2]}",
             f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * 7}"]
    lines += [f"{c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  {c[2]}" for c in cells]
    return "\n".join(lines)


def environment(tool) -> Dict[str, object]:
    from megatron_tawpipe.bench.calibrate import device_description
    from megatron_tawpipe.compat.cpu import megatron_version

    try:
        import transformer_engine
        te_version = getattr(transformer_engine, "__version__", "installed")
    except Exception:
        te_version = None
    return {"device": device_description(_device(tool)), "python": platform.python_version(),
            "torch": torch.__version__, "megatron_core": megatron_version(), "transformer_engine": te_version,
            "cuda": torch.version.cuda, "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}


def write_report(path: str, tool, rows: List[CheckRow]) -> None:
    report = {"tool": PROG, "environment": environment(tool), "flags": dict(vars(tool)),
              "checks": [r.to_json() for r in rows], "failed": any(r.failed for r in rows)}
    atomic_write_json(path, report, indent=1, newline=True)


def _make_output_directories(tool) -> None:
    for path in (tool.json, tool.times_output if "timings" in tool.checks else None):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def main(argv: Optional[List[str]] = None) -> int:
    tool = parse_tool_args(argv)
    problem = device_problem(tool.device)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    _make_output_directories(tool)
    env = environment(tool)
    print(f"{PROG}: {env['device']}; megatron-core {env['megatron_core']}, "
          f"Transformer Engine {env['transformer_engine'] or 'not installed'}; checks {','.join(tool.checks)}",
          flush=True)
    rows = run_checks(tool)
    print(format_table(rows), flush=True)
    if tool.json:
        write_report(tool.json, tool, rows)
        print(f"{PROG}: report written to {tool.json}", flush=True)
    return 1 if any(r.failed for r in rows) else 0
