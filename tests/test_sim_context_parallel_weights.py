"""Context parallelism inside weight passing in the simulator (megatron_tawpipe/sim/context_parallel_weights.py):
the node link carries the bytes of C = 1, a GPU's compute is 1/C (plus the ring), the pieces' collectives inside
the node cost what a ring of C members costs, and the activations alone fall to 1/C. Beside tensor parallelism T:
virtual ranks of T x C GPUs, each GPU's pieces carrying its tensor-parallel slice (1/T of the bytes), the links
T x C, the state / T and the activations / (T x C); T = 1 and C = 1 are the pricing of either alone."""

import json
import os
import subprocess
import sys

from dataclasses import replace

import pytest

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.sim.context_parallel_weights import (PieceCollectives, per_gpu_breakdown, virtual_rank_pricing,
                                                           weight_passing_cost)
from megatron_tawpipe.sim.context_parallel import AttentionShape, ring_attention_exposed
from megatron_tawpipe.sim.costmodel import CostModel, Link
from megatron_tawpipe.sim.memory import TERMS, MemoryBreakdown
from megatron_tawpipe.sim.tensor_parallel import per_gpu_breakdown as tensor_parallel_breakdown
from megatron_tawpipe.sim.tensor_parallel import virtual_rank_cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "1408", "--num-attention-heads", "8",
         "--seq-length", "8192", "--micro-batch-size", "1", "--num-microbatches", "4", "--vocab-size", "4096",
         "--no-recompute", "--json", "--no-validate"]


def simulate(*args):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "simulate.py"), *MODEL, *args],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return {r["schedule"]: r for r in json.loads(done.stdout)}


@pytest.mark.parametrize("schedule", ["tawpipe", "weipipe"])
def test_node_link_carries_the_bytes_of_one_gpu_per_virtual_rank(schedule):
    """C = 2 on 8 ranks in 2 nodes against C = 1 on 4 ranks in 2 nodes (the same plan over the virtual ranks):
    the same bytes between nodes; half the tokens per GPU at the same iteration time on free links."""
    two = simulate("--schedule", schedule, "--ranks", "8", "--groups", "2", "--context-parallel-size", "2",
                   "--inter-bw", "1GB/s")[schedule]
    one = simulate("--schedule", schedule, "--ranks", "4", "--groups", "2", "--inter-bw", "1GB/s")[schedule]
    assert two["inter_group_bytes"] == pytest.approx(one["inter_group_bytes"]) and one["inter_group_bytes"] > 0
    assert two["options"]["context_parallel_size"] == 2
    assert two["options"]["context_parallel_bytes_per_gpu"] > 0
    pieces = two["options"]["context_parallel_piece_bytes_per_gpu"]
    assert pieces["gather"] > 0 and pieces["scatter"] > 0 and set(pieces) == {"gather", "scatter"}
    # memory per GPU: activations / 2, weights and masters whole, the Adam moments (8 of the 12 B) halved
    m1, m2 = one["options"]["memory_breakdown"], two["options"]["memory_breakdown"]
    assert m2["activations"] == pytest.approx(m1["activations"] / 2)
    assert m2["weights"] == pytest.approx(m1["weights"]) and m2["optimizer"] == pytest.approx(m1["optimizer"] * 8 / 12)
    assert two["state_bytes"] == pytest.approx(one["state_bytes"] - m1["optimizer"] * 4 / 12)


def test_compute_per_gpu_is_a_cth_plus_the_ring():
    """A free link inside the node: each GPU's layer and output layer take exactly 1/C of one GPU's times; on
    0.6 GB/s the ring's exposed time comes on top, the same as the native side's."""
    kw = dict(hidden_size=512, seq_length=8192, ffn_hidden_size=1408, num_attention_heads=8, vocab_size=4096,
              recompute=False)
    shape = AttentionShape(8192, 1, 512, 8, None, 1408)
    free = replace(CostModel.from_flops(**kw), intra=Link(float("inf"), 0.0))
    virtual = weight_passing_cost(free, 2, shape)
    assert virtual.layer_forward == pytest.approx(free.layer_forward / 2)
    assert virtual.layer_backward == pytest.approx(free.layer_backward / 2)
    assert virtual.head_backward == pytest.approx(free.head_backward / 2)
    slow = CostModel.from_flops(**kw, intra_bw="0.6GB/s")
    ring = ring_attention_exposed(slow, shape, 2)
    assert ring.backward > 0
    virtual = weight_passing_cost(slow, 2, shape)
    assert virtual.layer_backward == pytest.approx(slow.layer_backward / 2 + ring.backward)
    assert virtual.layer_forward == pytest.approx(slow.layer_forward / 2 + ring.forward)


_RECV = A.RecvStart(tag=1, peer=0, shard=1, buf="w0", kind="weight", link="inter")
_SEND = A.SendStart(tag=2, peer=0, shard=1, buf="w0", kind="grad", link="inter")
_SEND_WEIGHT = A.SendStart(tag=3, peer=0, shard=1, buf="w0", kind="weight", link="inter")


class _Plan:
    """Rank 1 receives a weight, sends a gradient and a weight (where the members meet: the plan's member points)."""
    num_ranks, num_shards, shard_layers = 2, 2, [2, 2]
    actions = [[], [_RECV, A.Wait(1), _SEND, A.Wait(2), _SEND_WEIGHT, A.Wait(3)]]

    def layers_held_by(self, rank):
        return 2


def test_pieces_collectives_by_hand():
    """C = 2 on gloo, 1 GB/s and 1 ms per step inside the node, shards of 2 layers of 1M parameters: a weight that
    arrived (2 bytes a value: 4 MB) is all-gathered in 1/2 x 4 MB / 1 GB/s + 1 ms = 3 ms;
    a gradient (8 MB fp32) is reduce-scattered as gloo does, an all-reduce's bytes: 8 ms + 2 ms; around the
    optimizer the reduce-scatter of 2 M + 1 M replicated parameters' gradients (12 MB, gloo: 12 ms + 2 ms) and the
    all-gather of their fp32 masters (1/2 x 12 MB + 1 ms = 7 ms); on NCCL the reduce-scatter is half (7 ms), so
    the two cost an all-reduce's 14 ms."""
    cost = CostModel(layer_forward=1.0, layer_backward=2.0, params_per_layer=1e6, dtype_bytes=2, grad_bytes=4,
                     replicated_params=1e6, intra=Link(1e9, 1e-3), backend="gloo")
    pieces = PieceCollectives(cost, 2, _Plan())
    assert pieces.after_wait(1, _RECV) == pytest.approx(0.003)
    send = _SEND
    assert pieces.before_start(1, send) == pytest.approx(0.010)
    assert pieces.before_start(1, _SEND_WEIGHT) == 0.0
    assert pieces.before_optimizer(0) == pytest.approx(0.021)
    assert pieces.bytes == {"gather": 2e6 + 6e6, "scatter": 8e6 + 12e6}
    nccl = PieceCollectives(replace(cost, backend="nccl"), 2, _Plan())
    assert nccl.before_start(1, send) == pytest.approx(0.005)   # a ring reduce-scatter: half the bytes, one step
    assert nccl.before_optimizer(0) == pytest.approx(0.014)


_REPLICATED = A.ReplicatedAllReduceStart(tag=4, ranks=(0, 1), part="embedding")


class _PlanWithReplicated(_Plan):
    """Rank 1 also all-reduces the embedding's gradients over the virtual ranks."""
    actions = [[], _Plan.actions[1] + [_REPLICATED, A.Wait(4)]]


def test_replicated_gradients_are_reduce_scattered_once():
    """C = 2 on gloo as above, 1 M replicated parameters of which 0.25 M the embedding's: before the plan's
    all-reduce of the embedding's gradients the members reduce-scatter them (1 MB fp32: an all-reduce's bytes on
    gloo, 1 ms + 2 ms); before the step the owned shards' 2 M and the head's 0.75 M (11 MB: 11 ms + 2 ms), not the
    embedding's again, and the all-gather of all 3 M fp32 masters (7 ms)."""
    cost = CostModel(layer_forward=1.0, layer_backward=2.0, params_per_layer=1e6, dtype_bytes=2, grad_bytes=4,
                     replicated_params=1e6, embedding_params=2.5e5, intra=Link(1e9, 1e-3), backend="gloo")
    pieces = PieceCollectives(cost, 2, _PlanWithReplicated())
    assert pieces.before_start(1, _REPLICATED) == pytest.approx(0.003)
    assert pieces.before_optimizer(1) == pytest.approx(0.013 + 0.007)
    assert pieces.before_optimizer(0) == pytest.approx(0.021)   # rank 0's list reduces nothing replicated


def test_weight_passing_cost_divides_the_optimizer_and_keeps_the_links_per_member():
    cost = CostModel.from_flops(hidden_size=512, seq_length=8192, ffn_hidden_size=1408, num_attention_heads=8,
                                vocab_size=4096, recompute=False, intra_bw="1GB/s")
    virtual = weight_passing_cost(cost, 2, AttentionShape(8192, 1, 512, 8, None, 1408))
    assert virtual.intra.bandwidth == pytest.approx(2 * cost.intra.bandwidth)
    assert virtual.optimizer_time_per_param == pytest.approx(cost.optimizer_time_per_param / 2)   # its piece
    assert virtual.layer_forward > cost.layer_forward / 2   # half the work plus the ring's exposed time
    assert virtual.head_forward == pytest.approx(cost.head_forward / 2)


def test_the_benchmark_prices_a_context_parallel_run_over_its_virtual_ranks():
    """tools/benchmark.py --simulate-as-run of a CP 2 run on 2 x 2: the simulator gets C and the micro-batches of
    each group of C ranks (global batch 16 over 2 data-parallel groups: 8 each)."""
    from megatron_tawpipe.bench.benchmark import BenchmarkConfig
    from megatron_tawpipe.bench.equal_memory import samples_per_rank, simulate_command

    model = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "4096",
             "--global-batch-size", "16", "--vocab-size", "2047", "--tokenizer-type", "NullTokenizer",
             "--context-parallel-size", "2"]
    config = BenchmarkConfig(ranks=4, model_args=model, cluster=(2, 2, "1gbit"), schedules=("distopt",))
    assert samples_per_rank(config) == 8
    cmd = simulate_command(config, 1, ["distopt"])
    assert cmd[cmd.index("--context-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--num-microbatches") + 1] == "8"
    without = BenchmarkConfig(ranks=4, model_args=model[:-2], cluster=(2, 2, "1gbit"), schedules=("distopt",))
    assert samples_per_rank(without) == 4 and "--context-parallel-size" not in simulate_command(without, 1, ["distopt"])


# ---- tensor parallelism T beside C ------------------------------------------------------------------------------

def _cost(**kw):
    return CostModel.from_flops(hidden_size=512, seq_length=8192, ffn_hidden_size=1408, num_attention_heads=8,
                                vocab_size=4096, recompute=False, **kw)


SHAPE = AttentionShape(8192, 1, 512, 8, None, 1408)


def test_pieces_collectives_carry_the_tensor_parallel_slice_by_hand():
    """T = 2 beside C = 2, the plan and links of test_pieces_collectives_by_hand: each GPU's collectives carry its
    slice, half the bytes, at the same latencies: the weight's all-gather 1/2 x 2 MB / 1 GB/s + 1 ms = 2 ms, the
    gradient's reduce-scatter (gloo: an all-reduce's bytes) 4 MB + 2 ms = 6 ms; around the optimizer the
    reduce-scatter of 6 MB (6 ms + 2 ms) and the masters' all-gather (1/2 x 6 MB + 1 ms = 4 ms)."""
    cost = CostModel(layer_forward=1.0, layer_backward=2.0, params_per_layer=1e6, dtype_bytes=2, grad_bytes=4,
                     replicated_params=1e6, intra=Link(1e9, 1e-3), backend="gloo")
    pieces = PieceCollectives(cost, 2, _Plan(), tp=2)
    assert pieces.after_wait(1, _RECV) == pytest.approx(0.002)
    assert pieces.before_start(1, _SEND) == pytest.approx(0.006)
    assert pieces.before_start(1, _SEND_WEIGHT) == 0.0
    assert pieces.before_optimizer(0) == pytest.approx(0.012)
    assert pieces.bytes == {"gather": 1e6 + 3e6, "scatter": 4e6 + 6e6}
    # C = 4 beside T = 4: an all-gather of 3/4 of a quarter of 4 MB in 3 steps
    four = PieceCollectives(replace(cost, backend="nccl"), 4, _Plan(), tp=4)
    assert four.after_wait(1, _RECV) == pytest.approx(0.75 * 1e6 / 1e9 + 3e-3)


def test_weight_passing_cost_at_t_by_c_by_hand():
    """T = 2 x C = 2 on 1 GB/s and 5 us inside the node: a layer's forward is a quarter of one GPU's, plus two
    tensor-parallel all-reduces of the local tokens' hidden state over 2 GPUs (2 latencies + half the tokens'
    bytes / 1 GB/s each), plus the ring's exposed time at T = 2; the output layer a quarter plus one all-reduce;
    the plan's transfers on 4 GPUs' links; the optimizer over a member's piece of the tensor-parallel slice (1/4);
    the copies of a slice on 2 GPUs' bandwidth."""
    cost = _cost(intra_bw="1GB/s", intra_latency="5us")
    virtual = weight_passing_cost(cost, 2, SHAPE, 2)
    all_reduce = 2 * 5e-6 + (cost.activation_bytes / 2) / 1e9
    ring = ring_attention_exposed(cost, SHAPE, 2, 2)
    assert ring.forward > 0
    assert virtual.layer_forward == pytest.approx(cost.layer_forward / 4 + 2 * all_reduce + ring.forward)
    assert virtual.layer_backward == pytest.approx(cost.layer_backward / 4 + 3 * all_reduce + ring.backward)
    assert virtual.head_forward == pytest.approx(cost.head_forward / 4 + all_reduce)
    assert virtual.intra.bandwidth == pytest.approx(4e9) and virtual.intra.latency == cost.intra.latency
    assert virtual.inter == cost.inter
    assert virtual.optimizer_time_per_param == pytest.approx(cost.optimizer_time_per_param / 4)
    assert virtual.copy_bandwidth == pytest.approx(2 * cost.copy_bandwidth)
    assert virtual.activation_bytes == cost.activation_bytes   # the virtual rank's micro-batch, whole


def test_t_by_c_reduces_to_either_alone():
    """C = 1: tensor parallelism's virtual rank exactly (cost model and memory); T = 1: the pricing at C alone."""
    cost = _cost(intra_bw="1GB/s")
    for tp in (2, 4):
        assert weight_passing_cost(cost, 1, SHAPE, tp) == virtual_rank_cost(cost, tp)
    assert weight_passing_cost(cost, 2, SHAPE, 1) == weight_passing_cost(cost, 2, SHAPE)
    costs, pieces = virtual_rank_pricing({False: cost}, 2, SHAPE, 1)
    assert costs[False] == weight_passing_cost(cost, 2, SHAPE) and pieces.tp == 1
    assert virtual_rank_pricing({False: cost}, 1, SHAPE, 2) == ({False: cost}, None)
    memory = _memory()
    assert per_gpu_breakdown(memory, 1, 2).as_dict() == tensor_parallel_breakdown(memory, 2).as_dict()
    assert per_gpu_breakdown(memory, 2, 1).as_dict() == per_gpu_breakdown(memory, 2).as_dict()
    one = PieceCollectives(cost, 2, _Plan())
    assert PieceCollectives(cost, 2, _Plan(), tp=1).after_wait(1, _RECV) == one.after_wait(1, _RECV)


def _memory():
    m = MemoryBreakdown()
    for i, term in enumerate(TERMS):
        setattr(m, term, 1e9 * (i + 1))
    return m


def test_memory_per_gpu_at_t_by_c_by_hand():
    """T = 2 x C = 4: the activations and logits / 8 (the local tokens, sequence-parallel over T); the weights,
    gradients and the buffers / 2 (the slice, whole on every member); the optimizer's 12 B a parameter as the
    master's 4 B / 2 and the Adam moments' 8 B / 8: (4 + 2) / 12 / 2 of it."""
    memory = _memory()
    per = per_gpu_breakdown(memory, 4, 2)
    for term in TERMS:
        share = 8 if term in ("activations", "logits") else (2 * 12 / 6 if term == "optimizer" else 2)
        assert getattr(per, term) == pytest.approx(getattr(memory, term) / share), term
    assert "/ 2 tensor- x 4 context-parallel GPUs" in per.notes["activations"]
    assert "/ 2 tensor-parallel GPUs (the masters whole, the Adam moments / 4 context-parallel GPUs)" \
        in per.notes["optimizer"]
    costs, pieces = virtual_rank_pricing({False: _cost()}, 4, SHAPE, 2)
    assert pieces.per_gpu(memory).as_dict() == per.as_dict()


@pytest.mark.parametrize("schedule", ["tawpipe", "weipipe"])
def test_tools_simulate_prices_t_by_c(schedule):
    """tools/simulate.py --tensor-model-parallel-size 2 --context-parallel-size 2 on 16 ranks in 2 groups: the plan
    over 4 virtual ranks of 4 GPUs; the node links carry the bytes of the same plan on 4 ranks at T = C = 1; the
    pieces' bytes per GPU are half those at T = 1 x C = 2 (8 ranks: the same plan); memory per GPU: the
    activations a quarter of T = C = 1's, the weights half, the optimizer state (4 + 8 / 2) / 12 / 2 of it."""
    common = ["--schedule", schedule, "--groups", "2", "--inter-bw", "1GB/s"]
    both = simulate(*common, "--ranks", "16", "--tensor-model-parallel-size", "2",
                    "--context-parallel-size", "2")[schedule]
    cp = simulate(*common, "--ranks", "8", "--context-parallel-size", "2")[schedule]
    one = simulate(*common, "--ranks", "4")[schedule]
    assert both["inter_group_bytes"] == pytest.approx(one["inter_group_bytes"]) and one["inter_group_bytes"] > 0
    assert both["options"]["context_parallel_size"] == 2 and both["options"]["tensor_model_parallel_size"] == 2
    p2, p1 = both["options"]["context_parallel_piece_bytes_per_gpu"], cp["options"]["context_parallel_piece_bytes_per_gpu"]
    for what in ("gather", "scatter"):
        assert p1[what] > 0 and p2[what] == pytest.approx(p1[what] / 2), what
    m4, m1 = both["options"]["memory_breakdown"], one["options"]["memory_breakdown"]
    assert m4["activations"] == pytest.approx(m1["activations"] / 4)
    assert m4["logits"] == pytest.approx(m1["logits"] / 4)
    assert m4["weights"] == pytest.approx(m1["weights"] / 2)
    assert m4["optimizer"] == pytest.approx(m1["optimizer"] * 8 / 12 / 2)
    assert m4["comm_buffers"] == pytest.approx(m1["comm_buffers"] / 2)
    assert both["weight_buffer_bytes"] == pytest.approx(one["weight_buffer_bytes"] / 2)
    assert both["activation_bytes"] == pytest.approx(one["activation_bytes"] / 4)
    assert 0 < both["tokens_per_sec_per_rank"] < float("inf")


def test_tools_simulate_decides_the_tawpipe_layout_at_t_by_c_on_the_same_pricing():
    """--tawpipe-ownership auto --recompute auto at T = 2 x C = 2: the layout decided (one owner per shard) is
    predicted at the iteration time the simulation of its flags gives (the decision and the simulation price the
    virtual ranks the same way)."""
    run = simulate("--schedule", "tawpipe", "--ranks", "16", "--groups", "2", "--tensor-model-parallel-size", "2",
                   "--context-parallel-size", "2", "--inter-bw", "1GB/s", "--tawpipe-ownership", "auto",
                   "--recompute", "auto")["tawpipe"]
    choice = run["options"]["layout_choice"]
    assert choice["layout"]["ownership"] == "owner"
    assert choice["predicted_iteration_time"] == pytest.approx(run["iteration_time_s"], rel=1e-9)
    assert run["options"]["tensor_model_parallel_size"] == 2 and run["options"]["context_parallel_size"] == 2
