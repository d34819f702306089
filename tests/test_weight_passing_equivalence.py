"""weipipe / tawpipe train exactly like single-process data-parallel training.

Every case runs 3 iterations with gradient clipping active and compares, against
a single-process run of the same model, initial weights and global batch
(megatron-core without pipelining, gradient accumulation over the whole batch):
the loss and gradient norm of every iteration, the gradients entering every optimizer step and
every parameter after it (both runs checkpoint each iteration; the files are compared, see
``training_helpers.assert_matches_reference``).
It also checks that the bytes the executor sent per link class equal the plan's.

The weight-passing runs use the executor's NCCL-faithful mode (``--tawpipe-nccl-faithful``):
their transfers obey NCCL's ordering rules on gloo, so a plan or executor change that would
hang on a GPU cluster fails here (after the timeout, naming rank and step) instead.
"""


import pytest

from distributed_harness import run_ranks
from megatron_tawpipe.arguments import LLAMA_FLAGS
from training_helpers import (assert_close_rel, assert_matches_reference, assert_same_parameters,  # noqa: F401
                              recompute_as_written,
                              losses, tiny_args, train_rank)  # (others import assert_same_parameters from here)

ITERS = 3


def _args(*extra, layers, global_batch, save=None, tied=False, architecture=LLAMA_FLAGS):
    argv = tiny_args(*extra, train_iters=ITERS, global_batch=global_batch, micro_batch=1, architecture=architecture)
    argv[argv.index("--num-layers") + 1] = str(layers)
    if tied:
        argv.remove("--untie-embeddings-and-output-weights")
    if save:
        argv += ["--save", save, "--save-interval", "1"]
    return recompute_as_written(argv)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(layers, global_batch, tied=False, architecture=LLAMA_FLAGS):
        key = (layers, global_batch, tied, tuple(architecture))
        if key not in cache:
            save = str(tmp_path_factory.mktemp(f"ref-L{layers}-B{global_batch}"))
            (records,) = run_ranks(train_rank, 1, _args(layers=layers, global_batch=global_batch, save=save,
                                                        tied=tied, architecture=architecture))
            cache[key] = (records, save)
        return cache[key]

    return get


CASES = [
    # world, schedule flags, layers, global batch (micro-batches per rank = batch / world)
    (2, ["--pipeline-schedule", "weipipe"], 2, 2),
    (2, ["--pipeline-schedule", "weipipe", "--tawpipe-no-recompute"], 4, 6),
    (3, ["--pipeline-schedule", "weipipe"], 6, 9),
    (4, ["--pipeline-schedule", "weipipe", "--tawpipe-no-recompute"], 4, 4),
    (4, ["--pipeline-schedule", "weipipe"], 8, 12),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "1"], 4, 12),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"], 8, 4),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-no-recompute"], 8, 12),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "4"], 4, 4),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-no-overlap"], 4, 12),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-microbatches-per-visit", "2"],
     8, 12),
    (6, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"], 6, 18),
    (6, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "3", "--tawpipe-no-recompute"], 12, 6),
    # Tied embedding and output weights: the output layer's gradient is part of the embedding's
    # replicated all-reduce, which starts only after shard 0's last backward.
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "tied"], 8, 8),
    # Shard 0 held in every group: its gradient all-reduced among the holders, stepped by each.
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-replicate-first-shard",
         "--tawpipe-microbatches-per-visit", "2", "tied"], 8, 12),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "4", "--tawpipe-replicate-first-shard"], 4, 8),
    (6, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "3", "--tawpipe-replicate-first-shard",
         "--tawpipe-no-recompute"], 6, 12),
    # Shards of different sizes (layers that the ranks do not divide): the default split (the first
    # L mod P shards one layer more), and Megatron-LM's flags choosing another.
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"], 6, 8),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "1"], 10, 8),
    (3, ["--pipeline-schedule", "weipipe"], 5, 6),
    (4, ["--pipeline-schedule", "weipipe"], 7, 8),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-no-recompute",
         "--tawpipe-replicate-first-shard", "--decoder-last-pipeline-num-layers", "3"], 6, 8),
    (3, ["--pipeline-schedule", "weipipe", "--tawpipe-no-recompute", "--pipeline-model-parallel-layout",
         "Et|ttt|tL"], 5, 6),
]


def _case_id(case):
    world, extra, layers, batch = case
    flags = "-".join(f.replace("--tawpipe-", "").replace("--", "").replace("|", "/") for f in extra[1:])
    per_shard = f"{layers // world}lps" if layers % world == 0 else f"L{layers}"
    return f"P{world}-{flags}-{per_shard}-{batch // world}mb"


@pytest.mark.parametrize("world,extra,layers,global_batch", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_single_process_reference(world, extra, layers, global_batch, reference, tmp_path):
    tied = "tied" in extra
    extra = [f for f in extra if f != "tied"]
    ref_records, ref_save = reference(layers, global_batch, tied)
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, world, _args(*extra, "--tawpipe-nccl-faithful", "--distributed-timeout-minutes",
                                                  "2", layers=layers, global_batch=global_batch, save=save,
                                                  tied=tied))
    for records in per_rank:
        assert_close_rel(losses(records), losses(ref_records), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in ref_records], 1e-5,
                         "grad norm")
    # Clipping was active (--clip-grad 1.0) and the model trained.
    assert max(r["grad_norm"] for r in ref_records) > 1.0
    assert losses(ref_records)[0] != losses(ref_records)[-1]
    # Gradients entering every optimizer step within 1e-5, parameters within what Adam makes of that.
    assert_matches_reference(save, ref_save, ITERS)
    # Bytes: what the executor sent equals what the plan prescribes (plan.simulate.link_bytes), every iteration.
    # (A ring all-reduce among a replicated shard's holders sends 2(n-1)/n of it per holder: each rank
    # counts that rounded to a byte.)
    slack = world if "--tawpipe-replicate-first-shard" in extra else 0
    for record in per_rank[0]:
        assert abs(record["inter_group_bytes"] - record["planned_inter_group_bytes"]) <= slack
        assert abs(record["intra_group_bytes"] - record["planned_intra_group_bytes"]) <= slack
    groups = int(extra[extra.index("--tawpipe-num-groups") + 1]) if "--tawpipe-num-groups" in extra else 1
    assert (per_rank[0][0]["inter_group_bytes"] > 0) == (groups > 1)
    assert (per_rank[0][0]["intra_group_bytes"] > 0) == (world // groups > 1)
