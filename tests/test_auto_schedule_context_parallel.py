"""``--pipeline-schedule auto`` with ``--context-parallel-size C``: every candidate at the command's T x C, over the
P / (T x C) virtual ranks and priced per GPU as the advisor prices that configuration; TawPipe (one owner per
shard) and WeiPipe ranked beside the native strategies at T = 1 and at T = 2 beside C = 2, TawPipe in the layout
``pretrain_llama.py --pipeline-schedule tawpipe`` decides with that T x C. TawPipe's layout decision itself prices the
pieces' collectives and the memory per GPU; the advisor's T x C weight passing is a direct simulation's."""

import math
import os
from dataclasses import replace

import pytest

from distributed_harness import run_ranks
from training_helpers import tiny_args

from megatron_tawpipe.sim.advisor import Advisor
from megatron_tawpipe.sim.advisor_configs import Cluster, Config, ModelSpec, enumerate_at
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.schedule_choice import rank_schedules

MODEL = ModelSpec(num_layers=12, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4, num_query_groups=4,
                  vocab_size=2048, seq_length=3072)
BATCH = 24


def _cluster(ranks, nodes):
    return Cluster(ranks=ranks, nodes=nodes, intra_bw=0.6e9, inter_bw=150e6 / 8, gpu_memory=5e9,
                   memory_reserve=0.5e9, intra_latency=5e-6, inter_latency=50e-6)


def cost_of(b, recompute):
    """One GPU's cost model (the run's: emulated compute times, gloo, the links above)."""
    base = CostModel.from_flops(hidden_size=256, seq_length=3072, micro_batch_size=b, ffn_hidden_size=704,
                                vocab_size=2048, num_attention_heads=4, num_query_groups=4, recompute=False,
                                dtype_bytes=4, peak_tflops=0.4, efficiency=1.0)
    base = replace(base, backend="gloo", intra=Link(0.6e9, 5e-6), inter=Link(150e6 / 8, 50e-6))
    return replace(base, layer_recompute=base.layer_forward if recompute else 0.0, recompute=recompute)


class RunCostAdvisor(Advisor):
    """The advisor on the same cost model (``cost_of``)."""

    def cost(self, b, recompute):
        return self.costs.setdefault((b, recompute), cost_of(b, recompute))


def _value(flags, flag):
    return flags[flags.index(flag) + 1] if flag in flags else None


def _advisor_config(strategy, recompute, knobs, cluster, tp=1, cp=2):
    """The advisor's configuration at T x C of ``strategy`` with ``knobs`` (the plain one: no plan file)."""
    configs, _ = enumerate_at(MODEL, cluster, BATCH, tp, cp)
    for cfg in configs:
        k = cfg.knobs
        if (cfg.strategy == strategy and cfg.micro_batch_size == 1 and cfg.recompute == recompute
                and not k.get("plan_schedule") and all(k.get(name, default) == want
                                                       for name, (want, default) in knobs.items())):
            return cfg
    raise AssertionError(f"no {strategy} configuration with {knobs}")


@pytest.mark.parametrize("ranks,tp", [(4, 1), (8, 2)], ids=["T1xC2", "T2xC2"])
def test_weight_passing_is_ranked_beside_the_native_strategies_at_the_commands_context_parallel_size(ranks, tp):
    """4 ranks in 2 groups at C = 2, and 8 at T = 2 x C = 2: TawPipe and WeiPipe ranked with finite positive
    tokens/s per GPU; every candidate's figures those the advisor gives the same configuration on the same cost
    model (TawPipe's in its decided layout, one owner per shard); the native candidates run and are priced at C = 2,
    not at C = 1."""
    cluster = _cluster(ranks, 2)
    ranking = rank_schedules(MODEL, cluster, BATCH, 1, cost_of, weight_passing_recompute=None,
                             native_recompute=None, check=lambda flags: "", tensor_parallel=tp, context_parallel=2)
    by_label = {r.label: r for r in ranking.ranked}
    tawpipe = next(r for r in ranking.ranked if r.label.startswith("tawpipe ("))
    weipipe = by_label["weipipe"]
    for r in ranking.ranked:
        assert math.isfinite(r.tokens_per_sec_per_gpu) and r.tokens_per_sec_per_gpu > 0 and r.memory_bytes > 0
    speeds = [r.tokens_per_sec_per_gpu for r in ranking.ranked]
    assert speeds == sorted(speeds, reverse=True)

    advisor = RunCostAdvisor(MODEL, cluster, BATCH)
    layout = tawpipe.layout.chosen
    assert layout.ownership == "owner"
    assert tawpipe.flags[:4] == ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"]
    assert tawpipe.flags[4:] == layout.flags()   # the layout's flags, checked with the rest
    same = advisor.evaluate(_advisor_config("tawpipe", layout.recompute, {
        "chunk": (layout.microbatches_per_visit, None), "cache": (layout.cache, None),
        "replicate_first": (layout.replicate_first, False), "shards_per_rank": (layout.shards_per_rank, 1)}, cluster,
        tp))
    assert tawpipe.tokens_per_sec_per_gpu == pytest.approx(same.tokens_per_sec_per_gpu, rel=1e-9)
    assert tawpipe.memory_bytes == pytest.approx(same.memory.total, rel=1e-9)

    recompute = _value(weipipe.flags, "--tawpipe-recompute") == "on"
    same = advisor.evaluate(_advisor_config("weipipe", recompute, {"zero_bubble": (None, None)}, cluster, tp))
    assert weipipe.tokens_per_sec_per_gpu == pytest.approx(same.tokens_per_sec_per_gpu, rel=1e-9)
    assert _value(weipipe.flags, "--context-parallel-size") == "2"

    distopt = by_label["megatron's distributed optimizer over all ranks (overlapped)"]
    assert _value(distopt.flags, "--context-parallel-size") == "2"
    recompute = "--recompute-granularity" in distopt.flags
    at_two = advisor.evaluate(_advisor_config("distopt", recompute, {}, cluster, tp))
    at_one = advisor.evaluate(_advisor_config("distopt", recompute, {}, cluster, tp, cp=1))
    assert distopt.tokens_per_sec_per_gpu == pytest.approx(at_two.tokens_per_sec_per_gpu, rel=1e-9)
    assert abs(at_one.tokens_per_sec_per_gpu / at_two.tokens_per_sec_per_gpu - 1) > 0.01
    assert all(_value(r.flags, "--context-parallel-size") == "2" for r in ranking.ranked
               if not r.label.startswith("tawpipe"))   # TawPipe's: the command's, which auto keeps
    if tp > 1:
        assert all(_value(r.flags, "--tensor-model-parallel-size") == str(tp) for r in ranking.ranked
                   if not r.label.startswith("tawpipe"))
        assert not ranking.left_out or all("not priced" not in r.refusal for r in ranking.left_out)


# what may differ between the same configuration at T x C and at T or C alone (with C > 1 the replicated parts'
# optimizer stays whole on every rank: sharded elsewhere)
OTHER_KNOBS = ("tp", "cp", "replicated_reduce")


@pytest.mark.parametrize("strategy", ["tawpipe", "weipipe"])
def test_the_advisor_prices_weight_passing_at_t_by_c_as_a_direct_simulation(strategy):
    """8 ranks in 2 groups at T = 2 x C = 2 (2 virtual ranks of 4 GPUs, 4 micro-batches each: simulated whole):
    the advisor enumerates TawPipe and WeiPipe there and evaluates them to finite figures, those of the plan
    simulated directly on the virtual ranks' pricing (the pieces' collectives beside it, the memory per GPU: the
    state / 2 but the Adam moments / 4, the activations / 4), and not those of T = 1 x C = 2 or T = 2 x C = 1 on
    the same GPUs."""
    from megatron_tawpipe.plan.planners import build_plan
    from megatron_tawpipe.sim.advisor_configs import wp_options, wp_schedule
    from megatron_tawpipe.sim.context_parallel import AttentionShape
    from megatron_tawpipe.sim.context_parallel_weights import virtual_rank_pricing
    from megatron_tawpipe.sim.memory import weight_passing_breakdown
    from megatron_tawpipe.sim.simulate import simulate

    cluster, batch = _cluster(8, 2), 8
    configs, _ = enumerate_at(MODEL, cluster, batch, 2, 2)
    mine = [c for c in configs if c.strategy == strategy and c.micro_batch_size == 1 and not c.recompute]
    assert mine and all(c.knobs["tp"] == 2 and c.knobs["cp"] == 2 for c in mine)
    cfg = mine[0]
    advisor = RunCostAdvisor(MODEL, cluster, batch)
    advisor.evaluate(cfg)
    assert math.isfinite(cfg.tokens_per_sec_per_gpu) and cfg.tokens_per_sec_per_gpu > 0
    assert "--tensor-model-parallel-size" in cfg.argv and "--context-parallel-size" in cfg.argv

    shape = AttentionShape(seq_length=3072, micro_batch_size=1, hidden_size=256, num_attention_heads=4,
                           num_query_groups=4, ffn_hidden_size=704)
    costs, pieces = virtual_rank_pricing({False: cost_of(1, False)}, 2, shape, 2)
    plan = build_plan(wp_schedule(cfg), num_ranks=2, num_groups=2, num_layers=12, num_microbatches=4,
                      **wp_options(cfg))
    result = simulate(plan, costs[False], record=False, around=pieces.around(False)(plan))
    assert cfg.tokens_per_sec_per_gpu == pytest.approx(result.tokens_per_sec_per_rank / 4, rel=1e-9)
    whole = weight_passing_breakdown(result, costs[False], plan, cfg.knobs.get("chunk", 1))
    assert cfg.memory.activations == pytest.approx(whole.activations / 4, rel=1e-9)
    assert cfg.memory.optimizer == pytest.approx(whole.optimizer * (4 / 2 + 8 / 4) / 12, rel=1e-9)
    assert cfg.memory.total == pytest.approx(pieces.per_gpu(whole).total, rel=1e-9)

    for tp, cp in ((1, 2), (2, 1)):
        other = next(c for c in enumerate_at(MODEL, cluster, batch, tp, cp)[0]
                     if c.strategy == strategy and c.micro_batch_size == 1 and not c.recompute
                     and {k: v for k, v in c.knobs.items() if k not in OTHER_KNOBS} ==
                     {k: v for k, v in cfg.knobs.items() if k not in OTHER_KNOBS})
        advisor.evaluate(other)
        assert abs(other.tokens_per_sec_per_gpu / cfg.tokens_per_sec_per_gpu - 1) > 1e-3


def test_a_ring_the_nodes_would_cut_is_not_priced():
    """C = 4 with 2 ranks per node: the ring would cross the node link, which the pricing does not model."""
    ranking = rank_schedules(MODEL, _cluster(4, 2), BATCH, 1, cost_of, weight_passing_recompute=None,
                             native_recompute=None, check=lambda flags: "", context_parallel=4)
    assert ranking.winner is None
    assert "C=4 does not divide the 2 GPUs of a node" in ranking.lines()[0]


def test_the_layout_decision_prices_the_pieces_and_the_memory_per_gpu():
    """TawPipe's layout decision with C = 2 (the run's, the advisor's, auto's): the same layout priced with the
    pieces' collectives takes longer, and holds less per GPU than the whole virtual rank (activations / C)."""
    from megatron_tawpipe.sim.context_parallel import AttentionShape
    from megatron_tawpipe.sim.context_parallel_weights import virtual_rank_pricing
    from megatron_tawpipe.sim.layout_choice import TawPipeLayout, price_layout

    shape = AttentionShape(seq_length=3072, micro_batch_size=1, hidden_size=256, num_attention_heads=4,
                           num_query_groups=4, ffn_hidden_size=704)
    costs, pieces = virtual_rank_pricing({False: cost_of(1, False)}, 2, shape)
    layout = TawPipeLayout(cache=True, recompute=False)
    with_pieces = price_layout(layout, costs[False], 2, 2, 12, [12], pieces=pieces)
    without = price_layout(layout, costs[False], 2, 2, 12, [12])
    assert with_pieces[0] > without[0] * 1.001
    assert with_pieces[1] < without[1]


CP2 = ["--context-parallel-size", "2", "--group-query-attention", "--num-query-groups", "2",
       "--tawpipe-link-bandwidth", "150Mbit/s"]


def _decisions_rank(rank, auto_argv, tawpipe_argv, world=4):
    """One process standing for ``world`` ranks in 2 groups: ``--pipeline-schedule auto``'s ranking (captured as the
    run makes it) and the layout ``--pipeline-schedule tawpipe`` decides, on the same fixed compute rate."""
    import torch
    import torch.distributed as dist

    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.cli.auto_schedule import choose_schedule
    from megatron_tawpipe.data import build_tokenizer
    from megatron_tawpipe.training import schedule_decision, tawpipe_layout
    from megatron_tawpipe.training.validate_args import validate_args

    dist.init_process_group("gloo", rank=0, world_size=1)
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))   # what the decisions are for
    tawpipe_layout.peak_rate = lambda device: (2e11, "a fixed rate")
    rankings = []
    rank_schedules_of_the_run = schedule_decision.rank_schedules

    def kept(*args, **kwargs):
        rankings.append(rank_schedules_of_the_run(*args, **kwargs))
        return rankings[-1]

    schedule_decision.rank_schedules = kept
    try:
        chosen_argv = choose_schedule(auto_argv)
        args = validate_args(parse_args(tawpipe_argv), world_size=world)
        build_tokenizer(args)
        decided = tawpipe_layout.settle_tawpipe_layout(args, world, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    (ranking,) = rankings
    candidates = ranking.ranked + ranking.left_out
    tawpipe = next(r for r in candidates if r.label.startswith("tawpipe ("))
    return {"argv": chosen_argv, "labels": [r.label for r in candidates],
            "tokens": {r.label: r.tokens_per_sec_per_gpu for r in candidates},
            "refusals": {r.label: r.refusal for r in candidates},
            "tawpipe": (tawpipe.layout.chosen, tawpipe.layout.chosen_priced.iteration_time, tawpipe.flags),
            "decided": (decided.chosen, decided.chosen_priced.iteration_time, decided.inputs)}


@pytest.mark.parametrize("world,tp", [(4, 1), (8, 2)], ids=["T1xC2", "T2xC2"])
def test_the_tawpipe_candidate_is_the_layout_the_run_decides(capfd, world, tp):
    """The run's own code on both sides (one forked process standing for 4 ranks in 2 groups at C = 2, or 8 at
    T = 2 x C = 2): auto's TawPipe candidate has the layout and the predicted time of ``--pipeline-schedule
    tawpipe``'s decision with the same T x C (both priced by the virtual ranks' pricing, the pieces and the memory
    per GPU included), its flags accepted by the run's validation; WeiPipe is ranked too; the winner's flags
    replace ``--pipeline-schedule auto``."""
    extra = CP2 + (["--tensor-model-parallel-size", str(tp)] if tp > 1 else [])
    auto_argv = tiny_args(*extra, "--pipeline-schedule", "auto", "--tawpipe-num-groups", "2", global_batch=8)
    tawpipe_argv = tiny_args(*extra, "--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", global_batch=8)
    (out,) = run_ranks(_decisions_rank, 1, auto_argv, tawpipe_argv, world)
    printed = capfd.readouterr().out
    layout, seconds, flags = out["tawpipe"]
    decided, decided_seconds, inputs = out["decided"]
    assert layout == decided and layout.ownership == "owner"
    assert seconds == pytest.approx(decided_seconds, rel=1e-9)
    assert inputs["context parallelism"] == ("2 GPUs per virtual rank" if tp == 1 else
                                              f"{tp} x 2 GPUs per virtual rank (tensor x context parallel)")
    assert out["refusals"][f"tawpipe ({layout.label()})"] == ""   # the run accepts its flags, layout included
    assert flags[-len(decided.flags()):] == decided.flags()
    weipipe = [label for label in out["labels"] if label.startswith("weipipe") and not out["refusals"][label]]
    assert weipipe and all(out["tokens"][label] > 0 for label in weipipe)
    assert f"virtual ranks: 2 of {tp} x 2 GPUs (tensor x context parallel)" in printed
    assert "--pipeline-schedule auto" not in " ".join(out["argv"]) and "--pipeline-schedule" in out["argv"]
    assert out["argv"][out["argv"].index("--context-parallel-size") + 1] == "2"
