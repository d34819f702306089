"""Command-line arguments of ``pretrain_llama.py`` (Megatron-LM's flags) and their validation.

* :mod:`.flags` — the parser: Megatron-LM's flag names, meanings and defaults, this project's
  schedule flags, and the derived defaults Megatron-LM fills in;
* :mod:`.validate` — checks before any process group exists, one line per problem.
"""

from megatron_tawpipe.arguments.flags import (ATTENTION_BACKENDS, LLAMA_FLAGS, NORMALIZATIONS,
                                              PIPELINE_SCHEDULES, POSITION_EMBEDDING_TYPES, SUPPORTED_TOKENIZERS,
                                              TOKENIZER_TYPES, TOOL_FLAGS, TRANSFORMER_IMPLS,
                                              WEIGHT_PASSING_SCHEDULES, ArgumentError, add_tawpipe_args, build_parser,
                                              default_ffn_hidden_size, fill_defaults, llama_ffn_hidden_size,
                                              parse_args, plain_arguments)
from megatron_tawpipe.arguments.validate import (data_parallel_size, notice, validate_args, virtual_pipeline_size,
                                                 weight_passing_runtime_available, world_size_from_env)

__all__ = ["ATTENTION_BACKENDS", "LLAMA_FLAGS", "NORMALIZATIONS", "PIPELINE_SCHEDULES",
           "POSITION_EMBEDDING_TYPES", "SUPPORTED_TOKENIZERS", "TOKENIZER_TYPES", "TOOL_FLAGS", "TRANSFORMER_IMPLS",
           "WEIGHT_PASSING_SCHEDULES", "ArgumentError", "add_tawpipe_args", "build_parser", "data_parallel_size",
           "default_ffn_hidden_size", "fill_defaults", "llama_ffn_hidden_size", "notice", "parse_args", "plain_arguments",
           "validate_args", "virtual_pipeline_size", "weight_passing_runtime_available", "world_size_from_env"]
