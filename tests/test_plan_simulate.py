"""Simulator and cost model: closed forms, byte counts, link sharing."""

import json
import math
from dataclasses import replace

import pytest

from megatron_tawpipe.plan import Plan, build_plan, link_bytes, replicated_allreduce_bytes
from megatron_tawpipe.sim import CostModel, Link, params_per_layer, parse_rate, parse_time, simulate
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.sim.fsdp import simulate_fsdp

# Equal stage times, free communication, no head/optimizer/copy costs.
FREE = CostModel(layer_forward=1.0, layer_backward=2.0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("N", [1, 2, 5, 8])
def test_pipeline_bubble_closed_form(schedule, P, N):
    for lps in (1, 2):
        plan = build_plan(schedule, num_ranks=P, num_layers=lps * P, num_microbatches=N)
        r = simulate(plan, FREE)
        assert r.bubble_ratio == pytest.approx((P - 1) / (N + P - 1), abs=1e-12)
        assert r.iteration_time == pytest.approx((N + P - 1) * 3.0 * lps)


@pytest.mark.parametrize("P,V", [(2, 2), (4, 2), (4, 3)])
def test_interleaved_bubble_closed_form(P, V):
    for N in (P, 2 * P, 3 * P):
        plan = build_plan("interleaved", num_ranks=P, num_layers=P * V, num_microbatches=N,
                          virtual_stages=V)
        assert simulate(plan, FREE).bubble_ratio == pytest.approx((P - 1) / (V * N + P - 1))


@pytest.mark.parametrize("P", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("N", [1, 2, 3, 6])
def test_weipipe_bubble_equals_1f1b_on_the_same_global_batch(P, N):
    # P ranks x N micro-batches each = one 1F1B pipeline of P stages with N*P.
    r = simulate(build_plan("weipipe", num_ranks=P, num_microbatches=N), FREE)
    one_f_one_b = (P - 1) / (N * P + P - 1)
    if N == 1 or P == 2:
        # Small cases can do better: with one micro-batch per rank there is
        # no forward/backward pairing to wait for, and with two ranks rank 1
        # starts only one turn late.
        assert r.bubble_ratio <= one_f_one_b + 1e-12
    else:
        assert r.bubble_ratio == pytest.approx(one_f_one_b)
        assert r.iteration_time == pytest.approx((N * P + P - 1) * 3.0)


@pytest.mark.parametrize("P", [3, 4, 6, 8])
@pytest.mark.parametrize("N", [1, 2, 3, 6])
def test_weipipe_zero_bubble_closed_form(P, N):
    """Each transfer of the ring is a rendezvous, so neighbours stay within a turn of each other and an
    iteration takes the work (3NP, F = 1, B = 2 split into 1 + 1) plus (P - 1) turns of the largest
    work of one turn: WeiPipe and WZB1 hold 2 (N = 1) or 3 per turn, WZB2, whose weight-gradient
    passes trail by a round, 1, 2 or 3 (N = 1, 2, 3+). Zero-bubble gains are the small-N ones here;
    WZB1's are in the gradient's arrival, which free communication does not show."""
    peaks = {"weipipe": min(3, N + 1), "weipipe-zb1": min(3, N + 1), "weipipe-zb2": min(3, N)}
    deferred = replace(FREE, deferred_weight_gradients=True)
    for schedule, peak in peaks.items():
        r = simulate(build_plan(schedule, num_ranks=P, num_microbatches=N), deferred)
        assert r.iteration_time == pytest.approx(3 * N * P + (P - 1) * peak), schedule


@pytest.mark.parametrize("P", [3, 4, 8])
@pytest.mark.parametrize("N", [1, 2, 3])
def test_weipipe_zero_bubble_as_the_runtime_computes_it(P, N):
    """Without deferred weight-gradient kernels (the runtime's compute: the input pass is the whole
    backward, the weight pass adds held gradients) WZB1 takes WeiPipe's time on free communication and
    WZB2 no more; the backward's time is the same, all of it in the input pass."""
    held = replace(FREE, deferred_weight_gradients=False)
    t = {s: simulate(build_plan(s, num_ranks=P, num_microbatches=N), held) for s in
         ("weipipe", "weipipe-zb1", "weipipe-zb2")}
    assert t["weipipe-zb1"].iteration_time == pytest.approx(t["weipipe"].iteration_time)
    assert t["weipipe-zb2"].iteration_time <= t["weipipe"].iteration_time + 1e-9
    plan = build_plan("weipipe-zb1", num_ranks=P, num_microbatches=N)
    assert {sp.end - sp.start for sp in t["weipipe-zb1"].spans if sp.kind == "Bi"} == {2.0}   # the whole backward
    assert all(held.backward_weight_time(plan, s) == 0.0 for s in range(plan.num_shards))
    deferred = FREE       # the default: the runtime defers the kernels
    assert all(deferred.backward_input_time(plan, s) == deferred.backward_weight_time(plan, s) == 1.0
               for s in range(plan.num_shards))


def test_weipipe_zero_bubble_trades_memory_for_idle():
    """On the FLOP model with real communication and the runtime's deferred weight-gradient kernels: WZB1
    idles less than WeiPipe, its input pass freeing a shard's activations for its weight-gradient store
    (here smaller: no more memory); WZB2 less again, holding a round (P - 1 or more) of stores more."""
    cost = CostModel.from_flops(hidden_size=1024, seq_length=8192, micro_batch_size=1, num_attention_heads=8,
                                vocab_size=32000, recompute=False, dtype_bytes=2)
    assert cost.deferred_weight_gradients
    store, stash = 2 * cost.layer_weight_store_bytes, 2 * cost.layer_activation_bytes   # one shard: two layers
    assert store < stash
    for P, N in ((3, 2), (4, 2), (4, 4)):
        rows = {s: simulate(build_plan(s, num_ranks=P, num_layers=2 * P, num_microbatches=N), cost, record=False)
                for s in ("weipipe", "weipipe-zb1", "weipipe-zb2")}
        bubble = {s: r.bubble_ratio for s, r in rows.items()}
        act = {s: r.activation_bytes for s, r in rows.items()}
        assert bubble["weipipe-zb2"] < bubble["weipipe-zb1"] < bubble["weipipe"], (P, N, bubble)
        assert act["weipipe-zb1"] == pytest.approx(act["weipipe"]), (P, N, act)
        assert act["weipipe-zb2"] >= act["weipipe-zb1"] + (P - 1) * store * (1 - 1e-9), (P, N, act)


@pytest.mark.parametrize("schedule,bound", [("tawpipe", 0.10), ("tawpipe-paper", 0.15)])
def test_tawpipe_bubble_when_communication_is_free(schedule, bound):
    # Every rank always has its own micro-batches to run and weights never
    # change within the iteration.  With two groups each rank exchanges shards
    # with one peer, in one NCCL group per slot, and nothing ever waits.  With
    # more groups an owner's batch also serves groups that free links let run
    # ahead of their nominal stagger: under NCCL's FIFO rules that batch holds
    # the stream until its slowest partner arrives, a small bubble that the
    # gloo-era rendezvous model did not see.
    for P, D in ((4, 2), (6, 3), (8, 2), (8, 4)):
        for N in (1, 4):
            plan = build_plan(schedule, num_ranks=P, num_groups=D, num_microbatches=N)
            r = simulate(plan, FREE)
            if D <= 2:
                assert r.bubble_ratio == pytest.approx(0.0, abs=1e-12)
                assert r.iteration_time == pytest.approx(N * P * 3.0)
            else:
                assert 0.0 < r.bubble_ratio < bound, (P, D, N, r.bubble_ratio)


# ------------------------------------------------------------ byte counts
def units(plan, link=None):
    b = link_bytes(plan, bytes_per_shard=1.0)
    return b[link] if link else b["intra"] + b["inter"]


@pytest.mark.parametrize("P,D", [(2, 2), (4, 2), (6, 3), (8, 4), (8, 8), (5, 1)])
def test_weipipe_per_turn_volume_is_36_H2(P, D):
    """One more micro-batch per rank adds P turns; in each, every rank receives a
    forward weight copy, a backward weight copy and a gradient from its ring
    neighbour, except that the hop into a shard's owner carries no weight (the
    owner reloads its master) and none leaves an owner's gradient (it absorbed
    it): 3(P-1)/P shard units per rank and turn -> 36 H^2 (P-1)/P per layer."""
    plans = [build_plan("weipipe", num_ranks=P, num_groups=D, num_microbatches=n)
             for n in (4, 5)]
    per_turn = (units(plans[1]) - units(plans[0])) / (P * P)
    assert per_turn == pytest.approx(3 * (P - 1) / P)
    if D > 1:      # the D ring hops that cross groups carry the same per turn
        per_link = (units(plans[1], "inter") - units(plans[0], "inter")) / (D * P)
        assert per_link == pytest.approx(3 * (P - 1) / P)
    H, lps = 4096, 2
    shard = params_per_layer(H) * lps
    assert per_turn * shard / lps == pytest.approx(36 * H * H * (P - 1) / P)


@pytest.mark.parametrize("P,D", [(4, 2), (6, 3), (8, 2), (12, 3), (24, 3), (8, 8)])
def test_tawpipe_per_turn_volume_is_24_H2_between_groups(P, D):
    """Reference arrangement (weights fetched per visit).  Per extra micro-batch
    round a group makes 2P visits; two reuse the previous visit's shard (F then B
    of the last shard, B of shard 0 then F of the next round), the others fetch
    the shard over the slow link when another group owns it, and all P backward
    visits send a reduced gradient to a foreign owner likewise:
    (D-1)(3P-2) units between groups, i.e. (D-1)(3P-2)/(DP) per node link and
    turn -> 3(D-1)/D units = 24 H^2 per layer for D = 3 (WeiPipe: 36 H^2).
    Inside the groups the same visits move (G-1) units each (broadcast, reduce)."""
    G = P // D
    plans = [build_plan("tawpipe-paper", num_ranks=P, num_groups=D, num_microbatches=n)
             for n in (4, 5)]
    d_inter = units(plans[1], "inter") - units(plans[0], "inter")
    d_intra = units(plans[1], "intra") - units(plans[0], "intra")
    assert d_inter == pytest.approx((D - 1) * (3 * P - 2))
    assert d_intra == pytest.approx(D * (G - 1) * (3 * P - 2))
    # Total per rank and turn equals WeiPipe's 3(P-1)/P asymptotically: the
    # volume is the same, TawPipe moves most of it inside the groups.
    assert (d_inter + d_intra) / (P * P) == pytest.approx((3 * P - 2) * (P - 1) / P ** 2)
    if D == 3:
        per_link_turn = d_inter / (D * P)
        assert per_link_turn == pytest.approx(2 * (3 * P - 2) / (3 * P))
        assert per_link_turn * 12 == pytest.approx(24 * (3 * P - 2) / (3 * P))   # x H^2


@pytest.mark.parametrize("P,D", [(4, 2), (6, 3), (8, 4), (24, 3)])
def test_tawpipe_cached_inter_group_volume_is_independent_of_N(P, D):
    # Each group fetches each foreign shard once and returns its gradient once.
    for N in (1, 3, 7):
        plan = build_plan("tawpipe", num_ranks=P, num_groups=D, num_microbatches=N, cache=True)
        assert units(plan, "inter") == 2 * P * (D - 1)


@pytest.mark.parametrize("schedule", ["tawpipe", "tawpipe-paper", "tawpipe-flat", "tawpipe-rep", "weipipe",
                                      "1f1b", "interleaved"])
def test_simulated_transfers_add_up_to_link_bytes(schedule):
    cost = CostModel.from_flops(hidden_size=256, seq_length=512, inter_bw="1GB/s")
    n = 8 if schedule in ("1f1b", "interleaved") else 3
    plan = build_plan(schedule, num_ranks=4, num_groups=2, num_layers=8, num_microbatches=n)
    r = simulate(plan, cost)
    moved = {"intra": 0.0, "inter": 0.0}
    for t in r.transfers:
        moved[t.link] += t.nbytes
        assert t.end >= t.posted
    # the plan's transfers, and the replicated (embedding, output layer) gradients' ring all-reduce
    expect = link_bytes(plan, cost.shard_bytes(plan), cost.activation_bytes, cost.grad_shard_bytes(plan))
    rep = replicated_allreduce_bytes(plan, cost.replicated_params * cost.grad_bytes)
    expect = {k: v + rep[k] for k, v in expect.items()}
    assert moved == pytest.approx(expect)
    assert r.link_bytes == pytest.approx(expect)
    if schedule not in ("1f1b", "interleaved"):     # weight passing all-reduces the replicated parts
        assert rep["inter"] > 0 and sum(t.nbytes for t in r.transfers if t.kind == "replicated") == \
            pytest.approx(rep["inter"] + rep["intra"])


def _two_flows_plan(concurrent: bool) -> Plan:
    """Ranks 0 and 1 (group 0) each send one shard to ranks 2 and 3 (group 1)."""
    acts = [[], [], [], []]
    for tag, (src, dst) in enumerate(((0, 2), (1, 3)), 1):
        acts[src] += [A.LoadWeights(src, "w0"), A.SendStart(tag, dst, "w0", "weight", src, "inter"),
                      A.Wait(tag)]
        acts[dst] += [A.RecvStart(tag, src, "w0", "weight", src, "inter"), A.Wait(tag)]
    if not concurrent:       # rank 1 only starts after a compute as long as the transfer
        acts[1].insert(0, A.Forward(0, 0, "w0"))
    for a in acts:
        a.append(A.OptimizerStep())
    return Plan("two-flows", "weight", 4, 2, 4, 1, (0, 1, 2, 3), (0, 1, 2, 3), 1, 0, acts)


def test_node_link_is_shared_by_concurrent_flows():
    cost = CostModel(layer_forward=1.0, layer_backward=1.0, params_per_layer=1e9, dtype_bytes=1,
                     inter=Link(1e9), intra=Link(1e12))
    both = simulate(_two_flows_plan(True), cost)
    assert sorted(t.end for t in both.transfers) == pytest.approx([2.0, 2.0])
    staggered = simulate(_two_flows_plan(False), cost)
    assert sorted(t.end for t in staggered.transfers) == pytest.approx([1.0, 2.0])


def _replicated_and_flow_plan(concurrent: bool) -> Plan:
    """Every rank all-reduces the replicated parts' gradients (a ring 0 -> 1 -> 2 -> 3 -> 0: the hops
    1 -> 2 and 3 -> 0 cross the node links) while rank 1 sends one shard to rank 3 (node 0 -> node 1), or
    (``concurrent=False``) only once the all-reduce completed."""
    acts = [[A.ReplicatedAllReduceStart(9, (0, 1, 2, 3)), A.Wait(9)] for _ in range(4)]
    send = [A.LoadWeights(1, "w0"), A.SendStart(1, 3, "w0", "weight", 1, "inter")]
    acts[1] = (send + acts[1]) if concurrent else (acts[1] + send)
    acts[1].append(A.Wait(1))
    acts[3] = [A.RecvStart(1, 1, "w0", "weight", 1, "inter")] + acts[3] + [A.Wait(1)]
    for a in acts:
        a.append(A.OptimizerStep())
    return Plan("replicated-and-flow", "weight", 4, 2, 4, 1, (0, 1, 2, 3), (0, 1, 2, 3), 1, 0, acts)


def test_replicated_allreduce_shares_the_node_link_with_concurrent_transfers():
    """The embedding / output layer's all-reduce is a ring of flows like any transfer between nodes: its
    hop from node 0 to node 1 and a shard sent the same way at the same time share node 0's link, and
    its bytes are counted with the inter-node bytes (docs/simulator-cost-model.md)."""
    # replicated 2e9 params x 4 B x 2 (4-1)/4 = 12e9 bytes per hop; the shard 12e9 bytes; 12e9 B/s links
    cost = CostModel(layer_forward=2.0, layer_backward=1.0, params_per_layer=12e9, dtype_bytes=1,
                     replicated_params=2e9, grad_bytes=4, inter=Link(12e9), intra=Link(1e15))
    alone = simulate(_replicated_and_flow_plan(False), cost)
    ring = [t for t in alone.transfers if t.kind == "replicated"]
    assert len(ring) == 4 and sum(t.link == "inter" for t in ring) == 2
    assert max(t.end for t in ring) == pytest.approx(1.0)          # 12e9 bytes at 12e9 B/s
    assert next(t.end for t in alone.transfers if t.kind == "weight") == pytest.approx(2.0)
    both = simulate(_replicated_and_flow_plan(True), cost)
    assert max(t.end for t in both.transfers if t.kind == "replicated") == pytest.approx(2.0)
    assert next(t.end for t in both.transfers if t.kind == "weight") == pytest.approx(2.0)
    assert both.link_bytes["inter"] == pytest.approx(2 * 12e9 + 12e9)
    assert both.link_bytes["intra"] == pytest.approx(2 * 12e9)


def test_latency_and_bandwidth_of_a_transfer():
    cost = CostModel(layer_forward=10.0, layer_backward=0.0, params_per_layer=5e8,
                     dtype_bytes=2, inter=Link(1e9, 0.25), intra=Link(1e12))
    r = simulate(_two_flows_plan(False), cost)      # 1e9 bytes each, one after the other
    assert sorted(t.end for t in r.transfers) == pytest.approx([1.25, 11.25])


def _exchange_plan(kinds=("act", "actgrad")) -> Plan:
    """Ranks 0 (group 0) and 2 (group 1) send each other one shard's worth at once: rank 0 a ``kinds[0]``,
    rank 2 a ``kinds[1]`` -- a pipeline boundary's activations one way and gradients the other (one
    connection for both directions, as megatron's pipeline group), or the weight-passing runtime's
    gradients both ways (one process group per direction)."""
    acts = [[], [], [], []]
    for me, peer, out_tag, in_tag, out_kind, in_kind in ((0, 2, 1, 2, kinds[0], kinds[1]),
                                                         (2, 0, 2, 1, kinds[1], kinds[0])):
        acts[me] += [A.LoadWeights(me, "w0"),
                     A.SendStart(out_tag, peer, "w0", out_kind, 0, "inter"),
                     A.RecvStart(in_tag, peer, "w1", in_kind, 0, "inter"),
                     A.Wait(out_tag), A.Wait(in_tag)]
    for a in acts:
        a.append(A.OptimizerStep())
    return Plan("exchange", "weight", 4, 2, 4, 1, (0, 1, 2, 3), (0, 1, 2, 3), 1, 0, acts)


@pytest.mark.parametrize("nbytes", [2e6, 12.6e6])
def test_gloo_pair_takes_turns_beyond_its_first_bytes(nbytes):
    """On gloo two ranks sending each other large messages at once on one process group move the first
    GLOO_PAIR_DUPLEX_BYTES of each at the link rate, the rest at half of it (measured by
    tools/tawpipe_lab/link_duplex.py with the emulated link's default bucket: 0.50-0.55 of one direction's
    rate per direction from 1 to 12.6 MB); NCCL's are full duplex."""
    from megatron_tawpipe.sim.costmodel import GLOO_PAIR_DUPLEX_BYTES as B

    rate = 125e6
    cost = CostModel(layer_forward=1.0, layer_backward=1.0, params_per_layer=nbytes, dtype_bytes=1,
                     activation_bytes=nbytes, inter=Link(rate), intra=Link(1e12))
    ends = {}
    for backend in ("nccl", "gloo"):
        r = simulate(_exchange_plan(), replace(cost, backend=backend))
        assert len(r.transfers) == 2
        ends[backend] = [t.end for t in r.transfers]
    assert ends["nccl"] == pytest.approx([nbytes / rate] * 2)
    expect = nbytes / rate if nbytes <= B else (B + 2 * (nbytes - B)) / rate
    assert ends["gloo"] == pytest.approx([expect] * 2)
    # One direction alone is not slowed, whatever the backend.
    alone = simulate(_two_flows_plan(False), replace(cost, backend="gloo"))
    assert sorted(t.end - t.posted for t in alone.transfers) == pytest.approx([nbytes / rate] * 2, rel=1e-6)
    # The weight-passing runtime's gradients both ways: a process group per direction (two gloo
    # connections, measured near full duplex by tools/tawpipe_lab/link_duplex.py), so neither waits for the
    # other.
    grads = simulate(_exchange_plan(("grad", "grad")), replace(cost, backend="gloo", grad_bytes=1))
    assert [t.end for t in grads.transfers] == pytest.approx([nbytes / rate] * 2)


# ------------------------------------------------------------- cost model
def test_flop_model():
    H, S = 4096, 16384
    c = CostModel.from_flops(hidden_size=H, seq_length=S, peak_tflops=312, efficiency=0.5)
    flops = 2 * S * 12 * H * H + 2 * S * S * H          # matmuls + causal attention
    assert c.layer_forward == pytest.approx(flops / 156e12)
    assert c.layer_backward == pytest.approx(2 * c.layer_forward)
    assert c.layer_recompute == pytest.approx(c.layer_forward)
    plan = build_plan("tawpipe", num_ranks=24, num_groups=3, num_layers=48, num_microbatches=1)
    assert c.shard_bytes(plan) == 12 * H * H * 2 * 2               # 2 layers in bf16
    assert c.activation_bytes == S * H * 2
    assert c.forward_time(plan, 23) > c.forward_time(plan, 0)      # the head
    exact = params_per_layer(H, ffn_hidden_size=11008, num_attention_heads=32,
                             num_query_groups=8)
    assert exact == 2 * H * H + 2 * H * 1024 + 3 * H * 11008 + 2 * H


def test_measured_times_override(tmp_path):
    path = tmp_path / "times.json"
    path.write_text(json.dumps({"layer_forward": 0.01, "layer_backward": 0.02,
                                "layer_recompute": 0.01, "device": "H100"}))
    c = CostModel.from_flops(hidden_size=1024, seq_length=1024).with_measured(str(path))
    assert (c.layer_forward, c.layer_backward, c.layer_recompute) == (0.01, 0.02, 0.01)
    with pytest.raises(ValueError, match="unknown keys"):
        c.with_measured({"layer_fwd": 1})
    # Without recompute, a measured recompute time does not bring it back.
    keep = CostModel.from_flops(hidden_size=1024, seq_length=1024, recompute=False).with_measured(str(path))
    assert (keep.layer_forward, keep.layer_backward, keep.layer_recompute) == (0.01, 0.02, 0.0)


@pytest.mark.parametrize("text,value", [
    ("200GB/s", 200e9), ("1.25 GB/s", 1.25e9), ("100Gbit/s", 12.5e9), ("25Gbps", 25e9 / 8),
    ("10GbE", 1.25e9), ("100Gb/s", 12.5e9), ("1GiB/s", 2 ** 30), ("inf", math.inf), (3e9, 3e9)])
def test_parse_rate(text, value):
    assert parse_rate(text) == pytest.approx(value)


def test_parse_time():
    assert parse_time("5us") == pytest.approx(5e-6)
    assert parse_time("1.5ms") == pytest.approx(1.5e-3)
    assert parse_time("2") == 2.0


def test_fsdp_model():
    c = CostModel(layer_forward=1.0, layer_backward=2.0, params_per_layer=1.0)
    r = simulate_fsdp(c, num_ranks=4, num_groups=2, num_layers=8, num_microbatches=3)
    assert r.bubble_ratio == pytest.approx(0.0)
    assert r.tokens_per_sec_per_rank == 0.0 and r.iteration_time == pytest.approx(3 * 8 * 3)
    slow = c.with_links(inter=Link(1.0))
    r = simulate_fsdp(slow, num_ranks=4, num_groups=2, num_layers=8, num_microbatches=3)
    assert r.bubble_ratio > 0.3 and r.link_bytes["inter"] > 0


def test_memory_report():
    c = CostModel.from_flops(hidden_size=1024, seq_length=2048)
    plan = build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=8, num_microbatches=4)
    r = simulate(plan, c, record=False)
    assert r.weight_buffer_bytes == plan.max_weight_buffers * c.shard_bytes(plan)
    assert r.activation_bytes > 0 and r.state_bytes > 0
    assert r.memory_bytes == pytest.approx(r.weight_buffer_bytes + r.grad_buffer_bytes +
                                           r.activation_bytes + r.state_bytes)
    assert not r.spans and not r.transfers


@pytest.mark.parametrize("schedule", ["tawpipe", "tawpipe-rep", "weipipe"])
def test_gradients_travel_in_fp32_weights_in_the_compute_dtype(schedule):
    """The runtime's gradient buffers are fp32 whatever the compute dtype: in bf16 a gradient
    transfer carries twice a weight transfer's bytes, and so do the gradient buffers."""
    cost = CostModel.from_flops(hidden_size=256, seq_length=512, inter_bw="1GB/s", dtype_bytes=2)
    plan = build_plan(schedule, num_ranks=4, num_groups=2, num_layers=8, num_microbatches=3)
    r = simulate(plan, cost)
    weight, grad = cost.shard_bytes(plan), cost.grad_shard_bytes(plan)
    assert grad == 2 * weight
    by_kind = {"weight": [], "grad": [], "replicated": []}
    for t in r.transfers:
        by_kind[t.kind].append(t.nbytes)
    assert by_kind["weight"] and by_kind["grad"]
    # the replicated parts' ring: fp32 gradients too, 2(n-1)/n of them per member
    assert sum(by_kind["replicated"]) == pytest.approx(2 * (4 - 1) * cost.replicated_params * 4)
    assert all(n % weight == 0 for n in by_kind["weight"])
    # (tawpipe-rep's all-reduce between 2 holders: each sends 2(n-1)/n = 1 buffer to the other)
    assert all(n % grad == 0 for n in by_kind["grad"])
    assert r.grad_buffer_bytes == plan.max_grad_buffers * grad
    assert r.weight_buffer_bytes == plan.max_weight_buffers * weight


# ------------------------------------------------------------------ shards of different sizes
@pytest.mark.parametrize("schedule", ["tawpipe", "tawpipe-rep", "tawpipe-paper", "weipipe", "1f1b"])
def test_uneven_transfers_carry_their_own_shards_bytes(schedule):
    """6 layers on 4 ranks, shards (2, 2, 1, 1): every point-to-point transfer carries its own shard's
    bytes (weights in the compute dtype, gradients in fp32, per layer), and they add up to the plan's
    link bytes, which scale each transfer by its shard's layers."""
    cost = CostModel.from_flops(hidden_size=256, seq_length=512, inter_bw="1GB/s")
    n = 8 if schedule == "1f1b" else 3
    plan = build_plan(schedule, num_ranks=4, num_groups=2, num_layers=6, num_microbatches=n)
    assert plan.shard_layers == (2, 2, 1, 1)
    r = simulate(plan, cost)
    per_layer = {"weight": cost.params_per_layer * cost.dtype_bytes, "grad": cost.params_per_layer * 4,
                 "act": cost.activation_bytes, "actgrad": cost.activation_bytes}
    expect = {}
    for acts in plan.actions:
        for a in acts:
            if type(a) is A.SendStart:
                layers = plan.shard_layers[a.shard] if a.kind in ("weight", "grad") else 1
                expect[a.tag] = a.size * layers * per_layer[a.kind]
    sent = {t.tag: t.nbytes for t in r.transfers if t.tag in expect}
    assert sent == pytest.approx(expect) and sent
    moved = {"intra": 0.0, "inter": 0.0}
    for t in r.transfers:
        if t.kind != "replicated":
            moved[t.link] += t.nbytes
    assert moved == pytest.approx(link_bytes(plan, cost.shard_bytes(plan), cost.activation_bytes,
                                             cost.grad_shard_bytes(plan)))
    if schedule != "1f1b":
        sizes = {round(t.nbytes / per_layer[t.kind], 9) for t in r.transfers if t.kind == "weight"}
        assert sizes == {1.0, 2.0}


def test_uneven_shards_memory_is_sized_to_the_largest_shard():
    """Buffers, a shard's recompute working set and the owner's state are priced for the largest shard:
    (2, 1, 1, 1) needs what (2, 2, 2, 2) needs."""
    cost = CostModel.from_flops(hidden_size=256, seq_length=512)
    uneven = build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=5, num_microbatches=4)
    even = build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=8, num_microbatches=4)
    assert uneven.shard_layers == (2, 1, 1, 1) and uneven.max_layers_per_shard == 2
    assert cost.shard_bytes(uneven) == cost.shard_bytes(even) == 2 * cost.params_per_layer * 2
    assert cost.shard_bytes(uneven, 3) == cost.params_per_layer * 2
    u, e = simulate(uneven, cost, record=False), simulate(even, cost, record=False)
    for name in ("weight_buffer_bytes", "grad_buffer_bytes", "activation_bytes", "state_bytes"):
        assert getattr(u, name) == pytest.approx(getattr(e, name)), name
    from megatron_tawpipe.sim.strategies import peak_stash

    # stored shard inputs, and the working set of the largest shard while it is recomputed
    assert u.activation_bytes == pytest.approx(max(peak_stash(uneven)) * cost.activation_bytes +
                                               2 * cost.layer_activation_bytes)


def test_uneven_shards_compute_and_pace():
    """Free links: TawPipe has no bubble with shards of any size (each rank runs all layers of its own
    micro-batches), so (2, 1, 1, 1) takes 5/8 of (2, 2, 2, 2); a 1F1B pipeline runs at its slowest stage's
    pace (each further micro-batch costs that stage's work) and never beats the bound of
    sim.stages.pipeline_time_bound, which it meets when the largest stage is the last."""
    from megatron_tawpipe.sim.stages import pipeline_time_bound

    free = CostModel(layer_forward=1.0, layer_backward=2.0)
    taw = {split: simulate(build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=sum(split),
                                      num_microbatches=4, shard_layers=split), free, record=False)
           for split in ((1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 2, 2))}
    assert taw[(2, 1, 1, 1)].bubble_ratio == pytest.approx(0.0)
    assert taw[(2, 1, 1, 1)].iteration_time == pytest.approx(4 * 5 * 3.0)
    assert taw[(1, 1, 1, 1)].iteration_time <= taw[(2, 1, 1, 1)].iteration_time <= \
        taw[(2, 2, 2, 2)].iteration_time
    for split in ((2, 1, 1, 1), (1, 3, 1, 1), (1, 1, 1, 2), (2, 2, 1, 1)):
        times = [simulate(build_plan("1f1b", num_ranks=4, num_layers=sum(split), num_microbatches=m,
                                     shard_layers=split), free, record=False).iteration_time for m in (8, 16)]
        assert times[1] - times[0] == pytest.approx(8 * 3.0 * max(split))
        bound = pipeline_time_bound([3.0 * n for n in split], 4, 16)
        assert times[1] >= bound - 1e-9
        if split[-1] == max(split) and len(set(split[:-1])) == 1:
            assert times[1] == pytest.approx(bound)
