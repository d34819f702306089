"""Micro-batches: Megatron's pretraining samplers, the data iterator and :func:`get_batch`.

Step ``k`` covers the global sample indices ``[consumed + k*mbs*dp, consumed + (k+1)*mbs*dp)`` and
data-parallel rank ``d`` takes the slice ``[d*mbs, (d+1)*mbs)`` of each step (``--dataloader-type
cyclic``: Megatron-LM's random sampler instead).
"""

from __future__ import annotations

import atexit
import functools
import weakref
from typing import Dict, Iterator, List, Optional


class MicroBatchSampler:
    """Megatron's pretraining sampler: consecutive global indices, sliced per DP rank.

    Step ``k`` covers global sample indices ``[consumed + k*M*D, consumed + (k+1)*M*D)``
    (M = micro batch size, D = data-parallel size); rank ``d`` yields the slice
    ``[d*M, (d+1)*M)`` of that step.  The last partial step is dropped.  With ``cyclic``
    the index wraps around the dataset (index mod len) and the iteration never ends.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, cyclic: bool = False) -> None:
        if total_samples <= 0:
            raise ValueError(f"the dataset is empty (total samples {total_samples})")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data-parallel rank {data_parallel_rank} is outside data-parallel size {data_parallel_size}"
            )
        if consumed_samples < 0:
            raise ValueError(f"consumed samples must be >= 0, got {consumed_samples}")
        if not cyclic and consumed_samples >= total_samples:
            raise ValueError(
                f"all {total_samples} samples of the dataset are consumed (consumed samples {consumed_samples})"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.cyclic = bool(cyclic)

    @property
    def step(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        if self.cyclic:
            raise TypeError("a cyclic sampler has no length")
        return (self.total_samples - self.consumed_samples) // self.step

    def __iter__(self) -> Iterator[List[int]]:
        start = self.consumed_samples
        lo = self.data_parallel_rank * self.micro_batch_size
        while self.cyclic or start + self.step <= self.total_samples:
            first = start + lo
            yield [(first + i) % self.total_samples for i in range(self.micro_batch_size)]
            start += self.step


class RandomMicroBatchSampler:
    """Megatron-LM's ``--dataloader-type cyclic`` sampler: epochs over the dataset, each in its own random
    order (a permutation seeded by the epoch number), endless.

    The dataset is cut to a multiple of ``M*D`` samples (the rest is never seen); each data-parallel rank
    owns a contiguous bucket of ``1/D`` of it and walks that bucket in the epoch's order, ``M`` samples per
    micro-batch. Resuming after ``consumed_samples`` (global samples) continues exactly where an
    uninterrupted run would be.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        self.step = int(micro_batch_size) * int(data_parallel_size)
        self.active = int(total_samples) - int(total_samples) % self.step
        if self.active <= 0:
            raise ValueError(f"the dataset has {total_samples} samples, fewer than one micro-batch on every "
                             f"data-parallel rank ({self.step})")
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)

    def __iter__(self) -> Iterator[List[int]]:
        import torch

        bucket = self.active // self.data_parallel_size
        start = self.data_parallel_rank * bucket
        consumed = self.consumed_samples
        while True:
            epoch, in_epoch = divmod(consumed, self.active)
            generator = torch.Generator()
            generator.manual_seed(epoch)
            order = torch.randperm(bucket, generator=generator).tolist()
            offset = in_epoch // self.data_parallel_size
            for first in range(offset, bucket - self.micro_batch_size + 1, self.micro_batch_size):
                yield [start + x for x in order[first:first + self.micro_batch_size]]
            consumed = (epoch + 1) * self.active


class DataIterator:
    """A rank's micro-batch iterator over a ``torch.utils.data.DataLoader``, which its owner ends.

    ``next()`` gives the next batch; :meth:`close` ends the loader's worker processes at once (each worker
    returns from its loop and is joined), whatever else still refers to the iterator. The training loop closes
    its iterators when training ends, fails or stops on a signal; an iterator left open is closed when the
    interpreter exits, before multiprocessing joins its children (a worker that leaves ``--exit-signal`` to its
    rank would otherwise never end). A worker whose rank dies ends on its own within seconds (the loader's
    workers watch their parent).
    """

    def __init__(self, loader) -> None:
        self._loader = loader
        self._iterator = iter(loader)
        _live_iterators().add(self)

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self):
        if self._iterator is None:
            raise StopIteration
        return next(self._iterator)

    @property
    def closed(self) -> bool:
        return self._iterator is None

    def close(self) -> None:
        """End the worker processes now (idempotent). Later ``next()`` calls raise ``StopIteration``."""
        iterator, self._iterator, self._loader = self._iterator, None, None
        if iterator is None:
            return
        # torch's multi-process loader iterator shuts its workers down (a stop message to each, a join, then a
        # terminate for any that hangs) in this method, which it otherwise runs only when garbage collected.
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> "DataIterator":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


_LIVE: Optional["weakref.WeakSet[DataIterator]"] = None


def _live_iterators() -> "weakref.WeakSet[DataIterator]":
    global _LIVE
    if _LIVE is None:
        _LIVE = weakref.WeakSet()
        # Registered after multiprocessing's own exit handler (imported with torch): runs before it.
        atexit.register(close_all_data_iterators)
    return _LIVE


def close_all_data_iterators() -> int:
    """Close every data iterator of this process still open; returns how many were."""
    if _LIVE is None:
        return 0
    open_ones = [it for it in list(_LIVE) if not it.closed]
    for iterator in open_ones:
        iterator.close()
    return len(open_ones)


def close_data_iterators(iterators) -> None:
    """Close each of ``iterators`` (None entries and iterators of other kinds are skipped)."""
    for iterator in iterators or ():
        if isinstance(iterator, DataIterator):
            iterator.close()


def build_data_iterator(dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                        consumed_samples: int, *, num_workers: int = 0, cyclic: bool = False,
                        pin_memory: Optional[bool] = None, ignore_signal: Optional[int] = None,
                        dataloader_type: str = "single", device=None) -> Optional[DataIterator]:
    """Iterator over this data-parallel rank's micro-batches (dicts of batched CPU tensors).

    Deterministic and resumable: the batches after ``consumed_samples`` (global samples,
    i.e. iterations * global batch size) are those an uninterrupted run would see.
    Finite (until the dataset is used up) unless ``cyclic``; ``dataloader_type`` ``cyclic`` is Megatron-LM's
    random sampler (:class:`RandomMicroBatchSampler`), endless.  Returns None for a None
    dataset (ranks that build no data).  Worker processes ignore ``ignore_signal`` (the signal
    ``--exit-signal-handler`` leaves to the training process).  ``pin_memory`` None (the default) pins
    the batches when they go to a GPU (:func:`pin_memory_for` of ``device``, default this rank's device).
    The caller ends the workers with :meth:`DataIterator.close`.
    """
    if dataset is None:
        return None
    import torch

    if pin_memory is None:
        from megatron_tawpipe.common.device import current_device

        pin_memory = pin_memory_for(current_device() if device is None else device)

    if dataloader_type == "cyclic":  # Megatron-LM's random sampler
        sampler = RandomMicroBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    else:
        sampler = MicroBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank,
                                    dp_size, cyclic=cyclic)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=int(num_workers),
        pin_memory=bool(pin_memory),
        worker_init_fn=(functools.partial(_ignore_signal_in_worker, ignore_signal)
                        if ignore_signal is not None and int(num_workers) > 0 else None),
    )
    return DataIterator(loader)


def pin_memory_for(device) -> bool:
    """Whether the loader pins its batches for ``device``: for a CUDA device. :func:`get_batch` copies them
    with ``non_blocking=True``, which overlaps with compute only from pinned (page-locked) host memory; from
    pageable memory the copy waits for the GPU. On the CPU there is nothing to copy to."""
    import torch

    return torch.device(device).type == "cuda"


def _ignore_signal_in_worker(signum: int, _worker_id: int) -> None:
    import signal

    signal.signal(signum, signal.SIG_IGN)


def get_batch(data_iterator, device):
    """Next micro-batch on ``device``: (tokens, labels, loss_mask, attention_mask|None, position_ids).

    Returns five Nones for a None iterator (pipeline stages that take no data).
    """
    if data_iterator is None:
        return None, None, None, None, None
    batch = next(data_iterator)

    def move(t):
        return None if t is None else t.to(device, non_blocking=True)

    return (
        move(batch["tokens"]),
        move(batch["labels"]),
        move(batch["loss_mask"]),
        move(batch.get("attention_mask")),
        move(batch["position_ids"]),
    )
