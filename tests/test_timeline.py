"""Measured timelines of weight-passing iterations (--timeline-file) and their drawing."""

import importlib.util
import json
import os

from distributed_harness import run_ranks
from training_helpers import pinned_layout, tiny_args, train_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plot_tool():
    spec = importlib.util.spec_from_file_location("plot_schedule", os.path.join(ROOT, "tools", "plot_schedule.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timeline_of_a_tawpipe_iteration(tmp_path):
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"layer_forward": 0.003, "layer_backward": 0.006, "layer_recompute": 0.003}))
    timeline = tmp_path / "timeline.json"
    # 8 layers on 4 ranks (4 shards), global batch 8: 2 micro-batches per rank.
    argv = tiny_args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--timeline-file", str(timeline),
                     "--emulated-compute-times", str(times), *pinned_layout(2), train_iters=2)
    run_ranks(train_rank, 4, argv)
    doc = json.loads(timeline.read_text())
    assert (doc["schedule"], doc["num_ranks"], doc["num_groups"], doc["num_microbatches"]) == ("tawpipe", 4, 2, 2)
    for rank in range(4):
        spans = [s for s in doc["spans"] if s[0] == rank]
        forwards = [(s[4], s[5]) for s in spans if s[3] == "F"]
        backwards = [(s[4], s[5]) for s in spans if s[3] == "B"]
        # Every micro-batch of this rank through every shard, once forward and once backward.
        assert sorted(forwards) == sorted(backwards) == [(mb, shard) for mb in range(2) for shard in range(4)]
        for _, start, end, *_ in spans:
            assert end >= start
        # Slept compute shows in the spans' lengths (3 ms per layer forward, 2 layers per shard).
        assert all(s[2] - s[1] >= 0.9 * 2 * 0.003 for s in spans if s[3] == "F")
        transfers = [t for t in doc["transfers"] if t[0] == rank]
        assert {t[1] for t in transfers} == {"in", "out"}
        assert all(t[5] >= t[4] for t in transfers)
    assert {t[3] for t in doc["transfers"]} >= {"intra", "inter"}

    plot = _plot_tool()
    plan, result = plot.load_timeline(str(timeline))
    assert plan.ranks_per_group == 2 and len(result.spans) == len(doc["spans"])
    assert 0.0 <= result.bubble_ratio < 1.0
    out = tmp_path / "timeline.png"
    assert plot.main(["--timeline", str(timeline), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
