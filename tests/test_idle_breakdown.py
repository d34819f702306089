"""tools/tawpipe_lab/idle_breakdown.py: a measured iteration's wall time split per rank, and the simulator's
beside it."""

import json
import time

import pytest
import torch

from distributed_harness import run_ranks
from training_helpers import pinned_layout, tiny_args, train_rank

from tawpipe_lab.idle_breakdown import (CATEGORIES, check_plan_matches, grouped, measured_breakdown,
                                        simulated_breakdown)
from megatron_tawpipe.plan.planners import build_plan
from megatron_tawpipe.runtime.executor import PlanExecutor
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.simulate import simulate

LOAD_DELAY, STEP_DELAY = 0.02, 0.08


def _slow_load(original):
    def load(self, a):
        time.sleep(LOAD_DELAY)
        original(self, a)
    return load


def _slow_step(original):
    def step(self, *args, **kwargs):
        time.sleep(STEP_DELAY)
        return original(self, *args, **kwargs)
    return step


@pytest.fixture(scope="module")
def delayed_run(tmp_path_factory):
    """A tawpipe run with artificial delays in every copy of the master weights into a buffer and in AdamW (the
    forked ranks inherit them): its timeline document."""
    tmp_path = tmp_path_factory.mktemp("idle")
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"layer_forward": 0.004, "layer_backward": 0.008, "layer_recompute": 0.004}))
    timeline = tmp_path / "timeline.json"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(PlanExecutor, "_load_weights", _slow_load(PlanExecutor._load_weights))
        monkeypatch.setattr(torch.optim.AdamW, "step", _slow_step(torch.optim.AdamW.step))
        # 8 layers on 2 ranks in 2 groups (one rank per node), 4 micro-batches per rank
        argv = tiny_args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--timeline-file",
                         str(timeline), "--emulated-compute-times", str(times), *pinned_layout(2, recompute=False), train_iters=2)
        run_ranks(train_rank, 2, argv)
    return json.loads(timeline.read_text())


def _loads(doc, rank):
    record = next(r for r in doc["ranks"] if r["rank"] == rank)
    return sum(1 for a in record["actions"] if a[1] == "load")


def test_categories_sum_to_the_wall_time_and_a_delay_lands_in_its_category(delayed_run):
    doc = delayed_run
    breakdown = measured_breakdown(doc)
    assert sorted(breakdown) == [0, 1]
    for rank, cats in breakdown.items():
        record = next(r for r in doc["ranks"] if r["rank"] == rank)
        marks = [t for _, t in record["marks"]]
        assert marks[0] is not None   # the second step: the time between steps is counted
        # every category is time that happened (no overlap between them), and they add up to the wall time
        assert all(cats[c] >= -1e-4 for c in CATEGORIES), {c: cats[c] for c in CATEGORIES if cats[c] < -1e-4}
        assert abs(sum(cats[c] for c in CATEGORIES) - cats["wall"]) < 1e-6
        assert abs(cats["wall"] - (marks[-1] - marks[0])) < 1e-9
        loads = _loads(doc, rank)
        assert loads >= 1
        # the delays land where they were made (a loaded machine only adds time: the upper bounds are the
        # timing test below)
        assert LOAD_DELAY * loads <= cats["load"]
        assert STEP_DELAY <= cats["optimizer step"]
        assert cats["compute"] >= 4 * 2 * 4 * 0.012 - 0.01
        rows = grouped(cats)
        assert abs(sum(v for k, v in rows.items() if k != "wall") - cats["wall"]) < 1e-6

    # the simulator's breakdown of the plan the run executed: the same actions, and it sums to the iteration
    plan = build_plan("tawpipe", num_ranks=2, num_groups=2, num_layers=8, num_microbatches=4)
    assert check_plan_matches(doc, plan) is None
    other = build_plan("tawpipe", num_ranks=2, num_groups=2, num_layers=8, num_microbatches=2)
    assert "rank 0" in check_plan_matches(doc, other)


@pytest.mark.timing
def test_a_delay_lands_in_its_category_and_nowhere_else(delayed_run):
    """The wall-clock side: each delay is within its bound of what was slept, nothing else grows by it."""
    for rank, cats in measured_breakdown(delayed_run).items():
        loads = _loads(delayed_run, rank)
        assert cats["load"] < LOAD_DELAY * loads + 0.05 + 0.01 * loads
        assert cats["optimizer step"] < STEP_DELAY + 0.1
        assert cats["between actions"] + cats["action overhead"] < LOAD_DELAY
        # emulated compute: 4 micro-batches x (4 layers x (4 + 8) ms) per shard visit... on 2 shards
        assert abs(cats["compute"] - 4 * 2 * 4 * 0.012) < 0.01


def test_simulated_idle_is_classified_by_link_and_kind():
    cost = CostModel.from_flops(hidden_size=256, seq_length=3072, micro_batch_size=1, ffn_hidden_size=704,
                                vocab_size=2048, num_attention_heads=4, peak_tflops=0.4, efficiency=1.0,
                                recompute=False, intra_bw=0.6e9, intra_latency=5e-6, inter_bw=300e6 / 8,
                                inter_latency=20e-6, dtype_bytes=4)
    plan = build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=8, num_microbatches=8, chunk=4)
    result = simulate(plan, cost, record=True)
    breakdown = simulated_breakdown(plan, result)
    for rank, cats in breakdown.items():
        assert abs(sum(cats[c] for c in CATEGORIES) - result.iteration_time) < 1e-9
        assert abs(cats["compute"] - result.compute_time[rank]) < 1e-12
    idle = sum(result.idle.values())
    assert idle > 0
    waits = sum(cats[c] for cats in breakdown.values() for c in CATEGORIES if c.startswith("wait"))
    assert abs(waits - idle) < 1e-9 and sum(cats["wait other"] for cats in breakdown.values()) == 0
    # a slower node link makes the waits on it longer, and only those
    slower = cost.with_links(inter=Link(cost.inter.bandwidth / 4, cost.inter.latency))
    slow = simulated_breakdown(plan, simulate(plan, slower, record=True))
    inter = lambda b: sum(c[k] for c in b.values() for k in CATEGORIES if k.startswith("wait") and k.endswith("inter"))  # noqa: E731
    assert inter(slow) > inter(breakdown) + 0.1
