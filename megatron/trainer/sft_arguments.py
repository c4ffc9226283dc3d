"""Megatron-LM's supervised fine-tuning flags (--sft, --sft-tokenizer-prompt-format) and
their checks (the data itself: megatron/dataprep/sft_dataset.py and sft_tokenizer.py)."""

from megatron.dataprep.names import SFT_PROMPT_FORMATS


def add_sft_arguments(group):
    group.add_argument(
        "--sft", action="store_true",
        help="as Megatron-LM: supervised fine-tuning on JSON-lines conversation files "
             "(--data-path chat.jsonl, each line {\"messages\": [{\"role\", \"content\"}, "
             "...]}), written in --sft-tokenizer-prompt-format by --tokenizer-type "
             "SFTTokenizer; a line's conversations are packed into one sample, attention "
             "and positions kept within each conversation; the nemotron formats train on "
             "the assistant turns only")
    group.add_argument(
        "--sft-tokenizer-prompt-format", choices=SFT_PROMPT_FORMATS, default="nemotron-h-aligned",
        help="how SFTTokenizer writes a conversation (default nemotron-h-aligned; 'default' "
             "is the tokenizer's own chat_template)")


def check_sft_args(args, tokenizer_builder=None):
    """Problems of --sft and the flags it rules out (each a line naming the flag); notes
    for flags it makes moot. ``tokenizer_builder`` (reading the tokenizer's files) also
    checks that the tokenizer takes the prompt format."""
    if not args.sft:
        if (args.sft_tokenizer_prompt_format != "nemotron-h-aligned"
                and args.tokenizer_type != "SFTTokenizer"):
            args.flag_notes.append("note: --sft-tokenizer-prompt-format has no effect without "
                                   "--tokenizer-type SFTTokenizer (as in Megatron-LM)")
        return []
    problems = []
    if args.tokenizer_type != "SFTTokenizer":
        problems.append(f"--sft needs --tokenizer-type SFTTokenizer (a Hugging Face tokenizer "
                        f"directory in --tokenizer-model), got {args.tokenizer_type}")
    for flag, given, why in (
            ("--mock-data", args.mock_data, "--sft reads conversation files: give --data-path "
                                            "chat.jsonl"),
            ("--fim-data", args.fim_data, "fill-in-the-middle rearranges pretraining "
                                          "documents, not conversations"),
            ("--reset-position-ids", args.reset_position_ids,
             "positions already restart with each conversation (Megatron-LM asserts the "
             "same)")):
        if given:
            problems.append(f"--sft with {flag} is not supported: {why}")
    moot = [flag for flag, given in (
        ("--eod-mask-loss", args.eod_mask_loss),
        ("--dataloader-inter-document-masking", args.dataloader_inter_document_masking))
        if given]
    if moot:
        args.flag_notes.append(
            f"note: {', '.join(moot)} {'has' if len(moot) == 1 else 'have'} no effect with "
            f"--sft (as in Megatron-LM): the conversations are the documents, and the prompt "
            f"format says which tokens train")
    if problems or tokenizer_builder is None:
        return problems
    try:
        tokenizer_builder()
    except ValueError as error:
        problems.append(str(error))
    return problems
