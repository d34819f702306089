import json
import pytest
from distributed_harness import run_ranks
from training_helpers import assert_close_rel, assert_trains_like, losses, tiny_args, train_rank
from megatron_tawpipe.plan.tawpipe import plan_tawpipe
from test_tawpipe_spread_training import _args, reference, LAYERS, BATCH, ITERS


@pytest.mark.parametrize("D,G,own", [(3, 1, "spread"), (2, 2, "spread"), (2, 1, "owner")])
def test_v2(D, G, own, reference, tmp_path):
    plan = plan_tawpipe(D * G, D, LAYERS, BATCH // (D * G), ownership=own, shards_per_rank=2)
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    save = str(tmp_path / "ckpt")
    per_rank = run_ranks(train_rank, D * G, _args("--pipeline-schedule", f"plan:{path}", "--tawpipe-num-groups", str(D),
                                              "--tawpipe-nccl-faithful", "--tawpipe-shards-per-rank", "2", save=save))
    assert_trains_like(per_rank, reference[0], save, reference[1], ITERS)
