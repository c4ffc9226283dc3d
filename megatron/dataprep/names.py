"""Names shared by the light modules (CLI checks, tokenizer training) and the tokenizers.

Kept apart so those light modules need not import megatron-core (seconds on a CPU box).
"""

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                   "Llama2Tokenizer", "NullTokenizer")
GPT2_EOD_TOKEN = "<|endoftext|>"
