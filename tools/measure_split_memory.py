#!/usr/bin/env python
"""The split backward's peak memory, measured with real compute on local ranks, beside the memory model.

    python tools/measure_split_memory.py --json examples/results/split_memory.json

For each recompute setting (on, off) it measures one decoder layer's activation bytes on this machine
(``tools/calibrate.py --measure-activations``), and for each schedule builds the plan
(``tools/plan.py build``), runs it with real compute (``torchrun pretrain_llama.py --pipeline-schedule
plan:FILE --record-plan-memory``) and reads back the most the plan held beyond its start
(``plan_memory_growth_bytes_max_rank``: activations, held gradients, logits, the weight-gradient store) and
the store's peak (``plan_wgrad_store_peak_bytes_max_rank``). Beside them: the memory model's activations +
logits (``tools/simulate.py``'s breakdown, the layer's activation bytes measured), its store peak
(``sim.memory.weight_store_peak_bytes``) and the store's formula (``CostModel.from_flops``'s
``layer_weight_store_bytes``, before the measured activations rescale it).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_tawpipe.arguments import TOOL_FLAGS  # noqa: E402
from megatron_tawpipe.plan.files import read_plan  # noqa: E402
from megatron_tawpipe.sim import CostModel, simulate  # noqa: E402
from megatron_tawpipe.sim.memory import weight_store_peak_bytes  # noqa: E402
from megatron_tawpipe.sim.plan_memory import activation_peaks  # noqa: E402
from megatron_tawpipe.sim.strategies import plan_memory  # noqa: E402

SCHEDULES = ("weipipe", "weipipe-zb1", "weipipe-zb2", "tawpipe", "tawpipe-zb")


def model_flags(a) -> list:
    return list(TOOL_FLAGS) + [
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--ffn-hidden-size", str(a.ffn_hidden_size),
        "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
        "--max-position-embeddings", str(a.seq_length), "--micro-batch-size", "1",
        "--global-batch-size", str(a.ranks * a.num_microbatches), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(a.vocab_size), "--lr", "1e-4", "--log-interval", "1000", "--eval-interval", "1000",
        "--no-gradient-accumulation-fusion", "--seed", "1234"]


def measure_layer_bytes(a, recompute: bool, tmp: str) -> float:
    out = os.path.join(tmp, f"layer_{int(recompute)}.json")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "calibrate.py"), "--output", out, "--from-cost-model",
                    "--peak-tflops", "1", "--measure-activations", *model_flags(a)], check=True,
                   stdout=subprocess.DEVNULL, cwd=ROOT)
    with open(out) as f:
        return float(json.load(f)["layer_activation_bytes"])


def sim_flags(a, recompute: bool) -> list:
    return ["--ranks", str(a.ranks), "--groups", str(a.groups), "--num-layers", str(a.num_layers),
            "--hidden-size", str(a.hidden_size), "--ffn-hidden-size", str(a.ffn_hidden_size),
            "--num-attention-heads", str(a.num_attention_heads), "--seq-length", str(a.seq_length),
            "--vocab-size", str(a.vocab_size), "--num-microbatches", str(a.num_microbatches), "--dtype-bytes", "4",
            *([] if recompute else ["--no-recompute"]), *(["--chunk", str(a.chunk)] if a.chunk else [])]


def build_plan_file(a, schedule: str, recompute: bool, path: str) -> None:
    flags = sim_flags(a, recompute)
    if not schedule.startswith("tawpipe") and "--chunk" in flags:   # WeiPipe has no visits
        i = flags.index("--chunk")
        del flags[i:i + 2]
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), "build", "--schedule", schedule, *flags,
                    "--out", path], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)


def run_plan(a, plan_path: str, recompute: bool, metrics: str, log: str) -> dict:
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(a.ranks), "pretrain_llama.py", *model_flags(a),
           "--pipeline-schedule", f"plan:{plan_path}", "--tawpipe-num-groups", str(a.groups),
           "--tawpipe-recompute", "on" if recompute else "off", "--record-plan-memory",
           "--train-iters", str(a.train_iters), "--metrics-file", metrics]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"run failed (exit {rc}); see {log}:\n  {' '.join(cmd)}")
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    growth = [r["plan_memory_growth_bytes_max_rank"] for r in records if "plan_memory_growth_bytes_max_rank" in r]
    store = [r["plan_wgrad_store_peak_bytes_max_rank"] for r in records if "plan_wgrad_store_peak_bytes_max_rank" in r]
    if not growth:
        raise SystemExit(f"the run recorded no plan memory ({metrics})")
    return {"plan_memory_measured": max(growth), "plan_memory_per_iteration": growth,
            "store_peak_measured": max(store) if store else 0}


def predict(a, plan, recompute: bool, layer_bytes: float) -> dict:
    """The memory model's figures for ``plan``. ``plan_memory_predicted``: activations + logits as
    ``tools/simulate.py`` prices them (with recompute, the shard's working set while it is recomputed
    included). ``held_between_actions_predicted``: what stays held from one compute action to the next --
    stored shard inputs (whole shards' activations without recompute), the weight-gradient store, without
    recompute one visit's logits -- the part the runtime's probe, sampling after each compute action, sees."""
    base = CostModel.from_flops(hidden_size=a.hidden_size, seq_length=a.seq_length, ffn_hidden_size=a.ffn_hidden_size,
                                num_attention_heads=a.num_attention_heads, vocab_size=a.vocab_size,
                                recompute=recompute, dtype_bytes=4)
    cost = base.with_measured({"layer_activation_bytes": layer_bytes})
    # the store is exact arithmetic (docs/split-backward.md); with_measured rescales it with the activations
    exact = replace(cost, layer_weight_store_bytes=base.layer_weight_store_bytes)
    memory = plan_memory(simulate(plan, cost, record=False), cost, plan)
    between = max(activation_peaks(plan, exact)) + (0.0 if recompute else memory.logits)
    return {"plan_memory_predicted": memory.activations + memory.logits,
            "activations_predicted": memory.activations, "logits_predicted": memory.logits,
            "held_between_actions_predicted": between,
            "store_peak_model": weight_store_peak_bytes(plan, cost),
            "store_peak_formula": weight_store_peak_bytes(plan, base),
            "store_per_layer_formula": base.layer_weight_store_bytes,
            "store_per_layer_model": cost.layer_weight_store_bytes}


def mb(x) -> str:
    return f"{x / 1e6:9.1f}" if x is not None else "        -"


def table(rows) -> str:
    out = [f"{'schedule':<12} {'recompute':<9} {'measured':>9} {'between':>9} {'model':>9} "
           f"{'store meas.':>11} {'formula':>9} {'model':>9}   (MB)"]
    for r in rows:
        out.append(f"{r['schedule']:<12} {('on' if r['recompute'] else 'off'):<9} {mb(r['plan_memory_measured'])} "
                   f"{mb(r['held_between_actions_predicted'])} {mb(r['plan_memory_predicted'])} "
                   f"{mb(r['store_peak_measured']):>11} {mb(r['store_peak_formula'])} {mb(r['store_peak_model'])}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="measure_split_memory.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, of " + ", ".join(SCHEDULES))
    p.add_argument("--recompute", default="on,off", help="on, off or on,off (default)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=704)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--num-microbatches", type=int, default=2, help="micro-batches per rank (global batch P x N)")
    p.add_argument("--chunk", type=int, default=None, help="TawPipe's micro-batches per visit (default: the planner's)")
    p.add_argument("--train-iters", type=int, default=2)
    p.add_argument("--outdir", default="runs/split_memory", help="plans, metrics and logs")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    schedules = [s for s in a.schedules.split(",") if s]
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad:
        p.error(f"--schedules: unknown {bad}; allowed: {', '.join(SCHEDULES)}")
    settings = a.recompute.split(",")
    if not settings or any(s not in ("on", "off") for s in settings):
        p.error("--recompute must be on, off or on,off")
    if a.ranks < 2 or a.num_microbatches < 1 or a.train_iters < 1:
        p.error("--ranks must be >= 2, --num-microbatches and --train-iters >= 1")
    os.makedirs(a.outdir, exist_ok=True)
    started = time.time()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in settings:
            recompute = setting == "on"
            layer = measure_layer_bytes(a, recompute, tmp)
            for schedule in schedules:
                tag = f"{schedule}-{'rc' if recompute else 'norc'}"
                plan_path = os.path.abspath(os.path.join(a.outdir, f"{tag}.plan.json"))
                build_plan_file(a, schedule, recompute, plan_path)
                plan = read_plan(plan_path)
                row = {"schedule": schedule, "recompute": recompute, "layer_activation_bytes": layer,
                       "chunk": plan.options.get("chunk"), **predict(a, plan, recompute, layer)}
                t0 = time.time()
                row.update(run_plan(a, plan_path, recompute, os.path.join(a.outdir, f"{tag}.metrics.jsonl"),
                                    os.path.join(a.outdir, f"{tag}.log")))
                row["wall_s"] = round(time.time() - t0, 1)
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    print(table(rows))
    if a.json:
        config = {k: v for k, v in vars(a).items() if k not in ("json", "outdir")}
        result = {"command": "python tools/measure_split_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "config": config, "machine": f"{os.cpu_count()} CPUs, no GPU" if not _has_gpu() else "GPU",
                  "load_average_before": load_before, "load_average_after": load_after,
                  "wall_s": round(time.time() - started, 1), "rows": rows}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
