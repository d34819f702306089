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

Modules: :mod:`.tokenizers`, :mod:`.preprocess` (corpus -> ``.bin``/``.idx``), :mod:`.validation`
(the data flags), :mod:`.blends` (``--data-path`` or a dataset per split, as Megatron-LM reads them), :mod:`.dataset_builder` (the splits), :mod:`.iterators` (samplers, batches),
:mod:`.checks` (file integrity), :mod:`.batch_schedule`, :mod:`.default_corpus`.
"""

from megatron_tawpipe.data.tokenizers import (SENTENCEPIECE_TOKENIZERS, SUPPORTED_TOKENIZERS, build_tokenizer,
                                              load_tokenizer, pad_vocab_size, tokenizer_files, tokenizer_options)
from megatron_tawpipe.data.preprocess import (indexed_dataset_path, iter_documents, train_sentencepiece,
                                              write_indexed_dataset)
from megatron_tawpipe.data.validation import check_data_files, parse_data_path, parse_split, validate_data_args
from megatron_tawpipe.data.dataset_builder import build_datasets, dataset_sizes
from megatron_tawpipe.data.iterators import (DataIterator, MicroBatchSampler, RandomMicroBatchSampler,
                                             build_data_iterator, close_all_data_iterators, close_data_iterators,
                                             get_batch)

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
    "DataIterator",
    "build_data_iterator",
    "close_data_iterators",
    "close_all_data_iterators",
    "get_batch",
    "train_sentencepiece",
    "iter_documents",
    "write_indexed_dataset",
    "indexed_dataset_path",
]
