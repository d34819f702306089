"""TawPipe's layout decided by the run (every ``--tawpipe-*`` layout flag at its default, auto): the one decision
(``sim.layout_choice``) never overrides a flag given, refuses an impossible combination in one line, prices only
plans the validators accept; the link probe measures and falls back; a run with no layout flag trains exactly like
the single-process reference in the layout it chose, says so once, records it in the metrics and the checkpoint,
and its checkpoint resumes in another layout."""

import json
import os

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_trains_like, losses, tiny_args, train_rank

from megatron_tawpipe.plan import build_plan, validate_plan
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.layout_choice import LayoutRequest, TawPipeLayout, candidate_layouts, choose_layout

ITERS = 3
LAYERS, BATCH = 12, 12


def _cost(inter_bw, intra_bw=0.6e9):
    base = CostModel.from_flops(hidden_size=256, seq_length=3072, micro_batch_size=1, ffn_hidden_size=704,
                                vocab_size=2048, num_attention_heads=4, num_query_groups=4, recompute=False,
                                dtype_bytes=4, peak_tflops=0.4, efficiency=1.0)
    from dataclasses import replace

    return replace(base, backend="gloo", intra=Link(intra_bw, 5e-6), inter=Link(inter_bw, 50e-6))


def test_auto_decides_only_what_is_left_to_it():
    """Every flag given is kept; what is left is searched; 3 x 2 at 150 Mbit/s takes the spread layout with two
    shards per rank and the cache (the layout that closes the gap to the distributed optimizer)."""
    cost = _cost(150e6 / 8)
    free = choose_layout(LayoutRequest(), cost, 6, 3, 12, [4])
    assert free.chosen.ownership == "spread" and free.chosen.shards_per_rank == 2 and free.chosen.cache
    assert free.runner_up is not None and free.margin() >= -0.002
    assert all(p.iteration_time >= free.chosen_priced.iteration_time * 0.998 for p in free.priced if p.fits)
    pinned = choose_layout(LayoutRequest(ownership="owner", microbatches_per_visit=2), cost, 6, 3, 12, [4])
    assert all(p.layout.ownership == "owner" and p.layout.microbatches_per_visit == 2 for p in pinned.priced)
    one_group = choose_layout(LayoutRequest(), cost, 4, 1, 12, [4])
    assert {(p.layout.ownership, p.layout.cache, p.layout.replicate_first) for p in one_group.priced} == {
        ("owner", False, False)}
    line = free.line()
    assert "runner-up" in line and "spread, 2 shards/rank" in line and "\n" not in line


def test_a_memory_limit_rules_out_what_does_not_fit():
    cost = _cost(150e6 / 8)
    free = choose_layout(LayoutRequest(), cost, 6, 3, 12, [4])
    limit = free.chosen_priced.memory_bytes * 0.999
    tight = choose_layout(LayoutRequest(), cost, 6, 3, 12, [4], memory_limit=limit)
    assert tight.chosen_priced.memory_bytes <= limit and tight.chosen != free.chosen
    nothing = choose_layout(LayoutRequest(), cost, 6, 3, 12, [4], memory_limit=1.0)
    assert not nothing.chosen_priced.fits
    assert nothing.chosen_priced.memory_bytes == min(p.memory_bytes for p in nothing.priced)


@pytest.mark.parametrize("ranks,groups,layers,micro", [(4, 2, 12, 4), (6, 3, 12, 4), (8, 4, 10, 2), (4, 1, 8, 3)])
def test_every_layout_auto_may_choose_is_a_sound_plan(ranks, groups, layers, micro):
    """The candidates are plans the validator and the NCCL ordering model accept."""
    layouts = candidate_layouts(LayoutRequest(), ranks, groups, layers, [micro])
    assert layouts and len(set(layouts)) == len(layouts)
    for layout in layouts:
        plan = build_plan("tawpipe", num_ranks=ranks, num_groups=groups, num_layers=layers, num_microbatches=micro,
                          **layout.plan_options())
        validate_plan(plan)   # NCCL's ordering rules included


def test_an_impossible_combination_is_refused_before_any_rank_starts():
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.common.errors import ArgumentError
    from megatron_tawpipe.training.validate_args import validate_args

    def refusal(*flags, world=4):
        argv = tiny_args("--pipeline-schedule", "tawpipe", *flags, train_iters=3, global_batch=8)
        with pytest.raises(ArgumentError) as refused:
            validate_args(parse_args(argv), world_size=world)
        assert "\n" not in str(refused.value)
        return str(refused.value)

    message = refusal("--tawpipe-num-groups", "2", "--tawpipe-ownership", "spread", "--tawpipe-replicate-first-shard")
    assert "--tawpipe-ownership spread" in message and "--tawpipe-replicate-first-shard" in message
    assert "--tawpipe-ownership spread needs two or more groups" in refusal("--tawpipe-num-groups", "1",
                                                                            "--tawpipe-ownership", "spread")
    assert "--tawpipe-shards-per-rank 2" in refusal("--tawpipe-num-groups", "2", "--tawpipe-shards-per-rank", "2",
                                                    world=8)   # 8 layers: 16 shards of one layer or more needed
    # what the flags leave open is decided, not refused: spread without the cache, 3 per visit of 2 micro-batches
    validate_args(parse_args(tiny_args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                                       "--tawpipe-ownership", "spread", "--tawpipe-cache", "off",
                                       "--tawpipe-microbatches-per-visit", "3", train_iters=3, global_batch=8)),
                  world_size=4)


def _probe_rank(rank, budget):
    import torch
    import torch.distributed as dist

    from megatron_tawpipe.distributed.link_probe import probe_links

    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    try:
        inter, intra, seconds = probe_links(2, 2, torch.device("cpu"), budget_s=budget)
        return inter, intra, seconds
    finally:
        dist.destroy_process_group()


def test_the_probe_measures_the_links_and_every_rank_gets_rank_0s_figures():
    results = run_ranks(_probe_rank, 4, 2.0)
    inter, intra, _ = results[0]
    assert inter.source == "measured" and intra.source == "measured"
    assert inter.bandwidth > 1e6 and 0 < inter.latency < 0.1 and intra.bandwidth > 1e6
    assert all((r[0].bandwidth, r[1].bandwidth) == (inter.bandwidth, intra.bandwidth) for r in results)
    assert all(r[2] > 0 for r in results)   # its time is reported (bounds on it are the benchmark's business)


def test_a_probe_past_its_budget_gives_the_default_and_says_so():
    results = run_ranks(_probe_rank, 4, 1e-6)
    inter, intra, _ = results[0]
    assert inter.source.startswith("default: the probe failed") and "budget" in inter.source
    assert inter.bandwidth == 12.5e9 and intra.source.startswith("default")


def _args(*extra, save=None, iters=ITERS):
    argv = tiny_args(*extra, train_iters=iters, global_batch=BATCH, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(LAYERS)
    return argv + (["--save", save, "--save-interval", "1"] if save else [])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ref"))
    (records,) = run_ranks(train_rank, 1, _args(save=save))
    return records, save


def test_no_layout_flag_trains_like_the_reference_and_records_its_layout(reference, tmp_path, capfd):
    """4 ranks in 2 groups, a slow link given (so the decision is not noise), under NCCL's ordering rules: the run
    decides, says so once, trains exactly, keeps the decision in its first metrics record and its checkpoint."""
    save = str(tmp_path / "ckpt")
    metrics = str(tmp_path / "metrics.jsonl")
    per_rank = run_ranks(train_rank, 4, _args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                                              "--tawpipe-link-bandwidth", "150Mbit/s", "--tawpipe-nccl-faithful",
                                              "--distributed-timeout-minutes", "2", "--metrics-file", metrics,
                                              save=save))
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)
    layout = per_rank[-1][0]["tawpipe_layout"]
    assert "tawpipe_layout" not in per_rank[-1][1]
    assert layout["inputs"]["node link"].endswith("(--tawpipe-link-bandwidth)")
    assert set(layout["auto"]) == {"ownership", "shards_per_rank", "replicate_first", "cache",
                                   "microbatches_per_visit", "replicated_reduce", "recompute"}
    assert layout["layout"]["recompute"] is False   # a tiny model: its activations fit the host's memory
    with open(metrics, encoding="utf-8") as f:
        first = json.loads(f.readline())
    assert first["tawpipe_layout"]["layout"] == layout["layout"]
    out = capfd.readouterr().out
    assert out.count("tawpipe layout: ") == 1
    from megatron_tawpipe.checkpoint.formats import named

    saved = named("torch_dist").saved_arguments(os.path.join(save, f"iter_{ITERS:07d}"))
    assert saved["tawpipe_layout"]["layout"] == layout["layout"]
    assert saved["tawpipe_ownership"] == layout["layout"]["ownership"]
    chosen = TawPipeLayout(**layout["layout"])
    # resumed from iteration 2 (the tracker set back), the third iteration again: with the same flags the saved
    # decision is taken (no probe, the same layout: the same loss bit for bit); in a layout pinned to differ from
    # the chosen one, the same loss within the bound
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w", encoding="utf-8") as f:
        f.write("2")
    same = run_ranks(train_rank, 4, _args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                                          "--tawpipe-link-bandwidth", "150Mbit/s", "--load", save,
                                          "--distributed-timeout-minutes", "2"))
    assert "as decided by the run saved in" in capfd.readouterr().out
    assert [r["iteration"] for r in same[0]] == [3] and same[0][0]["lm_loss"] == per_rank[0][2]["lm_loss"]
    other = ["--tawpipe-ownership", "spread" if chosen.ownership == "owner" else "owner",
             "--tawpipe-shards-per-rank", "2" if chosen.shards_per_rank == 1 else "1",
             "--no-tawpipe-replicate-first-shard", "--tawpipe-cache", "on",
             "--tawpipe-microbatches-per-visit", "1", "--tawpipe-replicated-reduce", "hierarchical"]
    resumed = run_ranks(train_rank, 4, _args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                                             *other, "--load", save, "--distributed-timeout-minutes", "2"))
    assert [r["iteration"] for r in resumed[0]] == [3]
    assert resumed[0][0]["lm_loss"] == pytest.approx(per_rank[0][2]["lm_loss"], rel=1e-5)


@pytest.mark.parametrize("layout", [
    ("--tawpipe-ownership", "owner", "--tawpipe-shards-per-rank", "2", "--tawpipe-replicate-first-shard",
     "--tawpipe-cache", "on", "--tawpipe-microbatches-per-visit", "3", "--tawpipe-replicated-reduce", "flat"),
    ("--tawpipe-ownership", "spread", "--tawpipe-shards-per-rank", "2", "--tawpipe-cache", "on",
     "--tawpipe-microbatches-per-visit", "3", "--tawpipe-replicated-reduce", "hierarchical"),
], ids=["owner-x2-first-replicated-3-per-visit-flat", "spread-x2-3-per-visit"])
def test_layouts_auto_picks_train_like_the_reference(layout, reference, tmp_path):
    """Combinations of the knobs auto chooses among, beyond those the layout tests cover one by one: 2 groups of 2
    ranks, under NCCL's ordering rules."""
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, 4, _args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", *layout,
                                              "--tawpipe-nccl-faithful", "--distributed-timeout-minutes", "2",
                                              save=save))
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)
    sent = [r["inter_group_bytes"] for r in per_rank[0]]
    assert sent == [r["planned_inter_group_bytes"] for r in per_rank[0]]


# ----------------------------------------------------------------- --pipeline-schedule auto


def test_auto_schedule_replaces_the_schedule_and_the_groups():
    from megatron_tawpipe.cli.auto_schedule import with_schedule

    argv = ["--num-layers", "4", "--pipeline-schedule", "auto", "--tawpipe-num-groups=2", "--lr", "1e-3",
            "--tawpipe-no-recompute", "--tawpipe-cache", "on"]
    assert with_schedule(argv, ["--pipeline-schedule", "1f1b", "--use-distributed-optimizer"]) == [
        "--num-layers", "4", "--lr", "1e-3", "--pipeline-schedule", "1f1b", "--use-distributed-optimizer"]
    assert with_schedule(argv, ["--pipeline-schedule", "weipipe", "--tawpipe-num-groups", "2"]) == [
        "--num-layers", "4", "--lr", "1e-3", "--tawpipe-no-recompute", "--pipeline-schedule", "weipipe",
        "--tawpipe-num-groups", "2"]
    assert with_schedule(argv, ["--pipeline-schedule", "tawpipe"])[-5:] == [
        "--tawpipe-no-recompute", "--tawpipe-cache", "on", "--pipeline-schedule", "tawpipe"]


def test_auto_schedule_ranks_what_pretrain_runs_and_drops_what_it_refuses():
    """3 x 2 at 150 Mbit/s, emulated compute: TawPipe in its decided layout, WeiPipe, megatron's pipelines and
    distributed optimizer ranked by predicted tokens/s; a candidate the run refuses is left out with its reason."""
    from megatron_tawpipe.sim.advisor_configs import Cluster, ModelSpec
    from megatron_tawpipe.sim.schedule_choice import rank_schedules

    model = ModelSpec(num_layers=12, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4,
                      num_query_groups=4, vocab_size=2048, seq_length=3072)
    cluster = Cluster(ranks=6, nodes=3, intra_bw=0.6e9, inter_bw=150e6 / 8, gpu_memory=5e9, memory_reserve=0.5e9,
                      intra_latency=5e-6, inter_latency=50e-6)

    def cost_of(b, recompute):
        from dataclasses import replace

        base = _cost(150e6 / 8)
        return replace(base, layer_recompute=base.layer_forward if recompute else 0.0, recompute=recompute)

    refused = []

    def check(flags):
        if "interleaved" in flags:
            refused.append(flags)
            return "interleaved refused here (test)"
        return ""

    ranking = rank_schedules(model, cluster, 24, 1, cost_of, weight_passing_recompute=False,
                             native_recompute=False, check=check)
    labels = [r.label for r in ranking.ranked]
    assert any(label.startswith("tawpipe (spread, 2 shards/rank") for label in labels)
    assert any("distributed optimizer over all ranks" in label for label in labels)
    assert any(label.startswith("weipipe") for label in labels) and any(label.startswith("1f1b") for label in labels)
    speeds = [r.tokens_per_sec_per_gpu for r in ranking.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert not any("interleaved" in label for label in labels)
    assert refused and all(r.refusal for r in ranking.left_out if "interleaved" in r.label)
    lines = ranking.lines()
    assert len(lines) == 3 and "%" in lines[1] and "%" not in lines[0]


def test_pipeline_schedule_auto_runs_the_winner_exactly(reference, tmp_path, capfd):
    """4 ranks in 2 groups, --pipeline-schedule auto: the top three printed with the flags that pin the winner; the
    winner trains exactly like the single-process reference (every candidate computes the same step)."""
    from megatron_tawpipe.cli.pretrain import run_training

    def rank_body(rank, argv):
        return run_training(argv, prog="test")

    argv = _args("--pipeline-schedule", "auto", "--tawpipe-num-groups", "2", "--tawpipe-link-bandwidth", "150Mbit/s",
                 "--metrics-file", str(tmp_path / "m.jsonl"), "--distributed-timeout-minutes", "2")
    statuses = run_ranks(rank_body, 4, argv)
    assert statuses == [0, 0, 0, 0]
    out = capfd.readouterr().out
    assert out.count("--pipeline-schedule auto: ") == 1 and "to pin it, replace --pipeline-schedule auto with:" in out
    assert "  1. " in out and "  2. " in out
    with open(tmp_path / "m.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    for got, want in zip(records, reference[0]):
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
