"""Megatron-LM's fill-in-the-middle flags (--fim-*): their defaults, their checks, and the
settings the datasets take (the rearrangement itself: megatron/dataprep/fim.py)."""

from megatron.dataprep.fim import FimSettings

# flag -> (default, help); Megatron-LM's names and defaults
_TOKENS = (
    ("--fim-prefix-token", "<fim_prefix>", "the token before the prefix"),
    ("--fim-middle-token", "<fim_middle>", "the token before the middle"),
    ("--fim-suffix-token", "<fim_suffix>", "the token before the suffix"),
    ("--fim-pad-token", "<fim_pad>", "the token that fills a rearranged sample up to its "
                                     "length"),
    ("--fim-eod-token", "<|endoftext|>", "the end-of-document token the samples are cut at "
                                         "before the rearrangement"),
)


def add_fim_arguments(group):
    group.add_argument(
        "--fim-data", action="store_true",
        help="as Megatron-LM: fill-in-the-middle training data; each document piece of a "
             "sample is, with probability --fim-rate, cut into prefix, middle and suffix "
             "and laid out as <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle "
             "(PSM) or the SPM order (megatron/dataprep/fim.py); needs a tokenizer holding "
             "the --fim-*-token tokens")
    group.add_argument("--fim-rate", type=float, default=0.5,
                       help="probability that a piece is rearranged (default 0.5)")
    group.add_argument("--fim-spm-rate", type=float, default=0.5,
                       help="probability that a rearranged piece takes the SPM order "
                            "rather than PSM (default 0.5)")
    group.add_argument("--fim-split-sample", type=str, default=None, metavar="TOKEN",
                       help="a token (e.g. a file separator) at which a piece is cut into "
                            "fragments, each rearranged with --fim-fragment-rate")
    group.add_argument("--fim-fragment-rate", type=float, default=None,
                       help="probability that a fragment is rearranged (with "
                            "--fim-split-sample)")
    group.add_argument("--fim-no-prefix", type=str, default=None, metavar="TEXT",
                       help="pieces whose text starts with TEXT are left as they are")
    for flag, default, meaning in _TOKENS:
        group.add_argument(flag, type=str, default=default,
                           help=f"{meaning} (default {default})")


def _dest(flag):
    return flag[2:].replace("-", "_")


def check_fim_args(args, tokenizer_builder=None):
    """Problems of these flags (each a line naming the flag); without --fim-data, a note
    naming the ones given. ``tokenizer_builder`` (reading the tokenizer's files) also
    checks that its vocabulary holds the tokens."""
    if not args.fim_data:
        given = [f"--fim-{name.replace('_', '-')}" for name, default in (
            ("rate", 0.5), ("spm_rate", 0.5), ("split_sample", None),
            ("fragment_rate", None), ("no_prefix", None))
            if getattr(args, f"fim_{name}") != default]
        if given:  # Megatron-LM ignores them too: a note, not a stop
            args.flag_notes.append(
                f"note: {', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect "
                f"without --fim-data (as in Megatron-LM)")
        return []
    problems = []
    for flag in ("--fim-rate", "--fim-spm-rate", "--fim-fragment-rate"):
        value = getattr(args, _dest(flag))
        if value is not None and not 0.0 <= value <= 1.0:
            problems.append(f"{flag} {value:g} is a probability: give a value in [0, 1]")
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        problems.append("--fim-split-sample needs --fim-fragment-rate (the probability that "
                        "each fragment is rearranged)")
    if args.mock_data:
        problems.append("--fim-data rearranges the text of the documents, and --mock-data's "
                        "are not text (Megatron-LM asserts the same): give --data-path")
    if args.tokenizer_type == "NullTokenizer":
        problems.append("--fim-data needs a tokenizer with a vocabulary holding the "
                        "--fim-*-token tokens; NullTokenizer has none")
    if args.dataloader_inter_document_masking:
        problems.append("--fim-data with --dataloader-inter-document-masking is not "
                        "supported: the rearranged samples no longer match their documents' "
                        "packing; use --reset-attention-mask --reset-position-ids (the "
                        "documents from the end-of-document tokens)")
    if problems or tokenizer_builder is None:
        return problems
    try:
        tokenizer = tokenizer_builder()
    except ValueError:
        return problems  # the tokenizer's own flags are reported by the data checks
    try:
        fim_settings(args, tokenizer)
    except ValueError as error:
        problems.append(str(error))
    return problems


def fim_settings(args, tokenizer) -> FimSettings:
    """The settings of --fim-data with the tokens' ids; ValueError naming each token the
    tokenizer's vocabulary lacks."""
    ids, missing = {}, []
    flags = [flag for flag, _, _ in _TOKENS]
    if args.fim_split_sample is not None:
        flags.append("--fim-split-sample")
    for flag in flags:
        token = getattr(args, _dest(flag))
        ids[flag] = tokenizer.token_id(token)
        if ids[flag] is None:
            missing.append(f"{flag} {token}")
    if missing:
        raise ValueError(
            f"--fim-data: the tokenizer ({_tokenizer_name(args)}) has no "
            f"{'; no '.join(missing)}: give the tokens your tokenizer has for them (e.g. "
            f"--fim-prefix-token '<|fim_prefix|>'), or a tokenizer with FIM tokens")
    return FimSettings(
        rate=args.fim_rate, spm_rate=args.fim_spm_rate,
        prefix_id=ids["--fim-prefix-token"], middle_id=ids["--fim-middle-token"],
        suffix_id=ids["--fim-suffix-token"], pad_id=ids["--fim-pad-token"],
        eod_id=ids["--fim-eod-token"], split_id=ids.get("--fim-split-sample"),
        fragment_rate=args.fim_fragment_rate, no_prefix=args.fim_no_prefix)


def _tokenizer_name(args):
    source = args.tokenizer_model or args.vocab_file
    return f"--tokenizer-type {args.tokenizer_type}" + (f" of {source}" if source else "")
