"""Megatron-LM's tools/preprocess_data.py flags that this tool answers without doing the
work they name: accepted without effect (with the reason, noted at start-up) or refused
(with the reason and the alternative, before any input is read). The flags it implements
are in preprocess.build_parser."""

_TOKEN_IDS = ("would change the token ids this tokenizer writes, and is not supported here; "
              "drop it")

# flag -> (values it takes: 0, 1 or "+", reason)
NO_OP = {
    "--padded-vocab-size": (1, "the model's vocabulary padding: the token ids written do not "
                               "depend on it"),
    "--no-pad-vocab-size": (0, "the model's vocabulary padding: the token ids written do not "
                               "depend on it"),
    "--disable-pad-vocab-size": (0, "the model's vocabulary padding: the token ids written do "
                                    "not depend on it"),
    "--trust-remote-code": (0, "tokenizer.json is read by HF tokenizers, which runs no code"),
    "--workers-to-check": ("+", "only read by --find-optimal-num-workers (refused here)"),
    "--max-documents": (1, "only read by --find-optimal-num-workers (refused here)"),
    "--performance-dir": (1, "only read by --find-optimal-num-workers (refused here)"),
    # Megatron-LM 0.17's (deprecated) spellings of its defaults, which are this tool's
    "--tokenizer-hf-use-fast": (0, "HF tokenizers' fast tokenizer is the one used here"),
    "--tokenizer-hf-include-special-tokens": (
        0, "HF tokenizers encode with their special tokens here unless "
           "--tokenizer-hf-no-include-special-tokens"),
}

REFUSED = {
    "--find-optimal-num-workers": (0, "timing several --workers counts is not done here; run "
                                      "with --workers N (the summary prints docs/s)"),
    "--tokenizer-hf-no-use-fast": (0, "only HF tokenizers' fast tokenizer (tokenizer.json) "
                                      "runs here; a slow tokenizer may split text otherwise"),
    "--vocab-extra-ids": (1, "T5's span-masking tokens are not added here; drop it"),
    "--tokenizer-metadata": (1, _TOKEN_IDS),
    "--tiktoken-pattern": (1, "TikTokenizer is not supported here (--tokenizer-type)"),
    "--tiktoken-num-special-tokens": (1, "TikTokenizer is not supported here "
                                         "(--tokenizer-type)"),
    "--tokenizer-sentencepiece-legacy": (0, _TOKEN_IDS),
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": (0, _TOKEN_IDS),
    "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces": (0, _TOKEN_IDS),
    "--chat-template": (1, "chat templates are for SFT data, which is not built here"),
}


def add_to(parser):
    group = parser.add_argument_group(
        "Megatron-LM flags accepted without effect", "each noted at start-up, with why")
    for flag, (takes, reason) in NO_OP.items():
        _add(group, flag, takes, reason)
    group = parser.add_argument_group(
        "Megatron-LM flags refused", "each stops the run before any input is read, with why")
    for flag, (takes, reason) in REFUSED.items():
        _add(group, flag, takes, reason)


def _add(group, flag, takes, reason):
    dest = "flag" + flag  # kept apart from the implemented flags' names
    if takes == 0:
        group.add_argument(flag, dest=dest, action="store_true", help=reason)
    else:
        group.add_argument(flag, dest=dest, nargs=None if takes == 1 else takes,
                           default=None, metavar="VALUE", help=reason)


# a refused flag given with Megatron-LM's default value asks for nothing
_HARMLESS = {"--vocab-extra-ids": "0"}


def _given(args, flag):
    value = getattr(args, "flag" + flag)
    return value not in (None, False, _HARMLESS.get(flag))


def refused(args):
    """'FLAG: reason' of every refused flag given."""
    return [f"{flag}: {reason}" for flag, (_, reason) in REFUSED.items() if _given(args, flag)]


def noted(args):
    """'FLAG: reason' of every no-op flag given."""
    return [f"{flag} has no effect here: {reason}"
            for flag, (_, reason) in NO_OP.items() if _given(args, flag)]
