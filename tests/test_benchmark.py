"""The benchmark tool's local path and the strategies' command lines."""

import json
import os
import re
import subprocess
import sys

import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.arguments import TOOL_FLAGS
from training_helpers import assert_close_rel, train_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCH_MODEL = list(TOOL_FLAGS) + [
    "--lr", "3e-4", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
    "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--log-interval", "1000", "--eval-interval", "1000", "--seed", "3",
]


def fork_launcher(config, script_args, log_path):
    """Runs what torchrun would run, on ranks forked from this process (no interpreter start-up per run)."""
    with open(log_path, "w") as log:
        log.write(" ".join(script_args) + "\n")
    run_ranks(train_rank, config.ranks, list(script_args[1:]))
    return 0


def test_benchmark_two_schedules_two_repetitions(tmp_path):
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, read_metrics, run_benchmark
    from megatron_tawpipe.bench.benchmark_report import format_table, write_chart

    config = BenchmarkConfig(schedules=("tawpipe", "1f1b"), ranks=2, repetitions=2, train_iters=3, warmup_iters=1,
                             model_args=BENCH_MODEL, outdir=str(tmp_path / "runs"))
    lines = []
    result = run_benchmark(config, progress=lines.append, launcher=fork_launcher)

    # Alternating order: A B A B.
    assert [(r["schedule"], r["repetition"]) for r in result["runs"]] == [
        ("tawpipe", 0), ("1f1b", 0), ("tawpipe", 1), ("1f1b", 1)]
    assert len(lines) == 4
    rows = {row["schedule"]: row for row in result["summary"]}
    assert set(rows) == {"tawpipe", "1f1b"}
    for row in rows.values():
        assert row["repetitions"] == 2
        assert row["tokens_per_sec_per_rank_min"] <= row["tokens_per_sec_per_rank"] <= row["tokens_per_sec_per_rank_max"]
        assert row["tokens_per_sec_per_rank"] > 0
        assert row["elapsed_ms"] > 0
        assert 1e6 < row["peak_memory_bytes_max_rank"] < 64e9
    for run in result["runs"]:
        assert run["iterations"] == 2  # 3 iterations, 1 warm-up dropped
        # Per iteration, tokens/s per rank and ms/iteration describe the same time: G*S / t / P.
        # (Checked per record: medians of the two over noisy iterations need not satisfy it.)
        for record in read_metrics(run["metrics_file"]):
            expected_tps = 4 * 32 / (record["elapsed_ms"] / 1000.0) / 2
            assert record["tokens_per_sec_per_rank"] == pytest.approx(expected_tps, rel=1e-3)
    # Weight passing counts its traffic between the 2 groups; native schedules do not count bytes.
    assert rows["tawpipe"]["inter_group_bytes"] > 0
    assert 0.0 < rows["tawpipe"]["compute_busy_fraction"] <= 1.0
    assert rows["1f1b"]["inter_group_bytes"] is None
    # Same model, batch, data and seed: both schedules train identically.
    by_sched = {r["schedule"]: r["lm_loss"] for r in result["runs"] if r["repetition"] == 0}
    assert_close_rel(by_sched["tawpipe"], by_sched["1f1b"], 1e-5)

    table = format_table(result)
    assert "tokens/s/rank" in table and "tawpipe" in table and "1f1b" in table
    json.loads(json.dumps(result))  # what --json writes
    chart = tmp_path / "chart.png"
    write_chart(result, str(chart))
    assert chart.stat().st_size > 1000


def test_schedule_commands_are_valid_pretrain_flags(tmp_path):
    """Every strategy's command line passes the project's own argument checks for 2 nodes x 2 ranks,
    with the data-parallel flags its users would pass."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args
    from megatron_tawpipe.bench.benchmark import SCHEDULES, BenchmarkConfig, schedule_command

    model = [a if a != "4" else "16" for a in BENCH_MODEL]  # global batch 16
    model[model.index("--num-layers") + 1] = "8"
    config = BenchmarkConfig(ranks=4, model_args=model, groups=2)
    parsed = {}
    for schedule in SCHEDULES:
        cmd = schedule_command(schedule, config, "/tmp/m.jsonl")
        assert cmd[0].endswith("pretrain_llama.py")
        args = validate_args(parse_args(cmd[1:]), world_size=4)
        assert args.global_batch_size == 16 and args.metrics_file == "/tmp/m.jsonl"
        parsed[schedule] = args
    for schedule in ("tawpipe", "weipipe", "1f1b", "interleaved"):
        assert parsed[schedule].pipeline_schedule == schedule
    assert parsed["pp-nodes"].pipeline_model_parallel_size == 2 and parsed["pp-nodes"].data_parallel_size == 2
    for schedule in ("pp-nodes", "distopt-node", "distopt"):
        args = parsed[schedule]
        assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather
    assert parsed["distopt-node"].num_distributed_optimizer_instances == 2
    assert parsed["distopt"].num_distributed_optimizer_instances == 1
    assert parsed["fsdp"].use_torch_fsdp2 and parsed["fsdp"].num_distributed_optimizer_instances == 1
    assert parsed["hsdp"].use_torch_fsdp2 and parsed["hsdp"].num_distributed_optimizer_instances == 2
    hfsdp = parsed["hfsdp"]
    assert hfsdp.use_megatron_fsdp and not hfsdp.use_torch_fsdp2 and hfsdp.num_distributed_optimizer_instances == 2
    assert (hfsdp.data_parallel_sharding_strategy, hfsdp.outer_dp_sharding_strategy) == ("optim_grads_params", "optim")
    assert hfsdp.use_distributed_optimizer and hfsdp.overlap_grad_reduce and hfsdp.overlap_param_gather
    assert parsed["tawpipe-rep"].pipeline_schedule == "tawpipe" and parsed["tawpipe-rep"].tawpipe_replicate_first_shard
    assert not parsed["tawpipe"].tawpipe_replicate_first_shard
    assert parsed["tawpipe-nocache"].tawpipe_cache == "off" and parsed["tawpipe"].tawpipe_cache == "auto"
    assert parsed["weipipe-zb2"].weipipe_zero_bubble == 2 and not parsed["weipipe-zb2"].record_plan_memory
    # The zero-bubble benchmark's options: plan memory recorded, weight-gradient kernels emulated as deferred.
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"layer_forward": 0.01, "layer_backward": 0.02}))
    config = BenchmarkConfig(ranks=4, model_args=model, groups=2, deferred_weight_gradients=True,
                             emulated_compute_times=str(times))
    zb1 = validate_args(parse_args(schedule_command("weipipe-zb1", config, "/tmp/m.jsonl")[1:]), world_size=4)
    assert zb1.weipipe_zero_bubble == 1 and zb1.emulated_deferred_weight_gradients and not zb1.record_plan_memory
    taw = validate_args(parse_args(schedule_command("tawpipe", config, "/tmp/m.jsonl")[1:]), world_size=4)
    assert not taw.emulated_deferred_weight_gradients     # no split backward to defer
    config = BenchmarkConfig(ranks=4, model_args=model, groups=2, record_plan_memory=True)   # real compute
    for schedule in ("weipipe-zb2", "tawpipe"):
        args = validate_args(parse_args(schedule_command(schedule, config, "/tmp/m.jsonl")[1:]), world_size=4)
        assert args.record_plan_memory and not args.emulated_compute_times


def test_cli_with_torchrun_keeps_a_failed_strategys_logs_and_runs_the_others(tmp_path):
    """The command-line tool end to end, through a real torchrun: a strategy that fails (distopt at a micro-batch
    size the global batch does not divide: its ranks exit 2) makes the tool exit non-zero, naming it, its exit
    status and failing rank, with the tail of that rank's log; every rank's log is kept; the next strategy
    still runs and its results are printed and written; every collective's bytes are counted."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "benchmark.py"), "--ranks", "2", "--schedules", "distopt", "fsdp",
         "--micro-batch-size-of", "distopt=3", "--repetitions", "1", "--train-iters", "2", "--outdir", str(tmp_path),
         "--json", str(out), "--"] + BENCH_MODEL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert re.search(r"strategy distopt repetition 0 failed \(exit status 1; rank [01] failed first with exit code 2\)",
                     said)   # both ranks refuse the flags; either may be the first torchrun sees
    assert "--global-batch-size" in said.split("last 40 lines of")[1]      # the rank's own error, in its tail
    rank_logs = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "distopt-rep0-ranks") for f in fs
                 if f == "stderr.log"]
    assert len(rank_logs) == 2 and (tmp_path / "distopt-rep0.log").exists()
    result = json.loads(out.read_text())
    assert [row["schedule"] for row in result["summary"]] == ["fsdp"]
    assert result["failures"][0]["schedule"] == "distopt" and result["failures"][0]["exit_status"] == 1
    fsdp = result["summary"][0]
    # One local "node" per group (2 groups of 1 rank): FSDP's collectives cross between them every iteration.
    assert fsdp["inter_node_bytes_per_iteration"] > 0
    kinds = {f["kind"] for f in fsdp["formulas_per_iteration"].values() if f["inter"] > 0}
    assert {"all_gather", "reduce_scatter"} <= kinds       # FSDP2's own collectives (all_gather_single, ...) count
    assert "fsdp" in proc.stdout and "between nodes/iter" in proc.stdout


def _write_metrics(path, iterations=2):
    with open(path, "w") as f:
        for _ in range(iterations):
            f.write(json.dumps({"tokens_per_sec_per_rank": 1.0, "elapsed_ms": 1.0, "peak_memory_bytes": 1}) + "\n")


def test_a_run_that_failed_in_the_rendezvous_is_started_once_more_and_said_so(tmp_path):
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, run_benchmark

    tries = []

    def launcher(config, script_args, log_path):
        metrics = script_args[script_args.index("--metrics-file") + 1]
        tries.append(metrics)
        with open(log_path, "w") as log:
            if len(tries) == 1:
                log.write("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                          "network address. port: 29600, useIpv6: false, code: -98, name: EADDRINUSE, message: "
                          "Address already in use\n")
                return 1
        _write_metrics(metrics)
        return 0

    lines = []
    config = BenchmarkConfig(schedules=("fsdp",), ranks=2, repetitions=1, train_iters=2, model_args=BENCH_MODEL,
                             outdir=str(tmp_path))
    result = run_benchmark(config, progress=lines.append, launcher=launcher)
    assert len(tries) == 2 and result["runs"][0]["retries"] == 1 and result["summary"][0]["retries"] == 1
    assert any("failed at start-up ('Address already in use'" in line and "again" in line for line in lines)
    assert (tmp_path / "fsdp-rep0-try0.log").exists()        # the first try's log is kept


def test_a_run_that_failed_while_training_is_not_retried_and_fails_the_benchmark(tmp_path):
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, BenchmarkFailed, run_benchmark

    calls = []

    def launcher(config, script_args, log_path):
        metrics = script_args[script_args.index("--metrics-file") + 1]
        schedule = os.path.basename(metrics).split("-rep")[0]
        calls.append(schedule)
        if schedule == "fsdp":
            _write_metrics(metrics, 1)      # it trained an iteration: not safe to start again
            ranks = os.path.join(log_path[:-4] + "-ranks", "run_x", "attempt_0")
            for rank in (0, 1):
                os.makedirs(os.path.join(ranks, str(rank)))
                with open(os.path.join(ranks, str(rank), "stderr.log"), "w") as f:
                    f.write("".join(f"rank {rank} line {i}\n" for i in range(100)))
            with open(log_path, "w") as log:
                log.write("Connection reset by peer\nRoot Cause (first observed failure):\n[0]:\n  rank      : 1 "
                          "(local_rank: 1)\n  exitcode  : 7 (pid: 12)\n")
            return 1
        _write_metrics(metrics)
        return 0

    lines = []
    config = BenchmarkConfig(schedules=("fsdp", "distopt"), ranks=2, repetitions=2, train_iters=2,
                             model_args=BENCH_MODEL, outdir=str(tmp_path))
    with pytest.raises(BenchmarkFailed) as failed:
        run_benchmark(config, progress=lines.append, launcher=launcher)
    assert calls == ["fsdp", "distopt", "distopt"]        # not retried, not repeated; the other strategy ran on
    text = str(failed.value)
    assert "strategy fsdp repetition 0 failed (exit status 1; rank 1 failed first with exit code 7)" in text
    tail = text.split("last 40 lines of ")[1].splitlines()
    assert tail[0].endswith(os.path.join("1", "stderr.log") + ":")
    assert tail[1:] == [f"rank 1 line {i}" for i in range(60, 100)]
    assert [row["schedule"] for row in failed.value.result["summary"]] == ["distopt"]
    assert any("FAILED" in line for line in lines)


def test_a_local_run_that_times_out_is_stopped_with_its_ranks(tmp_path):
    from megatron_tawpipe.bench import bench_runs
    from tawpipe_lab import netns

    script = tmp_path / "sleeper.py"
    pids = tmp_path / "pids"
    script.write_text("import os, subprocess, sys, time\n"
                      f"child = subprocess.Popen(['sleep', '120'])\n"
                      f"open({str(pids)!r} + os.environ['RANK'], 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
                      "time.sleep(120)\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = bench_runs.launch_local(2, [str(script)], str(tmp_path / "run.log"), str(tmp_path / "run-ranks"), env,
                                   sys.executable, timeout=20)
    assert done.rc == 124
    started = [int(p) for r in (0, 1) for p in open(f"{pids}{r}").read().split()]
    assert len(started) == 4 and not any(netns.pid_alive(p) for p in started)
    assert "timed out after 20 s" in (tmp_path / "run.log").read_text()
    assert sorted(bench_runs.rank_logs(str(tmp_path / "run-ranks"), 2)) == [0, 1]


def test_comparison_with_the_simulator():
    from megatron_tawpipe.bench.benchmark_report import compare_with_simulation, format_comparison

    result = {"summary": [{"schedule": "tawpipe", "tokens_per_sec_per_rank": 300.0},
                          {"schedule": "1f1b", "tokens_per_sec_per_rank": 200.0},
                          {"schedule": "fsdp", "tokens_per_sec_per_rank": 100.0}]}
    simulated = [{"schedule": "tawpipe", "tokens_per_sec_per_rank": 400.0},
                 {"schedule": "1f1b", "tokens_per_sec_per_rank": 250.0},
                 {"schedule": "weipipe", "tokens_per_sec_per_rank": 1.0}]
    comparison = compare_with_simulation(result, simulated)
    rows = {r["schedule"]: r for r in comparison["rows"]}
    assert set(rows) == {"tawpipe", "1f1b"}  # fsdp was not simulated, weipipe not measured
    assert rows["tawpipe"]["measured_over_predicted"] == pytest.approx(0.75)
    (ratio,) = comparison["ratios"]
    assert ratio["ratio"] == "tawpipe/1f1b"
    assert ratio["measured"] == pytest.approx(1.5) and ratio["predicted"] == pytest.approx(1.6)
    assert ratio["deviation"] == pytest.approx(1.5 / 1.6 - 1)
    text = format_comparison(comparison)
    assert "tawpipe/1f1b" in text and "-6%" in text


def test_simulator_matrix_report():
    from tawpipe_lab.matrix import (MATRIX, compare, format_config, format_markdown, format_summary,
                                    simulate_command, summarize)

    c = MATRIX[0]
    measured = {"summary": [
        {"schedule": "tawpipe", "tokens_per_sec_per_rank": 1000.0, "compute_busy_fraction": 0.9,
         "node_tx_bytes_per_iteration": 5e7, "memory_since_model_bytes_max_rank": 2e8},
        {"schedule": "distopt", "tokens_per_sec_per_rank": 1100.0, "compute_busy_fraction": 0.95,
         "node_tx_bytes_per_iteration": 8e7, "memory_since_model_bytes_max_rank": 3e8},
        {"schedule": "fsdp", "tokens_per_sec_per_rank": 500.0}]}
    simulated = [
        {"schedule": "tawpipe", "tokens_per_sec_per_rank": 1200.0, "bubble_ratio": 0.05, "inter_group_bytes": 5e7,
         "options": {"memory_breakdown": {"weights": 1e6, "grads": 2e6, "optimizer": 3e6, "comm_buffers": 4e6,
                                          "activations": 9e9}}},
        {"schedule": "distopt", "tokens_per_sec_per_rank": 1000.0, "bubble_ratio": 0.0, "inter_group_bytes": 8e7},
        {"schedule": "fsdp", "tokens_per_sec_per_rank": 480.0, "bubble_ratio": 0.5, "inter_group_bytes": 1e8}]
    entry = compare(c, measured, simulated)
    rows = {r["schedule"]: r for r in entry["rows"]}
    assert rows["tawpipe"]["measured_over_predicted"] == pytest.approx(1000 / 1200)
    # tawpipe/distopt: measured 1000/1100, predicted 1200/1000.
    assert rows["distopt"]["ratio_deviation"] == pytest.approx((1000 / 1100) / (1200 / 1000) - 1)
    assert rows["tawpipe"]["memory_resident_predicted"] == pytest.approx(1e7)  # activations left out
    assert entry["winner_measured"] == "distopt" and entry["winner_predicted"] == "tawpipe"
    assert entry["predicted_winner_measured_gap"] == pytest.approx(1 - 1000 / 1100)
    summary = summarize([entry])
    assert summary["ratios"] == 2 and summary["winners_right"] == 0 and summary["winners_tied"] == 0  # 9% behind
    assert {o["schedule"] for o in summary["outside"]} == {"distopt", "fsdp"}  # -24% and -20%
    text = format_config(entry) + format_summary(summary)
    assert "winner measured: distopt, predicted: tawpipe" in text
    row = format_markdown([entry], summary).splitlines()[-1]
    assert row.startswith(f"| `{c.name}` | 0.33 |") and "distopt -24%, fsdp -20%" in row
    cmd = simulate_command(c, "times.json")
    assert cmd[cmd.index("--backend") + 1] == "gloo" and cmd[cmd.index("--inter-bw") + 1] == "125000000B/s"


def test_simulator_matrix_calibrates_the_model_it_measures(tmp_path):
    """The matrix's emulated compute comes from the cost model of the Llama layer its runs build
    (SwiGLU, its FFN size), at the configuration's device speed."""
    from megatron_tawpipe.arguments import llama_ffn_hidden_size
    from tawpipe_lab.matrix import HIDDEN, MATRIX, calibrate
    from megatron_tawpipe.sim.costmodel import CostModel

    c = MATRIX[0]
    path = str(tmp_path / "times.json")
    calibrate(c, path)
    with open(path) as f:
        times = json.load(f)
    expect = CostModel.from_flops(hidden_size=HIDDEN, seq_length=c.seq_length, ffn_hidden_size=llama_ffn_hidden_size(HIDDEN),
                                  num_attention_heads=4, peak_tflops=c.peak_tflops, efficiency=1.0)
    assert times["layer_forward"] == pytest.approx(expect.layer_forward, rel=1e-6)


def test_replicated_first_shard_needs_two_nodes(tmp_path):
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, BenchmarkError, run_benchmark

    config = BenchmarkConfig(ranks=2, model_args=BENCH_MODEL, groups=1, schedules=["tawpipe-rep"],
                             outdir=str(tmp_path))
    with pytest.raises(BenchmarkError, match="tawpipe-rep .* at least 2 nodes"):
        run_benchmark(config, launcher=fork_launcher)
    assert not os.listdir(tmp_path)      # refused before any run


def test_an_emulated_cluster_is_the_callers(tmp_path):
    """The package builds no emulated cluster: a run on one takes it from ``cluster=`` (tools/benchmark.py
    --nodes gives the lab's), entered once around every run and left after them; without it, refused."""
    import contextlib

    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, BenchmarkError, run_benchmark

    config = BenchmarkConfig(ranks=2, model_args=BENCH_MODEL, schedules=["distopt", "fsdp"], cluster=(2, 1, "1gbit"),
                             burst="64k", repetitions=1, train_iters=3, count_bytes=False, outdir=str(tmp_path))
    with pytest.raises(BenchmarkError, match="needs the cluster"):
        run_benchmark(config, launcher=fork_launcher)
    assert not os.listdir(tmp_path)      # refused before any run

    calls, lines = [], []

    @contextlib.contextmanager
    def cluster(nodes, ranks_per_node, rate, burst, progress):
        calls.append(("enter", nodes, ranks_per_node, rate, burst))
        yield "the cluster"
        calls.append(("exit",))

    def launcher(config, script_args, log_path):
        calls.append(("run", config.cluster))
        metrics = script_args[script_args.index("--metrics-file") + 1]
        with open(metrics, "w") as f:
            for _ in range(3):
                f.write(json.dumps({"tokens_per_sec_per_rank": 1.0, "elapsed_ms": 1.0,
                                    "peak_memory_bytes_max_rank": 1}) + "\n")
        return 0

    result = run_benchmark(config, progress=lines.append, launcher=launcher, cluster=cluster)
    assert calls == [("enter", 2, 1, "1gbit", "64k"), ("run", (2, 1, "1gbit")), ("run", (2, 1, "1gbit")), ("exit",)]
    assert [r["schedule"] for r in result["summary"]] == ["distopt", "fsdp"]


def _validated_commands(model, schedules, ranks=4, groups=2):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, schedule_command
    from megatron_tawpipe.training.validate_args import validate_args

    config = BenchmarkConfig(ranks=ranks, model_args=model, groups=groups)
    return {s: validate_args(parse_args(schedule_command(s, config, "/tmp/m.jsonl")[1:]), world_size=ranks)
            for s in schedules}


def test_uneven_layers_run_under_every_strategy():
    """9 layers on 2 nodes x 2 ranks: the weight pipeline's default split (3, 2, 2, 2), the same split of
    1F1B's stages, and of interleaved's 8 and one-stage-per-node's 2 (megatron-core's layout string)."""
    from megatron_tawpipe.bench.benchmark import SCHEDULES

    model = [a if a != "4" else "16" for a in BENCH_MODEL]
    model[model.index("--num-layers") + 1] = "9"
    parsed = _validated_commands(model, SCHEDULES)
    assert parsed["tawpipe"].decoder_layer_split == parsed["weipipe"].decoder_layer_split == (3, 2, 2, 2)
    assert parsed["tawpipe-tp"].decoder_layer_split == (5, 4)     # 2 tensor-parallel groups of 2
    assert parsed["1f1b"].pipeline_model_parallel_layout == "Ettt|tt|tt|ttL"
    assert parsed["1f1b"].decoder_layer_split == (3, 2, 2, 2)
    assert parsed["interleaved"].decoder_layer_split == (2, 1, 1, 1, 1, 1, 1, 1)
    assert parsed["pp-nodes"].decoder_layer_split == (5, 4)
    assert all(parsed[s].decoder_layer_split is None for s in ("distopt", "distopt-node", "fsdp", "hsdp"))


def test_split_flags_in_the_model_flags_give_one_piece_per_rank(tmp_path):
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, BenchmarkError, run_benchmark

    model = [a if a != "4" else "16" for a in BENCH_MODEL] + ["--decoder-last-pipeline-num-layers", "5"]
    model[model.index("--num-layers") + 1] = "8"
    parsed = _validated_commands(model, ("tawpipe", "weipipe", "1f1b", "fsdp", "distopt"))
    assert parsed["tawpipe"].decoder_layer_split == parsed["1f1b"].decoder_layer_split == (1, 1, 1, 5)
    assert parsed["fsdp"].decoder_last_pipeline_num_layers is None     # no stages: left out
    config = BenchmarkConfig(ranks=4, model_args=model, groups=2, schedules=["tawpipe", "pp-nodes"],
                             outdir=str(tmp_path))
    with pytest.raises(BenchmarkError, match="pp-nodes: the model flags' --decoder-last-pipeline-num-layers give "
                                             "one piece per rank"):
        run_benchmark(config, launcher=fork_launcher)
    assert not os.listdir(tmp_path)      # refused before any run


def test_benchmark_with_uneven_layers_trains_alike(tmp_path):
    """3 layers on 2 ranks: tawpipe's shards of 2 and 1 layers, 1F1B's stages of 2 and 1 (a layout)."""
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig, run_benchmark

    model = list(BENCH_MODEL)
    model[model.index("--num-layers") + 1] = "3"
    config = BenchmarkConfig(schedules=("tawpipe", "1f1b"), ranks=2, repetitions=1, train_iters=2, warmup_iters=1,
                             model_args=model, outdir=str(tmp_path / "runs"))
    result = run_benchmark(config, progress=lambda line: None, launcher=fork_launcher)
    losses = {r["schedule"]: r["lm_loss"] for r in result["runs"]}
    assert_close_rel(losses["tawpipe"], losses["1f1b"], 1e-5)
    with open(tmp_path / "runs" / "1f1b-rep0.log") as log:
        assert "--pipeline-model-parallel-layout Ett|tL" in log.read()


def test_simulator_matrix_takes_uneven_layers():
    from tawpipe_lab.matrix import MatrixConfig, simulate_command

    six, ten = (MatrixConfig(f"s1k-l{n}", 1024, n, "1gbit", 1, 0.1) for n in (6, 10))
    assert six.layers_per_shard == "2,2,1,1" and "interleaved" not in six.schedules()
    assert ten.layers_per_shard == "3,3,2,2" and "interleaved" in ten.schedules() and ten.virtual_stages() == 2
    cmd = simulate_command(ten, "times.json")
    assert cmd[cmd.index("--num-layers") + 1] == "10" and cmd[cmd.index("--virtual-stages") + 1] == "2"


def test_simulator_matrix_simulates_each_strategy_at_the_size_it_ran():
    from tawpipe_lab.matrix import MATRIX, ran_sizes, simulate_command

    c = MATRIX[1]
    sizes = ran_sizes(c, {"config": {"micro_batch_sizes": {"distopt": 4, "fsdp": 2, "tawpipe": 1}}})
    assert sizes["distopt"] == 4 and sizes["fsdp"] == 2 and sizes["1f1b"] == 1 and set(sizes) == set(c.schedules())
    cmd = simulate_command(c, "times.json", schedules=["distopt"], micro_batch_size=4)
    assert cmd[cmd.index("--schedule") + 1] == "distopt"
    assert cmd[cmd.index("--micro-batch-size") + 1] == "4" and cmd[cmd.index("--num-microbatches") + 1] == "1"


def _long_context_config(tmp_path, **kw):
    """The emulated long-context table's shape (2 x 2 ranks, global batch 16, TawPipe 4 micro-batches per
    visit, no recompute) on times from the FLOP model."""
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig

    times = tmp_path / "times.json"
    times.write_text(json.dumps({"layer_forward": 0.0244, "layer_backward": 0.0488, "head_forward": 0.008,
                                 "head_backward": 0.016, "micro_batch_size": 1, "seq_length": 3072}))
    model = list(TOOL_FLAGS) + ["--num-layers", "8", "--hidden-size", "256", "--ffn-hidden-size", "704",
                                "--num-attention-heads", "4", "--seq-length", "3072", "--micro-batch-size", "1",
                                "--global-batch-size", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
                                "--vocab-size", "2047", "--lr", "1e-4"]
    base = dict(schedules=("tawpipe", "weipipe", "1f1b", "pp-nodes", "distopt", "fsdp"), ranks=4, model_args=model,
                groups=2, recompute=False, emulated_compute_times=str(times), tawpipe_microbatches_per_visit=4)
    return BenchmarkConfig(**{**base, **kw})


@pytest.mark.parametrize("rule", ["whole", "activations"])
def test_equal_memory_choice_respects_the_budget(tmp_path, rule):
    """Each strategy's micro-batch size: the fastest the simulator predicts among the sizes whose memory
    (the rule's: the whole footprint by default, or activations and logits only) fits the budget (TawPipe's
    by default), ties to the larger; a budget nothing fits leaves the smallest, marked."""
    from megatron_tawpipe.bench.equal_memory import RULES, TIE, choose_micro_batch_sizes, format_choices

    config = _long_context_config(tmp_path, equal_memory_rule=rule)
    selection = choose_micro_batch_sizes(config)
    assert selection["candidates"] == [1, 2, 4] and selection["rule"] == rule
    budget = selection["budget_bytes"]
    tawpipe = selection["choices"]["tawpipe"]
    assert budget == tawpipe["counted_bytes"] > 0
    assert tawpipe["counted_bytes"] == (tawpipe["memory_bytes"] if rule == "whole" else tawpipe["activation_bytes"])
    for name, choice in selection["choices"].items():
        # the whole footprint is every part of the memory model, whatever the rule counts
        assert choice["memory_bytes"] == pytest.approx(sum(choice["memory_parts"].values()))
        assert choice["memory_bytes"] > choice["activation_bytes"] > 0
        if name == "tawpipe":
            assert choice["micro_batch_size"] == 1 and not choice["tried"]
            continue
        fits = [t for t in choice["tried"] if t["counted_bytes"] <= budget * (1 + 1e-9)]
        # acts (below) grows with the size: the sizes are really priced
        if not fits:   # nothing within TawPipe's footprint: the smallest, marked
            assert not choice["fits"] and choice["micro_batch_size"] == choice["tried"][0]["micro_batch_size"]
            continue
        assert choice["fits"] and choice["counted_bytes"] <= budget * (1 + 1e-9)
        best = max(t["predicted_tokens_per_sec_per_rank"] for t in fits)
        assert choice["predicted_tokens_per_sec_per_rank"] >= (1 - TIE) * best
        assert all(t["micro_batch_size"] <= choice["micro_batch_size"] for t in fits
                   if t["predicted_tokens_per_sec_per_rank"] >= (1 - TIE) * best)
        # Activation memory grows with the micro-batch: the sizes are really priced, not assumed.
        acts = [t["activation_bytes"] for t in choice["tried"]]
        assert acts == sorted(acts) and acts[-1] > acts[0]
    # the budget is what TawPipe holds in the layout the run decides (its visit: micro-batches of activations
    # kept); data parallelism gets the largest window within it, as the loop above checks size by size
    assert selection["choices"]["distopt"]["fits"] and selection["choices"]["fsdp"]["fits"]
    assert RULES[rule] in format_choices(selection)

    first = selection["choices"]["distopt"]["tried"][0]["counted_bytes"]
    small = choose_micro_batch_sizes(config, budget_bytes=first)
    assert small["choices"]["distopt"]["micro_batch_size"] == 1 and small["choices"]["distopt"]["fits"]
    none = choose_micro_batch_sizes(config, budget_bytes=1.0)
    assert none["choices"]["fsdp"]["micro_batch_size"] == 1 and not none["choices"]["fsdp"]["fits"]
    assert "nothing fits" in format_choices(none)


def test_equal_whole_memory_counts_every_part_and_activations_only_is_an_option(tmp_path):
    """The whole-memory rule counts each part of a strategy's footprint (weights, gradients, optimizer
    state, buffers, activations, logits): a strategy whose state alone is larger than TawPipe's gets a
    smaller micro-batch than at equal activation memory, and adding to any one part changes what is
    counted by that much. The activation rule is the option that ignores the state, and says so."""
    from megatron_tawpipe.bench.equal_memory import RULES, choose_micro_batch_sizes, format_choices
    from megatron_tawpipe.sim.memory import TERMS

    state = {"weights": 30e6, "grads": 60e6, "optimizer": 20e6, "comm_buffers": 10e6}

    def fake_simulate(cmd):
        b = int(cmd[cmd.index("--micro-batch-size") + 1])
        rows = []
        for s in cmd[cmd.index("--schedule") + 1].split(","):
            parts = dict(weights=2e6, grads=4e6, optimizer=12e6, comm_buffers=40e6, activations=400e6 * 4,
                         logits=50e6) if s == "tawpipe" else dict(state, activations=400e6 * b, logits=10e6 * b)
            rows.append({"schedule": s, "tokens_per_sec_per_rank": 1000.0 * (1 + b / 10), "bubble_ratio": 0.1,
                         "options": {"memory_breakdown": dict(parts, total=sum(parts.values()), notes={})}})
        return rows

    config = _long_context_config(tmp_path, schedules=("tawpipe", "distopt"))
    whole = choose_micro_batch_sizes(config, simulate=fake_simulate, rule="whole")
    acts = choose_micro_batch_sizes(config, simulate=fake_simulate, rule="activations")
    assert whole["budget_bytes"] == pytest.approx(2e6 + 4e6 + 12e6 + 40e6 + 1600e6 + 50e6)
    assert acts["budget_bytes"] == pytest.approx(1650e6)
    # distopt at b=4: 1600 MB activations + 40 MB logits + 120 MB state > TawPipe's 1708 MB whole; b=2 fits
    assert whole["choices"]["distopt"]["micro_batch_size"] == 2 and whole["choices"]["distopt"]["fits"]
    # activations and logits only: b=4 (1640 MB) fits TawPipe's 1650 MB: the state is not counted
    assert acts["choices"]["distopt"]["micro_batch_size"] == 4
    tried = {t["micro_batch_size"]: t for t in whole["choices"]["distopt"]["tried"]}
    assert tried[1]["memory_parts"] == dict(state, activations=400e6, logits=10e6)
    assert tried[1]["counted_bytes"] == pytest.approx(120e6 + 410e6)
    for term in TERMS:          # each part is counted: one more MB in it is one more MB counted
        def more(cmd, term=term):
            rows = fake_simulate(cmd)
            for r in rows:
                r["options"]["memory_breakdown"][term] += 1e6
            return rows
        bumped = choose_micro_batch_sizes(config, simulate=more, rule="whole")
        assert bumped["choices"]["distopt"]["tried"][0]["counted_bytes"] == pytest.approx(tried[1]["counted_bytes"]
                                                                                        + 1e6), term
        counted_acts = choose_micro_batch_sizes(config, simulate=more, rule="activations")
        delta = counted_acts["choices"]["distopt"]["tried"][0]["counted_bytes"] - 410e6
        assert delta == pytest.approx(1e6 if term in ("activations", "logits") else 0.0), term
    assert RULES["whole"] in format_choices(whole) and "grads 60.0 MB" in format_choices(whole)
    assert "activations and logits only" in format_choices(acts)
    with pytest.raises(Exception, match="equal-memory rule 'peak': one of whole, activations"):
        choose_micro_batch_sizes(config, simulate=fake_simulate, rule="peak")


def test_equal_memory_runs_each_strategy_at_its_size(tmp_path):
    """run_benchmark with equal memory: every run's command carries its strategy's micro-batch size (once;
    the global batch unchanged), sizes given by hand win, and the results say what each row ran with."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.bench.benchmark import run_benchmark
    from megatron_tawpipe.training.validate_args import validate_args

    config = _long_context_config(tmp_path, schedules=("tawpipe", "distopt", "fsdp"), equal_memory=True,
                                  micro_batch_sizes={"fsdp": 2}, repetitions=1, train_iters=2,
                                  outdir=str(tmp_path / "runs"))
    seen = {}

    def launcher(cfg, script_args, log_path):
        args = validate_args(parse_args(script_args[1:]), world_size=4)
        assert script_args.count("--micro-batch-size") == 1 and args.global_batch_size == 16
        schedule = os.path.basename(args.metrics_file).split("-rep")[0]
        seen[schedule] = args.micro_batch_size
        with open(args.metrics_file, "w") as f:
            for _ in range(2):
                f.write(json.dumps({"tokens_per_sec_per_rank": 1.0, "elapsed_ms": 1.0, "peak_memory_bytes": 1}) + "\n")
        return 0

    lines = []
    result = run_benchmark(config, progress=lines.append, launcher=launcher)
    chosen = result["equal_memory"]["choices"]["distopt"]["micro_batch_size"]   # within TawPipe's decided layout's
    assert seen == {"tawpipe": 1, "distopt": chosen, "fsdp": 2}
    assert {r["schedule"]: r["micro_batch_size"] for r in result["summary"]} == seen
    assert result["equal_memory"]["choices"]["fsdp"]["micro_batch_size"] == chosen  # the choice, overridden by hand
    assert result["equal_memory"]["rule"] == "whole" and any("equal whole memory" in line for line in lines)
    # the table sets each strategy's predicted whole memory beside its measured peak
    from megatron_tawpipe.bench.benchmark_report import format_table
    table = format_table(result)
    assert "peak mem/rank  predicted mem" in table and "equal whole memory" in table


def test_equal_memory_results_compare_with_their_own_predictions():
    """An equal-memory run compares each strategy with the prediction at the size it ran (a size given by
    hand takes the prediction priced for that size)."""
    from megatron_tawpipe.bench.benchmark_report import compare_with_simulation

    result = {"config": {"micro_batch_sizes": {"tawpipe": 1, "distopt": 2}},
              "summary": [{"schedule": "tawpipe", "tokens_per_sec_per_rank": 90.0},
                          {"schedule": "distopt", "tokens_per_sec_per_rank": 120.0}],
              "equal_memory": {"choices": {
                  "tawpipe": {"micro_batch_size": 1, "predicted_tokens_per_sec_per_rank": 100.0, "tried": []},
                  "distopt": {"micro_batch_size": 4, "predicted_tokens_per_sec_per_rank": 150.0,
                              "tried": [{"micro_batch_size": 2, "predicted_tokens_per_sec_per_rank": 125.0},
                                        {"micro_batch_size": 4, "predicted_tokens_per_sec_per_rank": 150.0}]}}}}
    rows = {r["schedule"]: r for r in compare_with_simulation(result)["rows"]}
    assert rows["distopt"]["predicted"] == 125.0 and rows["tawpipe"]["predicted"] == 100.0
    assert rows["distopt"]["measured_over_predicted"] == pytest.approx(120 / 125)
    # Busy and what the plan held (--record-plan-memory) beside their predictions at the size that ran.
    from megatron_tawpipe.bench.benchmark_report import format_comparison

    result["summary"][0].update(compute_busy_fraction=0.8, plan_memory_growth_bytes_max_rank=2.1e9)
    result["equal_memory"]["choices"]["tawpipe"].update(predicted_busy=0.9, activation_bytes=2e9)
    comparison = compare_with_simulation(result)
    rows = {r["schedule"]: r for r in comparison["rows"]}
    assert (rows["tawpipe"]["busy_measured"], rows["tawpipe"]["busy_predicted"]) == (0.8, 0.9)
    assert (rows["tawpipe"]["plan_memory_measured"], rows["tawpipe"]["plan_memory_predicted"]) == (2.1e9, 2e9)
    text = format_comparison(comparison)
    assert "plan memory" in text and "2100 MB" in text and "2000 MB" in text and "90%" in text


def test_simulator_matrix_replaces_the_rows_it_measures_again():
    from tawpipe_lab.matrix import _replace_rows

    previous = {"config": {"micro_batch_sizes": {"hfsdp": 4}},
                "runs": [{"schedule": "tawpipe", "repetition": 0}, {"schedule": "hfsdp", "repetition": 0}],
                "summary": [{"schedule": "tawpipe", "tokens_per_sec_per_rank": 1.0},
                            {"schedule": "hfsdp", "tokens_per_sec_per_rank": 2.0}]}
    new = {"runs": [{"schedule": "hfsdp", "repetition": 0}, {"schedule": "hfsdp", "repetition": 1}],
           "summary": [{"schedule": "hfsdp", "tokens_per_sec_per_rank": 3.0}]}
    out = _replace_rows(previous, new, ["hfsdp"])
    assert [r["schedule"] for r in out["runs"]] == ["tawpipe", "hfsdp", "hfsdp"]
    assert [(r["schedule"], r["tokens_per_sec_per_rank"]) for r in out["summary"]] == [("tawpipe", 1.0), ("hfsdp", 3.0)]
    assert set(out["remeasured"]) == {"hfsdp"} and out["config"] == previous["config"]


@pytest.mark.parametrize("nodes", [3, 4])
def test_every_strategy_has_valid_flags_on_three_and_four_nodes_of_two_ranks(nodes):
    """3 x 2 and 4 x 2 (nodes x ranks per node): one weight-pipeline group, optimizer instance, FSDP
    replica and pipeline stage per node; 8 layers cut by the default split where the ranks do not divide them."""
    from megatron_tawpipe.bench.benchmark import SCHEDULES, BenchmarkError

    model = list(BENCH_MODEL)
    model[model.index("--global-batch-size") + 1] = "24"            # divisible by 6 and 8
    model[model.index("--num-layers") + 1] = "8"
    ranks = 2 * nodes
    parsed = _validated_commands(model, [s for s in SCHEDULES if s != "interleaved"], ranks=ranks, groups=nodes)
    with pytest.raises(BenchmarkError, match="interleaved needs at least 2 layers per stage"):
        _validated_commands(model, ["interleaved"], ranks=ranks, groups=nodes)   # 8 layers: too few, said so
    assert parsed["tawpipe"].tawpipe_num_groups == nodes and len(parsed["tawpipe"].decoder_layer_split or [1] * ranks) == ranks
    assert parsed["pp-nodes"].pipeline_model_parallel_size == nodes and parsed["pp-nodes"].data_parallel_size == 2
    for schedule in ("distopt-node", "hsdp", "hfsdp"):
        assert parsed[schedule].num_distributed_optimizer_instances == nodes
    assert parsed["tawpipe-rep"].tawpipe_replicate_first_shard
    if nodes == 3:
        assert parsed["tawpipe"].decoder_layer_split == (2, 2, 1, 1, 1, 1)
        assert parsed["pp-nodes"].decoder_layer_split == (3, 3, 2)


def test_collective_byte_formulas_and_their_sums_over_ranks():
    """What each member sends per collective (gloo's algorithms, checked against the interfaces in
    tests/test_emulated_cluster.py), which link it crosses, and a run's bytes per measured iteration."""
    from megatron_tawpipe.bench.collective_bytes import (CollectiveCounter, binomial_children, format_formulas,
                                                         sent_bytes, summarize_counts)

    B = 600.0
    assert sent_bytes("all_reduce", [0, 1, 2], 2, B) == [(0, 2 * 2 / 3 * B)]          # ring: 2(n-1)/n B to the successor
    assert sent_bytes("reduce_scatter", [0, 1, 2], 0, B) == [(1, 2 * 2 / 3 * B)]      # gloo: an all-reduce's bytes
    assert sent_bytes("all_gather", [0, 2, 4], 4, B) == [(0, 2 / 3 * B)]
    assert binomial_children(0, 6) == [1, 2, 4] and binomial_children(1, 6) == [3, 5] and binomial_children(3, 6) == []
    assert sent_bytes("broadcast", [0, 1, 2, 3, 4, 5], 1, B, root=1) == [(2, B), (3, B), (5, B)]   # relative 0 -> 1, 2, 4
    assert sent_bytes("reduce", [0, 1, 2], 2, B, root=0) == [(0, 2 / 3 * B), (0, B / 3)]
    assert sent_bytes("send", [0, 3], 0, B, root=3) == [(3, B)]
    assert sent_bytes("all_reduce", [5], 5, B) == []

    # 2 nodes x 2 ranks: rank 1's ring successor (2) is on the other node, rank 0's (1) on its own.
    counters = [CollectiveCounter(rank, 2) for rank in range(4)]
    for iteration in range(3):
        for c in counters:
            c.add("all_reduce", [0, 1, 2, 3], 1000.0)
            if iteration > 0:
                c.add("send", [c.rank, (c.rank + 2) % 4], 10.0, (c.rank + 2) % 4)   # to the other node
            c.snapshot()
    assert counters[0].totals == {"intra": 3 * 1500.0, "inter": 20.0}
    assert counters[1].totals == {"intra": 0.0, "inter": 3 * 1500.0 + 20.0}
    summary = summarize_counts([c.to_json() for c in counters], train_iters=3, warmup=1)
    assert summary["inter_node_bytes_per_iteration"] == 2 * 1500.0 + 4 * 10.0      # two ring hops cross, 4 sends
    assert summary["intra_node_bytes_per_iteration"] == 2 * 1500.0
    assert summary["inter_node_bytes_whole_run_per_iteration"] == (3 * 3000.0 + 2 * 40.0) / 3
    ring = summary["formulas_per_iteration"]["all_reduce n=4 nodes=2 hops=2"]
    assert (ring["calls"], ring["payload"], ring["inter"]) == (4, 4000.0, 3000.0)
    lines = format_formulas(summary["formulas_per_iteration"])
    assert lines[0].startswith("all_reduce n=4 nodes=2 hops=2: 1 calls of ring all-reduce")
    assert "2 of 4 ring hops cross nodes: 2 x 2(4-1)/4 x 0.00 MB" in lines[0]
