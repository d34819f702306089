"""Context parallelism in the simulator and the advisor (megatron_tawpipe/sim/context_parallel.py): C = 1 changes
nothing; a GPU's compute falls to 1/C plus the ring's exposed time, which grows on a slow link; activations and
logits per GPU fall to 1/C while weights and gradients stay whole; the advisor tries C only for the native
strategies, says why an impossible C is absent, and finds what fits at a long sequence."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_tawpipe.sim.advisor import PLAN_BASED, Advisor, advise
from megatron_tawpipe.sim.advisor_configs import Cluster, Config, ModelSpec, enumerate_configs
from megatron_tawpipe.sim.advisor_report import searched_lines
from megatron_tawpipe.sim.context_parallel import (ACCUMULATOR_BYTES, CONTEXT_PARALLEL_STRATEGIES, AttentionShape,
                                                   attention_share, context_parallel_bytes_per_gpu,
                                                   context_parallel_cost, context_parallel_problem,
                                                   context_parallel_ring_seconds_per_gpu,
                                                   per_gpu_breakdown, ring_attention_exposed)
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.memory import TERMS, MemoryBreakdown
from megatron_tawpipe.sim.pipelines import simulate_pipeline
from megatron_tawpipe.sim.strategies import simulate_distopt
from megatron_tawpipe.sim.tensor_parallel import per_gpu_breakdown as tensor_parallel_breakdown
from megatron_tawpipe.sim.tensor_parallel import virtual_rank_cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(hidden_size=1024, seq_length=32768, ffn_hidden_size=2816, num_attention_heads=8, num_query_groups=4)


def cost(**kw):
    args = dict(SHAPE, vocab_size=1000, peak_tflops=400, efficiency=0.5, intra_bw="200GB/s", inter_bw="10GB/s")
    args.update(kw)
    return CostModel.from_flops(**args)


def shape(**kw):
    args = dict(SHAPE, micro_batch_size=1)
    args.update(kw)
    return AttentionShape(**args)


# ------------------------------------------------------------------------------------------ the cost model
def test_context_parallel_of_one_changes_nothing():
    c = cost()
    for tp in (1, 2, 4):
        assert context_parallel_cost(c, 1, shape(), tp) == virtual_rank_cost(c, tp)
    assert ring_attention_exposed(c, shape(), 1).backward == 0.0
    assert context_parallel_bytes_per_gpu(c, shape(), 1, 1, 8, 4) == 0.0
    plain = simulate_distopt(c, 8, 2, 8, 4)
    assert simulate_distopt(c, 8, 2, 8, 4, context_parallel=1) == plain
    assert simulate_distopt(c, 8, 2, 8, 4, instances=2, context_parallel=1) == simulate_distopt(c, 8, 2, 8, 4, 2)
    assert simulate_pipeline(c, 8, 2, 8, 16, 4, context_parallel=1) == simulate_pipeline(c, 8, 2, 8, 16, 4)
    m = MemoryBreakdown.from_dict(plain.options["memory_breakdown"])
    assert per_gpu_breakdown(m, 2, 1) == tensor_parallel_breakdown(m, 2)


def test_attention_share_is_the_flop_models():
    """The split of a layer's FLOPs into score blocks and linear layers is the one from_flops prices: doubling the
    sequence doubles the score FLOPs per token, and the two shares rebuild the layer's forward time."""
    s = shape()
    share = attention_share(s)
    assert 0.0 < share < 1.0
    long = cost(seq_length=65536)
    per_token = lambda c: c.layer_forward / c.tokens_per_microbatch  # noqa: E731
    linear = (1 - share) * per_token(cost())
    assert per_token(long) == pytest.approx(linear + 2 * share * per_token(cost()))
    assert attention_share(shape(seq_length=65536)) > share


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_compute_per_gpu_is_a_cth_plus_the_exposed_ring(cp):
    c = cost()
    s = shape()
    v = context_parallel_cost(c, cp, s)
    ring = ring_attention_exposed(c, s, cp)
    assert v.layer_forward == pytest.approx(c.layer_forward / cp + ring.forward)
    assert v.layer_backward == pytest.approx(c.layer_backward / cp + ring.backward)
    assert v.layer_recompute == pytest.approx(c.layer_recompute / cp + ring.recompute)
    assert v.head_forward == pytest.approx(c.head_forward / cp)
    # on 200 GB/s the keys and values hide behind the blocks: the forward shows the messages' latency only
    assert ring.forward == pytest.approx((cp - 1) * c.intra.latency)
    # ... and the backward its last gradient accumulator besides
    last = s.kv_bytes(cp, 1, ACCUMULATOR_BYTES) / c.intra.bandwidth
    assert ring.backward >= last and v.layer_backward < 1.05 * c.layer_backward / cp
    # a slow link: the transfers outlast the blocks, and the exposed time grows as the link slows
    slow, slower = c.with_links(intra=Link(2e9, 5e-6)), c.with_links(intra=Link(0.5e9, 5e-6))
    r_slow, r_slower = ring_attention_exposed(slow, s, cp), ring_attention_exposed(slower, s, cp)
    assert r_slower.forward > r_slow.forward > ring.forward
    assert r_slower.backward > r_slow.backward > ring.backward
    assert context_parallel_cost(slower, cp, s).layer_forward > context_parallel_cost(slow, cp, s).layer_forward
    # the message bytes do not depend on the link
    assert r_slow.forward_bytes == ring.forward_bytes == (cp - 1) * s.kv_bytes(cp)


def test_exposed_ring_of_two_by_hand():
    """C = 2 on a slow link, step by step: the forward's one key/value message beside the first step's blocks,
    the backward's key/value message beside the first step, the first gradient accumulator beside the second,
    and the second accumulator after it."""
    link = Link(1e9, 1e-5)
    c = cost().with_links(intra=link)
    s = shape()
    share = attention_share(s)
    kv = 2 * 32768 / 2 * 1 * 512 * 2          # keys and values of the local tokens, 512 kv channels, bf16
    dkv = kv * 2                               # the fp32 accumulator
    block = share / 2 / 4                      # one block's share of a layer (2C = 4 blocks per rank)
    step_f, step_b = 2 * block * c.layer_forward, 2 * block * c.layer_backward
    fwd = max(0.0, kv / link.bandwidth - step_f) + link.latency
    bwd = (max(0.0, kv / link.bandwidth - step_b) + link.latency
           + max(0.0, dkv / link.bandwidth - step_b) + link.latency
           + dkv / link.bandwidth + link.latency)
    r = ring_attention_exposed(c, s, 2)
    assert r.forward == pytest.approx(fwd) and r.backward == pytest.approx(bwd)
    assert r.forward > link.latency                                  # the link is slow enough to show
    assert (r.forward_bytes, r.backward_bytes) == (kv, kv + 2 * dkv)
    recompute = 2 * r.forward_bytes + r.backward_bytes
    assert context_parallel_bytes_per_gpu(c, s, 2, 1, layers=8, microbatches=3) == pytest.approx(24 * recompute)
    assert context_parallel_bytes_per_gpu(cost(recompute=False), s, 2, 1, 8, 3) == \
        pytest.approx(24 * (r.forward_bytes + r.backward_bytes))
    # the ring's exposed seconds per GPU and iteration: every layer and micro-batch, the recompute's ring too
    assert context_parallel_ring_seconds_per_gpu(c, s, 2, 1, layers=8, microbatches=3) == \
        pytest.approx(24 * (r.forward + r.backward + r.recompute))
    assert r.recompute > 0                                           # c recomputes: the forward's ring again
    assert context_parallel_ring_seconds_per_gpu(c, s, 1, 1, 8, 3) == 0.0
    # tensor parallelism splits the key/value heads: 1/T of every message
    assert ring_attention_exposed(c, s, 2, tp=2).forward_bytes == pytest.approx(kv / 2)


def test_sdpa_diagonal_blocks_cost_more():
    """The project's ring attention computes its diagonal blocks in full: (2C+1)/(2C) of the score work."""
    c, s = cost(intra_bw="100TB/s", intra_latency="0us"), shape()
    share = attention_share(s)
    for cp in (2, 4):
        full = context_parallel_cost(c, cp, s, full_diagonal=True).layer_forward
        assert full == pytest.approx(c.layer_forward / cp * (1 - share + share * (2 * cp + 1) / (2 * cp)), rel=1e-6)


# ------------------------------------------------------------------------------------------- memory
TINY = ModelSpec(num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_query_groups=4,
                 vocab_size=1000, seq_length=16384)


def tiny_cluster(**kw):
    args = dict(ranks=8, nodes=2, intra_bw=100e9, inter_bw=1.25e9, peak_tflops=100, efficiency=0.5,
                gpu_memory=80e9, memory_reserve=0)
    args.update(kw)
    return Cluster(**args)


@pytest.mark.parametrize("strategy, knobs", [("distopt", {}), ("distopt-node", {}), ("pp-nodes", {"pipeline_size": 2}),
                                             ("1f1b", {"pipeline_size": 4})])
def test_activations_per_gpu_are_a_cth_and_the_weights_whole(strategy, knobs):
    """Per GPU at the same micro-batch: activations and logits / C, weights and gradients as without context
    parallelism, the optimizer state sharded over the data x context-parallel GPUs (the same GPUs as without
    it: the same share)."""
    adv = Advisor(TINY, tiny_cluster(ranks=16), 32)       # nodes of 8
    one = adv.evaluate(Config(strategy, 1, True, dict(knobs)))
    for cp in (2, 4):
        many = adv.evaluate(Config(strategy, 1, True, dict(knobs, cp=cp)))
        assert many.memory.activations == pytest.approx(one.memory.activations / cp)
        assert many.memory.logits == pytest.approx(one.memory.logits / cp)
        assert many.memory.comm_buffers == pytest.approx(one.memory.comm_buffers / cp)
        assert many.memory.weights == pytest.approx(one.memory.weights)
        assert many.memory.grads == pytest.approx(one.memory.grads)
        assert many.memory.optimizer == pytest.approx(one.memory.optimizer)
        if strategy in PLAN_BASED:     # the memory the advisor checks before simulating is the simulation's
            probe = adv.memory_only(Config(strategy, 1, True, dict(knobs, cp=cp)))
            assert many.memory.total == pytest.approx(probe.total)
        assert many.context_parallel_bytes_per_gpu > 0
        assert f"--context-parallel-size {cp}" in many.command and f"cp={cp}" in many.label()
        assert many.row()["context_parallel_bytes_per_gpu"] == many.context_parallel_bytes_per_gpu
    with_tp = adv.evaluate(Config(strategy, 1, True, dict(knobs, tp=2, cp=2)))
    assert with_tp.memory.weights == pytest.approx(one.memory.weights / 2)          # T slices, C does not
    assert with_tp.memory.activations == pytest.approx(one.memory.activations / 4)
    assert "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2" in with_tp.command


def test_context_parallel_commands_pass_the_trainers_check():
    from megatron_tawpipe.cli.plan_args import check_command

    adv = Advisor(TINY, tiny_cluster(), 32, check_command=check_command)
    for strategy, knobs in (("distopt", {"cp": 2}), ("distopt-node", {"cp": 4}), ("pp-nodes", {"pipeline_size": 2,
                            "cp": 2, "tp": 2}), ("interleaved", {"pipeline_size": 2, "virtual_stages": 2, "cp": 2})):
        cfg = adv.evaluate(Config(strategy, 1, True, dict(knobs)))
        assert cfg.status == "ok" and cfg.trainable, (cfg.label(), cfg.note)


def test_tokens_per_gpu_follow_the_virtual_rank():
    """Per GPU: 1/C of the virtual rank's tokens/s; with fast links and a long sequence C GPUs on a micro-batch
    run as fast per GPU as one GPU on it, less the ring."""
    adv = Advisor(TINY, tiny_cluster(intra_bw=1e14), 32)
    one = adv.evaluate(Config("distopt", 1, True, {}))
    two = adv.evaluate(Config("distopt", 1, True, {"cp": 2}))
    inner = adv.virtual(1, 2).measure(Config("distopt", 1, True, {}))
    assert two.tokens_per_sec_per_gpu == pytest.approx(inner.tokens_per_sec_per_gpu / 2)
    assert two.tokens_per_sec_per_gpu == pytest.approx(one.tokens_per_sec_per_gpu, rel=0.02)
    slow = Advisor(TINY, tiny_cluster(intra_bw=1e9), 32)
    assert slow.evaluate(Config("distopt", 1, True, {"cp": 2})).tokens_per_sec_per_gpu < \
        0.9 * slow.evaluate(Config("distopt", 1, True, {})).tokens_per_sec_per_gpu


def test_gradient_rings_count_the_context_parallel_gpus():
    """The data-parallel reduction runs over the data x context-parallel GPUs: one virtual rank of 4 GPUs in a
    node still reduce-scatters its gradients over 4 (no data parallelism between virtual ranks)."""
    c = cost()
    alone = simulate_distopt(c, 1, 1, 8, 4)
    ring = simulate_distopt(c, 1, 1, 8, 4, context_parallel=4)
    assert alone.options["exposed_comm_s"] == 0.0 and ring.options["exposed_comm_s"] > 0.0
    assert ring.link_bytes["intra"] > 0.0


# ------------------------------------------------------------------------------------------- the advisor
def test_context_parallel_is_tried_for_the_native_strategies_and_weight_passing():
    model = replace(TINY, seq_length=8192)
    configs, absent = enumerate_configs(model, tiny_cluster(), 32)
    cp = [c for c in configs if c.knobs.get("cp", 1) > 1]
    assert {c.strategy for c in cp} == set(CONTEXT_PARALLEL_STRATEGIES) | {"tawpipe", "weipipe"}
    assert {c.knobs["cp"] for c in cp} == {2, 4}                       # 4 GPUs per node
    assert all(c.knobs.get("tp", 1) * c.knobs["cp"] <= 4 for c in cp)
    # weight passing: at every T x C the native strategies are tried at (T = 2 beside C = 2 too), one owner per
    # shard, no plan file (what the simulator prices)
    wp = [c for c in cp if c.strategy in ("tawpipe", "weipipe")]
    assert all(c.knobs.get("ownership") != "spread" and not c.knobs.get("plan_schedule") for c in wp)
    sizes = lambda cs: {(c.knobs.get("tp", 1), c.knobs["cp"]) for c in cs}   # noqa: E731
    assert sizes(wp) == sizes(c for c in cp if c.strategy in CONTEXT_PARALLEL_STRATEGIES) and (2, 2) in sizes(wp)
    (others,) = [a for a in absent if a.what == "C>1"]
    assert set(others.strategies) == {"fsdp", "hsdp", "hfsdp"}
    # C = 8 does not divide a node of 4: absent, with the reason
    (eight,) = [a for a in absent if a.what == "C=8"]
    assert "does not divide the 4 GPUs of a node" in eight.reason and set(eight.strategies) == \
        set(CONTEXT_PARALLEL_STRATEGIES)
    assert context_parallel_problem(3, 1, 8, 8192, 16) == \
        "C=3 does not divide the 8 GPUs of a node (a context-parallel ring stays in a node)"
    assert "divisible by 8" in context_parallel_problem(4, 1, 8, 8196, 16)
    assert "T x C = 4 x 4" in context_parallel_problem(4, 4, 8, 8192, 16)
    # short sequences: too few tokens per rank to try
    short, absent = enumerate_configs(replace(TINY, seq_length=2048), tiny_cluster(), 32)
    assert not [c for c in short if "cp" in c.knobs]
    assert any(a.what.startswith("C=2") and "tokens per rank" in a.reason for a in absent)


def _native_min_memory(adv, configs):
    """The least memory per GPU among ``configs`` (micro-batch 1: memory grows with it)."""
    out = float("inf")
    for c in configs:
        if c.micro_batch_size != 1:
            continue
        m = adv.memory_only(c) if c.strategy in PLAN_BASED else adv.evaluate(c).memory
        out = min(out, m.total)
    return out


def test_long_sequences_fit_with_context_parallelism_where_nothing_native_fits_without():
    """128k tokens on nodes of 8 GPUs, a model of two key/value heads (tensor parallelism up to T = 2 only): the
    least memory per GPU of a native configuration with context parallelism (T x C up to 8) is below that of
    any without it (T <= 2). With GPU memory between the two the advisor ranks context-parallel configurations
    and no native one of C = 1, the weight pipelines only with context parallelism too, and FSDP never with it."""
    model = ModelSpec(num_layers=8, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8, num_query_groups=2,
                      vocab_size=1000, seq_length=131072)
    big = Cluster(ranks=16, nodes=2, intra_bw=450e9, inter_bw=1.25e9, peak_tflops=989, efficiency=0.4,
                  gpu_memory=1e12, memory_reserve=0)
    G = 16
    configs, _ = enumerate_configs(model, big, G)
    adv = Advisor(model, big, G)
    native = [c for c in configs if c.strategy in CONTEXT_PARALLEL_STRATEGIES]
    plain = _native_min_memory(adv, [c for c in native if c.knobs.get("cp", 1) == 1])
    split = _native_min_memory(adv, [c for c in native if c.knobs.get("cp", 1) > 1])
    assert split < plain              # what the model derives: context parallelism needs less per GPU
    cl = replace(big, gpu_memory=(plain + split) / 2)
    s = advise(model, cl, G)
    ranked = s["ranked"]
    native_ranked = [r for r in ranked if r["strategy"] in CONTEXT_PARALLEL_STRATEGIES]
    assert native_ranked and all(r["knobs"].get("cp", 1) > 1 for r in native_ranked)
    assert all(r["knobs"].get("cp", 1) > 1 for r in ranked if r["strategy"] in ("tawpipe", "weipipe"))
    assert all(r["knobs"].get("cp", 1) == 1 for r in ranked
               if r["strategy"] not in CONTEXT_PARALLEL_STRATEGIES + ("tawpipe", "weipipe"))
    assert all(r["memory_bytes"] <= cl.usable_memory for r in ranked)
    assert "--context-parallel-size" in native_ranked[0]["command"]
    assert s["searched"]["distopt"]["context_parallel"] == [1, 2, 4, 8]
    assert "T=1, 2, C=1, 2, 4, 8" in "\n".join(searched_lines(s["searched"]))


# ------------------------------------------------------------------------------------------- the command line
def run_simulate(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "simulate.py"), *args], capture_output=True,
                          text=True, cwd=ROOT)


SIM = ["--ranks", "8", "--groups", "2", "--num-layers", "8", "--hidden-size", "1024", "--seq-length", "16384",
       "--num-attention-heads", "8", "--num-microbatches", "2", "--json"]


def test_simulate_prices_one_context_parallel_configuration():
    out = run_simulate("--schedule", "distopt,pp-nodes,1f1b", "--context-parallel-size", "1", *SIM)
    plain = run_simulate("--schedule", "distopt,pp-nodes,1f1b", *SIM)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == json.loads(plain.stdout)          # C = 1: as without the flag
    two = run_simulate("--schedule", "distopt,1f1b", "--context-parallel-size", "2", *SIM)
    assert two.returncode == 0, two.stderr
    rows = {r["schedule"]: r for r in json.loads(two.stdout)}
    one = {r["schedule"]: r for r in json.loads(plain.stdout)}
    for r in rows.values():
        assert r["options"]["context_parallel_size"] == 2
        assert r["options"]["context_parallel_bytes_per_gpu"] > 0
        assert r["options"]["context_parallel_ring_seconds_per_gpu"] > 0
        mem = r["options"]["memory_breakdown"]
        assert mem["total"] == pytest.approx(sum(mem[t] for t in TERMS))
    # distopt: the same GPUs share the optimizer; activations halve; the weights stay whole
    d1, d2 = one["distopt"]["options"]["memory_breakdown"], rows["distopt"]["options"]["memory_breakdown"]
    assert d2["activations"] == pytest.approx(d1["activations"] / 2) and d2["weights"] == d1["weights"]
    assert d2["optimizer"] == pytest.approx(d1["optimizer"])
    for bad, message in ((["--schedule", "tawpipe", "--context-parallel-size", "2", "--tawpipe-ownership", "spread"],
                          "neither runs with context parallelism"),
                         (["--schedule", "tawpipe", "--context-parallel-size", "2", "--tawpipe-replicated-reduce",
                           "sharded"], "neither runs with context parallelism"),
                         (["--schedule", "fsdp", "--context-parallel-size", "2"], "not fsdp"),
                         (["--schedule", "distopt", "--context-parallel-size", "8"], "does not divide the 4 GPUs")):
        refused = run_simulate(*bad, *SIM)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
