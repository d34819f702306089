"""Every strategy at the same activation memory: its own micro-batch size, chosen under a budget.

A fair comparison gives each strategy the overlap window its memory allows. TawPipe runs ``c``
micro-batches per shard visit and holds their activations together; a data-parallel strategy holding
the same activation memory runs micro-batches of ``c`` samples, and its gradient reduction hides behind
a last backward ``c`` times longer. So the benchmark gives every strategy its own ``--micro-batch-size``
(the global batch and the data stay the same), either as given (``--micro-batch-size-of STRATEGY=N``)
or chosen here: for each strategy, among the micro-batch sizes that divide every rank's share of the
global batch, the one the simulator predicts fastest whose activation memory (stored activations plus
the output layer's logits, the memory model of :mod:`megatron_tawpipe.sim.memory`) fits the budget --
by default what TawPipe holds at the configured micro-batch size and visit. Predicted ties (within
:data:`TIE`) go to the larger micro-batch (the longer window). The weight-passing references keep the
configured micro-batch size: their window is the visit.

The prediction is ``tools/simulate.py --json`` run once per candidate size on the benchmark's own
model flags, times file and links (as :mod:`.matrix` runs it), so a choice can be reproduced and
checked by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence

from megatron_tawpipe.bench.stages import flag_value, interleaved_virtual_stages
from megatron_tawpipe.common.errors import BenchmarkError
from megatron_tawpipe.common.units import parse_rate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXED = ("tawpipe", "tawpipe-rep", "tawpipe-nocache", "tawpipe-tp")   # their window is the visit: the configured size
NO_CACHE = "tawpipe-nocache"     # simulated as tawpipe with --no-cache
TIE = 0.005            # predicted speeds this close are a tie, won by the larger micro-batch
INTRA_BW = "0.6GB/s"   # gloo over a namespace's loopback on the 2-core VM (docs/simulator-validation.md)


def simulator_rate(tc_rate: str) -> str:
    """An emulated link's tc rate (``1gbit``: 10^9 bit/s) as ``tools/simulate.py`` takes it (bytes/s)."""
    return f"{parse_rate(tc_rate + '/s'):.0f}B/s"


def activation_memory(row: dict) -> float:
    """A simulated row's batch-dependent memory: stored activations plus the output layer's logits."""
    memory = (row.get("options") or {}).get("memory_breakdown") or {}
    return float(memory.get("activations", row.get("activation_bytes", 0.0))) + float(memory.get("logits", 0.0))


def model_int(config, flag: str, default: Optional[int] = None) -> int:
    value = flag_value(config.model_args, flag)
    if value is None:
        if default is None:
            raise BenchmarkError(f"equal memory needs {flag} among the model flags (after --)")
        return default
    return int(value)


def samples_per_rank(config) -> int:
    """Each rank's share of the global batch (every strategy keeps the same global batch)."""
    global_batch = model_int(config, "--global-batch-size")
    if global_batch % config.ranks:
        raise BenchmarkError(f"--global-batch-size {global_batch} is not a multiple of the {config.ranks} ranks")
    return global_batch // config.ranks


def candidate_sizes(config) -> List[int]:
    """Micro-batch sizes that divide every rank's share of the global batch."""
    share = samples_per_rank(config)
    return [m for m in range(1, share + 1) if share % m == 0]


def simulate_command(config, micro_batch_size: int, schedules: Sequence[str]) -> List[str]:
    """``tools/simulate.py`` for the benchmark's configuration at one micro-batch size (every rank's share of
    the global batch in micro-batches of that size), on the times file and links the runs use."""
    args = config.model_args
    layers = model_int(config, "--num-layers", config.num_layers)
    hidden = model_int(config, "--hidden-size")
    vocab = model_int(config, "--vocab-size", 32000) + (1 if flag_value(args, "--tokenizer-type") == "NullTokenizer"
                                                         else 0)
    dtype_bytes = 2 if ("--bf16" in args or "--fp16" in args) else 4
    cmd = ["tools/simulate.py", "--json", "--schedule", ",".join(schedules), "--ranks", str(config.ranks),
           "--groups", str(config.num_groups()), "--num-layers", str(layers), "--hidden-size", str(hidden),
           "--seq-length", str(model_int(config, "--seq-length")), "--micro-batch-size", str(micro_batch_size),
           "--num-microbatches", str(samples_per_rank(config) // micro_batch_size), "--vocab-size", str(vocab),
           "--dtype-bytes", str(dtype_bytes), "--intra-bw", INTRA_BW,
           "--backend", "nccl" if flag_value(args, "--distributed-backend") == "nccl" else "gloo"]
    for flag in ("--num-attention-heads", "--ffn-hidden-size", "--num-query-groups"):
        if flag_value(args, flag) is not None:
            cmd += [flag, flag_value(args, flag)]
    if any(s.startswith("tawpipe") for s in schedules):
        cmd += ["--chunk", str(config.tawpipe_microbatches_per_visit)]
    if "interleaved" in schedules:
        cmd += ["--virtual-stages", str(interleaved_virtual_stages(layers, config.ranks))]
    if "--untie-embeddings-and-output-weights" not in args:   # Megatron-LM's default: tied
        cmd.append("--tie-embeddings-and-output-weights")
    if not config.recompute:
        cmd.append("--no-recompute")
    if config.deferred_weight_gradients:
        cmd.append("--deferred-weight-gradients")
    times = config.measured_times or config.emulated_compute_times
    if times:
        cmd += ["--measured-times", os.path.abspath(times)]
    rate = config.cluster[2] if config.cluster is not None else None
    cmd += ["--inter-bw", simulator_rate(rate) if rate else INTRA_BW]
    return cmd


def run_simulator(cmd: List[str]) -> List[dict]:
    """``tools/simulate.py --json`` (``cmd``: its path and arguments) from the repository root: its rows."""
    done = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchmarkError(f"the simulator failed ({' '.join(cmd)}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def _busy(row: dict) -> Optional[float]:
    """The compute's share of a simulated row's iteration (1 - its bubble ratio), where the row has one."""
    return 1.0 - float(row["bubble_ratio"]) if row.get("bubble_ratio") is not None else None


def choose_micro_batch_sizes(config, budget_bytes: Optional[float] = None,
                             simulate: Callable[[List[str]], List[dict]] = run_simulator) -> dict:
    """Each strategy's micro-batch size at equal activation memory (see the module's text).

    Returns ``{"budget_bytes", "budget_from", "candidates", "choices": {strategy: {"micro_batch_size",
    "activation_bytes", "predicted_tokens_per_sec_per_rank", "fits", "tried": [...]}}}``; a strategy whose
    every size exceeds the budget gets its smallest and ``fits`` False."""
    sizes = candidate_sizes(config)
    fixed = model_int(config, "--micro-batch-size", 1)
    if fixed not in sizes:
        raise BenchmarkError(f"--micro-batch-size {fixed} does not divide each rank's {samples_per_rank(config)} "
                             f"samples of the global batch")
    chosen = [s for s in config.schedules if s not in FIXED]
    names = list(dict.fromkeys(["tawpipe"] + [s for s in config.schedules if s not in ("tawpipe-tp", NO_CACHE)]))
    predicted: Dict[int, Dict[str, dict]] = {}
    for m in sizes:
        wanted = names if m == fixed else chosen
        if wanted:
            predicted[m] = {row["schedule"]: row for row in simulate(simulate_command(config, m, wanted))}
    if NO_CACHE in config.schedules:
        (row,) = simulate(simulate_command(config, fixed, ["tawpipe"]) + ["--no-cache"])
        predicted[fixed][NO_CACHE] = {**row, "schedule": NO_CACHE}
    budget_from = "--activation-budget"
    if budget_bytes is None:
        budget_bytes = activation_memory(predicted[fixed]["tawpipe"])
        budget_from = (f"tawpipe at --micro-batch-size {fixed}, {config.tawpipe_microbatches_per_visit} "
                       "micro-batches per visit")
    choices = {}
    for s in config.schedules:
        if s in FIXED:
            row = predicted[fixed].get(s, {})
            choices[s] = {"micro_batch_size": fixed, "fits": True, "activation_bytes": activation_memory(row) if row
                          else None, "predicted_tokens_per_sec_per_rank": row.get("tokens_per_sec_per_rank"),
                          "predicted_busy": _busy(row), "predicted_inter_node_bytes": row.get("inter_group_bytes"),
                          "tried": []}
            continue
        tried = [{"micro_batch_size": m, "activation_bytes": activation_memory(predicted[m][s]),
                  "predicted_tokens_per_sec_per_rank": predicted[m][s]["tokens_per_sec_per_rank"],
                  "predicted_busy": _busy(predicted[m][s]),
                  "predicted_inter_node_bytes": predicted[m][s].get("inter_group_bytes")} for m in sizes]
        fits = [t for t in tried if t["activation_bytes"] <= budget_bytes * (1 + 1e-9)]
        if fits:
            best_speed = max(t["predicted_tokens_per_sec_per_rank"] for t in fits)
            pick = max((t for t in fits if t["predicted_tokens_per_sec_per_rank"] >= (1 - TIE) * best_speed),
                       key=lambda t: t["micro_batch_size"])
        else:
            pick = tried[0]
        choices[s] = {**pick, "fits": bool(fits), "tried": tried}
    return {"budget_bytes": budget_bytes, "budget_from": budget_from, "candidates": sizes, "choices": choices}


def format_choices(selection: dict) -> str:
    """One line per strategy: the micro-batch size, its activation memory against the budget, and why."""
    out = [f"equal memory: activation budget {selection['budget_bytes'] / 1e6:.1f} MB ({selection['budget_from']}); "
           f"micro-batch sizes tried: {', '.join(map(str, selection['candidates']))}"]
    for s, c in selection["choices"].items():
        act = "-" if c["activation_bytes"] is None else f"{c['activation_bytes'] / 1e6:.1f} MB"
        speed = c.get("predicted_tokens_per_sec_per_rank")
        why = ("fixed (its window is the visit)" if not c["tried"] else
               "fastest predicted that fits" if c["fits"] else "nothing fits: the smallest")
        out.append(f"  {s:<13} micro-batch {c['micro_batch_size']:>3}  activations {act:>10}"
                   + (f"  predicted {speed:.0f} tok/s/rank" if speed else "") + f"  ({why})")
    return "\n".join(out)


def simulate_as_run(config, simulate: Callable[[List[str]], List[dict]] = run_simulator) -> List[dict]:
    """``tools/simulate.py --json`` rows for every strategy of ``config`` at the micro-batch size it ran
    (``config.micro_batch_size_of``), ``tawpipe-nocache`` as tawpipe with ``--no-cache``: what the runs are
    compared with (``tools/benchmark.py --results R --simulate-as-run``)."""
    by_size: Dict[int, List[str]] = {}
    for s in config.schedules:
        if s != "tawpipe-tp":
            by_size.setdefault(config.micro_batch_size_of(s), []).append(s)
    rows = []
    for size, schedules in sorted(by_size.items()):
        plain = [s for s in schedules if s != NO_CACHE]
        if plain:
            rows += simulate(simulate_command(config, size, plain))
        if NO_CACHE in schedules:
            (row,) = simulate(simulate_command(config, size, ["tawpipe"]) + ["--no-cache"])
            rows.append({**row, "schedule": NO_CACHE})
    return rows
