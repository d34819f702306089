"""Command-line arguments of ``pretrain_llama.py``: Megatron-LM's flags and this project's.

* :mod:`.flags` — the parser: Megatron-LM's flag names, meanings and defaults, this project's
  schedule flags, and the derived defaults Megatron-LM fills in;
* :mod:`.layout` — the data-parallel and virtual pipeline sizes the flags imply.

Their validation, which reads checkpoints and calibration files, is :mod:`megatron_tawpipe.training.validate_args`.
"""

from megatron_tawpipe.arguments.flags import (ATTENTION_BACKENDS, LLAMA_FLAGS, NORMALIZATIONS,
                                              PIPELINE_SCHEDULES, PLAN_FILE_PREFIX, POSITION_EMBEDDING_TYPES,
                                              SUPPORTED_TOKENIZERS, TOKENIZER_TYPES, TOOL_FLAGS, TRANSFORMER_IMPLS,
                                              WEIGHT_PASSING_SCHEDULES, ArgumentError, add_tawpipe_args, build_parser,
                                              default_ffn_hidden_size, fill_defaults, is_weight_passing,
                                              llama_ffn_hidden_size, parse_args, plain_arguments, plan_file_of)
from megatron_tawpipe.arguments.layout import data_parallel_size, virtual_pipeline_size, weight_pipeline_ranks

__all__ = ["ATTENTION_BACKENDS", "LLAMA_FLAGS", "NORMALIZATIONS", "PIPELINE_SCHEDULES", "PLAN_FILE_PREFIX",
           "POSITION_EMBEDDING_TYPES", "SUPPORTED_TOKENIZERS", "TOKENIZER_TYPES", "TOOL_FLAGS", "TRANSFORMER_IMPLS",
           "WEIGHT_PASSING_SCHEDULES", "ArgumentError", "add_tawpipe_args", "build_parser", "data_parallel_size",
           "default_ffn_hidden_size", "fill_defaults", "is_weight_passing", "llama_ffn_hidden_size", "parse_args",
           "plain_arguments", "plan_file_of", "virtual_pipeline_size", "weight_pipeline_ranks"]
