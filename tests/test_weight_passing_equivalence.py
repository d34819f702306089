"""weipipe / tawpipe train exactly like single-process data-parallel training."""

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, losses, tiny_args, train_rank


def _args(*extra, layers=8, micro_batch=1, global_batch=8):
    argv = tiny_args(*extra, train_iters=3, global_batch=global_batch, micro_batch=micro_batch)
    argv[argv.index("--num-layers") + 1] = str(layers)
    return argv


_REFERENCES = {}


def _reference(layers, global_batch):
    key = (layers, global_batch)
    if key not in _REFERENCES:
        (_REFERENCES[key],) = run_ranks(train_rank, 1, _args(layers=layers, global_batch=global_batch))
    return _REFERENCES[key]


CASES = [
    # (world, schedule flags, layers, global batch): 1 or 2 layers per shard, 1 or 3 micro-batches per rank
    (2, ["--pipeline-schedule", "weipipe"], 2, 2),
    (3, ["--pipeline-schedule", "weipipe"], 6, 9),
    (4, ["--pipeline-schedule", "weipipe"], 8, 4),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "1"], 4, 12),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2"], 8, 4),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "4"], 4, 4),
    (4, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "2", "--tawpipe-no-overlap"], 4, 12),
    (6, ["--pipeline-schedule", "tawpipe", "--tawpipe-num-groups", "3"], 6, 6),
]


@pytest.mark.parametrize("world,extra,layers,global_batch", CASES,
                         ids=[f"{e[1]}-P{w}-{'-'.join(e[2:])}-L{l}-B{b}" for w, e, l, b in CASES])
def test_matches_single_process_reference(world, extra, layers, global_batch):
    reference = _reference(layers, global_batch)
    per_rank = run_ranks(train_rank, world, _args(*extra, layers=layers, global_batch=global_batch))
    for records in per_rank:
        assert_close_rel(losses(records), losses(reference), 1e-5)
        assert_close_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in reference], 1e-5, "grad norm")
    assert losses(reference)[0] != losses(reference)[-1]
