#!/usr/bin/env python
"""Tokenize jsonl or plain text into Megatron .bin/.idx indexed datasets.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model \
        --output-prefix data/my/corpus --append-eod --workers 4

Writes {output-prefix}_{key}_document.bin/.idx for each JSON key, the layout and format
of Megatron-LM's tools/preprocess_data.py (token dtype uint16 below 65500 ids, else int32),
so the result is used with --data-path {output-prefix}_{key}_document.  Each jsonl record
(or plain-text line / paragraph / file, see --text-mode) is one document; a list value is
one document of several sequences.
"""

import argparse
import os
import sys
import time

try:
    import megatron_tawpipe  # noqa: F401
except ImportError:  # running from a source checkout without installation
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.arguments.flags import add_tokenizer_file_args  # noqa: E402
from megatron_tawpipe.data import (  # noqa: E402
    SENTENCEPIECE_TOKENIZERS,
    SUPPORTED_TOKENIZERS,
    iter_documents,
    tokenizer_options,
    write_indexed_dataset,
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="jsonl (.jsonl/.json) or plain text files, processed in order")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from jsonl records (default: text)")
    group.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                       help="auto: .jsonl/.json files are jsonl, anything else plain text")
    group.add_argument("--text-mode", choices=["line", "paragraph", "file"], default="line",
                       help="plain text: one document per line, per blank-line-separated "
                            "paragraph, or per file (default: line)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=list(SUPPORTED_TOKENIZERS))
    add_tokenizer_file_args(group)
    group.add_argument("--vocab-size", type=int, default=None,
                       help="NullTokenizer vocab size; TikTokenizer size with its special tokens")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="path prefix; files are {prefix}_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=10000,
                       help="print progress every N documents (0: never)")
    args = parser.parse_args(argv)

    for path in args.input:
        if not os.path.isfile(path):
            parser.error(f"--input: file not found: {path}")
    if args.tokenizer_type in SENTENCEPIECE_TOKENIZERS:
        if not args.tokenizer_model:
            parser.error(f"--tokenizer-model is required with --tokenizer-type {args.tokenizer_type}")
        if not os.path.isfile(args.tokenizer_model):
            parser.error(f"--tokenizer-model: file not found: {args.tokenizer_model}")
    if args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        parser.error("--vocab-size is required with --tokenizer-type NullTokenizer")
    if args.tokenizer_type in ("HuggingFaceTokenizer", "TikTokenizer") and not args.tokenizer_model:
        parser.error(f"--tokenizer-model is required with --tokenizer-type {args.tokenizer_type}")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        parser.error("--vocab-file and --merge-file are required with --tokenizer-type GPT2BPETokenizer")
    if args.workers < 1:
        parser.error("--workers must be at least 1")

    t = time.time()
    records = iter_documents(args.input, args.json_keys, args.input_format, args.text_mode)
    try:
        prefixes = write_indexed_dataset(
            records, args.output_prefix, args.tokenizer_type,
            tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
            json_keys=args.json_keys, append_eod=args.append_eod, workers=args.workers,
            log_interval=args.log_interval, **tokenizer_options(args),
        )
    except ValueError as err:
        sys.exit(f"error: {err}")
    print(f"done in {time.time() - t:.1f} s; use --data-path "
          + " ".join(prefixes[k] for k in args.json_keys))


if __name__ == "__main__":
    main()
