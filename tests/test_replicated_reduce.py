"""The replicated parameters' gradients (embedding, final norm, output layer) all-reduced through the nodes
(``--tawpipe-replicated-reduce hierarchical``, the default): inside each node, across the nodes, back inside.
A plan over several nodes of several ranks says so in its actions; runs with it train like the single-process
reference under NCCL's ordering rules and on the plain transport (its stages on a thread of their own), with
tensors that are not a multiple of the node size (padded parts); the flat all-reduce stays selectable."""

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
], ids=["2x2-nccl-faithful", "2x3-direct"])
def test_trains_like_the_single_process_reference(ranks, extra, reference, tmp_path):
    save = str(tmp_path / "ckpt")
    argv = _args("--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", *extra, save=save)
    per_rank = run_ranks(train_rank, ranks, argv)
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)
