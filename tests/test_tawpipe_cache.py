"""TawPipe's shard cache as a choice, ``--tawpipe-cache {auto,on,off}``: the flag's validation, the ``auto``
rule (the memory model against the device's memory, the same decision on every rank), what the cache
costs in buffers, the advisor's cache knob at 8 nodes, and training with the cache at 3 and 4 groups (and
without it at 4) exactly like the single-process reference."""

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_trains_like, tiny_args, train_rank, pinned_layout

from megatron_tawpipe.arguments import parse_args
from megatron_tawpipe.cli.plan_args import check_command
from megatron_tawpipe.plan import build_plan
from megatron_tawpipe.plan.traffic import link_bytes
from megatron_tawpipe.sim.advisor import Advisor
from megatron_tawpipe.sim.advisor_configs import Cluster, ModelSpec, enumerate_configs
from megatron_tawpipe.sim.costmodel import params_per_layer
from megatron_tawpipe.sim.tawpipe_cache import decide_cache, predicted_memory, run_cost_model

ITERS = 3
LAYERS, BATCH = 12, 12      # 12 layers and sequences: 3 groups of 1 (4 layers, 4 sequences each) and 4 groups of 1


def _validated(*extra, world):
    from megatron_tawpipe.training.validate_args import validate_args

    return validate_args(parse_args(tiny_args(*extra)), world_size=world)


# ----------------------------------------------------------------------- the flag
@pytest.mark.parametrize("extra,world,message", [
    (["--pipeline-schedule", "tawpipe", "--tawpipe-cache", "on", "--tawpipe-num-groups", "1"], 4, "two or more groups"),
    (["--pipeline-schedule", "tawpipe", "--tawpipe-cache", "on"], 4, "two or more groups"),   # one node: one group
    (["--pipeline-schedule", "weipipe", "--tawpipe-cache", "off"], 4, "tawpipe only"),
    (["--tawpipe-cache", "on"], 1, "tawpipe only"),
])
def test_settings_that_cannot_apply_are_refused_in_one_line(extra, world, message):
    from megatron_tawpipe.arguments import ArgumentError

    with pytest.raises(ArgumentError) as info:
        _validated(*extra, world=world)
    assert message in str(info.value) and "--tawpipe-cache" in str(info.value) and "\n" not in str(info.value)


def test_settings_that_apply_are_accepted():
    assert parse_args(tiny_args()).tawpipe_cache == "auto"
    assert _validated("--pipeline-schedule", "tawpipe", "--tawpipe-cache", "on", "--tawpipe-num-groups", "2",
                      world=4).tawpipe_cache == "on"
    # off with one group is the same plan as auto's: accepted
    assert _validated("--pipeline-schedule", "tawpipe", "--tawpipe-cache", "off", world=4).tawpipe_cache == "off"


# ------------------------------------------------------------------- the auto rule
def test_auto_is_on_exactly_when_the_peak_with_the_cache_fits_the_fraction_of_the_device():
    assert decide_cache("auto", 8, 71e9, 80e9).cache           # 71 <= 0.9 x 80 = 72
    assert not decide_cache("auto", 8, 73e9, 80e9).cache
    assert decide_cache("auto", 8, 73e9, 80e9, fraction=0.95).cache
    off = decide_cache("auto", 1, 1.0, 80e9)
    assert not off.cache and "one group" in off.reason
    assert decide_cache("on", 8, 500e9).cache and not decide_cache("off", 2).cache
    line = decide_cache("auto", 8, 73e9, 80e9, "GPU total memory").line()
    assert line.startswith("tawpipe shard cache: off") and "73.00 GB" in line and "GPU total memory" in line
    with pytest.raises(ValueError):
        decide_cache("auto", 8, None, 80e9)


@pytest.mark.parametrize("D", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("G", [1, 2])
def test_what_the_cache_costs_in_buffers(D, G):
    """With overlap a rank holds D+2 weight and 2D gradient buffers with the cache (D and 2D-2 with one rank
    per group), whatever the micro-batches, the chunk or a replicated first shard; without it 4 weight
    buffers (5 with a replicated first shard): the cache adds at most D-2 weight buffers and 2 gradient buffers."""
    for N, extra in ((1, {}), (3, {}), (4, {"chunk": 2}), (2, {"replicate_first": True})):
        on, off = (build_plan("tawpipe", num_ranks=D * G, num_groups=D, num_microbatches=N, cache=c, **extra)
                   for c in (True, False))
        assert (on.max_weight_buffers, on.max_grad_buffers) == ((D + 2, 2 * D) if G > 1 else (D, 2 * D - 2))
        assert off.max_weight_buffers <= 4 + ("replicate_first" in extra)
        assert on.max_weight_buffers - off.max_weight_buffers <= max(D - 2, 0)
        assert 0 <= on.max_grad_buffers - off.max_grad_buffers <= 2
        # inter-group traffic with the cache: every foreign shard's weights in and gradient out once
        if not extra.get("replicate_first"):
            assert link_bytes(on, 1.0)["inter"] == 2 * D * G * (D - 1)


def test_the_nccl_sweep_counts_tawpipe_by_cache_and_groups():
    from megatron_tawpipe.plan.sweep import run_sweep

    result = run_sweep([5], [1, 2], full_product_max_ranks=0, splits=("even",), schedules=["tawpipe"])
    assert not result.failures, result.failures[:3]
    counts = result.tawpipe_cache
    assert sum(n for n, _ in counts.values()) == result.by_schedule["tawpipe"]
    assert counts["cache on, D > 4"][0] > 0 and counts["cache off, D > 4"][0] > 0
    assert all(failed == 0 for _, failed in counts.values())


def test_predicted_memory_prices_the_extra_buffers():
    """The memory model's difference between cache on and off is the plans' extra buffers at their sizes."""
    cost = run_cost_model(hidden_size=4096, seq_length=4096, micro_batch_size=1, ffn_hidden_size=11008,
                          vocab_size=32000, num_attention_heads=32, num_query_groups=None, recompute=True,
                          dtype_bytes=2, grad_bytes=4)
    on, off = (build_plan("tawpipe", num_ranks=16, num_groups=8, num_layers=32, num_microbatches=2, cache=c)
               for c in (True, False))
    extra = ((on.max_weight_buffers - off.max_weight_buffers) * cost.shard_bytes(on)
             + (on.max_grad_buffers - off.max_grad_buffers) * cost.grad_shard_bytes(on))
    assert extra > 0
    assert predicted_memory(on, cost).total - predicted_memory(off, cost).total == pytest.approx(extra)
    assert predicted_memory(on, cost, tensor_parallel=4).total == pytest.approx(predicted_memory(on, cost).total / 4)


def _decide_rank(rank, memories, groups):
    """One rank's --tawpipe-cache auto decision with its device memory replaced by ``memories[rank]``."""
    import torch
    import torch.distributed as dist

    from megatron_tawpipe.arguments.run_config import RunConfig
    from megatron_tawpipe.runtime import tawpipe_cache

    dist.init_process_group("gloo")
    try:
        tawpipe_cache.device_memory = lambda device: (memories[rank], "memory given by the test")
        args = _validated("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", str(groups), world=2)
        build = lambda cache: {1: build_plan("tawpipe", num_ranks=2, num_groups=groups, num_layers=8,  # noqa: E731
                                             num_microbatches=1, cache=cache)}
        decision, plans = tawpipe_cache.decide(RunConfig.from_args(args, world_size=2), groups, build,
                                               torch.device("cpu"))
        return decision.cache, decision.reason, plans[1].options["cache"]
    finally:
        dist.destroy_process_group()


def test_every_rank_decides_alike_from_the_smallest_device_memory():
    # the tiny model needs a few MB: 1 GB fits, 1 kB does not; one small rank turns the cache off on both
    both = run_ranks(_decide_rank, 2, [1e9, 1e9], 2)
    assert [(cache, planned) for cache, _, planned in both] == [(True, True)] * 2
    mixed = run_ranks(_decide_rank, 2, [1e9, 1e3], 2)
    assert [(cache, planned) for cache, _, planned in mixed] == [(False, False)] * 2
    assert "smallest over ranks" in mixed[0][1] and "within" not in mixed[0][1]
    single = run_ranks(_decide_rank, 2, [1e9, 1e9], 1)
    assert [cache for cache, _, _ in single] == [False, False] and "one group" in single[0][1]


def test_device_memory_on_the_host_is_shared_by_its_ranks(monkeypatch):
    import torch

    from megatron_tawpipe.runtime.tawpipe_cache import device_memory, host_available_bytes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    memory, what = device_memory(torch.device("cpu"))
    assert 0 < memory <= host_available_bytes() / 4 * 1.5 and "4 ranks" in what


# -------------------------------------------------------------------- the advisor
def test_the_advisor_offers_the_cache_at_8_nodes_as_a_runnable_flag():
    model = ModelSpec(num_layers=16, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8,
                      num_query_groups=4, vocab_size=1000, seq_length=2048)
    cluster = Cluster(ranks=16, nodes=8, intra_bw=100e9, inter_bw=1.25e9, peak_tflops=100, efficiency=0.5,
                      gpu_memory=80e9, memory_reserve=0)
    adv = Advisor(model, cluster, 32, check_command=check_command)
    configs, absent = enumerate_configs(model, cluster, 32)
    assert not [a for a in absent if "cache" in a.what]
    pick = {c.knobs["cache"]: c for c in configs if c.strategy == "tawpipe" and c.recompute and "tp" not in c.knobs
            and c.knobs["chunk"] == 1 and not c.knobs["replicate_first"] and not c.knobs.get("plan_schedule")
            and not c.knobs.get("ownership")}   # one owner per shard, with and without the cache
    assert set(pick) == {True, False}
    for cache, cfg in pick.items():
        adv.evaluate(cfg)
        assert cfg.trainable, cfg.note
        flag = cfg.argv[cfg.argv.index("--tawpipe-cache") + 1]
        assert flag == ("on" if cache else "off")
    # the cache moves less between nodes and holds more
    assert pick[True].inter_bytes_per_node < pick[False].inter_bytes_per_node
    assert pick[True].memory.comm_buffers > pick[False].memory.comm_buffers
    one_node = enumerate_configs(model, Cluster(ranks=8, nodes=1, intra_bw=100e9, inter_bw=1.25e9), 32)[0]
    assert {c.knobs["cache"] for c in one_node if c.strategy == "tawpipe" and not c.knobs.get("plan_schedule")} \
        == {False}


# ----------------------------------------------- training with the cache (3, 4 groups) and without it (4)
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ref"))
    (records,) = run_ranks(train_rank, 1, _train_args(save=save))
    return records, save


def _train_args(*extra, save):
    argv = tiny_args(*extra, train_iters=ITERS, global_batch=BATCH, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(LAYERS)
    return argv + ["--save", save, "--save-interval", "1"]


def _units(groups, cache):
    """Inter-group shard units per iteration of the run's plan (weights and gradients both fp32 here)."""
    plan = build_plan("tawpipe", num_ranks=groups, num_groups=groups, num_layers=LAYERS,
                      num_microbatches=BATCH // groups, cache=cache)
    return link_bytes(plan, 1.0)["inter"] * LAYERS // groups      # in layers' worth


# a decoder layer of the tiny model (H 64, FFN 128, 4 heads, gated FFN, RMSNorm, no biases), fp32 on the wire
LAYER_BYTES = 4 * params_per_layer(64, 128, 4, 4)


@pytest.mark.parametrize("groups,setting", [(3, "on"), (4, "on"), (4, "off")])
def test_trains_like_the_single_process_reference(groups, setting, reference, tmp_path):
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, groups, _train_args(
        "--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", str(groups), *pinned_layout(groups),
        "--tawpipe-cache", setting,
        "--tawpipe-nccl-faithful", "--distributed-timeout-minutes", "2", save=save))
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)
    sent = [r["inter_group_bytes"] for r in per_rank[0]]
    assert sent == [r["planned_inter_group_bytes"] for r in per_rank[0]]
    # the bytes are those of the plan with the setting asked for, not of the other one
    units = {cache: _units(groups, cache) for cache in (True, False)}
    assert units[True] < units[False]
    assert sent == [units[setting == "on"] * LAYER_BYTES] * ITERS
