"""``tools/hf_checkpoint.py``: Hugging Face weights to a checkpoint every schedule loads, and back.

    python tools/hf_checkpoint.py import HF_DIR OUT_DIR [--target-tensor-parallel-size T --target-pipeline-parallel-size P]
    python pretrain_llama.py $(cat OUT_DIR/model_flags.txt) --load OUT_DIR --finetune ...
    python tools/hf_checkpoint.py export CKPT_DIR HF_DIR [--model-type llama|mistral|qwen2|qwen3] [--dtype bfloat16]

The conversion is :mod:`megatron_tawpipe.checkpoint.hf_convert`; see docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from megatron_tawpipe.common.errors import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf_checkpoint.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a Hugging Face model directory -> a release checkpoint and its flags")
    imp.add_argument("hf_dir", help="config.json and model.safetensors (or its sharded index)")
    imp.add_argument("out_dir", help="the checkpoint to write (--load it); model_flags.txt beside")
    imp.add_argument("--target-tensor-parallel-size", type=int, default=1,
                     help="tensor-parallel slices in the files (Megatron-LM's converter's flag; this project loads "
                          "any at every layout)")
    imp.add_argument("--target-pipeline-parallel-size", type=int, default=1,
                     help="pipeline stages in the files (as above)")
    exp = commands.add_parser("export", help="a checkpoint (any format) -> a Hugging Face model directory")
    exp.add_argument("checkpoint", help="a --save directory (its latest checkpoint) or one checkpoint's directory")
    exp.add_argument("hf_dir")
    exp.add_argument("--model-type", choices=("llama", "mistral", "qwen2", "qwen3"), default=None,
                     help="default: qwen2 with QKV biases, qwen3 with --qk-layernorm, otherwise llama")
    exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                     help="default: the run's (--bf16 / --fp16, else float32)")
    exp.add_argument("--norm-epsilon", type=float, default=None,
                     help="needed for a --ckpt-format tawpipe checkpoint, which does not record it")
    exp.add_argument("--tokenizer-dir", default=None,
                     help="copy the tokenizer's files from here (default: the run's HuggingFaceTokenizer directory)")
    exp.add_argument("--max-shard-size-gb", type=float, default=5.0)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_tawpipe.checkpoint.hf_convert import export_hf, import_hf

    try:
        if args.command == "import":
            for flag, value in (("--target-tensor-parallel-size", args.target_tensor_parallel_size),
                                ("--target-pipeline-parallel-size", args.target_pipeline_parallel_size)):
                if value < 1:
                    raise CheckpointError(f"{flag} {value}: a positive number of ranks")
            import_hf(args.hf_dir, args.out_dir, args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
        else:
            export_hf(args.checkpoint, args.hf_dir, model_type=args.model_type, dtype=args.dtype,
                      norm_epsilon=args.norm_epsilon, max_shard_bytes=int(args.max_shard_size_gb * 2 ** 30),
                      tokenizer_dir=args.tokenizer_dir)
    except (CheckpointError, ValueError) as exc:
        print(f"hf_checkpoint.py: error: {exc}", file=sys.stderr)
        return 2
    return 0
