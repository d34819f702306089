"""The simulator out of sample: a matrix of emulated configurations, measured and predicted.

Each configuration is an emulated 2 x 2 cluster (``tawpipe_lab.emulated_cluster``:
shaped node links, gloo over loopback inside a node) running every strategy of
``megatron_tawpipe.bench.benchmark`` with emulated compute from the FLOP model, and the
simulator (``tools/simulate.py --backend gloo``) on the same times and links.
The configurations span G*S/(12H) (activation bytes of a stage boundary over a
layer's weight bytes, G the micro-batch size) from 1/3 to 4, node links from
200 Mbit/s to 2 Gbit/s, 1 to 3 layers per TawPipe shard and 1 to 4
micro-batches per visit. Every strategy runs at equal activation memory
(``tools/benchmark.py --equal-memory``: each its own micro-batch size, the
fastest predicted whose activations fit what TawPipe holds at its visit), and is
simulated at the size it ran.

Stages, each resumable (a configuration whose files exist is not rerun):

1. ``measure``: calibrate times, run the benchmark (root), write
   ``OUT/<name>/{times,results}.json``;
2. ``simulate``: ``OUT/<name>/simulated.json`` from the current simulator
   (rerun after changing the model: the measurements stay);
3. ``report``: per configuration, measured / predicted tokens/s for every
   strategy, every strategy's ratio to TawPipe against the prediction, the
   winner measured and predicted, and memory: the model's resident terms
   (weights, gradients, optimizer state, communication buffers; emulated
   layers keep no activations) against what the process holds between
   iterations beyond what it held before the model was built (glibc's
   ``mallinfo2``, "held"), and against the growth of its peak resident set
   ("RSS+", which also keeps transient buffers the allocator did not return).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from megatron_tawpipe.arguments import LLAMA_FLAGS, TOOL_FLAGS, llama_ffn_hidden_size
from megatron_tawpipe.bench.benchmark import SCHEDULES, BenchmarkConfig, run_benchmark
from megatron_tawpipe.bench.equal_memory import INTRA_BW, run_simulator, simulator_rate
from megatron_tawpipe.bench.stages import interleaved_virtual_stages
from megatron_tawpipe.common.layer_split import default_layer_split
from megatron_tawpipe.common.atomic import atomic_write
from tawpipe_lab.benchmark_cluster import benchmark_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN, HEADS, VOCAB, RANKS, NODES, GLOBAL_BATCH = 256, 4, 2047, 4, 2, 16
WINNER_TIE = 0.02      # a measured lead below this is within the repetitions' spread


@dataclass(frozen=True)
class MatrixConfig:
    name: str
    seq_length: int
    num_layers: int      # 4 ranks own one shard each (the default split where 4 does not divide the layers)
    rate: str            # htb rate of each node link (tc syntax)
    visit: int           # TawPipe micro-batches per visit
    peak_tflops: float   # the emulated device (keeps one layer's forward near 25-50 ms)

    @property
    def boundary_over_layer(self) -> float:
        """G*S/(12H): activation values of one boundary over one layer's weights."""
        return 1 * self.seq_length / (12 * HIDDEN)

    @property
    def layers_per_shard(self):
        """Layers of a shard: one number where the shards are equal, else each shard's (``"2,2,1,1"``)."""
        split = default_layer_split(self.num_layers, RANKS)
        return split[0] if len(set(split)) == 1 else ",".join(map(str, split))

    def rate_bytes_per_s(self) -> str:
        """The rate for ``tools/simulate.py`` (tc's mbit/gbit are 10^6/10^9 bit/s)."""
        return simulator_rate(self.rate)

    def virtual_stages(self) -> int:
        """Interleaved's chunks per rank as the benchmark configures them (1 where it does not run)."""
        if "interleaved" not in self.schedules():
            return 1
        return interleaved_virtual_stages(self.num_layers, RANKS)

    def schedules(self) -> List[str]:
        """Every strategy of the long-context table, less interleaved 1F1B where the benchmark cannot
        configure it (tawpipe-tp, TawPipe with tensor parallelism, has a benchmark of its own)."""
        return [s for s in SCHEDULES if s != "tawpipe-tp" and (s != "interleaved" or self.num_layers >= 2 * RANKS)]


MATRIX = (
    MatrixConfig("s1k-l8-1g-v1", 1024, 8, "1gbit", 1, 0.1),
    MatrixConfig("s3k-l8-1g-v4", 3072, 8, "1gbit", 4, 0.4),
    MatrixConfig("s12k-l8-500m-v2", 12288, 8, "500mbit", 2, 6.4),
    MatrixConfig("s3k-l4-500m-v1", 3072, 4, "500mbit", 1, 0.4),
    MatrixConfig("s3k-l12-2g-v2", 3072, 12, "2gbit", 2, 0.4),
    MatrixConfig("s6k-l8-2g-v4", 6144, 8, "2gbit", 4, 1.6),
    MatrixConfig("s1k-l8-200m-v2", 1024, 8, "200mbit", 2, 0.1),
)


def model_flags(c: MatrixConfig) -> List[str]:
    return list(TOOL_FLAGS) + ["--num-layers", str(c.num_layers), "--hidden-size", str(HIDDEN),
            "--ffn-hidden-size", str(llama_ffn_hidden_size(HIDDEN)), "--num-attention-heads", str(HEADS),
            "--seq-length", str(c.seq_length), "--max-position-embeddings", str(c.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH), "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--lr", "1e-4",
            "--log-interval", "1000", "--eval-interval", "1000"]


def _python(*args: str, stdout=None) -> None:
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=stdout)


def calibrate(c: MatrixConfig, path: str) -> None:
    _python("tools/calibrate.py", "--output", path, "--from-cost-model", "--peak-tflops", str(c.peak_tflops),
            "--efficiency", "1", *LLAMA_FLAGS, "--hidden-size", str(HIDDEN),
            "--ffn-hidden-size", str(llama_ffn_hidden_size(HIDDEN)), "--num-attention-heads", str(HEADS),
            "--seq-length", str(c.seq_length), "--micro-batch-size", "1", "--vocab-size", str(VOCAB + 1),
            "--num-layers", str(c.num_layers), stdout=subprocess.DEVNULL)


def measure(c: MatrixConfig, outdir: str, repetitions: int, train_iters: int,
            progress=print, burst: Optional[str] = None, equal_memory: bool = True,
            only: Sequence[str] = (), equal_memory_rule: str = "whole") -> dict:
    """Measure the configuration into ``OUTDIR/results.json``; with ``only``, measure those strategies again
    at the micro-batch sizes the existing results chose for them and replace their runs and rows."""
    times = os.path.join(outdir, "times.json")
    path = os.path.join(outdir, "results.json")
    previous = None
    if only:
        with open(path, encoding="utf-8") as f:
            previous = json.load(f)
    else:
        calibrate(c, times)
    sizes = ran_sizes(c, previous) if previous else {}
    config = BenchmarkConfig(schedules=list(only) or c.schedules(), ranks=RANKS, repetitions=repetitions,
                             train_iters=train_iters, warmup_iters=1, model_args=model_flags(c),
                             outdir=os.path.join(outdir, "runs"), cluster=(NODES, RANKS // NODES, c.rate),
                             recompute=False, emulated_compute_times=times,
                             tawpipe_microbatches_per_visit=c.visit, ddp_bucket_size=1_000_000, burst=burst,
                             equal_memory=equal_memory and not only, equal_memory_rule=equal_memory_rule,
                             micro_batch_sizes={s: sizes[s] for s in only if s in sizes})
    result = run_benchmark(config, progress=progress, cluster=benchmark_cluster)
    if previous is not None:
        result = _replace_rows(previous, result, only)
    result["matrix_config"] = asdict(c)
    result["burst"] = burst
    with atomic_write(path) as f:
        json.dump(result, f, indent=1)
    return result


def _replace_rows(previous: dict, new: dict, schedules: Sequence[str]) -> dict:
    """``previous`` with the runs and summary rows of ``schedules`` taken from ``new`` (and when)."""
    out = dict(previous)
    out["runs"] = [r for r in previous["runs"] if r["schedule"] not in schedules] + new["runs"]
    rows = {r["schedule"]: r for r in previous["summary"]}
    rows.update({r["schedule"]: r for r in new["summary"]})
    out["summary"] = [rows[s] for s in dict.fromkeys([r["schedule"] for r in previous["summary"]] +
                                                     [r["schedule"] for r in new["summary"]])]
    out["remeasured"] = dict(previous.get("remeasured") or {}, **{s: time.strftime("%Y-%m-%d") for s in schedules})
    return out


def simulate_command(c: MatrixConfig, times: str, backend: str = "gloo", schedules: Optional[Sequence[str]] = None,
                     micro_batch_size: int = 1) -> List[str]:
    """``tools/simulate.py`` for ``schedules`` (default: all of the configuration's) at one micro-batch size."""
    return ["tools/simulate.py", "--schedule", ",".join(schedules or c.schedules()), "--ranks", str(RANKS),
            "--groups", str(NODES), "--num-layers", str(c.num_layers), "--hidden-size", str(HIDDEN),
            "--num-attention-heads", str(HEADS), "--seq-length", str(c.seq_length),
            "--micro-batch-size", str(micro_batch_size),
            "--num-microbatches", str(GLOBAL_BATCH // RANKS // micro_batch_size), "--vocab-size", str(VOCAB + 1),
            "--dtype-bytes", "4", "--no-recompute", "--chunk", str(c.visit),
            "--virtual-stages", str(c.virtual_stages()), "--measured-times", times,
            "--intra-bw", INTRA_BW, "--inter-bw", c.rate_bytes_per_s(), "--backend", backend, "--json"]


def ran_sizes(c: MatrixConfig, measured: Optional[dict]) -> Dict[str, int]:
    """Each strategy's micro-batch size in the measured run (1 where it gave none)."""
    sizes = ((measured or {}).get("config") or {}).get("micro_batch_sizes") or {}
    return {s: int(sizes.get(s, 1)) for s in c.schedules()}


def simulate(c: MatrixConfig, outdir: str, backend: str = "gloo") -> list:
    """Every strategy simulated at the micro-batch size its measured run used (``results.json``)."""
    measured = None
    results = os.path.join(outdir, "results.json")
    if os.path.exists(results):
        with open(results, encoding="utf-8") as f:
            measured = json.load(f)
    by_size: Dict[int, List[str]] = {}
    for s, m in ran_sizes(c, measured).items():
        by_size.setdefault(m, []).append(s)
    rows = []
    for m, schedules in sorted(by_size.items()):
        cmd = simulate_command(c, os.path.join(outdir, "times.json"), backend, schedules, m)
        rows += [dict(row, micro_batch_size=m) for row in run_simulator(cmd)]
    order = {s: i for i, s in enumerate(c.schedules())}
    rows.sort(key=lambda r: order.get(r["schedule"], len(order)))
    with atomic_write(os.path.join(outdir, "simulated.json")) as f:
        json.dump(rows, f, indent=1)
    return rows


# ------------------------------------------------------------------ report
def _resident_terms(row: dict) -> Optional[float]:
    """What the model predicts an emulated run keeps besides activations and logits (sleeps keep none)."""
    mem = (row.get("options") or {}).get("memory_breakdown")
    if not mem:
        return None
    return sum(mem.get(k, 0.0) for k in ("weights", "grads", "optimizer", "comm_buffers"))


def compare(c: MatrixConfig, measured: dict, simulated: list) -> dict:
    got = {r["schedule"]: r for r in measured["summary"]}
    pred = {r["schedule"]: r for r in simulated}
    rows = []
    for s in c.schedules():
        if s not in got or s not in pred:
            continue
        m, p = got[s], pred[s]
        rows.append({
            "schedule": s, "micro_batch_size": p.get("micro_batch_size", 1), "measured": m["tokens_per_sec_per_rank"], "predicted": p["tokens_per_sec_per_rank"],
            "measured_over_predicted": m["tokens_per_sec_per_rank"] / p["tokens_per_sec_per_rank"],
            "busy_measured": m.get("compute_busy_fraction"), "busy_predicted": 1.0 - p["bubble_ratio"],
            "node_bytes_measured": m.get("node_tx_bytes_per_iteration"),
            "node_bytes_predicted": p.get("inter_group_bytes"),
            "memory_growth_measured": m.get("memory_since_model_bytes_max_rank"),
            "memory_held_measured": m.get("memory_held_since_model_bytes_max_rank"),
            "memory_resident_predicted": _resident_terms(p),
        })
    ref = next((r for r in rows if r["schedule"] == "tawpipe"), None)
    for r in rows:
        if ref is not None:
            r["ratio_measured"] = ref["measured"] / r["measured"]
            r["ratio_predicted"] = ref["predicted"] / r["predicted"]
            r["ratio_deviation"] = r["ratio_measured"] / r["ratio_predicted"] - 1.0
    win_m = max(rows, key=lambda r: r["measured"])["schedule"] if rows else None
    win_p = max(rows, key=lambda r: r["predicted"])["schedule"] if rows else None
    # A winner is "right" when the predicted one is within the measurement's own spread of the measured best.
    best = max((r["measured"] for r in rows), default=0.0)
    pick = next((r for r in rows if r["schedule"] == win_p), None)
    return {"config": asdict(c), "boundary_over_layer": c.boundary_over_layer,
            "layers_per_shard": c.layers_per_shard, "rows": rows, "winner_measured": win_m,
            "winner_predicted": win_p,
            "predicted_winner_measured_gap": (1.0 - pick["measured"] / best) if pick and best else None}


def format_config(entry: dict) -> str:
    c = entry["config"]
    out = [f"{c['name']}: S={c['seq_length']} (G*S/12H={entry['boundary_over_layer']:.2f}), L={c['num_layers']} "
           f"({entry['layers_per_shard']}/shard), node links {c['rate']}, {c['visit']} per visit, "
           f"device {c['peak_tflops']:g} TFLOP/s",
           f"  {'strategy':<13}{'mbs':>4}{'measured':>9}{'predicted':>10}{'m/p':>6}{'tawpipe/x m':>12}{'p':>6}{'dev':>6}"
           f"{'busy m':>8}{'p':>5}{'MB/it m':>9}{'p':>7}{'RSS+ MB':>9}{'held MB':>9}{'p':>7}"]
    for r in entry["rows"]:
        mb = lambda v: "-" if v is None else f"{v / 1e6:.1f}"  # noqa: E731
        busy = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
        out.append(f"  {r['schedule']:<13}{r.get('micro_batch_size', 1):>4}{r['measured']:>9.0f}{r['predicted']:>10.0f}"
                   f"{r['measured_over_predicted']:>6.2f}{r.get('ratio_measured', 0):>12.2f}"
                   f"{r.get('ratio_predicted', 0):>6.2f}{100 * r.get('ratio_deviation', 0):>+5.0f}%"
                   f"{busy(r['busy_measured']):>8}{busy(r['busy_predicted']):>5}"
                   f"{mb(r['node_bytes_measured']):>9}{mb(r['node_bytes_predicted']):>7}"
                   f"{mb(r['memory_growth_measured']):>9}{mb(r.get('memory_held_measured')):>9}"
                   f"{mb(r['memory_resident_predicted']):>7}")
    gap = entry["predicted_winner_measured_gap"]
    out.append(f"  winner measured: {entry['winner_measured']}, predicted: {entry['winner_predicted']}"
               + ("" if gap is None or gap == 0 else f" (measured {100 * gap:.1f}% behind the best)"))
    return "\n".join(out)


def summarize(entries: Sequence[dict], tolerance: float = 0.10) -> Dict[str, object]:
    devs = [(e["config"]["name"], r["schedule"], r["ratio_deviation"]) for e in entries for r in e["rows"]
            if r["schedule"] != "tawpipe" and "ratio_deviation" in r]
    outside = [d for d in devs if abs(d[2]) > tolerance]
    return {"ratios": len(devs), "within_tolerance": len(devs) - len(outside), "tolerance": tolerance,
            "outside": [{"config": n, "schedule": s, "deviation": d} for n, s, d in outside],
            "max_abs_deviation": max((abs(d[2]) for d in devs), default=None),
            "winners_right": sum(e["winner_measured"] == e["winner_predicted"] for e in entries),
            # the predicted winner measured within WINNER_TIE of the measured best: a tie within noise
            "winners_tied": sum(e["winner_measured"] != e["winner_predicted"]
                                and (e["predicted_winner_measured_gap"] or 0.0) <= WINNER_TIE for e in entries),
            "configs": len(entries)}


def format_summary(summary: Dict[str, object]) -> str:
    lines = [f"ratios to TawPipe within {100 * summary['tolerance']:.0f}% of the prediction: "
             f"{summary['within_tolerance']} of {summary['ratios']} (largest deviation "
             f"{100 * (summary['max_abs_deviation'] or 0):.0f}%); winner named right in "
             f"{summary['winners_right']} of {summary['configs']} configurations"
             + (f", and in {summary['winners_tied']} more the predicted winner measured within "
                f"{100 * WINNER_TIE:.0f}% of the best" if summary.get("winners_tied") else "")]
    for o in summary["outside"]:
        lines.append(f"  outside: {o['config']} tawpipe/{o['schedule']} {100 * o['deviation']:+.0f}%")
    return "\n".join(lines)


def format_markdown(entries: Sequence[dict], summary: Dict[str, object]) -> str:
    """One row per configuration (the table in docs/simulator-validation.md)."""
    out = ["| configuration | G·S/12H | link | layers/shard | per visit | measured best (tok/s/rank) | "
           "predicted best | measured/predicted, min-max over strategies | ratios to TawPipe outside 10% |",
           "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        c = e["config"]
        rows = {r["schedule"]: r for r in e["rows"]}
        best = rows[e["winner_measured"]]
        mp = [r["measured_over_predicted"] for r in e["rows"]]
        outside = [f"{r['schedule']} {100 * r['ratio_deviation']:+.0f}%" for r in e["rows"]
                   if r["schedule"] != "tawpipe" and abs(r.get("ratio_deviation", 0.0)) > summary["tolerance"]]
        gap = e["predicted_winner_measured_gap"] or 0.0
        pred = e["winner_predicted"] + ("" if e["winner_predicted"] == e["winner_measured"]
                                        else f" (measured {100 * gap:.1f}% behind)")
        out.append(f"| `{c['name']}` | {e['boundary_over_layer']:.2f} | {c['rate']} | {e['layers_per_shard']} | "
                   f"{c['visit']} | {e['winner_measured']} {best['measured']:.0f} (mbs {best.get('micro_batch_size', 1)}) | "
                   f"{pred} | "
                   f"{min(mp):.2f}-{max(mp):.2f} (tawpipe {rows['tawpipe']['measured_over_predicted']:.2f}) | "
                   f"{', '.join(outside) or '-'} |")
    return "\n".join(out)
