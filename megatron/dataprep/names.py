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
# SFTTokenizer's --sft-tokenizer-prompt-format values (megatron/dataprep/sft_tokenizer.py)
SFT_PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "identity", "default")
