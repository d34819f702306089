"""The replicated parameters' gradients (embedding, final norm, output layer) all-reduced through the nodes
(``--tawpipe-replicated-reduce hierarchical``, the default): inside each node, across the nodes, back inside.
A plan over several nodes of several ranks says so in its actions; runs with it train like the single-process
reference under NCCL's ordering rules and on the plain transport (its stages on a thread of their own), with
tensors that are not a multiple of the node size (padded parts); the flat all-reduce stays selectable."""

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
