"""A split backward's input pass really leaves the weight-gradient kernels to its weight pass.

The decoder layers of a split plan are built with the deferred linear layers
(``megatron_tawpipe.models.deferred_linear``): B (``BackwardInput``) runs the input-gradient GEMMs and
stores each linear layer's input and output gradient, W (``BackwardWeight``) runs the weight-gradient
GEMMs from them. Checked here: the GEMM counts of B and W (the layers' own count and, independently,
every ``aten::mm``/``addmm`` dispatched), equal gradients to an unsplit backward (one process and two
tensor-parallel ranks, with and without sequence parallelism), the bytes the store holds, and whole
training runs of split plans against one process.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed_harness import run_ranks
from megatron_tawpipe.models.deferred_linear import TE_MIN_VERSION, WgradStore, deferred_wgrad_kind, te_wgrad_modules
from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan import build_plan, split_backward, validate_plan, write_plan
from megatron_tawpipe.arguments import LLAMA_FLAGS
from training_helpers import GPT_FLAGS, assert_trains_like, tiny_args, train_rank, recompute_as_written

ITERS = 3
GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


class GemmCounter(TorchDispatchMode):
    """Counts the matrix multiplies dispatched (CPU: what the linear layers' matmuls become)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in GEMMS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _templates(extra, architecture, layers=2):
    """A plain and a split-backward template of ``layers`` decoder layers with the same initial weights."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.data import build_tokenizer
    from megatron_tawpipe.distributed.initialize import initialize_distributed, initialize_model_parallel
    from megatron_tawpipe.runtime.shard_model import ShardTemplate
    from megatron_tawpipe.training.validate_args import validate_args

    argv = tiny_args(*extra, global_batch=2, architecture=architecture)
    argv[argv.index("--num-layers") + 1] = str(layers)
    args = validate_args(parse_args(argv))
    initialize_distributed(args)
    initialize_model_parallel(args)
    build_tokenizer(args)
    plain = ShardTemplate(args, (layers,), torch.device("cpu"))
    split = ShardTemplate(args, (layers,), torch.device("cpu"), split_backward=True)
    weights = torch.empty(plain.shard_numel)
    plain.init_shard(0, weights)
    plain.bind(weights)
    split.bind(weights)
    return args, plain, split, weights


def _layer_stack_equivalence(rank, extra, architecture):
    """One layer stack, split B then W against one unsplit backward: input and weight gradients, GEMM counts."""
    from megatron_tawpipe.distributed.initialize import destroy

    try:
        args, plain, split, weights = _templates(extra, architecture)
        tp = args.tensor_model_parallel_size
        seq = args.seq_length // tp if args.sequence_parallel else args.seq_length
        generator = torch.Generator().manual_seed(11)   # the same input and output gradient on every rank
        x = torch.randn(seq, 2, args.hidden_size, generator=generator)
        seed_grad = torch.randn(seq, 2, args.hidden_size, generator=generator)
        rotary = plain.rotary(args.seq_length)

        def run(template):
            hidden = x.clone().requires_grad_(True)
            return hidden, template.run_layers(hidden, rotary, None)

        hidden, out = run(plain)
        with GemmCounter() as unsplit:
            out.backward(seed_grad)
        reference = [p.grad.clone() for p in plain.layer_parameters()]

        store = split.wgrad_store
        hidden_s, out_s = run(split)
        assert torch.equal(out_s, out)
        with GemmCounter() as b_pass, store.recording((0, 0)):
            out_s.backward(seed_grad)
        held = {id(p): p.grad for p in split.layer_parameters() if p.grad is not None}
        linears = 4 * 2   # qkv, proj, fc1, fc2 per layer
        assert store.deferred_gemms == linears and store.eager_gemms == 0 and store.keys() == [(0, 0)]
        held_bytes = store.bytes_held()
        grads, biases = {}, 0
        split.unbind()   # W needs no weights: the stored inputs and output gradients only
        with GemmCounter() as w_pass:
            for entry in store.pop((0, 0)):
                grads[id(entry.weight)], bias = entry.compute()
                if bias is not None:   # the query-key-value bias, added inside the matrix multiply
                    grads[id(entry.bias)], biases = bias, biases + 1
        assert biases == (2 if args.add_bias_linear else 0)
        assert store.bytes_held() == 0 and store.keys() == []
        # B: the input-gradient GEMMs only; W: the weight-gradient GEMMs; together one unsplit backward's.
        assert b_pass.count == linears and w_pass.count == linears, (b_pass.count, w_pass.count)
        assert b_pass.count + w_pass.count == unsplit.count
        assert torch.equal(hidden_s.grad, hidden.grad)
        for param, expected in zip(split.layer_parameters(), reference):
            got = grads.get(id(param), held.get(id(param)))
            assert got is not None, param.shape
            assert (got - expected).abs().max() <= 1e-6 * max(1.0, expected.abs().max()), param.shape
        assert set(held) | set(grads) == {id(p) for p in split.layer_parameters()}
        assert not set(held) & set(grads)   # the norms in B, the linear weights in W
        # A backward the store does not record computes both, like megatron's (a plan's unsplit Backward).
        split.bind(weights)
        hidden_e, out_e = run(split)
        out_e.backward(seed_grad)
        assert store.eager_gemms == linears and store.deferred_gemms == linears
        assert torch.equal(hidden_e.grad, hidden.grad)
        for param, expected in zip(split.layer_parameters(), reference):
            assert torch.equal(param.grad, expected)
        return held_bytes, args.seq_length, args.hidden_size, args.ffn_hidden_size, args.kv_channels, \
            args.num_attention_heads, args.num_query_groups or args.num_attention_heads, tp
    finally:
        destroy()


def _store_formula(s, b, h, f, d, heads, groups, tp, bytes_per=4):
    """Per layer and micro-batch: qkv (input h, output (heads + 2 groups) d / T), proj (input heads d / T,
    output h), fc1 (input h, output 2 f / T, SwiGLU), fc2 (input f / T, output h); sequence-parallel inputs
    are stored gathered, so the sequence is the whole s either way."""
    return s * b * (4 * h + (2 * heads * d + 2 * groups * d + 3 * f) // tp) * bytes_per


STACKS = [(1, [], LLAMA_FLAGS), (1, ["--group-query-attention", "--num-query-groups", "2"], LLAMA_FLAGS),
          (2, ["--tensor-model-parallel-size", "2"], LLAMA_FLAGS),
          (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], LLAMA_FLAGS),
          (1, [], GPT_FLAGS), (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], GPT_FLAGS)]


@pytest.mark.parametrize("tp,extra,architecture", STACKS,
                         ids=["tp1", "tp1-gqa", "tp2", "tp2-sequence-parallel", "tp1-gpt", "tp2-sequence-parallel-gpt"])
def test_split_backward_of_a_layer_stack_equals_an_unsplit_one(tp, extra, architecture):
    results = run_ranks(_layer_stack_equivalence, tp, extra, architecture)
    for held_bytes, s, h, f, d, heads, groups, t in results:
        if architecture is LLAMA_FLAGS:   # (SwiGLU: fc1 gives 2 f)
            assert held_bytes == 2 * _store_formula(s, 2, h, f, d, heads, groups, t)   # two layers


def test_the_store_refuses_what_would_mix_backwards():
    store = WgradStore()
    with store.recording((0, 1)):
        with pytest.raises(RuntimeError, match="recording"):
            with store.recording((1, 1)):
                pass
    with pytest.raises(RuntimeError, match="holds"):
        with store.recording((0, 1)):
            pass
    with pytest.raises(RuntimeError, match="no weight-gradient work"):
        store.pop((2, 0))
    te = WgradStore("te")
    for key in ((0, 0), (1, 0)):
        with te.recording(key):
            pass
    with pytest.raises(RuntimeError, match="first in, first out"):
        te.pop((1, 0))
    assert te.pop((0, 0)) == [] and te.keys() == [(1, 0)]


def test_transformer_engine_path_is_chosen_by_backend_and_version():
    """Not run on a GPU here: the choice and what W calls. TE's layers defer with delay_wgrad_compute from 2.3."""
    assert deferred_wgrad_kind("sdpa") == deferred_wgrad_kind("local") == "local"
    assert deferred_wgrad_kind("te", version=TE_MIN_VERSION) == "te"
    assert deferred_wgrad_kind("te", version=(2, 8)) == "te"
    with pytest.raises(ValueError, match="Transformer Engine >= 2.3.*found 2.2.*--transformer-impl local"):
        deferred_wgrad_kind("te", version=(2, 2))

    class Leaf(torch.nn.Module):
        def backward_dw(self):
            pass

    class Parent(torch.nn.Module):   # (an attention module whose backward_dw calls its linears')
        def __init__(self):
            super().__init__()
            self.a, self.b, self.plain = Leaf(), Leaf(), torch.nn.Linear(2, 2)

        def backward_dw(self):
            pass

    layers = [torch.nn.Sequential(Parent(), torch.nn.LayerNorm(2)) for _ in range(2)]
    found = te_wgrad_modules(layers)
    assert len(found) == 4 and all(isinstance(m, Leaf) for m in found)   # each queue popped once


# ---- whole runs: split plans train like one process ------------------------------------------------------------

def _args(*extra, layers, global_batch, save, architecture=LLAMA_FLAGS):
    argv = tiny_args(*extra, train_iters=ITERS, global_batch=global_batch, micro_batch=1, architecture=architecture)
    argv[argv.index("--num-layers") + 1] = str(layers)
    return recompute_as_written(argv + ["--save", save, "--save-interval", "1"])


RUNS = [   # schedule (a split tawpipe plan: "tawpipe-split"), P, N, layers, flags
    ("weipipe-zb1", 2, 2, 2, []),
    ("weipipe-zb1", 3, 1, 3, ["--tawpipe-no-recompute"]),
    ("weipipe-zb1", 4, 2, 4, []),
    ("weipipe-zb2", 2, 2, 4, ["--tawpipe-no-recompute"]),
    ("weipipe-zb2", 3, 1, 3, []),
    ("weipipe-zb2", 4, 1, 4, []),
    ("tawpipe-split", 2, 2, 2, ["--tawpipe-no-recompute"]),
    ("tawpipe-split", 3, 1, 3, []),          # three groups of one rank
    ("tawpipe-split", 4, 2, 4, []),
]


@pytest.mark.parametrize("schedule,P,N,layers,extra", RUNS,
                         ids=[f"{c[0]}-P{c[1]}-N{c[2]}-L{c[3]}{''.join(c[4])}" for c in RUNS])
def test_split_plans_with_deferred_kernels_train_like_one_process(schedule, P, N, layers, extra, tmp_path):
    if schedule == "tawpipe-split":
        groups = {2: 1, 3: 3, 4: 2}[P]
        plan = split_backward(build_plan("tawpipe", num_ranks=P, num_groups=groups, num_layers=layers,
                                         num_microbatches=N))
        validate_plan(plan)
        assert A.Backward not in {type(a) for acts in plan.actions for a in acts}
        path = str(tmp_path / "split.json")
        write_plan(plan, path)
        flags = ["--pipeline-schedule", f"plan:{path}", "--tawpipe-num-groups", str(groups)]
    else:
        flags = ["--pipeline-schedule", "weipipe", "--weipipe-zero-bubble", schedule[-1]]
    ref_save, save = str(tmp_path / "reference"), str(tmp_path / "split")
    (reference,) = run_ranks(train_rank, 1, _args(layers=layers, global_batch=P * N, save=ref_save))
    per_rank = run_ranks(train_rank, P, _args(*flags, "--tawpipe-nccl-faithful", *extra, layers=layers,
                                              global_batch=P * N, save=save))
    assert_trains_like(per_rank, reference, save, ref_save, ITERS)


TP_RUNS = [   # zero-bubble variant, world (T = 2: P / 2 virtual ranks), layers, global batch, flags, architecture
    (1, 4, 2, 6, ["--sequence-parallel"], GPT_FLAGS),   # biases (the query-key-value bias deferred too), LayerNorm
    (2, 4, 4, 4, ["--tawpipe-no-recompute"], LLAMA_FLAGS),
]


@pytest.mark.parametrize("variant,world,layers,global_batch,extra,architecture", TP_RUNS,
                         ids=[f"wzb{c[0]}-P{c[1]}-T2-L{c[2]}{''.join(c[4])}" for c in TP_RUNS])
def test_tensor_parallel_zero_bubble_with_deferred_kernels_trains_like_one_process(
        variant, world, layers, global_batch, extra, architecture, tmp_path):
    """The input-gradient all-reduce (and sequence-parallel gather / reduce-scatter) of the deferred layers
    in B, the weight-gradient kernels on the gathered inputs in W."""
    ref_save, save = str(tmp_path / "reference"), str(tmp_path / "split")
    (reference,) = run_ranks(train_rank, 1, _args(layers=layers, global_batch=global_batch, save=ref_save,
                                                  architecture=architecture))
    per_rank = run_ranks(train_rank, world, _args(
        "--pipeline-schedule", "weipipe", "--weipipe-zero-bubble", str(variant), "--tensor-model-parallel-size", "2",
        "--tawpipe-nccl-faithful", *extra, layers=layers, global_batch=global_batch, save=save,
        architecture=architecture))
    assert_trains_like(per_rank, reference, save, ref_save, ITERS)
