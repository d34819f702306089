"""Strategy models (HSDP, distributed optimizer, HFSDP, pipeline across nodes),
the memory breakdown and the advisor (tools/simulate.py --advise)."""

import json
from dataclasses import replace
import os
import subprocess
import sys

import pytest

from megatron_tawpipe.plan import build_plan, write_plan
from megatron_tawpipe.cli.plan_args import check_command
from megatron_tawpipe.sim import CostModel, Link, simulate
from megatron_tawpipe.sim.advisor import Advisor, advise
from megatron_tawpipe.sim.advisor_configs import PRESETS, Cluster, ModelSpec, enumerate_configs
from megatron_tawpipe.sim.memory import TERMS, parse_size, weight_passing_breakdown
from megatron_tawpipe.sim.strategies import (pipeline_memory, plan_memory_fields, run_strategy,
                                              simulate_distopt, simulate_extended, simulate_hfsdp,
                                              simulate_hsdp, simulate_pipeline, total_params)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, D, L, N = 8, 2, 8, 4
d = P // D


def small_cost(**kw):
    args = dict(hidden_size=256, seq_length=512, ffn_hidden_size=688, num_attention_heads=4,
                num_query_groups=2, vocab_size=1000, peak_tflops=100, efficiency=0.5,
                intra_bw="100GB/s", inter_bw="1GB/s")
    args.update(kw)
    return CostModel.from_flops(**args)


# ------------------------------------------------------------ traffic (docs/simulator-cost-model.md)
def test_inter_node_bytes_match_the_closed_forms():
    c = small_cost()
    psi = total_params(c, L)
    w, g = 2, 4
    hsdp = simulate_hsdp(c, P, D, L, N)
    assert hsdp.options["inter_bytes_per_node"] == pytest.approx(2 * g * psi * (D - 1) / D)
    node = simulate_distopt(c, P, D, L, N, instances=D)
    assert node.options["inter_bytes_per_node"] == pytest.approx(2 * g * psi * (D - 1) / D)
    flat = simulate_distopt(c, P, D, L, N, instances=1)
    assert flat.options["inter_bytes_per_node"] == pytest.approx((P - 1) / P * (g + w) * psi)
    hf = simulate_hfsdp(c, P, D, L, N)
    # megatron-core gathers the weights across nodes twice per step (after the optimizer step and in the
    # first micro-batch's forward); on gloo its reduce-scatter moves an all-reduce's bytes
    assert hf.options["inter_bytes_per_node"] == pytest.approx((2 * w + g) * psi * (D - 1) / D)
    on_gloo = simulate_hfsdp(replace(c, backend="gloo"), P, D, L, N)
    assert on_gloo.options["inter_bytes_per_node"] == pytest.approx((2 * w + 2 * g) * psi * (D - 1) / D)
    flat_gloo = simulate_distopt(replace(c, backend="gloo"), P, D, L, N, instances=1)
    assert flat_gloo.options["inter_bytes_per_node"] == pytest.approx((P - 1) / P * (2 * g + w) * psi)
    for r in (hsdp, node, flat, hf):          # cluster totals, once per iteration
        assert r.link_bytes["inter"] == pytest.approx(D * r.options["inter_bytes_per_node"])
    # independent of the number of micro-batches (HSDP's per-micro-batch traffic stays in the node)
    assert simulate_hsdp(c, P, D, L, 2 * N).link_bytes["inter"] == pytest.approx(hsdp.link_bytes["inter"])
    assert simulate_hsdp(c, P, D, L, 2 * N).link_bytes["intra"] == pytest.approx(2 * hsdp.link_bytes["intra"])


def test_pipeline_across_nodes_moves_only_boundary_activations():
    c = small_cost()
    total_mb = N * P
    r = simulate_pipeline(c, P, D, L, total_mb, pipeline_size=D)
    # each micro-batch crosses the D-1 node boundaries forward (activation) and back (its gradient)
    assert r.link_bytes["inter"] == pytest.approx(2 * (D - 1) * total_mb * c.activation_bytes)
    assert r.options["data_parallel"] == d and r.options["microbatches_per_pipeline"] == total_mb // d
    assert run_strategy("pp-nodes", c, P, D, L, N).iteration_time == pytest.approx(r.iteration_time)


@pytest.mark.parametrize("m", [2, 4, 9])
def test_pipeline_bubble_with_free_links(m):
    free = CostModel(layer_forward=1.0, layer_backward=2.0)
    r = simulate_pipeline(free, P, D, L, m * d, pipeline_size=D)
    assert r.bubble_ratio == pytest.approx((D - 1) / (m + D - 1))


def test_hsdp_exposes_what_the_last_backward_cannot_hide():
    fast = small_cost(inter_bw="1TB/s")
    # fast links: only the last unit's all-reduce, after the last backward, shows
    t_fast = 2 * (D - 1) / D * 4 * total_params(fast, L) / 1e12 + 2 * (D - 1) * fast.inter.latency
    assert simulate_hsdp(fast, P, D, L, N).options["exposed_comm_s"] == pytest.approx(t_fast / L)
    slow = small_cost(inter_bw="1MB/s")
    r = simulate_hsdp(slow, P, D, L, N)
    psi = total_params(slow, L)
    t_ar = 2 * (D - 1) / D * 4 * psi / 1e6
    assert r.options["exposed_comm_s"] == pytest.approx(t_ar, rel=0.05)
    assert r.bubble_ratio > 0.5


def test_first_gather_and_last_reduce_scatter_buckets_are_exposed():
    """Links fast enough for the compute to hide every bucket but the edges: the first parameter-gather
    bucket (before the first layer's forward) and the last gradient reduce-scatter bucket (after the last
    backward) still add to the iteration, one layer's bucket each (docs/simulator-cost-model.md)."""
    from megatron_tawpipe.sim.collectives import exposed, per_microbatch, ring_time

    c = small_cost(seq_length=4096, intra_bw="1TB/s", inter_bw="1TB/s", intra_latency="1us", inter_latency="1us")
    psi, w, g = total_params(c, L), 2, 4
    fwd, bwd = per_microbatch(c, L)
    opt = c.optimizer_time_per_param
    # one distributed-optimizer instance over all ranks: reduce-scatter and gather across nodes
    t_rs, t_ag = ring_time(c.inter, g * psi, P), ring_time(c.inter, w * psi, P)
    assert t_rs < bwd * (L - 1) / L and t_ag < fwd * (L - 1) / L     # everything else hides
    r = simulate_distopt(c, P, D, L, N, instances=1)
    assert r.options["exposed_comm_s"] == pytest.approx((t_rs + t_ag) / L)
    assert r.iteration_time == pytest.approx(N * (fwd + bwd) + (t_rs + t_ag) / L + psi / P * opt)
    # one instance per node: the last bucket's reduce-scatter in the node and all-reduce across nodes
    t_rs = ring_time(c.intra, g * psi, d) + ring_time(c.inter, g * psi, D, 2.0)
    t_ag = ring_time(c.intra, w * psi, d)
    r = simulate_distopt(c, P, D, L, N, instances=D)
    assert r.options["exposed_comm_s"] == pytest.approx((t_rs + t_ag) / L)
    # HSDP: the last unit's cross-node all-reduce follows its (exposed) reduce-scatter in the node
    t_ar = ring_time(c.inter, g * psi, D, 2.0)
    assert simulate_hsdp(c, P, D, L, N).options["exposed_comm_s"] == pytest.approx(t_ar / L)
    # HFSDP: the first bucket of both outer gathers (the optimizer step's for the next iteration and the
    # first forward's), the outer reduce-scatter's last bucket
    t_rs, t_ag = ring_time(c.inter, g * psi, D), ring_time(c.inter, w * psi, D)
    assert simulate_hfsdp(c, P, D, L, N).options["exposed_comm_s"] == pytest.approx((t_rs + 2 * t_ag) / L)
    # the rule: one bucket when the compute hides the rest, the excess when it does not, all when blocking
    assert exposed(1.0, 100.0, 10) == pytest.approx(0.1)
    assert exposed(10.0, 5.0, 10) == pytest.approx(10.0 - 4.5)
    assert exposed(3.0, 100.0, 1) == 3.0 and exposed(0.0, 1.0, 4) == 0.0


def test_pipeline_data_parallel_exposes_its_last_bucket_and_its_synchronous_gather():
    """A megatron pipeline with data parallelism in the node (``--overlap-grad-reduce``, no
    ``--overlap-param-gather``): each stage's last reduce-scatter bucket follows its last backward and
    the parameter gather after the step is synchronous; the stage exposing most shows."""
    from megatron_tawpipe.sim.collectives import ring_time

    c = small_cost(intra_bw="10GB/s", seq_length=4096)
    free = simulate_pipeline(replace_links(c), P, D, L, N * P, pipeline_size=D)
    r = simulate_pipeline(c, P, D, L, N * P, pipeline_size=D)
    layers = L // D
    psi_first = layers * c.params_per_layer + c.embedding_params
    psi_last = layers * c.params_per_layer + c.replicated_params - c.embedding_params
    psi_stage = max(psi_first, psi_last)
    assert ring_time(c.intra, 4 * psi_stage, d) < layers * (c.layer_backward + c.layer_recompute) * (layers - 1) / layers
    shown = ring_time(c.intra, 4 * psi_stage, d) / layers + ring_time(c.intra, 2 * psi_stage, d)
    assert r.options["exposed_comm_s"] == pytest.approx(shown + psi_stage / d * c.optimizer_time_per_param)
    assert free.options["exposed_comm_s"] == pytest.approx(psi_stage / d * c.optimizer_time_per_param)


def replace_links(c):
    return c.with_links(Link(float("inf")), Link(float("inf")))


# --------------------------------------------------- --backend gloo (the CPU runs)
def test_gloo_backend_blocks_fsdp_and_partial_dp_but_not_one_instance():
    from dataclasses import replace

    from megatron_tawpipe.sim.fsdp import simulate_fsdp

    nccl = small_cost(intra_bw="1GB/s", inter_bw="100MB/s")
    gloo = replace(nccl, backend="gloo")
    # FSDP: nothing overlaps and the reduce-scatter costs an all-reduce: the closed form.
    r = simulate_fsdp(gloo, P, D, L, N)
    unit = gloo.params_per_layer * gloo.dtype_bytes
    coll = (P - 1) * gloo.inter.latency + (P - 1) / P * unit / gloo.inter.bandwidth
    per_mb = L * (gloo.layer_forward + gloo.layer_backward + gloo.layer_recompute + 4 * coll) + \
        gloo.head_forward + gloo.head_backward
    params = (L * gloo.params_per_layer + gloo.replicated_params) / P
    assert r.iteration_time == pytest.approx(N * per_mb + params * gloo.optimizer_time_per_param)
    assert r.link_bytes["inter"] == pytest.approx(4 / 3 * simulate_fsdp(nccl, P, D, L, N).link_bytes["inter"])
    assert r.iteration_time > simulate_fsdp(nccl, P, D, L, N).iteration_time
    # HSDP: the cross-node all-reduce is exposed whole.
    h = simulate_hsdp(gloo, P, D, L, N)
    t_ar = 2 * (D - 1) / D * 4 * total_params(gloo, L) / gloo.inter.bandwidth + 2 * (D - 1) * gloo.inter.latency
    assert h.options["exposed_comm_s"] == pytest.approx(t_ar)
    assert h.iteration_time > simulate_hsdp(nccl, P, D, L, N).iteration_time
    # The distributed optimizer: one instance's reductions are asynchronous gloo work, each moving an
    # all-reduce's bytes; one instance per node reduces synchronously.
    flat, flat_nccl = (simulate_distopt(c, P, D, L, N, instances=1) for c in (gloo, nccl))
    assert flat.iteration_time > flat_nccl.iteration_time
    assert flat.link_bytes["inter"] == pytest.approx(
        flat_nccl.link_bytes["inter"] * (2 * 4 + gloo.dtype_bytes) / (4 + gloo.dtype_bytes))
    assert simulate_distopt(gloo, P, D, L, N, instances=D).options["exposed_comm_s"] > \
        simulate_distopt(nccl, P, D, L, N, instances=D).options["exposed_comm_s"]
    # Plan-based schedules are executed by this project's runtime: the backend changes nothing.
    plan = build_plan("tawpipe", num_ranks=P, num_groups=D, num_layers=L, num_microbatches=N)
    assert simulate(plan, gloo).iteration_time == pytest.approx(simulate(plan, nccl).iteration_time)


def test_simulate_backend_flag():
    def iteration_times(*extra):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "simulate.py"), "--schedule", "fsdp,hsdp",
                              "--ranks", "4", "--groups", "2", "--num-layers", "4", "--hidden-size", "256",
                              "--seq-length", "1024", "--num-microbatches", "2", "--vocab-size", "1000",
                              "--inter-bw", "100MB/s", "--json", *extra],
                             capture_output=True, text=True, check=True).stdout
        return {r["schedule"]: r["iteration_time_s"] for r in json.loads(out)}

    gloo, nccl = iteration_times("--backend", "gloo"), iteration_times()
    assert gloo["fsdp"] > nccl["fsdp"] and gloo["hsdp"] > nccl["hsdp"]


# ------------------------------------------------------------------ memory
def _check_sums(mem):
    assert mem["total"] == pytest.approx(sum(mem[t] for t in TERMS))
    assert all(mem[t] >= 0 for t in TERMS)


@pytest.mark.parametrize("recompute", [True, False])
def test_memory_breakdowns_add_up(recompute):
    c = small_cost(recompute=recompute)
    psi = total_params(c, L)
    for name in ("hsdp", "distopt-node", "distopt", "hfsdp", "pp-nodes"):
        r = run_strategy(name, c, P, D, L, N)
        mem = r.options["memory_breakdown"]
        _check_sums(mem)
        # the simulator's memory fields are the breakdown without the logits
        assert r.memory_bytes == pytest.approx(mem["total"] - mem["logits"])
    opt = lambda name: run_strategy(name, c, P, D, L, N).options["memory_breakdown"]  # noqa: E731
    assert opt("hsdp")["optimizer"] == pytest.approx(12 * psi / d)
    assert opt("hsdp")["grads"] == pytest.approx(4 * psi / d)
    assert opt("distopt")["optimizer"] == pytest.approx(12 * psi / P)
    assert opt("distopt-node")["optimizer"] == pytest.approx(12 * psi / d)
    assert opt("distopt")["grads"] == pytest.approx(4 * psi) and opt("distopt")["weights"] == 2 * psi
    hf = opt("hfsdp")       # Opt/(d D) + (Grad + Weight)/d
    assert (hf["optimizer"], hf["grads"], hf["weights"]) == pytest.approx((12 * psi / P, 4 * psi / d, 2 * psi / d))
    # activations: without recompute every layer keeps 34 B per token and hidden unit
    act = opt("distopt")["activations"]
    tokens = c.tokens_per_microbatch
    if recompute:
        assert act == pytest.approx(L * tokens * 256 * 2 + 34 * tokens * 256)
    else:
        assert act == pytest.approx(L * 34 * tokens * 256)
    assert opt("distopt")["logits"] == pytest.approx(6 * tokens * 1000)


@pytest.mark.parametrize("schedule,opts", [("tawpipe", {}), ("tawpipe", {"chunk": 2}),
                                           ("tawpipe", {"cache": False}), ("weipipe", {}),
                                           ("tawpipe", {"replicate_first": True})])
def test_weight_passing_breakdown_is_the_simulators_memory(schedule, opts):
    c = small_cost()
    plan = build_plan(schedule, num_ranks=P, num_groups=D, num_layers=L, num_microbatches=N, **opts)
    r = simulate(plan, c, record=False)
    mem = weight_passing_breakdown(r, c, plan, opts.get("chunk", 1)).as_dict()
    _check_sums(mem)
    assert mem["total"] - mem["logits"] == pytest.approx(r.memory_bytes)
    # the same fields without a simulation, from a plan with fewer micro-batches
    probe = build_plan(schedule, num_ranks=P, num_groups=D, num_layers=L,
                       num_microbatches=2 * opts.get("chunk", 1), **opts)
    fields = plan_memory_fields(probe, c)
    for name in ("weight_buffer_bytes", "grad_buffer_bytes", "activation_bytes", "state_bytes"):
        assert getattr(fields, name) == pytest.approx(getattr(r, name)), name


def test_pipeline_memory_first_stage_holds_p_microbatches():
    c = small_cost()
    mem = pipeline_memory(c, P, D, L, 16, pipeline_size=D)
    # 1F1B: stage 0 keeps D micro-batches' inputs of its L/D layers (recompute)
    assert D * (L // D) * c.activation_bytes < mem.activations <= \
        D * (L // D) * c.activation_bytes + c.layer_activation_bytes + 1


def test_parse_size():
    assert parse_size("80GB") == 80e9 and parse_size("80GiB") == 80 * 2 ** 30
    with pytest.raises(ValueError):
        parse_size("80 parsecs")


# ------------------------------------------------------------ extension
@pytest.mark.parametrize("bw", ["1GB/s", "100GB/s"])
def test_extended_simulation_matches_the_full_one(bw):
    c = small_cost(inter_bw=bw, seq_length=2048)
    build = lambda n: build_plan("tawpipe", num_ranks=P, num_groups=D, num_layers=L,  # noqa: E731
                                 num_microbatches=n)
    full = simulate(build(12), c, record=False)
    ext = simulate_extended(build, c, 12, 2, 4)
    assert ext.iteration_time == pytest.approx(full.iteration_time, rel=1e-9)
    assert ext.link_bytes == pytest.approx(full.link_bytes)
    assert ext.bubble_ratio == pytest.approx(full.bubble_ratio, abs=1e-9)
    exact = simulate_pipeline(c, P, D, L, 64, pipeline_size=4)
    approx = simulate_pipeline(c, P, D, L, 64, pipeline_size=4, exact=False)
    assert approx.options["extended_from"] == (8, 16)
    assert approx.iteration_time == pytest.approx(exact.iteration_time, rel=1e-9)


# ---------------------------------------------------------------- advisor
TINY = ModelSpec(num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8,
                 num_query_groups=4, vocab_size=1000, seq_length=2048)


def tiny_cluster(**kw):
    args = dict(ranks=8, nodes=2, intra_bw=100e9, inter_bw=1.25e9, peak_tflops=100, efficiency=0.5,
                gpu_memory=80e9, memory_reserve=0)
    args.update(kw)
    return Cluster(**args)


def test_enumeration_respects_divisibility():
    configs, na = enumerate_configs(TINY, tiny_cluster(), 16)
    for c in configs:
        mbs = 16 // c.micro_batch_size
        tp = c.knobs.get("tp", 1)
        virtual = 8 // tp    # T divides the 4 GPUs of a node and the 4 query groups: 1, 2 or 4
        assert tp in (1, 2, 4)
        if "pipeline_size" in c.knobs:
            p = c.knobs["pipeline_size"]
            assert p % 2 == 0 and virtual % p == 0 and mbs % (virtual // p) == 0
        else:
            assert mbs % virtual == 0
        if c.strategy in ("tawpipe", "weipipe"):
            assert 8 % virtual == 0   # layers over the virtual ranks
        if c.strategy == "tawpipe":
            assert (mbs // virtual) % c.knobs["chunk"] == 0
    assert {c.strategy for c in configs} >= {"tawpipe", "weipipe", "hsdp", "distopt", "distopt-node",
                                              "hfsdp", "fsdp", "pp-nodes", "1f1b", "interleaved"}
    for strategies in (("tawpipe",), ("distopt",), ("1f1b", "pp-nodes")):   # (T = 4: 2 virtual ranks, 1 per node)
        assert {c.knobs.get("tp", 1) for c in configs if c.strategy in strategies} == {1, 2, 4}
    # 6 layers on 8 GPUs: no weight pipeline of 8 shards (it says why and what fixes it); over 4 or 2
    # tensor-parallel groups the shards are uneven, and so are pipelines of 4 stages
    configs, na = enumerate_configs(ModelSpec(**{**vars(TINY), "num_layers": 6}), tiny_cluster(), 16)
    (short,) = [a for a in na if "tawpipe" in a.strategies and "< 8 GPUs" in a.reason]
    assert short.line() == "--num-layers 6 < 8 GPUs: one shard per rank needs a layer each; fix: tensor " \
        "parallelism T >= 2 (no more shards than layers), or fewer GPUs"
    assert not [c for c in configs if c.strategy in ("tawpipe", "weipipe") and "tp" not in c.knobs]
    assert {c.knobs["shard_layers"] for c in configs if c.strategy == "weipipe" and c.knobs.get("tp") == 2} == \
        {(2, 2, 1, 1)}
    assert {c.knobs.get("uneven", False) for c in configs if c.knobs.get("pipeline_size") == 4} == {True}


def test_tensor_parallel_configurations_run_over_virtual_ranks():
    """T = 2: the strategy over 4 virtual ranks of 2 GPUs; per GPU half the virtual rank's tokens/s and
    memory; the tensor-parallel collectives add to compute; the command carries the flags, and
    pretrain_llama.py accepts it for weight passing and megatron, refuses it for FSDP2."""
    from megatron_tawpipe.sim.advisor import Advisor
    from megatron_tawpipe.sim.advisor_configs import Config
    from megatron_tawpipe.sim.tensor_parallel import all_reduce_time, tensor_parallel_problem

    adv = Advisor(TINY, tiny_cluster(), 16, check_command=check_command)
    one = adv.evaluate(Config("weipipe", 1, True, {}))
    two = adv.evaluate(Config("weipipe", 1, True, {"tp": 2}))
    sub = adv.virtual(2)
    assert sub.cluster.ranks == 4 and sub.cluster.usable_memory == 2 * adv.cluster.usable_memory
    base, virtual = adv.cost(1, True), sub.cost(1, True)
    ar = all_reduce_time(base.intra, base.activation_bytes, 2)
    assert ar > 0 and virtual.layer_forward == pytest.approx(base.layer_forward / 2 + 2 * ar)
    assert virtual.intra.bandwidth == 2 * base.intra.bandwidth
    inner = sub.measure(Config("weipipe", 1, True, {}))
    assert two.tokens_per_sec_per_gpu == pytest.approx(inner.tokens_per_sec_per_gpu / 2)
    assert two.memory.total == pytest.approx(inner.memory.total / 2)
    assert two.memory.optimizer < one.memory.optimizer     # the replicated parts are sliced too
    assert two.memory.total == pytest.approx(adv.memory_only(Config("weipipe", 1, True, {"tp": 2})).total)
    assert "--tensor-model-parallel-size 2 --sequence-parallel" in two.command
    assert two.trainable and two.status == "ok"
    distopt = adv.evaluate(Config("distopt", 1, True, {"tp": 2}))
    assert distopt.trainable, distopt.note
    fsdp = adv.evaluate(Config("fsdp", 1, True, {"tp": 2}))
    assert not fsdp.trainable and "--use-torch-fsdp2" in fsdp.note
    assert tensor_parallel_problem(3, 4, 8, 4, 1408) == "T=3 does not divide the 4 GPUs of a node"
    assert "query groups" in tensor_parallel_problem(8, 8, 8, 4, 1408)


def test_sequence_parallel_backward_prices_three_collectives_per_layer():
    """--sequence-parallel (the advisor's commands with T > 1): per decoder layer 2 all-reduces' bytes of
    collectives in the forward, 3 in the backward (the column-parallel linears all-gather their input
    again for the weight gradient), 2 in a recompute; without it 2 all-reduces each way."""
    from megatron_tawpipe.sim.tensor_parallel import (all_reduce_time, collectives_per_layer,
                                                      tensor_parallel_bytes_per_gpu, virtual_rank_cost)

    assert collectives_per_layer(True) == {"forward": 2, "backward": 3, "recompute": 2}
    assert collectives_per_layer(False) == {"forward": 2, "backward": 2, "recompute": 2}
    c = small_cost()
    ar = all_reduce_time(c.intra, c.activation_bytes, 4)
    sp, plain = virtual_rank_cost(c, 4), virtual_rank_cost(c, 4, sequence_parallel=False)
    assert sp.layer_backward == pytest.approx(c.layer_backward / 4 + 3 * ar)
    assert plain.layer_backward == pytest.approx(c.layer_backward / 4 + 2 * ar)
    assert sp.layer_forward == plain.layer_forward == pytest.approx(c.layer_forward / 4 + 2 * ar)
    assert sp.layer_recompute == pytest.approx(c.layer_recompute / 4 + 2 * ar)
    per_collective = 2 * 3 / 4 * c.activation_bytes
    assert tensor_parallel_bytes_per_gpu(c, 4, L, N) == pytest.approx(N * (L * 7 + 2) * per_collective)
    assert tensor_parallel_bytes_per_gpu(c, 4, L, N, sequence_parallel=False) == \
        pytest.approx(N * (L * 6 + 2) * per_collective)
    # the advisor's virtual ranks (every strategy with T > 1) use the sequence-parallel count
    adv = Advisor(TINY, tiny_cluster(), 16)
    assert adv.virtual(2).cost(1, True) == virtual_rank_cost(adv.cost(1, True), 2)


@pytest.mark.parametrize("schedule", ["tawpipe", "weipipe"])
def test_weight_passing_inter_bytes_include_the_replicated_allreduce(schedule):
    """The embedding / output layer's gradient all-reduce crosses the node links too: the simulator's
    and the advisor's inter-node bytes count it, per node 2 (D-1)/D of the fp32 replicated gradients through
    the nodes (TawPipe's) or 2 (P-1)/P in a ring over every rank (WeiPipe's), and its ceiling from the node
    links counts them."""
    def node_share(ranks, nodes):
        return 2 * (nodes - 1) / nodes if schedule == "tawpipe" else 2 * (ranks - 1) / ranks

    from megatron_tawpipe.plan import link_bytes
    from megatron_tawpipe.sim.advisor_configs import Config

    c = small_cost()
    plan = build_plan(schedule, num_ranks=P, num_groups=D, num_layers=L, num_microbatches=N)
    ring = node_share(P, D) * c.replicated_params * 4
    plan_only = link_bytes(plan, c.shard_bytes(plan), c.activation_bytes, c.grad_shard_bytes(plan))["inter"]
    assert ring > 0 and simulate(plan, c).link_bytes["inter"] == pytest.approx(plan_only + D * ring)
    adv = Advisor(TINY, tiny_cluster(), 16)
    knobs = {"chunk": 1, "cache": True, "replicate_first": False} if schedule == "tawpipe" else {}
    cfg = adv.evaluate(Config(schedule, 1, True, dict(knobs)))
    cl, cost = adv.cluster, adv.cost(1, True)
    n = 16 // cl.ranks
    wp = build_plan(schedule, num_ranks=cl.ranks, num_groups=cl.nodes, num_layers=TINY.num_layers,
                    num_microbatches=n, **({"chunk": 1, "cache": True} if knobs else {}))
    ring = node_share(cl.ranks, cl.nodes) * cost.replicated_params * 4
    decoder = link_bytes(wp, cost.shard_bytes(wp), bytes_per_grad=cost.grad_shard_bytes(wp))["inter"] / cl.nodes
    assert cfg.inter_bytes_per_node == pytest.approx(decoder + ring)
    ceiling = TINY.seq_length * 16 / (cl.ranks * (decoder + ring) / cl.inter_bw)
    assert adv.comm_bound(Config(schedule, 1, True, dict(knobs))) == pytest.approx(ceiling)


def test_advisor_tries_weipipes_zero_bubble_variants():
    """WZB1 and WZB2 are WeiPipe knobs: ranked with their own simulated figures, WZB2 holding more memory,
    and their commands carry --weipipe-zero-bubble and pass the trainer's validation."""
    from megatron_tawpipe.arguments import parse_args

    cl = tiny_cluster()
    adv = Advisor(TINY, cl, 16, check_command=check_command)
    configs, _ = enumerate_configs(TINY, cl, 16)
    wei = {c.knobs.get("zero_bubble", 0): adv.evaluate(c) for c in configs
           if c.strategy == "weipipe" and c.micro_batch_size == 1 and c.recompute and c.knobs.get("tp", 1) == 1
           and not c.knobs.get("plan_schedule")}
    assert set(wei) == {0, 1, 2}
    assert wei[2].memory.activations > wei[1].memory.activations > wei[0].memory.activations
    for z, cfg in wei.items():
        assert cfg.trainable, cfg.note
        assert (f"--weipipe-zero-bubble {z}" in cfg.command) == (z > 0) and (f"wzb{z}" in cfg.label()) == (z > 0)
        args = parse_args(cfg.argv + ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer"])
        assert args.weipipe_zero_bubble == z
        assert cfg.tokens_per_sec_per_gpu <= adv.bound(cfg) * (1 + 1e-9)


def test_advisor_ranks_and_prunes_consistently():
    s = advise(TINY, tiny_cluster(), 16, check_command=check_command)
    ranked = s["ranked"]
    assert ranked and s["best"] == ranked[0]
    tps = [r["tokens_per_sec_per_gpu"] for r in ranked]
    assert all(a >= b - 0.1 for a, b in zip(tps, tps[1:]))
    for r in ranked:
        assert r["memory_bytes"] <= s["cluster"]["usable_memory_bytes"]
        assert r["tokens_per_sec_per_gpu"] <= r["compute_bound_tokens_per_sec_per_gpu"] * (1 + 1e-9)
    # pruning only skips what cannot change the answer
    top2 = advise(TINY, tiny_cluster(), 16, prune="top2", check_command=check_command)
    assert top2["best"]["tokens_per_sec_per_gpu"] == pytest.approx(s["best"]["tokens_per_sec_per_gpu"])


def test_advisor_refuses_what_does_not_fit_and_names_the_limit():
    model = ModelSpec(seq_length=8192, **PRESETS["70b"])
    s = advise(model, tiny_cluster(ranks=16, nodes=2, gpu_memory=40e9, memory_reserve=0), 16, check_command=check_command)
    assert s["best"] is None and s["ranked"] == []
    assert "nothing fits in 40.00 GB" in s["error"] and "dominated by" in s["error"]
    assert s["rejected"] and all("needs" in r["reason"] and "largest term" in r["reason"]
                                 for r in s["rejected"])


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("strategy", ["tawpipe", "1f1b", "pp-nodes", "weipipe", "hsdp", "distopt",
                                      "distopt-node", "fsdp", "interleaved"])
def test_commands_parse_with_the_projects_arguments(strategy, recompute):
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    cl = tiny_cluster()
    adv = Advisor(TINY, cl, 16, check_command=check_command)
    configs, _ = enumerate_configs(TINY, cl, 16)
    cfg = next(c for c in configs if c.strategy == strategy and c.recompute == recompute)
    adv.evaluate(cfg)
    assert cfg.command.startswith("torchrun --nnodes 2 --nproc-per-node 4 pretrain_llama.py ")
    args = parse_args(cfg.argv + ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer"])
    assert args.global_batch_size == 16 and args.micro_batch_size == cfg.micro_batch_size
    # every strategy but HFSDP runs here, FSDP2 and HSDP with full recompute included
    assert cfg.trainable, cfg.note
    validate_args(args, world_size=cl.ranks)
    if recompute:
        assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == \
            ("full", "uniform", 1) or strategy in ("tawpipe", "weipipe")
    if strategy in ("tawpipe", "weipipe"):   # the recompute it was priced with, pinned
        assert args.tawpipe_recompute == ("on" if recompute else "off") and args.tawpipe_no_recompute == (not recompute)


def test_replicated_first_shard_is_a_tawpipe_knob_with_its_memory_and_flag():
    """The advisor tries TawPipe with shard 0 in every group (two or more nodes): its state counts on
    the ranks holding two shards, and its command carries --tawpipe-replicate-first-shard."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    cl = tiny_cluster()
    adv = Advisor(TINY, cl, 16, check_command=check_command)
    configs, _ = enumerate_configs(TINY, cl, 16)
    pick = {c.knobs["replicate_first"]: c for c in configs if c.strategy == "tawpipe" and c.micro_batch_size == 1
            and c.recompute and c.knobs["chunk"] == 1 and c.knobs["cache"] and "tp" not in c.knobs
            and not c.knobs.get("plan_schedule")}
    for cfg in pick.values():
        adv.evaluate(cfg)
    plain, replicated = pick[False], pick[True]
    shard_params = TINY.num_layers // cl.ranks * CostModel.from_flops(
        hidden_size=512, seq_length=2048, micro_batch_size=1, ffn_hidden_size=1408, vocab_size=1000,
        num_attention_heads=8, num_query_groups=4).params_per_layer
    # fp32 master + Adam moments (12 B per parameter) of one more shard on its holders
    assert replicated.memory.optimizer - plain.memory.optimizer == pytest.approx(12 * shard_params, rel=1e-6)
    assert "--tawpipe-replicate-first-shard" in replicated.argv and "rep0" in replicated.label()
    assert "--tawpipe-replicate-first-shard" not in plain.argv
    validate_args(parse_args(replicated.argv + ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type",
                                                "NullTokenizer"]), world_size=cl.ranks)
    assert not [c for c in enumerate_configs(TINY, tiny_cluster(nodes=1), 16)[0] if c.knobs.get("replicate_first")]


def test_hfsdp_is_runnable_and_its_command_passes_the_checks():
    """HFSDP runs through megatron-core's Megatron-FSDP (--use-megatron-fsdp): the advisor's command is
    pretrain_llama.py's and passes its checks; a configuration it refuses (tensor parallelism) says why."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    cl = tiny_cluster()
    configs, _ = enumerate_configs(TINY, cl, 16)
    adv = Advisor(TINY, cl, 16, check_command=check_command)
    plain = adv.evaluate(next(c for c in configs if c.strategy == "hfsdp" and c.knobs.get("tp", 1) == 1))
    assert plain.trainable and "pretrain_llama.py" in plain.command and "--use-megatron-fsdp" in plain.argv
    assert plain.argv[plain.argv.index("--outer-dp-sharding-strategy") + 1] == "optim"
    validate_args(parse_args(plain.argv + ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer"]),
                  world_size=cl.ranks)
    tp = [c for c in configs if c.strategy == "hfsdp" and c.knobs.get("tp", 1) > 1]
    for cfg in (adv.evaluate(c) for c in tp[:1]):
        assert not cfg.trainable and "refuses it" in cfg.note and "tensor" in cfg.note


def run_simulate(*argv):
    """tools/simulate.py's main on ``argv`` in this process (megatron-core, which the advisor's command check
    imports, is loaded already; a new process spends seconds on it): ``(returncode, stdout, stderr)`` as a
    completed process has them. test_simulate_backend_flag runs the script as a process."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("simulate_tool", os.path.join(ROOT, "tools", "simulate.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = tool.main(list(argv))
        except SystemExit as exc:   # argparse's refusals
            status = exc.code
    return subprocess.CompletedProcess(["simulate.py", *argv], status, out.getvalue(), err.getvalue())


ADVISE = ["--advise", "--ranks", "8", "--ranks-per-node", "4", "--num-layers", "8", "--hidden-size",
          "512", "--ffn-hidden-size", "1408", "--num-attention-heads", "8", "--num-query-groups", "4",
          "--vocab-size", "1000", "--seq-length", "2048", "--global-batch-size", "16",
          "--inter-bw", "10Gbit/s", "--intra-bw", "100GB/s", "--peak-tflops", "100"]


def test_advise_json_and_table():
    out = run_simulate(*ADVISE, "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    for key in ("cluster", "model", "global_batch_sequences", "ranked", "rejected", "not_applicable",
                "absent", "reasons", "missing", "best", "evaluated", "pruned"):
        assert key in s, key
    best = s["best"]
    for key in ("strategy", "knobs", "tokens_per_sec_per_gpu", "memory_breakdown", "command",
                "iteration_time_s", "bubble_ratio", "inter_bytes_per_node"):
        assert key in best, key
    assert s["model"]["num_layers"] == 8 and s["cluster"]["nodes"] == 2
    text = run_simulate(*ADVISE, "--prune", "top2")
    assert text.returncode == 0, text.stderr
    assert "memory per GPU, #1" in text.stdout and "best:" in text.stdout and "torchrun" in text.stdout


def test_advise_error_when_nothing_fits():
    out = run_simulate(*ADVISE, "--gpu-memory", "0.01GB", "--memory-reserve", "0")
    assert out.returncode == 2
    assert "nothing fits in 0.01 GB" in out.stderr and "dominated by" in out.stderr


def test_model_preset_and_overrides():
    from megatron_tawpipe.cli.plan_args import advisor_inputs

    class A:
        pass
    args = A()
    for k, v in dict(model="70b", num_layers=16, hidden_size=4096, ffn_hidden_size=None,
                     num_attention_heads=None, num_query_groups=None, vocab_size=32000,
                     seq_length=4096, ranks=16, ranks_per_node=8, groups=2, intra_bw="450GB/s",
                     inter_bw="25Gbit/s", intra_latency="5us", inter_latency="20us", peak_tflops=989,
                     efficiency=0.4, gpu_memory="80GB", memory_reserve="5GB", global_batch_size=64,
                     micro_batch_size=1, num_microbatches=1).items():
        setattr(args, k, v)
    model, cluster, gbs = advisor_inputs(args, ["--model", "70b"])
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_query_groups) == \
        (80, 8192, 28672, 8)
    assert 68e9 < model.params < 70e9
    model, _, _ = advisor_inputs(args, ["--model", "70b", "--num-layers", "16"])
    assert model.num_layers == 16 and model.hidden_size == 8192
    assert cluster.nodes == 2 and gbs == 64


def test_simulate_lists_the_new_strategies():
    out = run_simulate("--schedule", "tawpipe,hsdp,distopt-node,distopt,hfsdp,pp-nodes,fsdp", "--json",
                       "--ranks", "8", "--groups", "2", "--num-layers", "8", "--hidden-size", "512",
                       "--seq-length", "2048", "--num-microbatches", "2")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["schedule"] for r in rows] == ["tawpipe", "hsdp", "distopt-node", "distopt", "hfsdp",
                                             "pp-nodes", "fsdp"]
    for r in rows:
        mem = r["options"]["memory_breakdown"]
        assert mem["total"] == pytest.approx(sum(mem[t] for t in TERMS))
        assert r["tokens_per_sec_per_rank"] > 0


def test_simulate_cli_models_tensor_parallel_weight_passing():
    """tools/simulate.py --tensor-model-parallel-size 2: the plan over half the ranks, per-GPU figures
    (half a virtual rank's tokens/s and memory), the same bytes between nodes as that plan; refused
    for schedules it does not model."""
    import json

    shape = ["--ranks", "8", "--groups", "2", "--num-layers", "8", "--hidden-size", "1024", "--seq-length", "4096",
             "--num-attention-heads", "8", "--num-microbatches", "4", "--json"]
    (tp2,) = json.loads(run_simulate("--schedule", "tawpipe", "--tensor-model-parallel-size", "2", *shape).stdout)
    virtual = shape.copy()
    virtual[1] = "4"
    (plain,) = json.loads(run_simulate("--schedule", "tawpipe", *virtual).stdout)
    assert tp2["options"]["tensor_model_parallel_size"] == 2
    assert tp2["inter_group_bytes"] == plain["inter_group_bytes"] > 0
    assert tp2["tokens_per_sec_per_rank"] > plain["tokens_per_sec_per_rank"] / 2   # 1/2 compute per GPU
    assert tp2["memory_bytes"] == pytest.approx(plain["memory_bytes"] / 2)   # every term sliced T ways
    assert tp2["options"]["tensor_parallel_bytes_per_gpu"] > 0
    refused = run_simulate("--schedule", "1f1b", "--tensor-model-parallel-size", "2", *shape)
    assert refused.returncode == 2 and "modelled for tawpipe/weipipe only" in refused.stderr


# ------------------------------------------------- layers that do not divide; why a strategy is absent
UNEVEN = ModelSpec(**{**vars(TINY), "num_layers": 10})     # 10 layers: no even split over 4 or 8


def _argv(command: str) -> list:
    """pretrain_llama.py's arguments in a printed command (after torchrun and its two options)."""
    import shlex

    words = shlex.split(command.split("   # ")[0])
    return words[words.index("pretrain_llama.py") + 1:]


def test_uneven_layers_offer_weight_passing_and_pipelines_with_their_flags(tmp_path):
    """10 layers on 8 GPUs: TawPipe and WeiPipe run 8 uneven shards (the default split, no flag; shard 0
    replicated: the smaller size first, --decoder-first-pipeline-num-layers), megatron pipelines of 4 and 8
    stages uneven stages (megatron-core's first/last-stage flags, or a layout); every printed command is
    accepted by pretrain_llama.py and asks it for exactly the split the advisor priced."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    s = advise(UNEVEN, tiny_cluster(), 16, check_command=check_command, listed=10 ** 6)   # every row checked
    assert {"tawpipe", "weipipe", "1f1b", "interleaved"} <= {r["strategy"] for r in s["ranked"]}
    seen = set()
    for r in s["ranked"]:
        assert r["tokens_per_sec_per_gpu"] <= r["compute_bound_tokens_per_sec_per_gpu"] * (1 + 1e-9)
        k = r["knobs"]
        split = k.get("shard_layers") or k.get("stage_layers")
        if not split or not r["trainable"]:
            continue
        seen.add((r["strategy"], k.get("tp", 1), bool(k.get("replicate_first"))))
        assert "[" in r["label"] and sum(split) == 10
        argv = _argv(r["command"].split(" && ")[-1])
        if k.get("plan_schedule"):    # its plan file, built as the command's first part says, with the split
            assert f"--shard-layers {','.join(map(str, split))}" in r["command"]
            virtual = 8 // k.get("tp", 1)
            plan = build_plan(k["plan_schedule"], num_ranks=virtual, num_groups=2, num_layers=10,
                              num_microbatches=16 // k["micro_batch_size"] // virtual, shard_layers=split,
                              **({"chunk": k["chunk"], "cache": k["cache"],
                                  "replicate_first": k["replicate_first"]} if r["strategy"] == "tawpipe" else {}))
            write_plan(plan, str(tmp_path / "plan.json"))
            argv = [f"plan:{tmp_path / 'plan.json'}" if a == "plan:plan.json" else a for a in argv]
        for flag in k.get("split_flags", []):
            assert flag in argv
        if k.get("auto_layout"):   # no layout flag: the run decides this layout, and with it cuts the layers so
            assert "--tawpipe-shards-per-rank" not in argv
            argv = argv + ["--tawpipe-shards-per-rank", str(k.get("shards_per_rank", 1))]
        args = validate_args(parse_args(argv + ["--train-iters", "1", "--lr", "1e-4", "--tokenizer-type",
                                                "NullTokenizer"]), world_size=8)
        assert tuple(args.decoder_layer_split) == tuple(split), r["label"]
    assert {("tawpipe", 1, False), ("tawpipe", 1, True), ("weipipe", 1, False), ("1f1b", 1, False)} <= seen
    taw = next(r for r in s["ranked"] if r["strategy"] == "tawpipe" and r["knobs"].get("tp", 1) == 1
               and not r["knobs"]["replicate_first"])
    assert tuple(taw["knobs"]["shard_layers"]) == (2, 2, 1, 1, 1, 1, 1, 1) and not taw["knobs"]["split_flags"]
    rep = next(r for r in s["ranked"] if r["strategy"] == "tawpipe" and r["knobs"].get("tp", 1) == 1
               and r["knobs"]["replicate_first"])
    assert tuple(rep["knobs"]["shard_layers"])[0] == 1
    assert "--decoder-first-pipeline-num-layers 1" in rep["command"]


def test_uneven_pipelines_are_priced_by_their_largest_stage():
    """A pipeline's stages are priced each with its own layers: the first stage of (4, 2, 2, 2) holds 4
    layers' state and activations, and the pipeline runs at its pace (slower than the balanced split)."""
    c = small_cost(inter_bw="1TB/s", intra_bw="1TB/s")     # compute sets the pace
    L10 = 10
    balanced = simulate_pipeline(c, P, D, L10, 32, pipeline_size=4, stage_layers=(3, 3, 2, 2))
    heavy = simulate_pipeline(c, P, D, L10, 32, pipeline_size=4, stage_layers=(4, 2, 2, 2))
    assert heavy.iteration_time > balanced.iteration_time
    assert heavy.options["stage_layers"] == [4, 2, 2, 2]
    assert simulate_pipeline(c, P, D, L10, 32, pipeline_size=4).options["stage_layers"] == [3, 3, 2, 2]
    mem = pipeline_memory(c, P, D, L10, 32, pipeline_size=4, stage_layers=(4, 2, 2, 2))
    assert "(stage 0)" in mem.notes["weights"]
    assert mem.weights == pytest.approx(2 * (4 * c.params_per_layer + c.embedding_params))
    assert mem.activations == pytest.approx(4 * 4 * c.activation_bytes + c.layer_activation_bytes)
    with pytest.raises(ValueError, match="hold 9 layers, not 10"):
        simulate_pipeline(c, P, D, L10, 32, pipeline_size=4, stage_layers=(3, 2, 2, 2))


def test_absent_strategies_and_knobs_say_why_and_what_fixes_it():
    """One layer on one node of 8 GPUs, 12 sequences: no weight pipeline (fewer layers than shards at every
    tensor-parallel size), no pipeline (a stage needs a layer), nothing across nodes, T=8 does not divide
    the query groups, and 12 micro-batches do not split over 8 data-parallel GPUs; each absent strategy is
    listed with its reasons and a fix, in the JSON and in the text."""
    from megatron_tawpipe.sim.advisor_report import format_report

    one_layer = ModelSpec(**{**vars(TINY), "num_layers": 1})
    s = advise(one_layer, tiny_cluster(nodes=1), 12, check_command=check_command)
    assert {r["strategy"] for r in s["ranked"]} == {"distopt", "fsdp"}
    missing = s["missing"]
    assert set(missing) == {"distopt-node", "hsdp", "hfsdp", "pp-nodes", "1f1b", "interleaved", "tawpipe",
                            "weipipe"}
    assert "one node: nothing to split across nodes; fix: they are distopt, fsdp and 1f1b on one node" \
        in missing["hsdp"]
    assert missing["tawpipe"][0] == "--num-layers 1 < 8 GPUs: one shard per rank needs a layer each; fix: tensor " \
        "parallelism T >= 8 (no more shards than layers), or fewer GPUs"
    assert any("T=2: --num-layers 1 < 4 tensor-parallel groups of 2 GPUs" in x for x in missing["weipipe"])
    assert "pp=2, T=2 pp=2, T=4 pp=2: --num-layers 1 < 2 stages: a stage needs a layer; fix: a smaller pipeline " \
        "size" in missing["1f1b"]      # one line for every knob it concerns
    assert any("T=8: T=8 does not divide the 4 query groups" in x for x in s["reasons"]["distopt"])
    assert any("b=1: 12 micro-batches of 1 do not split over 8 GPUs (data parallel); fix: --global-batch-size a "
               "multiple of 8" in x for x in s["reasons"]["fsdp"])
    assert all(a["fix"] for a in s["absent"]) and all(s["missing"].values())
    text = format_report(s)
    assert "absent from the ranking, and why (fix after ';'):" in text
    assert "  tawpipe:\n    --num-layers 1 < 8 GPUs" in text and "pp=1" not in text
    assert "not tried, and why (fix after ';'):" in text and "  all strategies:" in text


def test_nothing_fits_and_left_out_strategies_say_why():
    model = ModelSpec(seq_length=8192, **PRESETS["70b"])
    s = advise(model, tiny_cluster(ranks=16, nodes=2, gpu_memory=40e9, memory_reserve=0), 16,
               check_command=check_command)
    assert all(r["fix"] and "more per GPU" in r["fix"] for r in s["rejected"])
    for strategy in s["missing"]:
        assert any("nothing fits" in x or "< " in x for x in s["missing"][strategy]), strategy
    left_out = advise(TINY, tiny_cluster(), 16, trainable_only=True, check_command=check_command)
    assert "hfsdp" in {r["strategy"] for r in left_out["ranked"]}   # runnable: not left out


def _weipipe_family_best(cluster, model, global_batch):
    """The advisor's best WeiPipe configuration (b=1, no recompute, no tensor or context parallelism) and, from
    the simulator directly, every variant's tokens/s per GPU."""
    keep = lambda c: c.strategy == "weipipe" and c.knobs.get("tp", 1) == 1 and c.knobs.get("cp", 1) == 1 \
        and c.micro_batch_size == 1 and not c.recompute  # noqa: E731
    s = advise(model, cluster, global_batch, check_command=check_command, keep=keep)
    adv = Advisor(model, cluster, global_batch)
    cost = adv.cost(1, False)
    N = global_batch // cluster.ranks
    variants = {"weipipe": {}, "weipipe-zb1": {}, "weipipe-zb2": {}, "weipipe-interleave-zb": {},
                "weipipe-zb1-paired": {}}
    simulated = {}
    for name in variants:
        plan = build_plan(name, num_ranks=cluster.ranks, num_groups=cluster.nodes, num_layers=model.num_layers,
                          num_microbatches=N)
        simulated[name] = simulate(plan, cost, record=False).tokens_per_sec_per_rank
    return s["best"], simulated


def test_advisor_offers_a_split_backward_schedule_where_the_simulator_says_it_wins():
    """The split-backward schedules run from a plan file (weipipe-interleave-zb, weipipe-zb1-paired,
    tawpipe-zb) are knobs of their strategy, priced by their own simulations: the advisor picks WZB1's paired
    layout where it is the fastest WeiPipe (one node, fast links, 4 micro-batches per rank, no recompute: its
    turns of two passes are even) and not where it is slower (two nodes at 1.25 GB/s); its command builds
    the plan and runs it."""
    model = ModelSpec(num_layers=16, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8,
                      num_query_groups=8, vocab_size=1000, seq_length=8192)
    fast = tiny_cluster(nodes=1, intra_bw=1e13)
    best, simulated = _weipipe_family_best(fast, model, 32)
    assert max(simulated, key=simulated.get) == "weipipe-zb1-paired"
    assert best["knobs"].get("plan_schedule") == "weipipe-zb1-paired" and best["trainable"]
    assert best["tokens_per_sec_per_gpu"] == pytest.approx(simulated["weipipe-zb1-paired"])
    assert best["command"].startswith("python tools/plan.py build --schedule weipipe-zb1-paired --ranks 8 "
                                      "--groups 1 --num-layers 16 --num-microbatches 4 --out plan.json && torchrun")
    assert "--pipeline-schedule plan:plan.json" in best["command"]
    slow = tiny_cluster()
    best, simulated = _weipipe_family_best(slow, model, 32)
    assert simulated["weipipe-zb1-paired"] < max(simulated.values())
    assert best["knobs"].get("plan_schedule") != "weipipe-zb1-paired"
    assert best["tokens_per_sec_per_gpu"] == pytest.approx(max(simulated.values()))
