"""Data pipeline: tokenizers, Megatron indexed datasets, samplers and batches.

Everything here runs on megatron-core's data stack:

* tokenizers come from ``megatron.core.tokenizers`` (SentencePiece, Null);
* documents are stored in Megatron's ``.bin``/``.idx`` indexed format written by
  ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``, the same files that
  Megatron-LM's ``tools/preprocess_data.py`` produces;
* training/validation/test splits are built by ``BlendedMegatronDatasetBuilder`` with
  ``GPTDataset`` (or ``MockGPTDataset`` for ``--mock-data``);
* micro-batches follow Megatron's pretraining sampler: step ``k`` covers the global sample
  indices ``[consumed + k*mbs*dp, consumed + (k+1)*mbs*dp)`` and data-parallel rank ``d``
  takes the slice ``[d*mbs, (d+1)*mbs)`` of each step.

``args`` is an ``argparse.Namespace`` with Megatron-LM attribute names.  Attributes that
are not present fall back to Megatron-LM's defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple


from megatron_tawpipe.data_checks import (check_indexed_dataset, check_token_ids, check_tokenizer_record,
                                          tokenizer_fingerprint)

logger = logging.getLogger(__name__)

from megatron_tawpipe.data.tokenizers import (SENTENCEPIECE_TOKENIZERS, SUPPORTED_TOKENIZERS, _arg, build_tokenizer,
                                              load_tokenizer, pad_vocab_size, tokenizer_files, tokenizer_options)
from megatron_tawpipe.data.preprocess import (indexed_dataset_path, iter_documents, train_sentencepiece,
                                              write_indexed_dataset)

DEFAULT_SPLIT = "969,30,1"

__all__ = [
    "SENTENCEPIECE_TOKENIZERS",
    "SUPPORTED_TOKENIZERS",
    "build_tokenizer",
    "load_tokenizer",
    "tokenizer_files",
    "tokenizer_options",
    "pad_vocab_size",
    "validate_data_args",
    "check_data_files",
    "parse_data_path",
    "parse_split",
    "dataset_sizes",
    "build_datasets",
    "MicroBatchSampler",
    "RandomMicroBatchSampler",
    "build_data_iterator",
    "get_batch",
    "train_sentencepiece",
    "iter_documents",
    "write_indexed_dataset",
    "indexed_dataset_path",
]


# ---------------------------------------------------------------------------------------
# Argument parsing helpers and validation
# ---------------------------------------------------------------------------------------


def parse_data_path(data_path: Optional[Sequence[str]]) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Megatron blend syntax -> (prefixes, weights or None).

    ``["prefix"]`` or ``["p1", "p2"]`` -> weights None (proportional to dataset sizes);
    ``["w1", "p1", "w2", "p2"]`` -> explicit weights.  Items may also hold several
    whitespace-separated tokens (``["0.3 p1 0.7 p2"]``).
    """
    if data_path is None:
        return None
    if isinstance(data_path, str):
        data_path = [data_path]
    items = [tok for item in data_path for tok in str(item).split()]
    if not items:
        return None

    def as_float(s):
        try:
            return float(s)
        except ValueError:
            return None

    if len(items) % 2 == 1:
        return items, None
    weights = [as_float(w) for w in items[0::2]]
    if all(w is None for w in weights):
        return items, None
    if any(w is None for w in weights):
        raise ValueError(
            f"--data-path {' '.join(items)!r} mixes weights and prefixes; use 'prefix ...' or 'w1 prefix1 w2 prefix2 ...'"
        )
    if any(w <= 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"--data-path weights must be positive numbers, got {items[0::2]}")
    return list(items[1::2]), weights


def parse_split(split: str) -> List[float]:
    """'969,30,1' -> normalized [train, valid, test] fractions (missing entries are 0)."""
    # Megatron-LM reads the numbers and ignores the rest, so a script's quoted "'99,1,0'" works.
    text = str(split).strip().strip("'\"")
    parts = [p.strip() for p in re.split(r"[,/]", text)] if text else []
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = None
    if (not values or len(values) > 3 or any(not math.isfinite(v) or v < 0 for v in values)
            or sum(values) <= 0):
        raise ValueError(
            f"--split {split!r} is invalid: expected 1-3 non-negative comma-separated weights "
            f"with a positive sum, e.g. {DEFAULT_SPLIT}"
        )
    values = values + [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def _split_bookends(split: List[float]) -> List[Optional[Tuple[float, float]]]:
    ends, acc = [], 0.0
    for v in split:
        ends.append(None if v == 0 else (acc, acc + v))
        acc += v
    return ends


def _idx_counts(prefix: str) -> Tuple[int, int]:
    """(sequence count, document count) of a Megatron .idx, after checking the .bin/.idx pair."""
    info = check_indexed_dataset(prefix, "--data-path")
    return info.sequence_count, info.document_count


def _tokenizer_vocab(args, vocab_size: Optional[int] = None) -> Optional[Tuple[int, str, str]]:
    """(number of token ids, message start naming the flag, hint) for the tokenizer of ``args``.

    ``vocab_size`` is the built tokenizer's size when there is one; otherwise it is read
    from the flags (SentencePiece: pieces in the model; NullTokenizer: --vocab-size ids
    plus the eod id --vocab-size).  None when neither gives a size.
    """
    if getattr(args, "tokenizer_type", None) in SENTENCEPIECE_TOKENIZERS:
        model = getattr(args, "tokenizer_model", None)
        if vocab_size is None:
            import sentencepiece

            vocab_size = sentencepiece.SentencePieceProcessor(model_file=model).get_piece_size()
        return (int(vocab_size), f"--tokenizer-model {model} has {int(vocab_size)} tokens",
                "the data was tokenized with another tokenizer")
    null_vocab = getattr(args, "vocab_size", None)
    if getattr(args, "tokenizer_type", None) != "NullTokenizer" or null_vocab is None:
        if vocab_size is None:
            return None
        return (int(vocab_size), f"the tokenizer has {int(vocab_size)} tokens",
                "the data was tokenized with another tokenizer")
    null_vocab = int(null_vocab)
    # megatron-core's null tokenizer: --vocab-size ids plus the eod --vocab-size up to 0.18,
    # --vocab-size ids with the eod --vocab-size - 1 from 0.19 (as Megatron-LM of each release).
    null = load_tokenizer("NullTokenizer", None, null_vocab)
    if vocab_size is None:
        vocab_size = null.vocab_size
    return (int(vocab_size),
            f"--vocab-size {null_vocab} gives the NullTokenizer {int(vocab_size)} token ids "
            f"(0..{int(vocab_size) - 1}, eod {null.eod})",
            "the data was tokenized with another tokenizer or a larger --vocab-size")


def check_data_files(args, vocab_size: Optional[int] = None) -> None:
    """Check each --data-path prefix: an intact .bin/.idx pair whose ids fit the tokenizer.

    Raises ValueError with one line naming the flag and file (see ``data_checks``).  A
    no-op for --mock-data.  ``vocab_size`` overrides the tokenizer size read from the flags.
    """
    if getattr(args, "mock_data", False):
        return
    blend = parse_data_path(getattr(args, "data_path", None))
    if blend is None:
        return
    infos = [check_indexed_dataset(prefix, "--data-path") for prefix in dict.fromkeys(blend[0])]
    vocab = _tokenizer_vocab(args, vocab_size)
    if vocab is not None:
        tokenizer_type = getattr(args, "tokenizer_type", None)
        files = tokenizer_files(tokenizer_type, getattr(args, "tokenizer_model", None),
                                getattr(args, "vocab_file", None), getattr(args, "merge_file", None))
        fingerprint = tokenizer_fingerprint(tokenizer_type, files, vocab[0])
        flag = (f"--vocab-file {args.vocab_file}" if tokenizer_type == "GPT2BPETokenizer" else
                f"--tokenizer-model {args.tokenizer_model}" if files else
                f"--vocab-size {args.vocab_size}" if tokenizer_type == "NullTokenizer" else "the tokenizer")
        for info in infos:
            check_token_ids(info, *vocab)  # the most concrete message first: an id the tokenizer lacks
            check_tokenizer_record(info.prefix, fingerprint, flag)  # also catches a larger tokenizer


def _check_splits_nonempty(prefixes: Sequence[str], split_text: str) -> None:
    """Refuse a split that has a share in --split but no documents.

    megatron-core's GPTDataset never terminates when asked for samples from an empty
    document range (it keeps adding epochs of zero tokens), so catch it here.
    """
    split = parse_split(split_text)
    for prefix in prefixes:
        num_sequences, _ = _idx_counts(prefix)
        for name, bookend in zip(("train", "valid", "test"), _split_bookends(split)):
            if bookend is None:
                continue
            beg = int(round(bookend[0] * num_sequences))
            end = int(round(bookend[1] * num_sequences))
            if end <= beg:
                raise ValueError(
                    f"--split {split_text!r} leaves the {name} split of {prefix} empty "
                    f"({num_sequences} documents); give it a larger share or 0"
                )


def validate_data_args(args) -> None:
    """Check the data/tokenizer flags; raise ValueError with one line naming the flag/file.

    Runs without torch.distributed and without building anything.  Each --data-path
    prefix must be an intact .bin/.idx pair whose token ids fit the tokenizer
    (``check_data_files``); --mock-data skips the data checks.
    """
    ttype = getattr(args, "tokenizer_type", None)
    if ttype not in SUPPORTED_TOKENIZERS:
        raise ValueError(
            f"--tokenizer-type {ttype!r} is not supported; use one of {', '.join(SUPPORTED_TOKENIZERS)}"
        )
    if ttype in SENTENCEPIECE_TOKENIZERS:
        model = getattr(args, "tokenizer_model", None)
        if not model:
            raise ValueError(f"--tokenizer-model is required with --tokenizer-type {ttype}")
        if not os.path.isfile(model):
            raise ValueError(f"--tokenizer-model: file not found: {model}")
        if not os.access(model, os.R_OK):
            raise ValueError(f"--tokenizer-model: file is not readable: {model}")
        try:
            import sentencepiece

            sentencepiece.SentencePieceProcessor(model_file=model)
        except Exception:
            raise ValueError(f"--tokenizer-model: not a valid SentencePiece model: {model}") from None
    elif ttype == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", getattr(args, "vocab_file", None)),
                           ("--merge-file", getattr(args, "merge_file", None))):
            if not path:
                raise ValueError(f"{flag} is required with --tokenizer-type GPT2BPETokenizer")
            if not os.path.isfile(path):
                raise ValueError(f"{flag}: file not found: {path}")
    elif ttype in ("HuggingFaceTokenizer", "TikTokenizer"):
        model = getattr(args, "tokenizer_model", None)
        if not model:
            raise ValueError(f"--tokenizer-model is required with --tokenizer-type {ttype}")
        if not os.path.exists(model):
            raise ValueError(f"--tokenizer-model: not found: {model} (tokenizers are read from local files)")
    else:
        vocab = getattr(args, "vocab_size", None)
        if vocab is None:
            raise ValueError("--vocab-size is required with --tokenizer-type NullTokenizer")
        if int(vocab) <= 0:
            raise ValueError(f"--vocab-size must be positive, got {vocab}")

    if getattr(args, "mock_data", False):
        return
    blend = parse_data_path(getattr(args, "data_path", None))
    if blend is None:
        raise ValueError("no training data: give --data-path PREFIX (Megatron .bin/.idx) or --mock-data")
    parse_split(_arg(args, "split", DEFAULT_SPLIT))
    for prefix in blend[0]:
        for ext in (".bin", ".idx"):
            if prefix.endswith(ext):
                raise ValueError(
                    f"--data-path takes the prefix without {ext}: use {prefix[: -len(ext)]}"
                )
        for ext in (".bin", ".idx"):
            path = prefix + ext
            if not os.path.isfile(path):
                raise ValueError(f"--data-path: {path} not found")
            if not os.access(path, os.R_OK):
                raise ValueError(f"--data-path: {path} is not readable")
    check_data_files(args)
    _check_splits_nonempty(blend[0], _arg(args, "split", DEFAULT_SPLIT))


# ---------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------


def dataset_sizes(args) -> List[int]:
    """Number of samples per split, as Megatron-LM computes them."""
    from megatron_tawpipe.training import batch_schedule

    schedule = getattr(args, "batch_schedule", None) or batch_schedule.constant(args.global_batch_size)
    gbs = batch_schedule.largest_batch(schedule)   # evaluation takes the batch in force (at most this)
    eval_iters = int(_arg(args, "eval_iters", 0))
    train_iters = int(_arg(args, "train_iters", 0)) or batch_schedule.iterations_for_samples(
        schedule, getattr(args, "train_samples", None) or 0)
    # A schedule's last iteration may go past --train-samples (Megatron-LM's count).
    train_samples = max(getattr(args, "train_samples", None) or 0, batch_schedule.samples_after(schedule, train_iters))
    eval_interval = int(_arg(args, "eval_interval", 1000))
    eval_samples = (train_iters // max(1, eval_interval) + 1) * eval_iters * gbs
    test_samples = eval_iters * gbs
    return [int(train_samples), int(eval_samples), int(test_samples)]


def build_dataset_config(args, tokenizer):
    """The GPTDatasetConfig for ``args`` (fields missing from this megatron-core are skipped)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    mock = bool(getattr(args, "mock_data", False))
    blend = None if mock else parse_data_path(getattr(args, "data_path", None))
    reset_attention_mask = bool(getattr(args, "reset_attention_mask", False))
    create_mask = getattr(args, "create_attention_mask_in_dataloader", None)
    if create_mask is None:
        # The model builds its causal mask itself; an explicit S x S mask per sample is only
        # needed for document-level masking (and costs O(S^2) memory at long context).
        create_mask = reset_attention_mask
    cache = getattr(args, "data_cache_path", None)
    blended = blend is not None and (len(blend[0]) > 1 or blend[1] is not None)
    if cache and blended and not _dist_initialized():
        # megatron-core's BlendedDataset calls torch.distributed.get_rank() on a cache miss
        # whenever a cache path is set, which fails in a single process without a process
        # group; build in memory there (the GPTDataset indices still go next to the data).
        logger.warning("--data-cache-path is ignored for blended data without torch.distributed")
        cache = None
    kwargs = dict(
        random_seed=int(_arg(args, "seed", 1234)),
        sequence_length=int(args.seq_length),
        blend=blend,
        split=None if mock else _arg(args, "split", DEFAULT_SPLIT),
        path_to_cache=cache,
        mmap_bin_files=bool(_arg(args, "mmap_bin_files", True)),
        tokenizer=tokenizer,
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        create_attention_mask=bool(create_mask),
        num_dataset_builder_threads=int(_arg(args, "num_dataset_builder_threads", 1)),
        mid_level_dataset_surplus=float(_arg(args, "mid_level_dataset_surplus", 0.005)),
    )
    names = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    for required in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        assert required in names, f"GPTDatasetConfig has no field {required}"
    return GPTDatasetConfig(**{k: v for k, v in kwargs.items() if k in names})


def _dist_initialized() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def build_datasets(args, tokenizer, is_built_on_rank: Optional[Callable[[], bool]] = None):
    """Build (train, valid, test) datasets with megatron-core's BlendedMegatronDatasetBuilder.

    Collective when torch.distributed is initialized: every rank of the default group must
    call it.  megatron-core builds on rank 0 first (writing the index cache), then barriers,
    then the other ranks load the cache, so no two ranks write the same cache file.
    ``is_built_on_rank`` (default: every rank) may return False on ranks that need no data
    (it must be True on global rank 0); they then get None for each split.  A split with no share in ``--split`` is None.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = build_dataset_config(args, tokenizer)
    if not config.mock:
        check_data_files(args, getattr(tokenizer, "vocab_size", None))
        _check_splits_nonempty(config.blend[0], config.split)
    cls = MockGPTDataset if config.mock else GPTDataset
    sizes = dataset_sizes(args)
    built_on_rank = is_built_on_rank if is_built_on_rank is not None else (lambda: True)
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        cls, sizes, built_on_rank, config
    ).build()
    return train_ds, valid_ds, test_ds


# ---------------------------------------------------------------------------------------
# Sampling and batches
# ---------------------------------------------------------------------------------------


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


def build_data_iterator(dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                        consumed_samples: int, *, num_workers: int = 0, cyclic: bool = False,
                        pin_memory: bool = False, ignore_signal: Optional[int] = None,
                        dataloader_type: str = "single") -> Optional[Iterator[Dict[str, "object"]]]:
    """Iterator over this data-parallel rank's micro-batches (dicts of batched CPU tensors).

    Deterministic and resumable: the batches after ``consumed_samples`` (global samples,
    i.e. iterations * global batch size) are those an uninterrupted run would see.
    Finite (until the dataset is used up) unless ``cyclic``; ``dataloader_type`` ``cyclic`` is Megatron-LM's
    random sampler (:class:`RandomMicroBatchSampler`), endless.  Returns None for a None
    dataset (ranks that build no data).  Worker processes ignore ``ignore_signal`` (the signal
    ``--exit-signal-handler`` leaves to the training process).
    """
    if dataset is None:
        return None
    import torch

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
        persistent_workers=int(num_workers) > 0,
        worker_init_fn=(functools.partial(_ignore_signal_in_worker, ignore_signal)
                        if ignore_signal is not None and int(num_workers) > 0 else None),
    )
    return iter(loader)


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


