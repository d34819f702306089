"""tools/gpu_check.py on the CPU (``--device cpu``, tiny sizes) and its parts: CUDA-event timing,
the layer-spec comparison, the Wait timer and probe, the refusal without a GPU."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from distributed_harness import run_ranks

from tawpipe_lab import gpu_check, layer_specs
from tawpipe_lab.one_rank import LlamaRun, one_rank_process_group, parsed_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "gpu_check.py")
TINY = ["--device", "cpu", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--vocab-size", "256", "--small-num-layers", "2", "--small-hidden-size", "64",
        "--small-num-attention-heads", "4", "--small-seq-length", "32", "--small-global-batch-size", "2",
        "--small-iters", "3", "--wait-probe-matmul", "64", "--wait-probe-ms", "5", "--wait-probe-repeats", "3",
        "--repeats", "2", "--warmup", "1"]


# ---- timing ------------------------------------------------------------------------------------


class _FakeEvent:
    """Stands in for torch.cuda.Event: reports 2 ms between any two events."""

    recorded = 0

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self, stream=None):
        _FakeEvent.recorded += 1

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 2.0


class _FakeStream:
    def synchronize(self):
        pass


def test_time_once_uses_cuda_events_on_cuda_and_the_clock_on_cpu(monkeypatch):
    from megatron_tawpipe.bench import calibrate

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    # A host-side 50 ms (what a wall clock would see around asynchronous launches) is not what counts on CUDA.
    assert calibrate.time_once(lambda: time.sleep(0.05), torch.device("cuda", 0)) == pytest.approx(0.002)
    assert _FakeEvent.recorded == 2
    assert calibrate.time_once(lambda: time.sleep(0.05), torch.device("cpu")) >= 0.05
    assert calibrate.timer_name(torch.device("cuda", 0)) == "CUDA events"
    assert calibrate.timer_name(torch.device("cpu")) == "wall clock"


def test_fastest_time_runs_prepare_untimed_before_every_call(monkeypatch):
    from megatron_tawpipe.bench import calibrate

    calls, timed, figures = [], [], iter([0.3, 0.1, 0.2])

    def time_once(fn, device):   # what the real timer measures: fn's call and nothing else
        timed.append(len(calls))
        fn()
        return next(figures)

    monkeypatch.setattr(calibrate, "time_once", time_once)
    seconds = calibrate.fastest_time(lambda: calls.append("fn"), repeats=3, warmup=2, device=torch.device("cpu"),
                                     prepare=lambda: calls.append("prepare"))
    assert calls == ["prepare", "fn"] * 5
    assert timed == [5, 7, 9]     # each timed call starts after its prepare: prepare is not part of a figure
    assert seconds == 0.1         # the fastest of the 3 timed calls, the 2 warm-up calls untimed


# ---- layer specs -------------------------------------------------------------------------------


def test_te_parameter_names_map_to_local_names():
    assert layer_specs.canonical_layer_name("0.self_attention.linear_qkv.layer_norm_weight") == \
        "0.input_layernorm.weight"
    assert layer_specs.canonical_layer_name("3.mlp.linear_fc1.layer_norm_weight") == "3.pre_mlp_layernorm.weight"
    assert layer_specs.canonical_layer_name("1.mlp.linear_fc1.weight") == "1.mlp.linear_fc1.weight"


class _Layers(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.Module()
        self._names = names
        for i, name in enumerate(names):
            self.decoder.layers.register_parameter(name.replace(".", "_"), torch.nn.Parameter(torch.full((2,), float(i))))

    def named(self):
        return dict(self.decoder.layers.named_parameters())


def test_copy_layer_weights_by_name_and_mismatch_errors(monkeypatch):
    # Parameter names with dots cannot be registered on one module: map the flat test names back.
    monkeypatch.setattr(layer_specs, "canonical_layer_name",
                        lambda name: {"q_ln": "input_layernorm.weight", "in_ln": "input_layernorm.weight"}.get(name, name))
    source, target = _Layers(["in_ln", "w"]), _Layers(["w", "q_ln"])
    assert layer_specs.copy_layer_weights(source, target) == 2
    assert target.named()["q_ln"].tolist() == [0.0, 0.0] and target.named()["w"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"only in the reference \['extra'\]"):
        layer_specs.copy_layer_weights(_Layers(["in_ln", "w", "extra"]), target)


@pytest.fixture(scope="module")
def fp32_args():
    run = LlamaRun(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                   micro_batch_size=1, global_batch_size=1, train_iters=2, dtype="fp32", attention_backend="sdpa")
    return parsed_args(run)


def _layer_spec_case(rank, args):
    """Runs in a forked child: a process group created in the test process itself would be
    inherited, half torn down, by the ranks later tests fork."""
    cpu = torch.device("cpu")
    with one_rank_process_group(args):
        same = layer_specs.compare_layer_specs(args, "sdpa", "local", cpu, tolerance=1e-5)
        copy = layer_specs.copy_layer_weights

        def copy_all_but_one_norm(source, target):
            count = copy(source, target)
            with torch.no_grad():
                layer_specs.layer_parameters(target)["1.pre_mlp_layernorm.weight"].fill_(1.0)
            return count

        layer_specs.copy_layer_weights = copy_all_but_one_norm
        wrong = layer_specs.compare_layer_specs(args, "sdpa", "local", cpu, tolerance=1e-5)
    return {"same": (same.passed, same.summary(), len(same.weight_grads), same.output, same.input_grad),
            "wrong": (wrong.passed, wrong.output, wrong.input_grad,
                      wrong.weight_grads["1.pre_mlp_layernorm.weight"])}


def test_layer_spec_comparison_agrees_on_equal_weights_and_catches_a_wrong_one(fp32_args):
    """SDPA vs megatron's local attention (both local spec) on the CPU: the comparison TE gets on a GPU."""
    (result,) = run_ranks(_layer_spec_case, 1, fp32_args, timeout=120)
    passed, summary, grads, output, input_grad = result["same"]
    assert passed, summary
    assert grads == 12  # 6 parameters x 2 layers, norms included
    assert max(output, input_grad) > 0  # two implementations, not one compared with itself
    passed, output, input_grad, norm_grad = result["wrong"]
    assert not passed
    # Far above the tolerance everywhere the wrong norm weight reaches: the output, the
    # gradient reaching the input, and that weight's own gradient.
    assert min(output, input_grad) > 10 * 1e-5
    assert norm_grad > 1e-2


# ---- compute: weight-passing against native megatron-core ------------------------------------------


def _compute_case(rank, args):
    """Runs in a forked child (see _layer_spec_case): equal weights, then one native weight changed."""
    from tawpipe_lab import compute_check

    cpu = torch.device("cpu")
    tolerance = compute_check.default_tolerance(torch.float32)
    with one_rank_process_group(args):
        same = compute_check.compare_compute(args, 2, cpu, repeats=2, warmup=1, tolerance=tolerance)
        load = compute_check.load_native_weights

        def load_all_but_one(ours, native):
            count = load(ours, native)
            with torch.no_grad():
                dict(native.gpt.decoder.layers.named_parameters())["1.mlp.linear_fc2.weight"].mul_(3.0)
            return count

        compute_check.load_native_weights = load_all_but_one
        wrong = compute_check.compare_compute(args, 2, cpu, repeats=1, warmup=0, tolerance=tolerance)
    return same.to_json(), same.summary(), wrong.to_json()


def _assert_compute_figures(details):
    """Positive figures, tokens/s from the fastest call, the ratio their quotient."""
    rates = details["tokens_per_s"]
    assert set(rates) == {"weight_passing", "weight_passing_recompute", "native"}
    for path, rate in rates.items():
        assert rate > 0 and len(details["seconds"][path]) >= 1
        assert rate == pytest.approx(details["tokens"] / min(details["seconds"][path]))
        assert details["fastest_s"][path] == min(details["seconds"][path]) > 0
    assert details["ratio"] == pytest.approx(rates["weight_passing"] / rates["native"])
    assert details["recompute_ratio"] == pytest.approx(rates["weight_passing_recompute"] / rates["native"])


def test_compute_check_agrees_on_the_same_weights_and_fails_on_a_wrong_one(fp32_args):
    """The weight-passing shard and native megatron-core's middle stage on the same fp32 layers (CPU)."""
    ((same, summary, wrong),) = run_ranks(_compute_case, 1, fp32_args, timeout=180)
    assert same["passed"], summary
    assert same["tolerance"] == pytest.approx(1e-4) and same["tokens"] == 32 and same["dtype"] == "fp32"
    assert len(same["seconds"]["native"]) == 2
    _assert_compute_figures(same)
    for figures in same["differences"].values():
        assert set(figures) == {"output", "input_grad", "weight_grads"} and max(figures.values()) <= 1e-4
    # One native weight tripled (the last MLP's output projection): the output, the input gradient and
    # the weight gradients all show it.
    assert not wrong["passed"]
    for figures in wrong["differences"].values():
        assert min(figures.values()) > 10 * 1e-4, figures


# ---- waits ---------------------------------------------------------------------------------------


def _wait_probe_case(rank, args):
    """Runs in a forked child (see _layer_spec_case)."""
    from tawpipe_lab.waits import probe_wait_behind_compute
    from megatron_tawpipe.runtime.executor import PlanExecutor

    original = PlanExecutor.wait_observer
    with one_rank_process_group(args):
        probe = probe_wait_behind_compute(torch.device("cpu"), torch.float32, 64, 0.003, repeats=3)
    return probe, PlanExecutor.wait_observer is original


def test_wait_probe_runs_through_the_executor_and_restores_it(fp32_args):
    ((probe, restored),) = run_ranks(_wait_probe_case, 1, fp32_args, timeout=120)
    assert restored
    assert len(probe.executor_wait_s) == len(probe.c10d_wait_s) == len(probe.c10d_wait_timeout_s) == 3
    assert len(probe.queued_compute_s) == 9  # the executor's Forward and the two bare-c10d rounds
    assert min(probe.queued_compute_s) > 0 and min(probe.executor_wait_s + probe.c10d_wait_s) > 0
    assert probe.verdict().startswith("not applicable on the CPU")


def _probe(executor_s, c10d_s, c10d_timeout_s, issued=True, pending=True):
    from tawpipe_lab.waits import WaitProbe

    return WaitProbe(queued_compute_s=[0.05] * 3, executor_wait_s=[executor_s] * 3, executor_issued=issued,
                     executor_pending=[pending] * 3, c10d_wait_s=[c10d_s] * 3,
                     c10d_wait_timeout_s=[c10d_timeout_s] * 3, c10d_pending=[True] * 3, on_cuda=True)


def test_wait_probe_verdicts():
    assert _probe(0.049, 2e-5, 0.05).verdict() == (
        "executor Wait blocks the host; c10d work.wait() returns at once (stream-ordered), "
        "work.wait(timeout) blocks the host")
    assert _probe(2e-5, 2e-5, 2e-5).verdict().startswith("executor Wait returns at once (stream-ordered)")
    assert _probe(2e-5, 2e-5, 0.05, issued=False).verdict().startswith(
        "executor: no transfer on a one-rank communicator")
    assert _probe(2e-5, 2e-5, 0.05, pending=False).verdict().startswith("executor: inconclusive")


# ---- the command ---------------------------------------------------------------------------------


def test_refuses_without_cuda_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--checks", "losses"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("gpu_check.py: error: no CUDA device is visible") and "--device cpu" in err


def test_refuses_cpu_with_a_visible_gpu_and_under_torchrun(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_check.main(["--device", "cpu"]) == 2
    assert "CUDA_VISIBLE_DEVICES=" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert gpu_check.main(["--device", "cpu"]) == 2
    assert "not under torchrun (WORLD_SIZE=4)" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--checks", "te,bogus"], "--checks: unknown ['bogus']"),
    (["--small-iters", "1"], "--small-iters must be >= 2"),
    (["--hidden-size", "100", "--num-attention-heads", "32"], "--hidden-size 100 must be divisible by --num-attention-heads 32"),
    (["--memory-rtol", "0"], "--memory-rtol must be > 0"),
    (["--num-query-groups", "5"], "--num-attention-heads 32 must be divisible by --num-query-groups 5"),
])
def test_flag_errors_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as info:
        gpu_check.parse_tool_args(["--device", "cpu"] + flags)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_check_that_raises_becomes_an_error_row_and_the_others_run(monkeypatch, tmp_path, capsys):
    def broken(session):
        raise RuntimeError("kernel exploded\nsecond line")

    def fine(session):
        return [gpu_check.CheckRow("timings", "measured", "1 ms")]

    monkeypatch.setitem(gpu_check.CHECK_FUNCTIONS, "te", broken)
    monkeypatch.setitem(gpu_check.CHECK_FUNCTIONS, "timings", fine)
    report = tmp_path / "out" / "report.json"
    assert gpu_check.main(["--device", "cpu", "--checks", "te,timings", "--json", str(report)]) == 1
    rows = json.loads(report.read_text())["checks"]
    assert [r["check"] for r in rows] == ["te", "timings"]
    assert rows[0]["result"] == "error: RuntimeError: kernel exploded" and "Traceback" in rows[0]["details"]["traceback"]
    assert rows[1]["result"] == "measured"
    assert "error: RuntimeError: kernel exploded" in capsys.readouterr().out


def test_tool_hides_gpus_for_device_cpu(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    module._hide_gpus_for_cpu_runs(["--device", "cuda"])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    module._hide_gpus_for_cpu_runs(["--json", "x", "--device", "cpu"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_every_check_end_to_end_on_cpu(tmp_path):
    """The command as users run it, with --device cpu and tiny sizes: all six checks, table and JSON."""
    from megatron_tawpipe.emulation.compute import load_compute_times
    from megatron_tawpipe.sim.costmodel import CostModel

    report_path = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, TOOL] + TINY + ["--json", str(report_path)], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    rows = {row["check"]: row for row in report["checks"]}
    assert list(rows) == ["compute", "te", "losses", "wait", "timings", "memory"]
    for name in rows:
        assert name in proc.stdout

    # (0) compute: weight-passing against native megatron-core on the same bf16 layers, equal.
    compute = rows["compute"]
    assert compute["result"] == "ok" and compute["details"]["passed"], compute["figures"]
    assert compute["details"]["dtype"] == "bf16" and compute["details"]["tokens"] == 64
    assert compute["details"]["tolerance"] == pytest.approx(2 ** -6)
    assert "tokens/s" in compute["figures"] and "wall clock" in compute["figures"]
    _assert_compute_figures(compute["details"])

    # (a) TE: never silently absent.
    reason = layer_specs.transformer_engine_unavailable_reason()
    expected = "skipped: " + (reason or "Transformer Engine runs on CUDA only (--device cpu)")
    assert rows["te"]["result"] == expected
    if reason == "Transformer Engine not installed":
        assert rows["te"]["result"] == "skipped: Transformer Engine not installed"

    # (b) TawPipe vs native 1F1B, one rank, bf16.
    losses = rows["losses"]
    assert losses["result"] == "ok"
    assert len(losses["details"]["tawpipe"]) == len(losses["details"]["native_1f1b"]) == 3
    assert max(losses["details"]["relative_differences"]) <= 1e-2
    assert "--bf16" in losses["details"]["argv"]

    # (c) two plan Waits per iteration (the replicated all-reduce of a one-rank plan, in its head
    # and embedding parts), and the probe.
    wait = rows["wait"]["details"]
    assert wait["plan_waits"]["count"] == 2 * 3 and wait["plan_waits"]["max_s"] > 0
    assert len(wait["probe"]["executor_wait_s"]) == 3 and wait["probe"]["verdict"].startswith("not applicable")

    # (d) the calibration JSON, readable by the emulation and the simulator.
    times_path = rows["timings"]["details"]["times_output"]
    assert times_path == str(tmp_path / "report.times.json")
    times = load_compute_times(times_path, flag="--measured-times")
    written = json.loads(open(times_path).read())
    assert written["hidden_size"] == 64 and written["seq_length"] == 64 and written["dtype"] == "bf16"
    assert "wall clock" in written["source"] and written["device"].startswith("cpu")
    shard = rows["timings"]["details"]["shard_seconds"]
    assert times.layer_forward == pytest.approx(shard["shard_forward"] / 2)
    assert times.layer_backward == pytest.approx(shard["shard_backward"] / 2)
    assert min(times.to_json().values()) > 0
    assert CostModel.from_flops(hidden_size=64, seq_length=64).with_measured(times_path).layer_recompute == \
        pytest.approx(times.layer_recompute)

    # (e) memory: what the rank holds against the simulator's state and buffers; no CPU peak is invented.
    memory = rows["memory"]["details"]
    assert memory["peak_allocated_bytes"] is None and "n/a on the CPU" in rows["memory"]["figures"]
    assert set(memory["predicted"]) == {"weight_buffer_bytes", "grad_buffer_bytes", "activation_bytes",
                                        "state_bytes", "memory_bytes"}
    assert memory["predicted"]["weight_buffer_bytes"] > 0 and memory["predicted"]["activation_bytes"] > 0
    held = memory["held_by_category"]
    assert held["fp32 masters and gradients"] > 0 and held["optimizer state"] > 0
    assert held["plan weight/gradient buffers"] == memory["predicted"]["weight_buffer_bytes"]
    assert 0.95 <= memory["held_ratio"] <= 1.25, memory
    assert rows["memory"]["result"] == "ok"
    assert report["failed"] is False and report["environment"]["megatron_core"]


# ---- on a GPU (``gpu`` tests: skipped without one) -------------------------------------------------

CUDA_SMALL = [flag for flag in TINY if flag not in ("--device", "cpu")]
for _flag, _value in (("--wait-probe-matmul", "2048"), ("--wait-probe-ms", "20")):
    CUDA_SMALL[CUDA_SMALL.index(_flag) + 1] = _value


@pytest.mark.gpu
def test_every_check_end_to_end_on_cuda(tmp_path):
    """The command on one GPU at small sizes: TE compared (or skipped, naming why), the bf16 one-rank
    TawPipe run against native 1F1B on NCCL, Waits measured behind queued GPU work, CUDA-event timings,
    a real memory peak."""
    report_path = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, TOOL] + CUDA_SMALL + ["--json", str(report_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    rows = {row["check"]: row for row in report["checks"]}
    te_rows = [name for name in rows if name.startswith("te")]
    assert [name for name in rows if not name.startswith("te")] == ["compute", "losses", "wait", "timings", "memory"]
    compute = rows["compute"]
    assert compute["result"] == "ok" and "CUDA events" in compute["figures"], compute["figures"]
    _assert_compute_figures(compute["details"])
    reason = layer_specs.transformer_engine_unavailable_reason()
    if reason is None:
        assert te_rows == ["te (bf16)", "te (fp32)"] and all(rows[name]["result"] == "ok" for name in te_rows)
    else:
        assert te_rows == ["te"] and rows["te"]["result"] == f"skipped: {reason}"

    losses = rows["losses"]
    assert losses["result"] == "ok" and len(losses["details"]["tawpipe"]) == 3
    assert "--bf16" in losses["details"]["argv"]
    wait = rows["wait"]
    assert wait["result"] == "measured" and wait["details"]["plan_waits"]["count"] == 2 * 3
    assert not wait["details"]["probe"]["verdict"].startswith("not applicable"), wait["details"]["probe"]["verdict"]
    written = json.loads(open(rows["timings"]["details"]["times_output"]).read())
    assert "CUDA events" in written["source"] and not written["device"].startswith("cpu")
    assert min(rows["timings"]["details"]["shard_seconds"].values()) > 0
    memory = rows["memory"]
    assert memory["result"] in ("ok", "differs") and memory["details"]["peak_allocated_bytes"] > 0
    assert report["failed"] is False and report["environment"]["cuda"]
