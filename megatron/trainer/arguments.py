"""Command-line flags with Megatron-LM's names and meanings, and their validation.

Every mistake a user can make with flags is caught here, before any process group
exists, and reported as one line naming the flag and the fix.
"""

import argparse
import os
import sys

import torch

from megatron.seqsplit.attention_backends import BACKEND_NAMES
from megatron.seqsplit.kv_cache import KV_CACHE_LAYOUTS


class ArgumentError(ValueError):
    """A flag value the run cannot work with; the message names the flag and the fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # unknown flags and bad types: one line, not a usage dump
        raise ArgumentError(f"{message} (see `{self.prog} --help`)")


def _str2bool(value):
    return str(value).lower() in ("1", "true", "yes", "y", "on")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = _Parser(prog=os.path.basename(sys.argv[0]) or "pretrain_gpt.py",
                     description="GPT pretraining on megatron-core with Seq1F1B",
                     allow_abbrev=False)

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=False)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    g.add_argument("--attention-backend", choices=["auto", *BACKEND_NAMES], default="auto",
                   help="core attention kernel (local layer spec); auto: flash when usable, "
                        "else sdpa; flex is opt-in and has no dropout")

    g = parser.add_argument_group("batch and training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved schedule: layers per model chunk (virtual stage)")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="interleaved schedule: model chunks per pipeline rank")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int,
                   default=None, help="interleaved schedule: microbatches each chunk runs "
                                      "before the next chunk starts (default: the pp size)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="every process group's timeout: a collective or p2p transfer that "
                        "waits longer (a peer stopped, dead or hung) stops the job")

    g = parser.add_argument_group("sequence-split pipeline (Seq1F1B)")
    g.add_argument("--seq1f1b-splits", "--pipe-sp-splits", dest="seq1f1b_splits", type=int,
                   default=1, help="splits per microbatch; 1 is plain 1F1B")
    g.add_argument("--seq1f1b-balance-method", "--pipe-sp-strategy",
                   dest="seq1f1b_balance_method", choices=["average", "uniform_comp"],
                   default="average")
    g.add_argument("--seq1f1b-split-alignment", type=int, default=1,
                   help="split lengths are multiples of this (and of the TP size under "
                        "sequence parallel)")
    g.add_argument("--seq1f1b-kv-cache", choices=list(KV_CACHE_LAYOUTS), default="buffer",
                   help="K/V prefix cache of split attention: 'buffer' (one full-sequence "
                        "buffer per microbatch and layer, attention by --attention-backend) "
                        "or 'chunked' (per-split chunks merged by log-sum-exp: no prefix "
                        "concatenation, no saved mask; plain-PyTorch kernel, no attention "
                        "dropout)")
    g.add_argument("--pipeline-schedule", choices=["1f1b", "seq1f1b", "slimpipe"],
                   default=None,
                   help="1f1b (interleaved with virtual stages), seq1f1b, or slimpipe (uniform "
                        "slices over virtual stages); default: slimpipe when a --slimpipe-* "
                        "flag is given, seq1f1b when --seq1f1b-splits > 1, else 1f1b")
    g.add_argument("--slimpipe-slices", type=int, default=None,
                   help="SlimPipe: equal slices per microbatch, a multiple of the pp size")
    g.add_argument("--slimpipe-slice-length", type=int, default=None,
                   help="SlimPipe: tokens per slice (divides --seq-length); instead of "
                        "--slimpipe-slices")
    g.add_argument("--slimpipe-attention-balance", action="store_true",
                   help="SlimPipe: pair units that run at the same time on two ranks and let "
                        "the light one compute part of the heavy one's attention (query slice "
                        "and prefix K/V chunks sent over, partial output and log-sum-exp "
                        "merged; exact). Needs --seq1f1b-kv-cache chunked")
    g.add_argument("--slimpipe-attention-balance-exchange-cost", type=float, default=0.0,
                   help="time to send one slice's K/V to the paired rank relative to "
                        "computing that slice's forward attention (default 0: free); pairs "
                        "whose exchange costs more than it saves are not made. "
                        "tools/plan.py --slimpipe-attention-balance prints the value for a "
                        "layout")
    g.add_argument("--timeline-file", type=str, default=None,
                   help="record each pipeline unit's start/end per rank to this JSON file")
    g.add_argument("--activation-memory-file", type=str, default=None,
                   help="measure each stage's activation peak (tensors saved for backward, "
                        "sampled at unit boundaries) in the last iteration; write JSON here")

    g = parser.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer", "HuggingFaceTokenizer",
                                                "NullTokenizer"], default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")

    g = parser.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving a checkpoint with --save) when the iteration "
                        "is a multiple of this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (SLURM preemption, torchrun forwarding it), finish the "
                        "current iteration, save a checkpoint with --save and exit 0")
    g.add_argument("--exit-signal-handler-for-dataloader", action="store_true",
                   help="refused: data is read in the training process (no DataLoader "
                        "workers), so --exit-signal-handler already covers it")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit 0 after the iteration during which this "
                        "many minutes of the run have passed (decided on all ranks together)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   help="stop at the first NaN/inf loss or gradient, before the optimizer "
                        "step and without saving (default)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="train on through non-finite values (not recommended)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")

    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def _require(condition, message):
    if not condition:
        raise ArgumentError(message)


def validate_args(args, world_size: int, cuda_available: bool, check_files: bool = True):
    """Fill defaults derived from other flags and reject inconsistent values.

    ``check_files=False`` skips what reads the disk (data files, tokenizer files, --load):
    tools/plan.py validates a training command line for a run elsewhere."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters"):
        _require(getattr(args, flag) is not None,
                 f"--{flag.replace('_', '-')} is required")
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                "micro_batch_size", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "log_interval", "seq1f1b_split_alignment")
    for flag in positive:
        _require(getattr(args, flag) >= 1,
                 f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    _require(args.train_iters >= 0, f"--train-iters must be >= 0, got {args.train_iters}")

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) "
             f"x --pipeline-model-parallel-size ({pp}); launch a multiple of {tp * pp} processes")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)
    dp = args.data_parallel_size

    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    _require(args.global_batch_size >= 1,
             f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    _require(args.distributed_timeout_minutes > 0,
             f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}")
    _require(args.global_batch_size % (args.micro_batch_size * dp) == 0,
             f"--global-batch-size ({args.global_batch_size}) must be divisible by "
             f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size ({dp}); "
             f"use a multiple of {args.micro_batch_size * dp}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)

    _require(args.num_layers % pp == 0,
             f"--num-layers ({args.num_layers}) must be divisible by "
             f"--pipeline-model-parallel-size ({pp})")
    _resolve_pipeline_schedule(args)
    _validate_virtual_pipeline(args)
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})")
    _require(args.hidden_size % args.num_attention_heads == 0 or args.kv_channels,
             f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
             f"({args.num_attention_heads}), or set --kv-channels")
    if args.num_query_groups is not None and not args.group_query_attention:
        args.group_query_attention = True
    if args.group_query_attention:
        _require(args.num_query_groups is not None,
                 "--group-query-attention needs --num-query-groups")
        _require(args.num_query_groups >= 1,
                 f"--num-query-groups must be >= 1, got {args.num_query_groups}")
        _require(args.num_attention_heads % args.num_query_groups == 0,
                 f"--num-query-groups ({args.num_query_groups}) must divide "
                 f"--num-attention-heads ({args.num_attention_heads})")
        _require(args.num_query_groups % tp == 0,
                 f"--num-query-groups ({args.num_query_groups}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp})")
    else:
        args.num_query_groups = args.num_attention_heads
    if args.ffn_hidden_size is None:
        # Megatron-LM's defaults: 4h, or the SwiGLU-adjusted 8h/3 rounded to 64
        args.ffn_hidden_size = (int(args.hidden_size * 4 * 2 / 3 / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute":
        _require(args.max_position_embeddings >= args.seq_length,
                 f"--max-position-embeddings ({args.max_position_embeddings}) must be >= "
                 f"--seq-length ({args.seq_length}) with learned absolute positions")

    from megatron.trainer.device import device_problems

    problems = device_problems(args, cuda_available)
    _require(not problems, problems[0] if problems else "")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron-LM: meaningless without TP
    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ArgumentError("--transformer-impl transformer_engine needs Transformer Engine "
                                "installed; use --transformer-impl local")

    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None,
                 "--recompute-granularity full needs --recompute-method {uniform,block}")
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1
    if args.recompute_method is not None:
        _require(args.recompute_granularity == "full",
                 "--recompute-method needs --recompute-granularity full")
    if args.recompute_num_layers is not None:
        _require(args.recompute_granularity == "full",
                 "--recompute-num-layers needs --recompute-granularity full "
                 "(selective recomputation covers every layer)")
        _require(args.recompute_num_layers >= 1,
                 f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}")

    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _require(args.lr_warmup_iters <= args.lr_decay_iters or args.lr_decay_style == "constant"
             or args.train_iters == 0, f"--lr-warmup-iters ({args.lr_warmup_iters}) must not exceed "
             f"--lr-decay-iters ({args.lr_decay_iters})")
    _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    _require(args.clip_grad >= 0, "--clip-grad must be >= 0 (0 disables clipping)")

    # data
    if args.mock_data:
        _require(not args.data_path, "--mock-data and --data-path are mutually exclusive")
    else:
        _require(bool(args.data_path),
                 "no training data: pass --data-path PREFIX (see tools/preprocess_data.py) "
                 "or --mock-data")
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else "GPT2BPETokenizer"
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type == "GPT2BPETokenizer":
        _require(args.vocab_file and args.merge_file,
                 "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            _require(not check_files or os.path.isfile(path), f"{flag} {path}: no such file")
    if args.tokenizer_type == "HuggingFaceTokenizer":
        _require(args.tokenizer_model, "--tokenizer-type HuggingFaceTokenizer needs "
                                       "--tokenizer-model (a tokenizer.json file or directory)")
        _require(not check_files or os.path.exists(args.tokenizer_model),
                 f"--tokenizer-model {args.tokenizer_model}: no such file or directory "
                 "(nothing is downloaded: give a local tokenizer.json or its directory)")
    if args.data_path and check_files:
        _check_data(args.data_path, args.split)

    # checkpoints
    if args.save is not None and args.save_interval is None:
        args.save_interval = args.train_iters if args.train_iters > 0 else 1
    if args.save_interval is not None:
        _require(args.save_interval >= 1, "--save-interval must be >= 1")
        _require(args.save is not None, "--save-interval needs --save DIR")
    if args.load is not None and args.exit_on_missing_checkpoint and check_files:
        _require(os.path.isdir(args.load), f"--load {args.load}: no such directory")
    _require(args.eval_interval >= 1, "--eval-interval must be >= 1")
    _require(not args.exit_signal_handler_for_dataloader,
             "--exit-signal-handler-for-dataloader is not supported: data is read in the "
             "training process (there are no DataLoader workers to signal); "
             "--exit-signal-handler alone covers it: drop the flag")
    _require(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
             f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    _require(args.exit_interval is None or args.exit_interval >= 1,
             f"--exit-interval must be >= 1, got {args.exit_interval}")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0")

    _validate_seq1f1b(args)
    _validate_slimpipe(args)
    return args


def _resolve_pipeline_schedule(args):
    """--pipeline-schedule from the flags given; reject contradictions."""
    slim_flags = [flag for flag, value in (("--slimpipe-slices", args.slimpipe_slices),
                                           ("--slimpipe-slice-length",
                                            args.slimpipe_slice_length))
                  if value is not None]
    schedule = args.pipeline_schedule
    if schedule is None:
        schedule = ("slimpipe" if slim_flags
                    else "seq1f1b" if args.seq1f1b_splits > 1 else "1f1b")
    _require(not slim_flags or schedule == "slimpipe",
             f"{slim_flags[0] if slim_flags else ''} belongs to --pipeline-schedule slimpipe, "
             f"not --pipeline-schedule {schedule}; drop it or use --pipeline-schedule slimpipe")
    _require(args.pipeline_schedule != "1f1b" or args.seq1f1b_splits == 1,  # as given
             f"--pipeline-schedule 1f1b runs whole microbatches but --seq1f1b-splits is "
             f"{args.seq1f1b_splits}; drop --seq1f1b-splits or use --pipeline-schedule seq1f1b")
    args.pipeline_schedule = schedule


def _validate_virtual_pipeline(args):
    """Interleaved 1F1B flags, with megatron-core's constraints checked up front."""
    pp = args.pipeline_model_parallel_size
    per_stage = args.num_layers_per_virtual_pipeline_stage
    vp = args.virtual_pipeline_model_parallel_size
    if per_stage is not None:
        _require(vp is None, "give --num-layers-per-virtual-pipeline-stage or "
                             "--virtual-pipeline-model-parallel-size, not both")
        _require(per_stage >= 1, "--num-layers-per-virtual-pipeline-stage must be >= 1")
        _require(args.num_layers % (pp * per_stage) == 0,
                 f"--num-layers ({args.num_layers}) must be divisible by "
                 f"--pipeline-model-parallel-size ({pp}) x "
                 f"--num-layers-per-virtual-pipeline-stage ({per_stage})")
        vp = args.num_layers // (pp * per_stage)
    if vp is None or vp == 1:
        args.virtual_pipeline_model_parallel_size = None  # the group size is then unused
        return
    _require(vp >= 1, f"--virtual-pipeline-model-parallel-size must be >= 1, got {vp}")
    _require(pp >= 2, "virtual pipeline stages need --pipeline-model-parallel-size >= 2")
    _require(args.num_layers % (pp * vp) == 0,
             f"--num-layers ({args.num_layers}) must be divisible by "
             f"--pipeline-model-parallel-size ({pp}) x virtual stages ({vp})")
    args.virtual_pipeline_model_parallel_size = vp
    if args.pipeline_schedule == "slimpipe":
        # a SlimPipe group is one microbatch's slices: checked in _validate_slimpipe
        _require(args.microbatch_group_size_per_virtual_pipeline_stage is None,
                 "--microbatch-group-size-per-virtual-pipeline-stage does not apply to "
                 "--pipeline-schedule slimpipe (each chunk runs one microbatch's slices "
                 "before the next chunk starts); drop it")
        return
    from megatron.schedules.interleaved import check_interleaved_shape

    try:
        check_interleaved_shape(pp, args.num_microbatches, vp,
                                args.microbatch_group_size_per_virtual_pipeline_stage)
    except ValueError as err:
        raise ArgumentError(str(err))


def _check_data(data_path, split):
    """The data files and the split, as the dataset builder will read them, checked
    before any process group exists (its errors name the flag)."""
    from megatron.dataprep.gpt_datasets import DataPathError, check_splits, parse_data_path

    try:
        prefixes, _ = parse_data_path(data_path)
        check_splits(prefixes, split)
    except DataPathError as error:
        raise ArgumentError(str(error)) from None


def _validate_seq1f1b(args):
    splits = args.seq1f1b_splits
    _require(splits >= 1, f"--seq1f1b-splits must be >= 1, got {splits}")
    alignment = args.seq1f1b_split_alignment
    if args.sequence_parallel:
        tp = args.tensor_model_parallel_size
        alignment = alignment * tp // _gcd(alignment, tp)
    args.seq1f1b_alignment = alignment
    _require(args.seq1f1b_kv_cache != "chunked" or args.attention_dropout == 0.0,
             f"--seq1f1b-kv-cache chunked has no attention dropout: add --attention-dropout 0 "
             f"(got {args.attention_dropout}) or use --seq1f1b-kv-cache buffer")
    if splits == 1:
        return
    _require(args.seq_length % alignment == 0,
             f"--seq-length ({args.seq_length}) must be a multiple of the split alignment "
             f"({alignment}) with --seq1f1b-splits")
    _require(splits <= args.seq_length // alignment,
             f"--seq1f1b-splits ({splits}) exceeds the {args.seq_length // alignment} aligned "
             f"positions of --seq-length {args.seq_length}; use fewer splits")
    unsupported = {
        "--transformer-impl transformer_engine": args.transformer_impl == "transformer_engine",
    }
    for flag, used in unsupported.items():
        _require(not used, f"{flag} is not supported with --seq1f1b-splits > 1 yet; "
                           "drop it or use --seq1f1b-splits 1")


def _validate_slimpipe(args):
    """SlimPipe: uniform slices, n a multiple of p (or a slice length dividing the
    sequence). Sets ``args.slimpipe_slices`` and ``args.slimpipe_slice_length``."""
    if args.pipeline_schedule != "slimpipe":
        _require(not args.slimpipe_attention_balance,
                 f"--slimpipe-attention-balance belongs to --pipeline-schedule slimpipe, not "
                 f"--pipeline-schedule {args.pipeline_schedule}")
        return
    seq, pp = args.seq_length, args.pipeline_model_parallel_size
    slices, length = args.slimpipe_slices, args.slimpipe_slice_length
    _require(slices is not None or length is not None,
             f"--pipeline-schedule slimpipe needs --slimpipe-slices N (a multiple of "
             f"--pipeline-model-parallel-size {pp}) or --slimpipe-slice-length L (dividing "
             f"--seq-length {seq})")
    _require(slices is None or length is None,
             "give --slimpipe-slices or --slimpipe-slice-length, not both")
    _require(args.seq1f1b_splits == 1,
             f"--seq1f1b-splits {args.seq1f1b_splits} does not combine with "
             "--pipeline-schedule slimpipe (its slices replace Seq1F1B's splits); drop "
             "--seq1f1b-splits or use --pipeline-schedule seq1f1b")
    _require(args.seq1f1b_balance_method == "average",
             f"SlimPipe slices are uniform; --seq1f1b-balance-method "
             f"{args.seq1f1b_balance_method} does not apply: drop it or use "
             "--pipeline-schedule seq1f1b")
    if length is not None:
        _require(length >= 1, f"--slimpipe-slice-length must be >= 1, got {length}")
        _require(seq % length == 0,
                 f"--slimpipe-slice-length {length} does not divide --seq-length {seq}; "
                 f"slices are uniform: use a divisor of {seq}")
        slices = seq // length
        _require(slices % pp == 0,
                 f"--slimpipe-slice-length {length} gives {slices} slices, not a multiple of "
                 f"--pipeline-model-parallel-size {pp}; use a length L with {seq} / L a "
                 f"multiple of {pp}")
    else:
        _require(slices >= 1, f"--slimpipe-slices must be >= 1, got {slices}")
        _require(slices % pp == 0,
                 f"--slimpipe-slices {slices} must be a multiple of "
                 f"--pipeline-model-parallel-size {pp}")
        _require(seq % slices == 0,
                 f"--slimpipe-slices {slices} does not divide --seq-length {seq}; slices are "
                 f"uniform: use a slice count that divides {seq}")
        length = seq // slices
    _require(length % args.seq1f1b_alignment == 0,
             f"SlimPipe slice length {length} (--seq-length {seq} / {slices} slices) must be "
             f"a multiple of the split alignment {args.seq1f1b_alignment} "
             "(--seq1f1b-split-alignment, and the TP size under --sequence-parallel); use "
             "fewer slices")
    _require(args.transformer_impl != "transformer_engine",
             "--transformer-impl transformer_engine is not supported with --pipeline-schedule "
             "slimpipe yet; use --transformer-impl local")
    from megatron.schedules.slimpipe import check_slimpipe_shape

    try:
        check_slimpipe_shape(pp, args.num_microbatches,
                             args.virtual_pipeline_model_parallel_size or 1, slices)
    except ValueError as err:
        raise ArgumentError(str(err))
    args.slimpipe_slices, args.slimpipe_slice_length = slices, length
    _validate_attention_balance(args)


def _validate_attention_balance(args):
    if not args.slimpipe_attention_balance:
        return
    flag = "--slimpipe-attention-balance"
    _require(args.slimpipe_attention_balance_exchange_cost >= 0,
             f"--slimpipe-attention-balance-exchange-cost must be >= 0, got "
             f"{args.slimpipe_attention_balance_exchange_cost}")
    _require(args.seq1f1b_kv_cache == "chunked",
             f"{flag} needs --seq1f1b-kv-cache chunked (the helper rank computes "
             "attention over whole K/V chunks and the results merge by log-sum-exp)")
    _require(args.pipeline_model_parallel_size >= 2,
             f"{flag} moves attention between pipeline ranks: it needs "
             "--pipeline-model-parallel-size >= 2")
    _require(args.slimpipe_slices >= 2, f"{flag} needs at least 2 slices per microbatch")


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def parse_args(argv=None, extra_args_provider=None, world_size=None, cuda_available=None):
    parser = build_parser(extra_args_provider)
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return validate_args(args, world_size, cuda_available)


def parse_args_or_exit(argv=None, extra_args_provider=None):
    """Parse and validate; on a mistake print one line (rank 0 only) and exit 2 on every rank."""
    try:
        return parse_args(argv, extra_args_provider)
    except ArgumentError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
