"""The values some flags allow: tokenizer types and checkpoint formats (Megatron-LM's, and which of them
this project reads and writes)."""

import argparse

# Megatron-LM's tokenizers on a SentencePiece model: SentencePieceTokenizer through megatron-core;
# GPTSentencePieceTokenizer and Llama2Tokenizer as Megatron-LM defines them (the model's own pieces,
# eod = its end-of-sentence id; Llama2Tokenizer starts every document with the model's bos id).
SENTENCEPIECE_TOKENIZERS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# Megatron-LM's other text tokenizers: HuggingFaceTokenizer and TikTokenizer through megatron-core (which needs
# the transformers / tiktoken packages), GPT2BPETokenizer (GPT-2's byte-level BPE from --vocab-file and
# --merge-file) on Hugging Face's tokenizers library, offline.
FILE_TOKENIZERS = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer")
SUPPORTED_TOKENIZERS = SENTENCEPIECE_TOKENIZERS + FILE_TOKENIZERS + ("NullTokenizer",)
TOKENIZER_TYPES = ("SentencePieceTokenizer", "NullTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer", "BertWordPieceLowerCase",
                   "BertWordPieceCase", "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")


# Checkpoint formats this project writes (and reads), and Megatron-LM's others (refused in one line).
CKPT_FORMATS = ("torch_dist", "tawpipe", "torch")
MEGATRON_LM_ONLY_CKPT_FORMATS = ("zarr", "torch_dcp", "fsdp_dtensor")
# Megatron-LM's --async-strategy values (its default nvrx needs nvidia-resiliency-ext).
ASYNC_STRATEGIES = ("nvrx", "mcore")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
