#!/usr/bin/env python
"""Build the embedded default corpus (no network): stdlib docstrings -> SentencePiece -> .bin/.idx.

    python tools/build_default_corpus.py [--output-dir data/default] [--vocab-size 8000]

Steps whose outputs already exist are skipped.  Prints the flags for pretrain_llama.py.
"""

import argparse
import os
import sys

try:
    import megatron_tawpipe  # noqa: F401
except ImportError:  # running from a source checkout without installation
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.compat.extensions import ignore_missing_extension_warnings  # noqa: E402
from megatron_tawpipe.data.default_corpus import (  # noqa: E402
    DEFAULT_OUTPUT_DIR,
    DEFAULT_SEED,
    DEFAULT_VOCAB_SIZE,
    build_default_corpus,
)

ignore_missing_extension_warnings()   # megatron-core's dataset writer imports its optimizers: irrelevant here


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help=f"where to write the corpus (default {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help=f"SentencePiece vocabulary size (default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--workers", type=int, default=None,
                        help="processes for parsing/tokenizing (default: min(4, CPUs))")
    parser.add_argument("--force", action="store_true", help="rebuild even if outputs exist")
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        parser.error("--vocab-size must be at least 300 (256 byte pieces + specials + merges)")

    corpus = build_default_corpus(args.output_dir, vocab_size=args.vocab_size, seed=args.seed,
                                  workers=args.workers, force=args.force)
    print(f"documents: {corpus.num_documents}  characters: {corpus.num_chars}  "
          f"tokens: {corpus.num_tokens}")
    print(f"--data-path {corpus.data_prefix}")
    print(f"--tokenizer-model {corpus.tokenizer_model}")
    print("flags: " + " ".join(corpus.flags()))


if __name__ == "__main__":
    main()
