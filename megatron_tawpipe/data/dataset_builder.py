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

from megatron_tawpipe.arguments.run_config import DataConfig
from megatron_tawpipe.data.validation import _check_splits_nonempty, check_data_files, data_blends

logger = logging.getLogger(__name__)

# megatron-core's default surplus of a blend's mid-level datasets (the flag is refused unless it is this value)
MID_LEVEL_DATASET_SURPLUS = 0.005


def dataset_sizes(data) -> List[int]:
    """Number of samples per split, as Megatron-LM computes them (``data``: a :class:`DataConfig` or the flags)."""
    from megatron_tawpipe.data import batch_schedule

    data = DataConfig.of(data)
    schedule = data.schedule
    gbs = batch_schedule.largest_batch(schedule)   # evaluation takes the batch in force (at most this)
    eval_iters = int(data.eval_iters or 0)
    train_iters = int(data.train_iters or 0) or batch_schedule.iterations_for_samples(schedule, data.train_samples or 0)
    # A schedule's last iteration may go past --train-samples (Megatron-LM's count).
    train_samples = max(data.train_samples or 0, batch_schedule.samples_after(schedule, train_iters))
    eval_interval = int(data.eval_interval or 1000)
    eval_samples = (train_iters // max(1, eval_interval) + 1) * eval_iters * gbs
    test_samples = eval_iters * gbs
    return [int(train_samples), int(eval_samples), int(test_samples)]


def build_dataset_config(data, tokenizer):
    """The GPTDatasetConfig for ``data`` (a :class:`DataConfig` or the flags; fields missing from this
    megatron-core are skipped)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    data = DataConfig.of(data)
    mock = data.mock_data
    # --data-path cut by --split, or one blend per split (--train-data-path ...): Megatron-LM's two ways.
    blend, blend_per_split = (None, None) if mock else data_blends(data)
    cache = data.data_cache_path
    blended = any(b is not None and (len(b[0]) > 1 or b[1] is not None) for b in [blend] + list(blend_per_split or []))
    if cache and blended and not _dist_initialized():
        # megatron-core's BlendedDataset calls torch.distributed.get_rank() on a cache miss
        # whenever a cache path is set, which fails in a single process without a process
        # group; build in memory there (the GPTDataset indices still go next to the data).
        logger.warning("--data-cache-path is ignored for blended data without torch.distributed")
        cache = None
    kwargs = dict(
        random_seed=int(data.seed),
        sequence_length=int(data.seq_length),
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if mock or blend_per_split is not None else data.split_or_default,
        path_to_cache=cache,
        mmap_bin_files=bool(data.mmap_bin_files),
        tokenizer=tokenizer,
        reset_position_ids=bool(data.reset_position_ids),
        reset_attention_mask=bool(data.reset_attention_mask),
        eod_mask_loss=bool(data.eod_mask_loss),
        create_attention_mask=bool(data.create_attention_mask_in_dataloader),
        num_dataset_builder_threads=int(data.num_dataset_builder_threads),
        mid_level_dataset_surplus=MID_LEVEL_DATASET_SURPLUS,
    )
    names = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    for required in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss", "blend_per_split",
                     "num_dataset_builder_threads"):
        assert required in names, f"GPTDatasetConfig has no field {required}"
    return GPTDatasetConfig(**{k: v for k, v in kwargs.items() if k in names})


def _dist_initialized() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_initialized()


def build_datasets(data, tokenizer, is_built_on_rank: Optional[Callable[[], bool]] = None):
    """Build (train, valid, test) datasets with megatron-core's BlendedMegatronDatasetBuilder for ``data`` (a
    :class:`DataConfig` or the flags).

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

    data = DataConfig.of(data)
    config = build_dataset_config(data, tokenizer)
    if not config.mock:
        check_data_files(data, getattr(tokenizer, "vocab_size", None))
        if config.blend is not None:
            _check_splits_nonempty(config.blend[0], config.split)
    cls = MockGPTDataset if config.mock else GPTDataset
    sizes = dataset_sizes(data)
    built_on_rank = is_built_on_rank if is_built_on_rank is not None else (lambda: True)
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        cls, sizes, built_on_rank, config
    ).build()
    return train_ds, valid_ds, test_ds
