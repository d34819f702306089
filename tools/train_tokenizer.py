#!/usr/bin/env python
"""Train a SentencePiece tokenizer from jsonl or plain text files.

    python tools/train_tokenizer.py --input corpus.jsonl --json-key text \
        --vocab-size 8000 --model-prefix data/my/tokenizer --model-type bpe

Writes {model-prefix}.model and {model-prefix}.vocab.  Llama-style settings: byte
fallback, split digits, whitespace kept, <unk>=0 <s>=1 </s>=2 (used as end of document).
Deterministic: the same input and flags give a byte-identical model.
"""

import argparse
import os
import sys
import time

try:
    import megatron_tawpipe  # noqa: F401
except ImportError:  # running from a source checkout without installation
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_tawpipe.data import iter_documents, train_sentencepiece  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="jsonl (.jsonl/.json) or plain text files")
    parser.add_argument("--json-key", default="text", help="key of the text in jsonl records")
    parser.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto",
                        help="auto: .jsonl/.json files are jsonl, anything else plain text")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-prefix", required=True,
                        help="output path without extension (.model/.vocab are added)")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-threads", type=int, default=1,
                        help="training threads (recorded in the model file)")
    args = parser.parse_args(argv)

    for path in args.input:
        if not os.path.isfile(path):
            parser.error(f"--input: file not found: {path}")
    if args.vocab_size < 300:
        parser.error("--vocab-size must be at least 300 (256 byte pieces + specials + merges)")

    def texts():
        for record in iter_documents(args.input, [args.json_key], args.input_format, "line"):
            value = record[args.json_key]
            if isinstance(value, list):
                yield from value
            else:
                yield value

    t = time.time()
    try:
        model = train_sentencepiece(texts(), args.model_prefix, args.vocab_size,
                                    model_type=args.model_type, seed=args.seed,
                                    num_threads=args.num_threads,
                                    character_coverage=args.character_coverage)
    except (ValueError, RuntimeError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {model} and {args.model_prefix}.vocab ({time.time() - t:.1f} s)")


if __name__ == "__main__":
    main()
