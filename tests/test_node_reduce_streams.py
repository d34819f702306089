"""On CUDA the stages of a collective through the nodes are ordered on a side stream, not on the compute stream.

No GPU here: torch.cuda's stream, event and current-stream calls and torch.distributed's collectives are replaced
by recorders, and the transport is asked for the hierarchical all-reduce and the sharded optimizer's scatter and
gather as it is on a GPU. What is checked is the order the streams are told to keep: the compute stream waits for
nothing until the plan's wait, and then for the side stream's end only; every stage is issued on the side stream,
which waits for the compute stream first and for each stage before the next.
"""

from __future__ import annotations

import contextlib
import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_tawpipe.runtime import node_reduce
from megatron_tawpipe.runtime.transport import DirectTransport, Op


class Recorder:
    def __init__(self):
        self.log = []
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self.works = 0


class FakeStream:
    def __init__(self, rec, name):
        self.rec, self.name = rec, name

    def wait_stream(self, other):
        self.rec.log.append((self.name, "waits stream", other.name))

    def wait_event(self, event):
        self.rec.log.append((self.name, "waits event", event.name))


class FakeEvent:
    def __init__(self, rec):
        self.rec, self.name = rec, None

    def record(self, stream):
        self.name = f"end of {stream.name}"
        self.rec.log.append((stream.name, "records", self.name))


class FakeWork:
    def __init__(self, rec, what):
        rec.works += 1
        self.rec, self.name = rec, f"{what} #{rec.works}"
        rec.log.append((rec.current.name, "issues", self.name))

    def wait(self, timeout=None):
        self.rec.log.append((self.rec.current.name, "waits work", self.name))
        return True


@pytest.fixture
def rec(monkeypatch):
    rec = Recorder()
    made = []

    def stream_class(device=None):
        made.append(FakeStream(rec, "side"))
        return made[-1]

    @contextlib.contextmanager
    def use(stream):
        before, rec.current = rec.current, stream
        try:
            yield
        finally:
            rec.current = before

    monkeypatch.setattr(torch.cuda, "Stream", stream_class)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: rec.current)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(rec))
    for name, what in (("all_reduce", "all-reduce"), ("reduce_scatter_tensor", "reduce-scatter"),
                       ("reduce_scatter_single", "reduce-scatter"), ("all_gather_into_tensor", "all-gather"),
                       ("all_gather_single", "all-gather")):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, lambda *a, _what=what, **k: FakeWork(rec, _what))
    rec.made = made
    return rec


def _op(kind, tensors):
    action = SimpleNamespace(node_size=2)
    return Op(tag=1, action=action, step=0, kind=kind, tensors=tensors, group=object(), ranks=(0, 1, 2, 3),
              subgroups=(object(), object()))


CASES = {
    "allreduce": lambda: [torch.zeros(8), torch.zeros(5)],   # the second one padded to a multiple of 2
    node_reduce.SHARDED_KINDS["scatter"]: lambda: [torch.zeros(2), torch.zeros(8)],
    node_reduce.SHARDED_KINDS["gather"]: lambda: [torch.zeros(8), torch.zeros(2)],
}


@pytest.mark.parametrize("kind", list(CASES))
def test_stages_through_the_nodes_wait_on_a_side_stream_and_compute_only_at_the_plans_wait(rec, kind):
    transport = DirectTransport(torch.device("cuda", 0))
    tensors = CASES[kind]()
    handle = transport._collective(_op(kind, tensors))
    issued = [entry for entry in rec.log if entry[1] == "issues"]
    assert issued and all(stream == "side" for stream, _, _ in issued), rec.log
    assert rec.log[0] == ("side", "waits stream", "compute"), rec.log   # the gradients are written first
    assert not [e for e in rec.log if e[0] == "compute"], rec.log       # compute goes on until the plan waits
    # on the side stream each stage is waited before the next stage of its tensor is issued, and every work
    # before the end is recorded
    recorded = next(j for j, e in enumerate(rec.log) if e[1] == "records")
    waits = {e[2]: j for j, e in enumerate(rec.log) if e[:2] == ("side", "waits work")}
    issued_at = [j for j, e in enumerate(rec.log) if e[1] == "issues"]
    assert all(waits.get(rec.log[j][2], recorded + 1) < recorded for j in issued_at), rec.log
    stages = 3 if kind == "allreduce" else 2
    for k in range(0, len(issued_at), stages):   # one tensor's stages are issued one after another
        chain = issued_at[k:k + stages]
        for this, following in zip(chain, chain[1:]):
            assert this < waits[rec.log[this][2]] < following, rec.log
    assert all(any(t is k for k in handle.works[0].tensors) for t in tensors)   # kept until the plan's wait
    before = len(rec.log)
    handle.wait(None)
    assert rec.log[before:] == [("compute", "waits event", "end of side")]
    assert handle.works[0].tensors == []
    transport._collective(_op(kind, CASES[kind]()))
    assert len(rec.made) == 1   # one side stream per transport


def test_host_blocking_transport_keeps_its_thread_and_makes_no_stream(rec):
    # gloo: the stages run on the reducer's thread; no CUDA stream is made
    transport = DirectTransport(torch.device("cpu"))
    handle = transport._collective(_op("allreduce", [torch.zeros(8)]))
    handle.wait(datetime.timedelta(seconds=10))
    transport.close()
    assert rec.made == []
    assert [e[0] for e in rec.log if e[1] == "issues"] == ["compute"] * 3


def _side_stream_on_cuda() -> dict:
    """One NCCL rank: each collective through the nodes (node groups of one) issued through the transport as on
    a cluster, a compute kernel queued between its start and the plan's wait, the results read after the wait."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        world = dist.group.WORLD
        transport = DirectTransport(device)
        out = {}
        grads = torch.arange(10, dtype=torch.float32, device=device)
        for kind, tensors in (("allreduce", [grads.clone()]),
                              (node_reduce.SHARDED_KINDS["scatter"], [torch.zeros(10, device=device), grads.clone()]),
                              (node_reduce.SHARDED_KINDS["gather"], [torch.zeros(10, device=device), grads.clone()])):
            op = Op(tag=1, action=SimpleNamespace(node_size=1), step=0, kind=kind, tensors=tensors, group=world,
                    ranks=(0, 1), subgroups=(world, world))
            handle = transport._collective(op)
            busy = torch.ones(256, 256, device=device) @ torch.ones(256, 256, device=device)   # compute meanwhile
            handle.wait(None)
            out[kind] = (tensors[0].cpu().tolist(), float(busy[0, 0]))
        torch.cuda.synchronize()
        return {"results": out, "expected": grads.cpu().tolist()}
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_collectives_through_the_nodes_run_on_a_cuda_side_stream():
    """On the GPU: the side stream, its event and NCCL's collectives issued under it give each collective's
    result (a group of one: the tensor itself) after the plan's wait, with compute queued in between."""
    from test_cuda_one_rank import run_in_fresh_process

    out = run_in_fresh_process(_side_stream_on_cuda)
    for kind, (values, busy) in out["results"].items():
        assert values == out["expected"], kind
        assert busy == 256.0
