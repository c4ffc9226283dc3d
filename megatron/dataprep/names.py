"""Names shared by the light modules (CLI checks, tokenizer training) and the tokenizers.

Kept apart so those light modules need not import megatron-core (seconds on a CPU box).
"""

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "NullTokenizer",
                   "SFTTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# Megatron-LM's other --tokenizer-type values: why each is not built here
_NOT_GPT = ("build no GPT vocabulary here; use GPT2BPETokenizer, HuggingFaceTokenizer or a "
            "SentencePiece type")
REFUSED_TOKENIZER_TYPES = {
    "BertWordPieceLowerCase": "BERT's WordPiece vocabularies " + _NOT_GPT,
    "BertWordPieceCase": "BERT's WordPiece vocabularies " + _NOT_GPT,
    "TikTokenizer": ("needs the tiktoken package, which is not used here: give the same "
                     "vocabulary as a Hugging Face tokenizer.json (HuggingFaceTokenizer)"),
    "MultimodalTokenizer": "multimodal models are not built here (GPT only)",
    "NullMultimodalTokenizer": "multimodal models are not built here (GPT only)",
}
GPT2_EOD_TOKEN = "<|endoftext|>"


def tokenizer_option_problems(tokenizer_type, vocab_size, special_tokens, null_eod_id,
                              null_pad_id=-1):
    """The mistakes in the options that shape a tokenizer's vocabulary, each naming its
    flag: the trainer's flag checks report them before any work, and building the
    tokenizer (tools/preprocess_data.py too) refuses them."""
    found = []
    if special_tokens and tokenizer_type not in ("HuggingFaceTokenizer", "GPT2BPETokenizer"):
        found.append(f"--tokenizer-special-tokens adds tokens to HuggingFaceTokenizer and "
                     f"GPT2BPETokenizer here, not to {tokenizer_type}: drop it")
    if tokenizer_type == "NullTokenizer" and vocab_size is not None:
        for flag, value, unset in (("--null-tokenizer-eod-id", null_eod_id, None),
                                   ("--null-tokenizer-pad-id", null_pad_id, -1)):
            if value != unset and not 0 <= value < vocab_size:
                found.append(f"{flag} {value}: outside the vocabulary, ids "
                             f"0..{vocab_size - 1} (--vocab-size {vocab_size})")
    return found


# SFTTokenizer's --sft-tokenizer-prompt-format values (megatron/dataprep/sft_tokenizer.py)
SFT_PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "identity", "default")
