"""Training, validation and test datasets: megatron-core's ``BlendedMegatronDatasetBuilder`` with
``GPTDataset`` (or ``MockGPTDataset`` for ``--mock-data``), sized as Megatron-LM sizes the splits.

The data come as Megatron-LM takes them (:mod:`.blends`): ``--data-path`` cut by ``--split`` (the config's
``blend`` and ``split``) or a dataset per split (``--train-data-path`` ...: its ``blend_per_split``).
``--num-dataset-builder-threads`` is the config's ``num_dataset_builder_threads`` (the threads that build a
blend's datasets).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, List, Optional

from megatron_tawpipe.data.tokenizers import _arg
from megatron_tawpipe.data.validation import DEFAULT_SPLIT, _check_splits_nonempty, check_data_files, data_blends

logger = logging.getLogger(__name__)


def dataset_sizes(args) -> List[int]:
    """Number of samples per split, as Megatron-LM computes them."""
    from megatron_tawpipe.data import batch_schedule

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
    # --data-path cut by --split, or one blend per split (--train-data-path ...): Megatron-LM's two ways.
    blend, blend_per_split = (None, None) if mock else data_blends(args)
    reset_attention_mask = bool(getattr(args, "reset_attention_mask", False))
    create_mask = getattr(args, "create_attention_mask_in_dataloader", None)
    if create_mask is None:
        # The model builds its causal mask itself; an explicit S x S mask per sample is only
        # needed for document-level masking (and costs O(S^2) memory at long context).
        create_mask = reset_attention_mask
    cache = getattr(args, "data_cache_path", None)
    blended = any(b is not None and (len(b[0]) > 1 or b[1] is not None) for b in [blend] + list(blend_per_split or []))
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
        blend_per_split=blend_per_split,
        split=None if mock or blend_per_split is not None else _arg(args, "split", DEFAULT_SPLIT),
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
    for required in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss", "blend_per_split",
                     "num_dataset_builder_threads"):
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
        if config.blend is not None:
            _check_splits_nonempty(config.blend[0], config.split)
    cls = MockGPTDataset if config.mock else GPTDataset
    sizes = dataset_sizes(args)
    built_on_rank = is_built_on_rank if is_built_on_rank is not None else (lambda: True)
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        cls, sizes, built_on_rank, config
    ).build()
    return train_ds, valid_ds, test_ds
