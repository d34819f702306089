"""Every strategy at the same memory: its own micro-batch size, chosen under a budget.

A fair comparison gives each strategy the overlap window its memory allows. TawPipe runs ``c``
micro-batches per shard visit and holds their activations together; a data-parallel strategy holding
the same memory may run micro-batches of several samples, and its gradient reduction hides behind
a longer last backward. So the benchmark gives every strategy its own ``--micro-batch-size``
(the global batch and the data stay the same), either as given (``--micro-batch-size-of STRATEGY=N``)
or chosen here: for each strategy, among the micro-batch sizes that divide every rank's share of the
global batch, the one the simulator predicts fastest whose memory fits the budget -- by default what
TawPipe holds at the configured micro-batch size and visit. Predicted ties (within :data:`TIE`) go to
the larger micro-batch (the longer window). The weight-passing references keep the configured
micro-batch size: their window is the visit.

What "memory" counts is the rule (:data:`RULES`, ``--equal-memory-rule``):

* ``whole`` (the default): the whole footprint per rank, every part of the memory model of
  :mod:`megatron_tawpipe.sim.memory` -- weights, gradients, optimizer state, communication buffers,
  activations and the output layer's logits. A strategy that keeps more state (the distributed
  optimizer's full gradient buffer, a replica's weights) has less room left for its micro-batch.
* ``activations``: stored activations plus the logits only (equal *activation* memory; the state each
  strategy keeps is not counted). Reported as such wherever it is used.

The prediction is ``tools/simulate.py --json`` run once per candidate size on the benchmark's own
model flags, times file and links (as :mod:`.matrix` runs it), so a choice can be reproduced and
checked by hand; the benchmark's table sets each strategy's predicted whole memory beside its measured
peak (:func:`predicted_memory_by_schedule`).
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
from megatron_tawpipe.sim.memory import TERMS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# their window is the visit
FIXED = ("tawpipe", "tawpipe-owner", "tawpipe-rep", "tawpipe-nocache", "tawpipe-spread", "tawpipe-tp")
NO_CACHE = "tawpipe-nocache"     # simulated as tawpipe with --no-cache
# The TawPipe variants the simulator prices as tawpipe with these flags.
VARIANTS = {NO_CACHE: ["--no-cache"], "tawpipe-spread": ["--tawpipe-ownership", "spread", "--cache"],
            "tawpipe-owner": ["--cache"]}
TIE = 0.005            # predicted speeds this close are a tie, won by the larger micro-batch
INTRA_BW = "0.6GB/s"   # gloo over a namespace's loopback on the 2-core VM (docs/simulator-validation.md)
#: what equal memory counts: the rule's name -> how the choices and reports label it
RULES = {"whole": "equal whole memory (weights, gradients, optimizer state, buffers, activations, logits)",
         "activations": "equal activation memory (activations and logits only; weights, gradients, optimizer "
                        "state and buffers not counted)"}


def simulator_rate(tc_rate: str) -> str:
    """An emulated link's tc rate (``1gbit``: 10^9 bit/s) as ``tools/simulate.py`` takes it (bytes/s)."""
    return f"{parse_rate(tc_rate + '/s'):.0f}B/s"


def activation_memory(row: dict) -> float:
    """A simulated row's batch-dependent memory: stored activations plus the output layer's logits."""
    memory = (row.get("options") or {}).get("memory_breakdown") or {}
    return float(memory.get("activations", row.get("activation_bytes", 0.0))) + float(memory.get("logits", 0.0))


def memory_parts(row: dict) -> Dict[str, float]:
    """A simulated row's memory per part (:data:`megatron_tawpipe.sim.memory.TERMS`: weights, grads,
    optimizer, comm_buffers, activations, logits), from its memory breakdown."""
    memory = (row.get("options") or {}).get("memory_breakdown")
    if not memory:
        raise BenchmarkError(f"the simulator's row for {row.get('schedule', '?')} has no memory breakdown: the "
                             "whole footprint cannot be counted (--equal-memory-rule activations counts "
                             "activations only)")
    return {term: float(memory.get(term, 0.0)) for term in TERMS}


def whole_memory(row: dict) -> float:
    """A simulated row's whole footprint per rank: the sum of every part (:func:`memory_parts`)."""
    return sum(memory_parts(row).values())


def counted_memory(row: dict, rule: str) -> float:
    """What ``rule`` (:data:`RULES`) counts of a simulated row."""
    return whole_memory(row) if rule == "whole" else activation_memory(row)


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise BenchmarkError(f"equal-memory rule {rule!r}: one of {', '.join(RULES)}")
    return rule


def model_int(config, flag: str, default: Optional[int] = None) -> int:
    value = flag_value(config.model_args, flag)
    if value is None:
        if default is None:
            raise BenchmarkError(f"equal memory needs {flag} among the model flags (after --)")
        return default
    return int(value)


def samples_per_rank(config) -> int:
    """Each rank's share of the global batch (every strategy keeps the same global batch); with
    ``--context-parallel-size C`` each group of C ranks' share (its members split every sequence)."""
    global_batch = model_int(config, "--global-batch-size")
    ranks = config.ranks // context_parallel_size(config)
    if global_batch % ranks:
        raise BenchmarkError(f"--global-batch-size {global_batch} is not a multiple of the {ranks} data-parallel ranks")
    return global_batch // ranks


def context_parallel_size(config) -> int:
    """The model flags' ``--context-parallel-size`` (1 without it)."""
    return model_int(config, "--context-parallel-size", 1)


def candidate_sizes(config) -> List[int]:
    """Micro-batch sizes that divide every rank's share of the global batch."""
    share = samples_per_rank(config)
    return [m for m in range(1, share + 1) if share % m == 0]


def simulate_command(config, micro_batch_size: int, schedules: Sequence[str], decided: bool = True) -> List[str]:
    """``tools/simulate.py`` for the benchmark's configuration at one micro-batch size (every rank's share of
    the global batch in micro-batches of that size), on the times file and links the runs use. ``decided``: the
    plain tawpipe alone in ``schedules`` is priced in the layout the run decides; False: in the benchmark's given
    one (micro-batches per visit, shards per rank), as the named variants run."""
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
    for flag in ("--num-attention-heads", "--ffn-hidden-size", "--num-query-groups", "--context-parallel-size"):
        if flag_value(args, flag) is not None:
            cmd += [flag, flag_value(args, flag)]
    if decided and list(schedules) == ["tawpipe"]:
        # the plain tawpipe run: its layout decided as the run decides it (no layout flag)
        cmd += ["--tawpipe-ownership", "auto"]
    elif any(s.startswith("tawpipe") for s in schedules):
        if decided and "tawpipe" in schedules:
            raise BenchmarkError("tawpipe (its layout decided) is simulated on its own: simulate_rows splits it off")
        cmd += ["--chunk", str(config.tawpipe_microbatches_per_visit or 1)]
        if (config.tawpipe_shards_per_rank or 1) != 1:
            cmd += ["--tawpipe-shards-per-rank", str(config.tawpipe_shards_per_rank)]
    if "interleaved" in schedules:
        cmd += ["--virtual-stages", str(interleaved_virtual_stages(layers, config.ranks))]
    if "--untie-embeddings-and-output-weights" not in args:   # Megatron-LM's default: tied
        cmd.append("--tie-embeddings-and-output-weights")
    cmd += ["--recompute", {None: "auto", True: "on", False: "off"}[config.recompute]]
    if config.deferred_weight_gradients:
        cmd.append("--deferred-weight-gradients")
    times = config.measured_times or config.emulated_compute_times
    if times:
        cmd += ["--measured-times", os.path.abspath(times)]
    rate = config.cluster[2] if config.cluster is not None else None
    cmd += ["--inter-bw", simulator_rate(rate) if rate else INTRA_BW]
    return cmd


def simulate_rows(config, micro_batch_size: int, schedules: Sequence[str],
                  simulate: Callable[[List[str]], List[dict]]) -> List[dict]:
    """The simulator's rows of ``schedules`` at one micro-batch size: the plain ``tawpipe`` (its layout decided, as
    the run decides it) in a call of its own, the others together."""
    rest = [s for s in schedules if s != "tawpipe"]
    rows = ([{**row, "schedule": "tawpipe"} for row in simulate(simulate_command(config, micro_batch_size, ["tawpipe"]))]
            if "tawpipe" in schedules else [])
    return rows + (simulate(simulate_command(config, micro_batch_size, rest)) if rest else [])


def run_simulator(cmd: List[str]) -> List[dict]:
    """``tools/simulate.py --json`` (``cmd``: its path and arguments) from the repository root: its rows."""
    done = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchmarkError(f"the simulator failed ({' '.join(cmd)}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def _busy(row: dict) -> Optional[float]:
    """The compute's share of a simulated row's iteration (1 - its bubble ratio), where the row has one."""
    return 1.0 - float(row["bubble_ratio"]) if row.get("bubble_ratio") is not None else None


def _priced(row: dict, micro_batch_size: int) -> dict:
    """One candidate's figures: its memory (whole and activations, each part), speed, busy and bytes."""
    return {"micro_batch_size": micro_batch_size, "memory_bytes": whole_memory(row), "memory_parts": memory_parts(row),
            "activation_bytes": activation_memory(row),
            "predicted_tokens_per_sec_per_rank": row.get("tokens_per_sec_per_rank"),
            "predicted_busy": _busy(row), "predicted_inter_node_bytes": row.get("inter_group_bytes")}


def choose_micro_batch_sizes(config, budget_bytes: Optional[float] = None,
                             simulate: Callable[[List[str]], List[dict]] = run_simulator,
                             rule: Optional[str] = None) -> dict:
    """Each strategy's micro-batch size at equal memory (see the module's text); ``rule``: what is counted
    (default ``config.equal_memory_rule``).

    Returns ``{"rule", "rule_label", "budget_bytes", "budget_from", "candidates", "choices": {strategy:
    {"micro_batch_size", "memory_bytes", "memory_parts", "activation_bytes", "counted_bytes",
    "predicted_tokens_per_sec_per_rank", "fits", "tried": [...]}}}`` (``counted_bytes``: what the rule
    counts, set against the budget); a strategy whose every size exceeds the budget gets its smallest and
    ``fits`` False."""
    rule = check_rule(rule or getattr(config, "equal_memory_rule", "whole"))
    sizes = candidate_sizes(config)
    fixed = model_int(config, "--micro-batch-size", 1)
    if fixed not in sizes:
        raise BenchmarkError(f"--micro-batch-size {fixed} does not divide each rank's {samples_per_rank(config)} "
                             f"samples of the global batch")
    chosen = [s for s in config.schedules if s not in FIXED]
    names = list(dict.fromkeys(["tawpipe"] + [s for s in config.schedules if s != "tawpipe-tp" and s not in VARIANTS]))
    predicted: Dict[int, Dict[str, dict]] = {}
    for m in sizes:
        wanted = names if m == fixed else chosen
        if wanted:
            predicted[m] = {row["schedule"]: row for row in simulate_rows(config, m, wanted, simulate)}
    for variant, flags in VARIANTS.items():
        if variant in config.schedules:
            (row,) = simulate(_variant_command(config, fixed, flags))
            predicted[fixed][variant] = {**row, "schedule": variant}
    what = "whole memory" if rule == "whole" else "activation memory"
    budget_from = "--memory-budget" if rule == "whole" else "--activation-budget"
    if budget_bytes is None:
        budget_bytes = counted_memory(predicted[fixed]["tawpipe"], rule)
        budget_from = f"tawpipe's {what} at --micro-batch-size {fixed}, in the layout it decides"
    choices = {}
    for s in config.schedules:
        if s in FIXED:
            row = predicted[fixed].get(s)
            base = dict(_priced(row, fixed), counted_bytes=counted_memory(row, rule)) if row else {
                "micro_batch_size": fixed, "memory_bytes": None, "memory_parts": None, "activation_bytes": None,
                "counted_bytes": None, "predicted_tokens_per_sec_per_rank": None, "predicted_busy": None,
                "predicted_inter_node_bytes": None}
            choices[s] = {**base, "fits": True, "tried": []}
            continue
        tried = [dict(_priced(predicted[m][s], m), counted_bytes=counted_memory(predicted[m][s], rule))
                 for m in sizes]
        fits = [t for t in tried if t["counted_bytes"] <= budget_bytes * (1 + 1e-9)]
        if fits:
            best_speed = max(t["predicted_tokens_per_sec_per_rank"] for t in fits)
            pick = max((t for t in fits if t["predicted_tokens_per_sec_per_rank"] >= (1 - TIE) * best_speed),
                       key=lambda t: t["micro_batch_size"])
        else:
            pick = tried[0]
        choices[s] = {**pick, "fits": bool(fits), "tried": tried}
    return {"rule": rule, "rule_label": RULES[rule], "budget_bytes": budget_bytes, "budget_from": budget_from,
            "candidates": sizes, "choices": choices}


def _mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / 1e6:.1f} MB"


_SHORT = {"weights": "weights", "grads": "grads", "optimizer": "optimizer", "comm_buffers": "buffers",
          "activations": "activations", "logits": "logits"}


def format_choices(selection: dict) -> str:
    """The rule and budget, then one line per strategy: the micro-batch size, its whole memory with each part
    and what the rule counts against the budget, and why."""
    rule = selection.get("rule", "activations")      # results written before the rule existed: activations
    out = [f"{RULES[rule]}: budget {selection['budget_bytes'] / 1e6:.1f} MB ({selection['budget_from']}); "
           f"micro-batch sizes tried: {', '.join(map(str, selection['candidates']))}"]
    for s, c in selection["choices"].items():
        speed = c.get("predicted_tokens_per_sec_per_rank")
        why = ("fixed (its window is the visit)" if not c["tried"] else
               "fastest predicted that fits" if c["fits"] else "nothing fits: the smallest")
        parts = c.get("memory_parts")
        whole = (f"  whole {_mb(c.get('memory_bytes')):>10} (" + ", ".join(
            f"{_SHORT[k]} {_mb(v)}" for k, v in parts.items()) + ")") if parts else ""
        counted = _mb(c.get("counted_bytes", c.get("activation_bytes")))
        out.append(f"  {s:<13} micro-batch {c['micro_batch_size']:>3}  counted {counted:>10}"
                   + (f"  predicted {speed:.0f} tok/s/rank" if speed else "") + f"  ({why})" + whole)
    return "\n".join(out)


def predicted_memory_by_schedule(result: dict) -> Dict[str, Optional[float]]:
    """An equal-memory benchmark's predicted whole memory per strategy at the micro-batch size it ran (a size
    given by hand takes the prediction priced for that size); None where it was not priced."""
    selection = result.get("equal_memory") or {}
    ran = (result.get("config") or {}).get("micro_batch_sizes") or {}
    out = {}
    for s, c in (selection.get("choices") or {}).items():
        size = ran.get(s, c["micro_batch_size"])
        row = next((p for p in [c] + list(c.get("tried") or []) if p["micro_batch_size"] == size), None)
        out[s] = row.get("memory_bytes") if row else None
    return out


def _variant_command(config, micro_batch_size: int, flags: Sequence[str]) -> List[str]:
    """``tools/simulate.py`` of a named TawPipe variant: tawpipe with its layout given (``flags`` and the benchmark's
    micro-batches per visit and shards per rank)."""
    return simulate_command(config, micro_batch_size, ["tawpipe"], decided=False) + list(flags)


def simulate_as_run(config, simulate: Callable[[List[str]], List[dict]] = run_simulator) -> List[dict]:
    """``tools/simulate.py --json`` rows for every strategy of ``config`` at the micro-batch size it ran
    (``config.micro_batch_size_of``), ``tawpipe-nocache`` and ``tawpipe-spread`` as tawpipe with ``--no-cache`` and
    ``--tawpipe-ownership spread``: what the runs are
    compared with (``tools/benchmark.py --results R --simulate-as-run``)."""
    by_size: Dict[int, List[str]] = {}
    for s in config.schedules:
        if s != "tawpipe-tp":
            by_size.setdefault(config.micro_batch_size_of(s), []).append(s)
    rows = []
    for size, schedules in sorted(by_size.items()):
        plain = [s for s in schedules if s not in VARIANTS]
        if plain:
            rows += simulate_rows(config, size, plain, simulate)
        for variant, flags in VARIANTS.items():
            if variant in schedules:
                (row,) = simulate(_variant_command(config, size, flags))
                rows.append({**row, "schedule": variant})
    return rows
