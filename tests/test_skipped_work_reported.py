"""Work the product skips to keep a run going is reported, once, and counted: a background-save retention
delete that fails, a collective whose bytes cannot be counted."""

import inspect
import os

from megatron_tawpipe.bench.collective_bytes import CollectiveCounter, summarize_counts
from megatron_tawpipe.checkpoint import retention


def test_a_retention_delete_that_fails_is_said_and_leaves_the_latest(tmp_path, monkeypatch, caplog):
    root = tmp_path / "ckpt"
    for iteration in (3, 4):
        (root / f"iter_{iteration:07d}").mkdir(parents=True)
        (root / f"iter_{iteration:07d}" / "stuck.distcp").write_text("x")
    (root / "iter_0000003.deleting").mkdir()   # left by a run killed while deleting
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if os.fspath(path).endswith("stuck.distcp"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level("WARNING", logger=retention.__name__):
        assert retention.delete_checkpoint(str(root), 3, latest=4) == str(root / "iter_0000003")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "iter_0000003.deleting could not be removed" in warnings[0], warnings
    assert "PermissionError" not in warnings[0] and "Permission denied" in warnings[0]
    assert sorted(os.listdir(root)) == ["iter_0000003.deleting", "iter_0000004"]
    assert (root / "iter_0000004" / "stuck.distcp").exists()


def test_a_collective_that_cannot_be_counted_is_said_once_and_counted(capsys):
    counter = CollectiveCounter(rank=0, ranks_per_node=2)
    calls = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append(tensor)
        return "done"

    counted = counter._wrap(all_reduce, "all_reduce", inspect.signature(all_reduce))
    # No process group here: counting fails, the call itself still runs.
    assert counted("not a tensor") == "done" and counted("again") == "done"
    assert calls == ["not a tensor", "again"]
    err = capsys.readouterr().err
    assert err.count("collective bytes, rank 0: a all_reduce call was not counted") == 1, err
    assert counter.to_json()["uncounted"] == {"all_reduce": 2}
    summary = summarize_counts([counter.to_json(), dict(counter.to_json(), rank=1)], train_iters=1, warmup=0)
    assert summary["uncounted_calls"] == {"all_reduce": 4}
