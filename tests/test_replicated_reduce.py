"""The replicated parameters' gradients (embedding, final norm, output layer) all-reduced through the nodes
(``--tawpipe-replicated-reduce hierarchical``, the default): inside each node, across the nodes, back inside.
A plan over several nodes of several ranks says so in its actions; runs with it train like the single-process
reference under NCCL's ordering rules and on the plain transport (its stages on a thread of their own), with
tensors that are not a multiple of the node size (padded parts); the flat all-reduce stays selectable. The
replicated parts' optimizer sharded over the ranks (``--tawpipe-replicated-reduce sharded``): its plans, their
validation and pricing, its runs against the same reference, evaluation after each step, its refusals."""

import datetime

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_trains_like, tiny_args, train_rank

from megatron_tawpipe.plan import actions as A
from megatron_tawpipe.plan import build_plan

ITERS = 3
LAYERS, BATCH = 6, 12


def _args(*extra, save):
    argv = tiny_args(*extra, train_iters=ITERS, global_batch=BATCH, micro_batch=1)
    argv[argv.index("--num-layers") + 1] = str(LAYERS)
    return argv + ["--save", save, "--save-interval", "1", "--distributed-timeout-minutes", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ref"))
    (records,) = run_ranks(train_rank, 1, _args(save=save))
    return records, save


def _replicated(plan):
    return [a for a in plan.actions[0] if type(a) is A.ReplicatedAllReduceStart]


def test_the_plan_reduces_through_the_nodes_where_there_are_several_of_several_ranks():
    def sizes(ranks, groups, **options):
        plan = build_plan("tawpipe", num_ranks=ranks, num_groups=groups, num_layers=LAYERS,
                          num_microbatches=2, **options)
        return {a.node_size for a in _replicated(plan)}

    assert sizes(4, 2) == {2}
    assert sizes(6, 2) == {3}
    assert sizes(6, 3, ownership="spread") == {2}
    assert sizes(4, 2, hierarchical_replicated=False) == {0}
    assert sizes(4, 1) == {0}        # one node: a ring inside it
    assert sizes(4, 4) == {0}        # one rank per node: a ring of the nodes already


@pytest.mark.parametrize("ranks,extra", [
    (4, ("--tawpipe-nccl-faithful",)),                  # 2 nodes of 2, NCCL's ordering rules
    (6, ()),                                            # 2 nodes of 3 (64-element norms: padded parts), gloo
    (4, ("--tawpipe-replicated-reduce", "sharded", "--tawpipe-nccl-faithful")),   # sharded, through the nodes
    (6, ("--tawpipe-replicated-reduce", "sharded")),    # sharded over 2 nodes of 3, padded slices, gloo
], ids=["2x2-nccl-faithful", "2x3-direct", "sharded-2x2-nccl-faithful", "sharded-2x3-direct"])
def test_trains_like_the_single_process_reference(ranks, extra, reference, tmp_path):
    save = str(tmp_path / "ckpt")
    argv = _args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", *extra, save=save)
    per_rank = run_ranks(train_rank, ranks, argv)
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)


class _LazyWork:
    """A collective whose result lands when it is waited for, as an asynchronous one may."""

    def __init__(self, land):
        self.land = land

    def wait(self, *args, **kwargs):
        if self.land is not None:
            self.land()
            self.land = None
        return True


def test_a_reduction_on_the_thread_is_done_when_its_handle_says_so(monkeypatch):
    """On a host-blocking backend the three stages run on the reducer's thread; its handle is done only once the
    last stage (the all-gather back into the gradient) has landed: torch.distributed is replaced by collectives
    that write their result only when waited for (two nodes of two ranks, every rank's gradients alike)."""
    import torch
    import torch.distributed as dist

    from megatron_tawpipe.runtime.node_reduce import NodeReducer

    def reduce_scatter(output, source, op=None, group=None, async_op=True):
        return _LazyWork(lambda: output.copy_(2 * source[:output.numel()]))

    def all_reduce(tensor, op=None, group=None, async_op=True):
        return _LazyWork(lambda: tensor.mul_(2))

    def all_gather(output, source, group=None, async_op=True):
        return _LazyWork(lambda: output.copy_(source.repeat(output.numel() // source.numel())))

    for name, fake in (("reduce_scatter_single", reduce_scatter), ("reduce_scatter_tensor", reduce_scatter),
                       ("all_reduce", all_reduce), ("all_gather_single", all_gather),
                       ("all_gather_into_tensor", all_gather)):
        monkeypatch.setattr(dist, name, fake, raising=False)
    grads = [torch.ones(8), torch.full((6,), 3.0)]
    reducer = NodeReducer()
    try:
        handle = reducer.submit(grads, "node", "cross", 2, "the replicated gradients")
        handle.wait(datetime.timedelta(seconds=30))
        assert torch.equal(grads[0], torch.full((8,), 4.0)) and torch.equal(grads[1], torch.full((6,), 12.0))
    finally:
        reducer.close()


# ------------------------------------------------------------------ the replicated parts' optimizer sharded
def _sharded(**options):
    return build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=LAYERS, num_microbatches=2,
                      sharded_replicated=True, **options)


def test_a_sharded_plan_gathers_the_weights_first_and_reduce_scatters_the_gradients_last():
    """Every rank: the embedding's and the head's weights all-gathered at the start (through the nodes), the head's
    waited only before the rank's first forward of the last shard; their gradients reduce-scattered at the end."""
    plan = _sharded()
    assert plan.options["sharded_replicated"] is True
    for actions in plan.actions:
        rep = [a for a in actions if type(a) is A.ReplicatedAllReduceStart]
        assert [(a.mode, a.part) for a in rep] == [("gather", "embedding"), ("gather", "head"),
                                                    ("scatter", "head"), ("scatter", "embedding")]
        assert {a.node_size for a in rep} == {2}
        waits = {a.tag: i for i, a in enumerate(actions) if type(a) is A.Wait}
        first_head = next(i for i, a in enumerate(actions) if type(a) is A.Forward and a.shard == plan.num_shards - 1)
        first_compute = next(i for i, a in enumerate(actions) if type(a) is A.Forward)
        assert waits[rep[0].tag] < first_compute < waits[rep[1].tag] < first_head
    flat = _sharded(hierarchical_replicated=False)
    assert {a.node_size for a in _replicated(flat)} == {0}


def test_the_validator_refuses_compute_before_the_weights_it_reads_were_gathered():
    import dataclasses

    from megatron_tawpipe.plan import validate_plan
    from megatron_tawpipe.plan.errors import PlanError
    from megatron_tawpipe.plan.plan import Plan

    plan = Plan.from_json(_sharded().to_json())
    validate_plan(plan)
    actions = plan.actions[0]
    gather = next(a for a in actions if type(a) is A.ReplicatedAllReduceStart and a.part == "embedding")
    wait = next(i for i, a in enumerate(actions) if type(a) is A.Wait and a.tag == gather.tag)
    first = next(i for i, a in enumerate(actions) if type(a) is A.Forward)
    actions.insert(first, actions.pop(wait))          # the wait after the rank's first forward of shard 0
    with pytest.raises(PlanError, match="compute of shard 0 before the replicated embedding weights were all-gathered"):
        validate_plan(plan)
    plan = Plan.from_json(_sharded().to_json())
    for actions in plan.actions:   # the head's reduce-scatter an all-reduce again, on every rank alike
        i = next(i for i, a in enumerate(actions) if type(a) is A.ReplicatedAllReduceStart and a.mode == "scatter")
        actions[i] = dataclasses.replace(actions[i], mode="sum")
    with pytest.raises(PlanError, match="an all-reduce of the replicated gradients in a plan that shards"):
        validate_plan(plan)


@pytest.mark.parametrize("backend,ratio", [("nccl", (4 + 2) / 8), ("gloo", (8 + 2) / 8)])
def test_the_simulator_prices_the_reduce_scatter_and_the_gather_and_the_slices_memory(backend, ratio):
    """Per parameter: an fp32 reduce-scatter and a bf16 all-gather against an fp32 all-reduce's 2 x 4 bytes (gloo's
    reduce-scatter moves an all-reduce's); each rank keeps the master and moments of 1/P of the replicated parts."""
    import dataclasses

    from megatron_tawpipe.sim.costmodel import CostModel
    from megatron_tawpipe.sim.simulate import simulate

    cost = dataclasses.replace(CostModel.from_flops(hidden_size=256, seq_length=512, ffn_hidden_size=704,
                                                    vocab_size=8192, num_attention_heads=4, dtype_bytes=2,
                                                    inter_bw=1e9, intra_bw=1e10), backend=backend)
    whole = simulate(build_plan("tawpipe", num_ranks=4, num_groups=2, num_layers=LAYERS, num_microbatches=2), cost)
    sharded = simulate(_sharded(), cost)
    assert sharded.replicated_allreduce_bytes == pytest.approx(ratio * whole.replicated_allreduce_bytes)
    assert whole.state_bytes - sharded.state_bytes == pytest.approx(12 * (1 - 1 / 4) * cost.replicated_params)


def test_the_sharded_replicated_optimizer_with_another_schedule_is_refused_in_one_line(monkeypatch):
    from megatron_tawpipe.arguments import ArgumentError, parse_args
    from megatron_tawpipe.training.validate_args import validate_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(tiny_args("--pipeline-schedule", "weipipe", "--tawpipe-replicated-reduce", "sharded")))
    assert "--tawpipe-replicated-reduce sharded applies to --pipeline-schedule tawpipe only" in str(info.value)
    assert "\n" not in str(info.value)


def test_evaluation_reads_the_stepped_replicated_weights(tmp_path):
    """Evaluation runs the plan forward only: its all-gather of the replicated weights runs too, so the validation
    loss after every step is the single-process reference's (not that of the weights before the step)."""
    from training_helpers import assert_close_rel

    evaluate = ("--eval-interval", "1", "--eval-iters", "1")
    one = run_ranks(train_rank, 1, tiny_args(*evaluate, train_iters=ITERS, global_batch=8))[0]
    four = run_ranks(train_rank, 4, tiny_args(*evaluate, "--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2",
                                              "--tawpipe-replicated-reduce", "sharded", train_iters=ITERS,
                                              global_batch=8))[0]
    validation = [r["validation_lm_loss"] for r in four if r.get("validation_lm_loss") is not None]
    expected = [r["validation_lm_loss"] for r in one if r.get("validation_lm_loss") is not None]
    assert len(validation) == len(expected) == ITERS
    assert_close_rel(validation, expected, 1e-5, "validation loss")
