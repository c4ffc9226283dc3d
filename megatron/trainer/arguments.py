"""Command-line flags with Megatron-LM's names and meanings, and their validation.

Every mistake a user can make with flags is caught here, before any process group
exists, and reported as one line naming the flag and the fix.
"""

import argparse
import math
import os
import signal
import sys
import time

# no torch or megatron-core here: the command line is checked before they load (seconds
# to a minute on a busy node), see check_flags_early
from megatron.pipeline_layers import (
    UnevenSplitError,
    layout_chunk_layer_counts,
    stage_layer_counts,
)
from megatron.schedules import registry as schedule_registry
from megatron.seqsplit.names import BACKEND_NAMES, KV_CACHE_LAYOUTS
from megatron.trainer.mla_arguments import add_mla_arguments, check_mla_args
from megatron.trainer.mtp_arguments import add_mtp_arguments, check_mtp_args
from megatron.dataprep.names import (
    REFUSED_TOKENIZER_TYPES,
    SENTENCEPIECE_TYPES,
    TOKENIZER_TYPES,
    tokenizer_option_problems,
)
from megatron.trainer.fim_arguments import add_fim_arguments, check_fim_args
from megatron.trainer.sft_arguments import add_sft_arguments, check_sft_args
from megatron.trainer.rope_arguments import add_rope_scaling_arguments, check_rope_scaling_args
from megatron.trainer.attention_arguments import add_attention_arguments, check_attention_args
from megatron.trainer.moe_arguments import add_moe_arguments, check_moe_args, router_losses_on
from megatron.trainer.optimizers import UNSUPPORTED_OPTIMIZERS, optimizer_problems
from megatron.trainer import phases
from megatron.trainer.validation_arguments import (
    add_validation_arguments,
    check_validation_args,
    validates,
)

from megatron.trainer.megatron_lm_flags import (
    add_no_op_flags,
    no_op_flags_given,
    no_op_value,
    take_refused,
)

# Megatron-LM's other --position-embedding-type values: why each is not built here
REFUSED_POSITION_EMBEDDINGS = {
    "mrope": "multimodal RoPE (Qwen2-VL's) reads the image and video positions of "
             "multimodal samples, and multimodal models are not built here; use rope",
    "relative": "T5's relative position buckets belong to its encoder-decoder attention, "
                "which is not built here (decoder-only GPT); use rope",
}
# Megatron-LM's --attention-backend names that are not kernels of ours
MEGATRON_ATTENTION_BACKENDS = ("local", "unfused", "fused")


class ArgumentError(ValueError):
    """A flag value the run cannot work with; the message names the flag and the fix."""


class ArgumentErrors(ArgumentError):
    """Every flag problem of one command line, one per line."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class _Parser(argparse.ArgumentParser):
    """argparse that records a bad value or choice and goes on parsing, so that every
    problem of a command line is reported together."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.problems = []

    def error(self, message):  # what argparse cannot go on after (a missing value)
        raise ArgumentErrors(self.problems + [f"{message} (see `{self.prog} --help`)"])

    def _get_values(self, action, arg_strings):
        try:
            return super()._get_values(action, arg_strings)
        except argparse.ArgumentError as error:  # a bad type or choice: keep the default
            self.problems.append(str(error))
            return action.default


class _HelpFormatter(argparse.HelpFormatter):
    """Help lines never broken inside a hyphenated word (flag names, megatron-core)."""

    def _split_lines(self, text, width):
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return "\n".join(indent + line for line in self._split_lines(text, width - len(indent)))


# the signals --exit-signal takes: as Megatron-LM, any signal, but those no process can
# catch (SIGKILL, SIGSTOP); schedulers send SIGTERM, SIGUSR1/2 (SLURM's --signal), SIGXCPU
EXIT_SIGNALS = tuple(s.name for s in signal.Signals if s.name not in ("SIGKILL", "SIGSTOP"))


def _signal_name(value):
    """SIGINT, sigint, INT or 2 all name SIGINT."""
    import signal

    text = value.strip().upper()
    if text.isdigit():
        try:
            return signal.Signals(int(text)).name
        except ValueError:
            return text
    return text if text.startswith("SIG") else "SIG" + text


def _str2bool(value):
    return str(value).lower() in ("1", "true", "yes", "y", "on")


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = _Parser(prog=os.path.basename(sys.argv[0]) or "pretrain_gpt.py",
                     description="GPT pretraining on megatron-core with Seq1F1B",
                     allow_abbrev=False, formatter_class=_HelpFormatter)

    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=False)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention; --num-query-groups defaults to 1 (as in "
                        "Megatron-LM)")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type",
                   # Megatron-LM's mrope and relative are refused with the reason
                   choices=["rope", "yarn", "learned_absolute", "none",
                            *REFUSED_POSITION_EMBEDDINGS],
                   default="learned_absolute",
                   help="yarn: RoPE with YaRN's long-context scaling (standard attention; "
                        "the --yarn-* flags, --rotary-scaling-factor, --mscale, "
                        "--mscale-all-dim)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_false",
                   dest="add_position_embedding",
                   help="no learned absolute position embedding: --position-embedding-type "
                        "none (with rope, nothing changes)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times the TP size")
    g.add_argument("--no-pad-vocab-size", "--disable-pad-vocab-size", action="store_false",
                   dest="pad_vocab_size",
                   help="the model's vocabulary is the tokenizer's, not padded (it must "
                        "divide over the TP ranks)")
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="the embedding and output layer's vocabulary size, instead of the "
                        "tokenizer's padded by --make-vocab-size-divisible-by (at least the "
                        "tokenizer's size, divisible by the TP size)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="LayerNorm weights centred on zero (gamma = 1 + weight)")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="residual connections from the norms' outputs instead of their "
                        "inputs (Megatron-LM's legacy layer; --transformer-impl local)")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... instead of the "
                        "two halves of each head (as in Megatron-LM)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama-3.x RoPE frequency scaling (megatron-core's rope_scaling)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="the Llama-3.x RoPE scaling factor of --use-rope-scaling")
    add_rope_scaling_arguments(g)
    add_attention_arguments(g)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--squared-relu", action="store_true",
                   help="squared ReLU activation in the MLP instead of GeLU (not with --swiglu)")
    g.add_argument("--quick-geglu", action="store_true",
                   help="gated MLP with quick GeLU, x * sigmoid(1.702 x), as gpt-oss (not "
                        "with --swiglu or --squared-relu)")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="with --quick-geglu: added to the gate's linear half (gpt-oss: 1)")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="with --quick-geglu: the activation's input clamped at this value, "
                        "the linear half to +-this value (gpt-oss: 7)")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                   help="GeLU as Megatron-LM computes it without its bias+GeLU fusion (erf). "
                        "By default a GeLU MLP with biased linear layers computes what that "
                        "fusion does, GeLU's tanh approximation (megatron-core's bias_gelu), "
                        "as Megatron-LM by default")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise queries and keys per head (--normalization's norm) before "
                        "RoPE, as Qwen3")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="bias in the QKV projection only, also with --disable-bias-linear "
                        "(Qwen2.5); implied by biased linear layers, as in Megatron-LM")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float,
                   default=1e-5)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="as Megatron-LM: on a GPU the weights are initialised on the CPU, "
                        "each whole weight from one seed and then divided over the tensor-"
                        "parallel ranks (the same initial model at any TP size), then moved "
                        "to the GPU; a CPU run always initialises so")
    g.add_argument("--init-method-xavier-uniform", action="store_true",
                   help="Xavier-uniform initial weights for every linear layer (instead of "
                        "normal ones of --init-method-std)")
    g.add_argument("--embedding-init-method-std", type=float, default=None,
                   help="standard deviation of the embedding's initial weights (default "
                        "--init-method-std)")
    g.add_argument("--transformer-impl",
                   choices=["local", "transformer_engine", "inference_optimized"], default=None,
                   help="layer implementation; default as Megatron-LM: transformer_engine "
                        "when Transformer Engine is importable and the run has no sequence "
                        "splits or packed documents, else local (with a note)")
    g.add_argument("--attention-backend", choices=["auto", *BACKEND_NAMES,
                                                   *MEGATRON_ATTENTION_BACKENDS],
                   default="auto",
                   help="core attention kernel (local layer spec); auto: flash when usable, "
                        "else sdpa; flex is opt-in and has no dropout. Megatron-LM's names "
                        "fused, unfused and local run sdpa here (PyTorch's kernels; there is "
                        "no Transformer Engine attention in the split-aware layers)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Megatron-LM's older spelling of --attention-backend flash")

    g = parser.add_argument_group("batch and training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="as Megatron-LM: where --global-batch-size (or a batch of "
                        "--rampup-batch-size or --step-batch-size-schedule) is not a "
                        "multiple of --micro-batch-size x data-parallel size, each iteration "
                        "trains on the largest multiple below it instead of stopping (a job "
                        "relaunched on fewer nodes goes on); the samples left out are counted "
                        "as skipped samples, and a relaunch whose data-parallel size divides "
                        "the batch trains on the whole batch again")
    g.add_argument("--train-iters", type=int)
    g.add_argument("--iterations-to-skip", type=int, nargs="+", default=[],
                   help="1-indexed iterations whose batch is read and not trained on (the "
                        "optimizer and learning-rate schedule do not step), as Megatron-LM: "
                        "e.g. to pass a bad stretch of data after a loss spike")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train for this many samples instead of --train-iters")
    g.add_argument("--rampup-batch-size", nargs="*", default=None,
                   metavar="START INCREMENT SAMPLES",
                   help="grow the global batch from START by INCREMENT over SAMPLES samples "
                        "(needs --train-samples), as Megatron-LM")
    g.add_argument("--step-batch-size-schedule", default=None,
                   metavar='"THRESHOLD:BATCH ..."',
                   help="as Megatron-LM: the global batch is BATCH from THRESHOLD tokens on "
                        "(K/M/B/T suffixes; first threshold 0; tokens // --seq-length "
                        "samples); instead of --global-batch-size, with --train-samples")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="learning rate of the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate of the input embedding and output layer")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine",
                                                "inverse-square-root", "WSD"],
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay iterations (or samples)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine",
                                                    "minus_sqrt"], default="exponential")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="weight decay also on the query/key norms' weights (--qk-layernorm; "
                        "Qwen3-Next), which like every 1-D weight and bias get none by "
                        "default")
    g.add_argument("--no-weight-decay-cond-type", choices=["apply_wd_to_qk_layernorm"],
                   default=None,
                   help="Megatron-LM's deprecated spelling of --apply-wd-to-qk-layernorm")
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"],
                   default="constant")
    g.add_argument("--optimizer", choices=["adam", "sgd"] + list(UNSUPPORTED_OPTIMIZERS),
                   default="adam",
                   help="adam: Adam(W); sgd: SGD with --sgd-momentum (weight decay added to "
                        "the gradient), both as megatron-core builds them; "
                        + ", ".join(UNSUPPORTED_OPTIMIZERS) + " stop the run")
    g.add_argument("--sgd-momentum", type=float, default=0.9,
                   help="momentum factor of --optimizer sgd (Megatron-LM ignores it with adam)")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--fp16-lm-cross-entropy", action="store_true",
                   help="with --fp16: the output layer's cross entropy in fp16")
    g.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                   help="with --bf16 on CUDA: no reduced-precision reductions in bf16 "
                        "matmuls (torch.backends.cuda.matmul)")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="as Megatron-LM: the data-parallel gradient reduction averages in "
                        "the collective instead of each rank dividing by the data-parallel "
                        "size before summing (the same values up to rounding)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (default with --bf16: fp32)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32 (on with --bf16 unless "
                        "--grad-reduce-in-bf16)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-parallel-random-init", action="store_true",
                   help="as Megatron-LM: each data-parallel rank seeds its random streams "
                        "with --seed + 10 x its rank (its dropout differs); the weights are "
                        "data-parallel rank 0's, broadcast to the others")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-modules", nargs="*", type=str, default=None,
                   help="with --recompute-granularity selective: core_attn (Megatron-LM's "
                        "default), moe (whole MoE layers), layernorm, mlp, shared_experts, "
                        "mla_up_proj (moe_act is refused)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recompute unit with --recompute-granularity full; "
                        "without a granularity it has no effect (as in Megatron-LM; noted)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's spelling of --recompute-granularity selective")

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="order the ranks tensor, pipeline, then data parallel (consecutive "
                        "ranks form a pipeline) instead of tensor, data, then pipeline")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks that divide every sequence (split) between them: each holds "
                        "an equal contiguous part of every split, and the split's keys and "
                        "values are all-gathered over them (their gradients reduce-scattered) "
                        "in the split-aware attention")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved schedule: layers per model chunk (virtual stage)")
    g.add_argument("--virtual-pipeline-model-parallel-size",
                   "--num-virtual-stages-per-pipeline-rank",
                   dest="virtual_pipeline_model_parallel_size", type=int, default=None,
                   help="interleaved schedule: model chunks per pipeline rank")
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None,
                   help="every pipeline stage's layers, Megatron-LM's string: E embedding, "
                        "t transformer layer, m MTP layer, L loss, | between stages (the "
                        "stages are the pipeline ranks times their virtual stages), e.g. "
                        "'Et*3|(tt|)*6,tL'")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the first pipeline stage (default: an even "
                        "split); the middle stages share the rest evenly")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="transformer layers on the last pipeline stage (default: an even "
                        "split); the middle stages share the rest evenly")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as a layer when dividing the layers among the "
                        "pipeline stages (the first stage builds one layer fewer)")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as a layer when dividing the layers "
                        "among the pipeline stages (the last stage builds one layer fewer)")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int,
                   default=None, help="interleaved schedule: microbatches each chunk runs "
                                      "before the next chunk starts (default: the pp size)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the data-parallel gradient reduction with backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with the "
                        "next forward (needs --use-distributed-optimizer and "
                        "--overlap-grad-reduce)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="every process group's timeout: a collective or p2p transfer that "
                        "waits longer (a peer stopped, dead or hung) stops the job")

    g = parser.add_argument_group("sequence-split pipeline (Seq1F1B)")
    g.add_argument("--seq1f1b-splits", "--pipe-sp-splits", dest="seq1f1b_splits", type=int,
                   default=1, help="splits per microbatch; 1 is plain 1F1B")
    g.add_argument("--seq1f1b-balance-method", "--pipe-sp-strategy",
                   dest="seq1f1b_balance_method", choices=list(schedule_registry.BALANCE_METHODS),
                   default="average")
    g.add_argument("--seq1f1b-split-alignment", type=int, default=1,
                   help="split lengths are multiples of this (and of the TP size under "
                        "sequence parallel)")
    g.add_argument("--seq1f1b-kv-cache", choices=list(KV_CACHE_LAYOUTS), default="buffer",
                   help="K/V prefix cache of split attention: 'buffer' (one buffer per "
                        "microbatch and layer, grown split by split, attention by "
                        "--attention-backend) "
                        "or 'chunked' (per-split chunks merged by log-sum-exp: no prefix "
                        "concatenation, no saved mask; plain-PyTorch kernel, no attention "
                        "dropout)")
    g.add_argument("--pipeline-schedule", choices=list(schedule_registry.NAMES),
                   default=None,
                   help="; ".join(f"{s.name}: {s.summary}"
                                  for s in schedule_registry.SCHEDULES.values())
                        + ". Default: slimpipe when a --slimpipe-* flag is given, seq1f1b "
                          "when --seq1f1b-splits > 1, else 1f1b")
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
    g.add_argument("--data-path", nargs="*", default=None,
                   help="a prefix, several, or 'w1 p1 w2 p2 ...' (a weighted blend), divided "
                        "into train/valid/test by --split")
    g.add_argument("--split", type=str, default=None,
                   help="train,valid,test weights dividing --data-path (default 969,30,1)")
    for part, name in (("train", "training"), ("valid", "validation"), ("test", "test")):
        g.add_argument(f"--{part}-data-path", nargs="*", default=None,
                       help=f"the {name} data's own blend, read whole (as --data-path; "
                            f"instead of it and --split)")
    g.add_argument("--data-args-path", type=str, default=None,
                   help="a file holding --data-path's list (whitespace-separated)")
    g.add_argument("--per-split-data-args-path", type=str, default=None,
                   help="a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} "
                        "holding --train/--valid/--test-data-path's lists (a string or a list; "
                        "null for none)")
    g.add_argument("--phase-transition-iterations", type=str, default=None,
                   help="comma-separated iterations ending training phases, as Megatron-LM: "
                        "the run saves and stops at each; relaunched with the next phase's "
                        "data flags it reads that data from the start, built for the "
                        "phase's samples (needs a fixed global batch size)")
    g.add_argument("--dataloader-type", choices=["single", "cyclic", "external"], default=None,
                   help="single (the default, the only one here): one pass over megatron-core's "
                        "shuffled samples")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=0,
                   help="DataLoader worker processes reading samples ahead (0: read in the "
                        "training process). Default 0, not Megatron-LM's 2: reading from "
                        "memory-mapped files is cheap next to a long-sequence step")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read .bin files with plain reads instead of memory maps")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                   help="as Megatron-LM: the share of extra samples megatron-core builds for "
                        "each dataset of a weighted blend")
    g.add_argument("--allow-ambiguous-pad-tokens", action="store_true",
                   help="as Megatron-LM: where the tokenizer's pad id is also another special "
                        "token's (e.g. pad = EOS), still mask tokens of that id out of the "
                        "loss (megatron-core's default then masks no pad)")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="accepted; no attention mask is ever built in the data loader here "
                        "(the kernels mask causally, documents by their ids)")
    # Megatron-LM's values; those not built here are refused with the reason (flag checks)
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES + tuple(REFUSED_TOKENIZER_TYPES),
                   default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", nargs="+",
                   dest="special_tokens", default=None, metavar="TOKEN",
                   help="as Megatron-LM: tokens added to a HuggingFaceTokenizer or "
                        "GPT2BPETokenizer as special (whole) tokens, those the vocabulary "
                        "lacks appended (give tools/preprocess_data.py the same)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary (as Megatron-LM 0.18+: ids 0..N-1, the "
                        "end-of-document id N - 1)")
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                   help="NullTokenizer's end-of-document id (default --vocab-size - 1)")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                   help="NullTokenizer's pad id (default -1: none)")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--dataloader-inter-document-masking", action="store_true",
                   help="as Megatron-LM: attention stays within each document a sample was "
                        "packed from, and position ids restart at 0 at each, the documents "
                        "taken from the dataset's packing (with or without end-of-document "
                        "tokens); the document attention of --reset-attention-mask, which "
                        "reads the boundaries from EOD tokens")
    g.add_argument("--eod-mask-loss", action="store_true")
    add_fim_arguments(g)
    add_sft_arguments(g)

    g = parser.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true",
                   help="print the model TFLOP/s per GPU in the iteration line")
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-params-norm", action="store_true",
                   help="print and log the L2 norm of all parameters after each step ('params "
                        "norm', TensorBoard 'params-norm'), over the whole model")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="print and log the number of zero gradient elements ('num zeros', "
                        "TensorBoard 'num-zeros'), counted by megatron-core's optimizer")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write the CUDA allocator's mem-reserved-bytes, mem-allocated-bytes, "
                        "mem-max-allocated-bytes and mem-allocated-count (GPU runs; a CPU "
                        "run has no CUDA allocator and writes none, noted at start-up)")
    g.add_argument("--log-memory-interval", type=int, default=None,
                   help="print the CUDA memory report every N iterations (GPU runs)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="write 'world-size' with the per-iteration scalars")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                   action="store_false", dest="log_loss_scale_to_tensorboard",
                   help="do not write 'loss-scale'")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="events TensorBoard's writer queues before it writes them to disk")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bit-reproducible execution as Megatron-LM: "
                        "torch.use_deterministic_algorithms(True), NCCL_ALGO=Ring, "
                        "CUBLAS_WORKSPACE_CONFIG=:4096:8 and NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 "
                        "unless set (a non-deterministic value set is refused)")
    g.add_argument("--logging-level", type=int, default=None,
                   help="the level of Python's root logger (10 DEBUG ... 50 CRITICAL)")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0,
                   help="0: iteration time only; 1: forward-backward, optimizer and other "
                        "top-level timers; 2: also per-unit compute and communication")
    g.add_argument("--timing-log-option", choices=["max", "minmax", "all"], default="minmax")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collection; collect every "
                        "--manual-gc-interval iterations")
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false",
                   dest="manual_gc_eval",
                   help="with --manual-gc, do not collect around evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                   help="empty the CUDA cache after forward/backward (1) and after the "
                        "optimizer step (2); nothing to do on CPU")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start + 1 to --profile-step-end "
                        "on --profile-ranks: a torch.profiler trace in --tensorboard-dir (else "
                        "./torch_profile), file rank<R>.<ns>.pt.trace.json, and on GPU "
                        "cudaProfilerStart/Stop (nsys --capture-range=cudaProfilerApi)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0])
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="on GPU, adds CUDA kernels to the torch.profiler trace (without it the "
                        "trace has CPU activity only and nsys keeps the CUDA profiling "
                        "interface)")
    g.add_argument("--wandb-project", type=str, default="")
    g.add_argument("--wandb-exp-name", type=str, default="")
    g.add_argument("--wandb-save-dir", type=str, default="")
    g.add_argument("--wandb-entity", type=str, default="",
                   help="the wandb entity (team or user) the run goes to")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-micro-batch-size", type=int, default=None,
                   help="as Megatron-LM: the micro-batch size of evaluations (default "
                        "--micro-batch-size)")
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="as Megatron-LM: the samples of one evaluation step, --eval-iters "
                        "of which make an evaluation (default --global-batch-size)")
    add_validation_arguments(g)
    g.add_argument("--start-eval-at-iter", type=int, default=None,
                   help="as Megatron-LM: the periodic evaluations start at this iteration "
                        "(those of earlier iterations are skipped and read no validation "
                        "data); the evaluation after training is unchanged")
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving a checkpoint with --save) when the iteration "
                        "is a multiple of this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (SIGTERM: SLURM preemption, torchrun forwarding "
                        "it), finish the current iteration, save a checkpoint with --save "
                        "and exit 0")
    g.add_argument("--exit-signal", type=_signal_name, default="SIGTERM",
                   choices=EXIT_SIGNALS, metavar="SIGNAL",
                   help="the signal --exit-signal-handler saves on: any a process can "
                        "catch (not SIGKILL or SIGSTOP), e.g. SIGTERM (default), SIGUSR1 "
                        "(SLURM's --signal), SIGINT (Ctrl-C)")
    g.add_argument("--exit-signal-handler-for-training", action="store_true",
                   help="SIGINT or SIGTERM (the one --exit-signal-handler does not take) "
                        "stops every rank at once with one line and exit 0, without "
                        "saving (Megatron-LM's orderly shutdown); without it SIGINT stops "
                        "with one line and exit 130")
    g.add_argument("--exit-signal-handler-for-dataloader", action="store_true",
                   help="accepted: DataLoader workers (--num-workers) always ignore "
                        "SIGTERM here; the trainer handles it and ends them after saving")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit 0 after the iteration during which this "
                        "many minutes of the run have passed (decided on all ranks together)")
    g.add_argument("--rerun-mode", choices=["disabled", "validate_results", "report_stats"],
                   default="disabled",
                   help="Megatron-LM's rerun engine (megatron-core's RerunStateMachine). "
                        "validate_results: a rejected loss or gradient (NaN, Inf, "
                        "--check-for-spiky-loss, --check-for-large-grads) reruns the "
                        "iteration in place; not reproduced (transient): exit 17; "
                        "reproduced: on GPUs save and exit 16 (resume on other GPUs), on "
                        "CPU exit 17. report_stats: every iteration run twice, the "
                        "variability logged. disabled (this trainer's default, not "
                        "Megatron-LM's): the NaN/inf check stops the run with exit 1")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="Megatron-LM's fault injection into --rerun-mode validate_results: "
                        "about one validated result in this many is rejected (0: none)")
    g.add_argument("--error-injection-type", default="transient_error",
                   choices=["correct_result", "transient_error", "persistent_error"],
                   help="what an injected rejection behaves as on its reruns")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="a microbatch loss 10x the largest of the first 100 is rejected "
                        "(not fatal: with --rerun-mode validate_results the iteration is "
                        "rerun and training goes on; disabled: a warning)")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="a bucket's grad norm 10x the largest of the first 100 is rejected "
                        "(not fatal; megatron-core DDP's check)")
    g.add_argument("--result-rejected-tracker-filename", default=None,
                   help="file every rank appends its rejected results to (megatron-core's "
                        "format)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   help="stop at the first NaN/inf loss or gradient, before the optimizer "
                        "step and without saving (default)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="train on through non-finite values (not recommended)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration's checkpoint from --load instead of the one "
                        "its tracker file names (as Megatron-LM)")
    g.add_argument("--override-ckpt-iteration", type=int, default=None,
                   help="as Megatron-LM: resume the checkpoint in --load as if it had been "
                        "saved at this iteration: training goes on from the next one and "
                        "the data loader reads on from that iteration's samples (rewinding "
                        "to replay them, or skipping ahead past a bad stretch); the weights, "
                        "optimizer state and learning-rate schedule stay the checkpoint's")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--load-unverified-checkpoint", action="store_true",
                   help="load a checkpoint of this project whose checksums.json is missing "
                        "(its files cannot be verified; without this flag it is refused). "
                        "Megatron-LM's checkpoints, which have none, load without it")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=["assume_ok_unexpected", "log_unexpected", "log_all",
                            "raise_unexpected", "raise_all", "return_unexpected",
                            "return_all", "ignore_all"],
                   help="as Megatron-LM: megatron-core's handling of keys that the model "
                        "asks for but the checkpoint lacks (unexpected) or the checkpoint "
                        "has but the model does not ask for (missing); with log_*, "
                        "return_* and ignore_all the weights the checkpoint lacks keep "
                        "their initial values")
    g.add_argument("--pretrained-checkpoint", type=str, default=None,
                   help="as Megatron-LM: where --load holds no checkpoint (or is not "
                        "given), start from the weights of this directory's latest "
                        "checkpoint as --finetune does (iteration 0, a fresh optimizer); "
                        "once this run has saved into --load, a restart resumes from "
                        "there (e.g. extending a model's context: --pretrained-checkpoint "
                        "BASE --load RUN --save RUN)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model weights from --load; start at iteration 0 "
                        "without optimizer or RNG state")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model-shape flags from the checkpoint in --load (or "
                        "--pretrained-checkpoint's, when --load holds none)")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="as Megatron-LM, with --use-checkpoint-args: also the checkpoint's "
                        "tensor-, pipeline- and expert-parallel sizes and virtual stages "
                        "(recorded since 2026-12-07; older checkpoints keep the command "
                        "line's virtual stages)")
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch", "zarr", "torch_dcp",
                                             "fsdp_dtensor"], default="torch_dist",
                   help="only torch_dist (megatron-core distributed checkpoints) is written "
                        "and read here")
    g.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                   help="as Megatron-LM: the weights are not initialised, the checkpoint "
                        "--load (or --pretrained-checkpoint) gives them all (a faster start "
                        "of a large model); without a checkpoint there the run stops")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="stop when --load holds no checkpoint (without it such a run warns "
                        "and starts from random, as in Megatron-LM)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, the learning-rate and weight-decay schedule of this "
                        "command line replaces the checkpoint's (e.g. a longer --train-iters)")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, keep the checkpoint's learning-rate and weight-decay "
                        "schedule whatever this command line says; without either flag a "
                        "schedule that differs from the checkpoint's is refused")
    g.add_argument("--save-wgrads-interval", type=int, default=None,
                   help="as Megatron-LM: every N iterations each model-parallel rank writes "
                        "its parameters' gradients (after the data-parallel reduction, whole "
                        "on every rank also under the distributed optimizer) to "
                        "SAVE/wgrads/iter_N/mp_rank_TT[_PPP][_EEE].pth ({model_chunkK: {name: "
                        "tensor}}): compare two runs (Seq1F1B against 1F1B) tensor by tensor")
    g.add_argument("--save-params-interval", type=int, default=None,
                   help="as Megatron-LM: every N iterations the parameters after the "
                        "optimizer step, to SAVE/params/iter_N/ in the same form")
    g.add_argument("--save-activations-interval", type=int, default=None,
                   help="as Megatron-LM: every N iterations the inputs and outputs of every "
                        "linear layer and router in the iteration's last microbatch, to "
                        "SAVE/activations/iter_N/ ({model_chunkK: {'MODULE/inputI': tensor, "
                        "...}}); a split microbatch's splits joined along the sequence")
    g.add_argument("--save-dgrads-interval", type=int, default=None,
                   help="as Megatron-LM: the same modules' input and output gradients, to "
                        "SAVE/dgrads/iter_N/")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="keep only the checkpoints of iterations that are multiples of this "
                        "(and the latest): each save deletes the previous latest one unless "
                        "it is such a multiple (a multiple of --save-interval)")
    g.add_argument("--async-save", action="store_true",
                   help="as Megatron-LM: write the checkpoint's tensors in a background "
                        "process while training goes on; the checkpoint (checksums, "
                        "rename, tracker, --save-retain-interval) is published once every "
                        "rank's write is done, checked every iteration, and the run waits "
                        "for it before it ends")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="as Megatron-LM: with --async-save, one writer process per rank "
                        "for the whole run (forked at the first save) instead of one per "
                        "save; it is handed copies of the tensors, so each write is a "
                        "snapshot of its iteration")
    g.add_argument("--skip-train", action="store_true",
                   help="load --load and evaluate on the validation and test sets without "
                        "training (implies --no-load-optim, as in Megatron-LM)")

    add_moe_arguments(parser)
    add_mla_arguments(parser)
    add_mtp_arguments(parser)
    add_no_op_flags(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def _require(condition, message):
    if not condition:
        raise ArgumentError(message)


def validate_args(args, world_size: int, cuda_available: bool, check_files: bool = True):
    """Fill defaults derived from other flags and reject inconsistent values.

    Every problem is collected (each check below is independent, or skipped when an
    earlier one failed on a value it needs) and raised together as ``ArgumentErrors``.
    ``check_files=False`` skips what reads the disk (data files, tokenizer files, --load):
    tools/plan.py validates a training command line for a run elsewhere."""
    problems = []
    checks = (
        lambda: _apply_checkpoint_args(args, check_files),
        lambda: _check_required(args),
        lambda: _check_megatron_compat(args, cuda_available),
        lambda: _derive_parallel_layout(args, world_size),
        lambda: _check_model_shape(args),
        lambda: problems.extend(_device_problems(args, cuda_available)),
        lambda: _check_recompute(args),
        lambda: _derive_training_length(args),
        lambda: _check_learning_rate(args),
        lambda: _check_data_flags(args, check_files),
        lambda: _check_checkpoint_flags(args, check_files),
        lambda: _check_exit_flags(args),
        lambda: problems.extend(phases.problems(args)),
        lambda: _check_rerun_mode(args),
        lambda: _validate_seq1f1b(args),
        lambda: problems.extend(check_moe_args(args, cuda_available)),
        lambda: problems.extend(check_mla_args(args)),
        lambda: problems.extend(check_mtp_args(args)),
        lambda: problems.extend(check_rope_scaling_args(args)),
        lambda: problems.extend(check_attention_args(args)),
        lambda: _validate_slimpipe(args),
        lambda: _validate_context_parallel(args),
        lambda: _check_context_parallel_communication(args),
        lambda: _check_rampup_layouts(args),
        lambda: _derive_eval_batch(args),
        lambda: problems.extend(check_validation_args(args)),
        lambda: problems.extend(check_fim_args(
            args, (lambda: tokenizer_of(args)) if check_files else None)),
        lambda: problems.extend(check_sft_args(
            args, (lambda: tokenizer_of(args)) if check_files else None)),
        lambda: _check_per_token_router_losses(args),
    )
    for check in checks:
        try:
            check()
        except ArgumentErrors as error:
            problems.extend(error.problems)
        except ArgumentError as error:
            problems.append(str(error))
        except (TypeError, ValueError, ZeroDivisionError, AttributeError):
            if not problems:  # not a consequence of a problem already reported
                raise
    if problems:
        raise ArgumentErrors(problems)
    return args


def tokenizer_of(args):
    """The tokenizer of the run's flags (raises TokenizerError, a ValueError)."""
    from megatron.dataprep.tokenizer import build_tokenizer

    if args.tokenizer_type == "SFTTokenizer":
        from megatron.dataprep.sft_tokenizer import SFTTokenizer

        return SFTTokenizer(args.tokenizer_model, args.sft_tokenizer_prompt_format)
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                           vocab_size=args.vocab_size, special_tokens=args.special_tokens,
                           null_eod_id=args.null_tokenizer_eod_id,
                           null_pad_id=args.null_tokenizer_pad_id)


def _apply_checkpoint_args(args, check_files):
    """--use-checkpoint-args: the model shape of the checkpoint in --load replaces the
    command line's (as Megatron-LM), before anything is derived from it."""
    if not (args.use_checkpoint_args and check_files):
        return
    from megatron.trainer.checkpointing import (
        CheckpointError,
        load_source,
        saved_common_state,
        saved_model_shape,
        saved_parallel_sizes,
    )

    source, flag = load_source(args)
    if source is None:
        return  # --use-checkpoint-args without a directory: _check_checkpoint_flags says so
    try:
        common = saved_common_state(source, flag)
    except CheckpointError as error:
        raise ArgumentError(str(error))
    if args.use_mp_args_from_checkpoint_args:
        # as Megatron-LM: the checkpoint's TP, PP, virtual stages and EP replace the
        # command line's (a virtual-stage count replaces a per-stage layer count)
        sizes = saved_parallel_sizes(common)
        _require(sizes is not None,
                 f"--use-mp-args-from-checkpoint-args: {flag} {source} records no parallel "
                 f"sizes (a checkpoint saved by Megatron-LM?): give them on the command line")
        if sizes.get("virtual_pipeline_model_parallel_size") is not None:
            args.num_layers_per_virtual_pipeline_stage = None
        for dest, value in sizes.items():
            setattr(args, dest, value)
    shape = saved_model_shape(common, args)
    # as Megatron-LM: the checkpoint's vocabulary size unless the command line gives one
    # (else it follows the tokenizer, and the load compares it)
    if args.padded_vocab_size is not None:
        shape.pop("padded_vocab_size", None)
    for flag, value in shape.items():
        setattr(args, flag, value)
    if shape.get("num_query_groups") not in (None, shape.get("num_attention_heads")):
        args.group_query_attention = True


def _device_problems(args, cuda_available):
    if cuda_available is None:  # check_flags_early: the device is decided with torch
        return []
    from megatron.trainer.device import device_problems

    return device_problems(args, cuda_available)


def _check_required(args):
    problems = []
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, flag) is None:
            problems.append(f"--{flag.replace('_', '-')} is required")
    if args.train_iters is None and args.train_samples is None:
        problems.append("give the training length: --train-iters N or --train-samples N")
    positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                "micro_batch_size", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "context_parallel_size", "log_interval",
                "seq1f1b_split_alignment",
                "make_vocab_size_divisible_by", "tensorboard_log_interval")
    for flag in positive:
        value = getattr(args, flag)
        if value is not None and value < 1:
            problems.append(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("train_iters", "train_samples", "num_workers"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            problems.append(f"--{flag.replace('_', '-')} must be >= 0, got {value}")
    if problems:
        raise ArgumentErrors(problems)


def _check_megatron_compat(args, cuda_available):
    """Megatron-LM's spellings, its defaults that depend on the machine, and the
    Megatron-LM flags whose values this trainer cannot honour."""
    problems = []
    args.flag_notes = []
    if args.dataloader_inter_document_masking or args.sft:
        # the document attention of --reset-attention-mask, with the boundaries (and
        # positions) of the samples' packing (megatron.dataprep.sample_documents) or of
        # the conversations (megatron.dataprep.sft_dataset)
        args.reset_attention_mask = True
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        args.position_embedding_type = "none"
    if args.no_weight_decay_cond_type == "apply_wd_to_qk_layernorm":  # as Megatron-LM
        args.apply_wd_to_qk_layernorm = True
        args.flag_notes.append("note: --no-weight-decay-cond-type is deprecated (as in "
                               "Megatron-LM): use --apply-wd-to-qk-layernorm")
    if args.apply_wd_to_qk_layernorm and not args.qk_layernorm:
        args.flag_notes.append("note: --apply-wd-to-qk-layernorm without --qk-layernorm: "
                               "there are no query/key norms, it has no effect")
    if args.use_flash_attn:
        if args.attention_backend not in ("auto", "flash"):
            problems.append(f"--use-flash-attn contradicts --attention-backend "
                            f"{args.attention_backend}; keep one")
        elif _flash_attn_importable():
            args.attention_backend = "flash"
        else:  # SDPA's own FlashAttention kernel where it can run (CUDA, half precision)
            args.flag_notes.append("note: --use-flash-attn: flash-attn is not installed; "
                                   "attention runs in PyTorch SDPA (--attention-backend "
                                   "auto, its FlashAttention kernel on CUDA)")
    if args.attention_backend in MEGATRON_ATTENTION_BACKENDS:
        # Megatron-LM's names: PyTorch SDPA is the kernel that exists here for each
        args.flag_notes.append(
            f"note: --attention-backend {args.attention_backend} runs PyTorch SDPA here "
            + ("(its fused kernels: flash, memory-efficient, cuDNN)"
               if args.attention_backend == "fused" else "(exact attention; there is no "
               "separate unfused kernel)"))
        args.attention_backend = "sdpa"
    if args.transformer_impl is None:
        # Megatron-LM's default, where it can run: the split schedules and packed
        # documents need the split-aware local layers
        needs_local = [flag for flag, used in (
            ("--seq1f1b-splits > 1", args.seq1f1b_splits > 1),
            ("--context-parallel-size > 1", args.context_parallel_size > 1),
            ("SlimPipe", args.pipeline_schedule == "slimpipe" or args.slimpipe_slices
             or args.slimpipe_slice_length),
            ("--reset-attention-mask", args.reset_attention_mask),
            ("--apply-residual-connection-post-layernorm",
             args.apply_residual_connection_post_layernorm),
            # model.layer_spec's Transformer Engine spec is megatron-core's dense one
            ("--multi-latent-attention", getattr(args, "multi_latent_attention", False)),
            ("--num-experts", getattr(args, "num_experts", None) is not None)) if used]
        te = _te_importable()
        args.transformer_impl = "transformer_engine" if te and not needs_local else "local"
        args.transformer_impl_note = (
            None if args.transformer_impl == "transformer_engine" else
            "note: --transformer-impl local (Megatron-LM's default, transformer_engine, "
            + (f"does not run with {', '.join(needs_local)} here)" if te else
               "needs Transformer Engine, which is not installed)"))
    elif args.transformer_impl == "transformer_engine" and not _te_importable():
        problems.append("--transformer-impl transformer_engine needs Transformer Engine "
                        "installed; use --transformer-impl local")
    te_dense_only = [flag for flag, used in (
        ("--multi-latent-attention", getattr(args, "multi_latent_attention", False)),
        ("--num-experts", getattr(args, "num_experts", None) is not None)) if used]
    if args.transformer_impl == "transformer_engine" and te_dense_only:
        # layer_spec (megatron/trainer/model.py) would build a dense standard-attention
        # layer: silently another model
        problems.append(f"{' and '.join(te_dense_only)} need --transformer-impl local here "
                        "(the Transformer Engine layer spec built here is dense standard "
                        "attention): use --transformer-impl local")
    if (args.transformer_impl == "transformer_engine"
            and args.apply_residual_connection_post_layernorm):
        # TE's layer spec fuses the input norm into the QKV projection: its output never
        # exists as a tensor to take the residual from
        problems.append("--apply-residual-connection-post-layernorm needs --transformer-impl "
                        "local (Transformer Engine fuses the norm into the next linear layer)")
    if args.ckpt_format != "torch_dist":
        problems.append(f"--ckpt-format {args.ckpt_format} is not supported: checkpoints here "
                        "are megatron-core distributed checkpoints; use --ckpt-format "
                        "torch_dist (Megatron-LM's default)")
    if args.overlap_param_gather:
        if not args.use_distributed_optimizer:
            problems.append("--overlap-param-gather needs --use-distributed-optimizer "
                            "(as in Megatron-LM)")
        if not args.overlap_grad_reduce:
            problems.append("--overlap-param-gather needs --overlap-grad-reduce "
                            "(as in Megatron-LM)")
    if args.grad_reduce_in_bf16 and args.accumulate_allreduce_grads_in_fp32:
        problems.append("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 "
                        "contradict each other; keep one")
    if args.grad_reduce_in_bf16 and not args.bf16:
        problems.append("--grad-reduce-in-bf16 needs --bf16")
    if args.ddp_average_in_collective and args.calculate_per_token_loss:
        # megatron-core asserts it while building the model
        problems.append("--ddp-average-in-collective does not go with "
                        "--calculate-per-token-loss (the gradients are summed, then divided "
                        "by the token count; megatron-core refuses averaging there)")
    problems.extend(optimizer_problems(args))
    if args.position_embedding_type in REFUSED_POSITION_EMBEDDINGS:
        problems.append(f"--position-embedding-type {args.position_embedding_type} is "
                        f"refused: {REFUSED_POSITION_EMBEDDINGS[args.position_embedding_type]}")
    if args.transformer_impl == "inference_optimized":
        problems.append("--transformer-impl inference_optimized is refused: megatron-core's "
                        "inference layers do not train; use local or transformer_engine")
    args.no_op_flags = no_op_flags_given(args)
    if problems:
        raise ArgumentErrors(problems)


def _installed(name) -> bool:
    """Without importing it (which loads torch): for check_flags_early."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _flash_attn_importable() -> bool:
    if _LIGHT:
        return _installed("flash_attn")
    try:
        import flash_attn  # noqa: F401
        return True
    except Exception:  # not installed, or a build that does not load
        return False


def _te_importable() -> bool:
    if _LIGHT:
        return _installed("transformer_engine")
    try:
        import transformer_engine  # noqa: F401
        return True
    except Exception:  # not installed, or a build that does not load
        return False


def _derive_parallel_layout(args, world_size):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    _require(world_size % (tp * pp * cp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) "
             f"x --pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}); "
             f"launch a multiple of {tp * pp * cp} processes")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    dp = args.data_parallel_size

    _take_step_schedule(args)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    _require(args.global_batch_size >= 1,
             f"--global-batch-size must be >= 1, got {args.global_batch_size}")
    _require(args.distributed_timeout_minutes > 0,
             f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}")
    _check_batch_divides(args, args.global_batch_size,
                         "--global-batch-size" if args.step_batch_schedule is None
                         else "--step-batch-size-schedule's last batch")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    _derive_batch_rampup(args)

    _resolve_pipeline_schedule(args)
    _take_pipeline_layout(args)
    _validate_virtual_pipeline(args)
    if args.chunk_layer_counts is not None:  # --pipeline-model-parallel-layout
        args.stage_layer_counts = [sum(args.chunk_layer_counts[rank::pp])
                                   for rank in range(pp)]
        return
    try:  # after the virtual stages: each rank's layers must divide among its chunks
        args.stage_layer_counts = stage_layer_counts(
            args.num_layers, pp, args.decoder_first_pipeline_num_layers,
            args.decoder_last_pipeline_num_layers, args.virtual_pipeline_model_parallel_size,
            account_for_embedding=args.account_for_embedding_in_pipeline_split,
            account_for_loss=args.account_for_loss_in_pipeline_split)
    except UnevenSplitError as error:
        raise ArgumentError(str(error)) from None


def _check_batch_divides(args, batch, flag):
    """A global batch must be a multiple of --micro-batch-size x data-parallel size; with
    --decrease-batch-size-if-needed (as Megatron-LM) the largest multiple below it trains,
    with a note, and the rest of each batch is counted as skipped samples."""
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    unit = mbs * dp
    if batch % unit == 0:
        return
    _require(args.decrease_batch_size_if_needed,
             f"{flag} ({batch}) must be divisible by --micro-batch-size ({mbs}) x "
             f"data-parallel size ({dp}); use a multiple of {unit} (or "
             f"--decrease-batch-size-if-needed to train on the largest multiple below it, as "
             f"Megatron-LM)")
    _require(batch >= unit,
             f"--decrease-batch-size-if-needed: {flag} ({batch}) is below --micro-batch-size "
             f"({mbs}) x data-parallel size ({dp}), so not one microbatch per data-parallel "
             f"rank is left; use fewer data-parallel ranks or a batch of at least {unit}")
    running = batch // unit * unit
    args.flag_notes.append(
        f"note: --decrease-batch-size-if-needed: {flag} {batch} is not a multiple of "
        f"--micro-batch-size ({mbs}) x data-parallel size ({dp}): its iterations train on "
        f"{running} samples, and the {batch - running} left out of each are counted as "
        f"skipped samples")


def _take_step_schedule(args):
    """--step-batch-size-schedule: parsed into args.step_batch_schedule; its last batch
    is the run's --global-batch-size (as megatron-core's calculator reports it)."""
    args.step_batch_schedule = None
    if args.step_batch_size_schedule is None:
        return
    from megatron.trainer.batch_schedule import ScheduleError, parse_schedule

    _require(args.global_batch_size is None,
             "--step-batch-size-schedule and --global-batch-size exclude each other (as in "
             "Megatron-LM): the schedule gives the batch; keep one")
    _require(args.rampup_batch_size is None,
             "--step-batch-size-schedule and --rampup-batch-size exclude each other; keep one")
    _require(args.train_samples is not None,
             "--step-batch-size-schedule needs --train-samples instead of --train-iters (its "
             "iterations have different batch sizes, so the run's length and learning-rate "
             "schedule are counted in samples)")
    try:
        args.step_batch_schedule = parse_schedule(args.step_batch_size_schedule,
                                                  args.seq_length)
    except ScheduleError as error:
        raise ArgumentError(f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: "
                            f"{error}") from None
    args.global_batch_size = args.step_batch_schedule[-1][1]


def _derive_batch_rampup(args):
    """--rampup-batch-size START INCREMENT SAMPLES: the global batch sizes the run will
    use (megatron-core's calculator decides them), each checked against the layout."""
    args.rampup_global_batch_sizes = [args.global_batch_size]
    if args.step_batch_schedule is not None:
        unit = args.micro_batch_size * args.data_parallel_size
        sizes = [batch for _, batch in args.step_batch_schedule]
        wrong = [batch for batch in sizes
                 if batch % unit and not (args.decrease_batch_size_if_needed and batch >= unit)]
        _require(not wrong, f"--step-batch-size-schedule: the global batches {wrong} are not "
                            f"multiples of --micro-batch-size x data-parallel size ({unit})"
                 + ("" if args.decrease_batch_size_if_needed else
                    " (--decrease-batch-size-if-needed trains on the largest multiple below "
                    "each)"))
        args.rampup_global_batch_sizes = sizes[:-1] + [args.global_batch_size]
        return
    if args.rampup_batch_size is None:
        return
    values = args.rampup_batch_size
    _require(len(values) == 3, "--rampup-batch-size takes three numbers: START INCREMENT "
                               f"SAMPLES, got {len(values)}")
    try:
        start, increment, samples = (int(v) for v in values)
    except ValueError:
        raise ArgumentError(f"--rampup-batch-size takes three integers, got {' '.join(values)}")
    _require(args.train_samples is not None,
             "--rampup-batch-size needs --train-samples (as in Megatron-LM)")
    unit = args.micro_batch_size * args.data_parallel_size
    _require(start >= 1 and increment >= 1 and samples >= 0,
             "--rampup-batch-size: START and INCREMENT must be >= 1 and SAMPLES >= 0")
    if args.decrease_batch_size_if_needed:  # each batch on the way is rounded down
        _require(start >= unit,
                 f"--decrease-batch-size-if-needed: --rampup-batch-size START ({start}) is "
                 f"below --micro-batch-size x data-parallel size ({unit}): not one microbatch "
                 f"per data-parallel rank is left")
    else:
        _require(start % unit == 0 and increment % unit == 0,
                 f"--rampup-batch-size START ({start}) and INCREMENT ({increment}) must be "
                 f"multiples of --micro-batch-size x data-parallel size ({unit})")
    _require((args.global_batch_size - start) % increment == 0 and
             start <= args.global_batch_size,
             f"--rampup-batch-size: --global-batch-size ({args.global_batch_size}) minus START "
             f"({start}) must be a non-negative multiple of INCREMENT ({increment})")
    args.rampup_batch_size = [start, increment, samples]
    args.rampup_global_batch_sizes = list(range(start, args.global_batch_size + 1, increment))


def _check_schedule_shape(args, num_microbatches):
    """Raise ValueError where the pipeline schedule cannot run this many microbatches
    (SlimPipe's and the interleaved schedule's rules; the others run any count)."""
    pp, vp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if args.pipeline_schedule == "slimpipe":
        from megatron.schedules.slimpipe import check_slimpipe_shape

        check_slimpipe_shape(pp, num_microbatches, vp or 1, args.slimpipe_slices)
    elif vp:
        from megatron.schedules.interleaved import check_interleaved_shape

        check_interleaved_shape(pp, num_microbatches, vp,
                                args.microbatch_group_size_per_virtual_pipeline_stage)


def _check_rampup_layouts(args):
    """Every global batch of the ramp-up must suit the schedule, not only the last."""
    unit = args.micro_batch_size * args.data_parallel_size
    for batch in args.rampup_global_batch_sizes[:-1]:
        try:
            _check_schedule_shape(args, batch // unit)
        except ValueError as err:
            flag = ("--step-batch-size-schedule" if args.step_batch_schedule is not None
                    else "--rampup-batch-size")
            raise ArgumentError(f"{flag}: the global batch {batch} on the way "
                                f"does not suit the schedule: {err}")


def _derive_eval_batch(args):
    """--eval-micro-batch-size and --eval-global-batch-size (Megatron-LM's defaults: the
    training ones). ``args.eval_num_microbatches`` is None where neither is given: the
    evaluations then run the training batch shape of their iteration, as before."""
    given = args.eval_micro_batch_size is not None or args.eval_global_batch_size is not None
    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    if args.eval_global_batch_size is None:  # the batch that trains (under
        # --decrease-batch-size-if-needed the largest multiple below --global-batch-size)
        args.eval_global_batch_size = (args.num_microbatches * args.micro_batch_size
                                       * args.data_parallel_size)
    args.eval_num_microbatches = None
    if not given:
        return
    mbs, gbs, dp = args.eval_micro_batch_size, args.eval_global_batch_size, args.data_parallel_size
    _require(mbs >= 1 and gbs >= 1, f"--eval-micro-batch-size ({mbs}) and "
                                    f"--eval-global-batch-size ({gbs}) must be >= 1")
    _require(gbs % (mbs * dp) == 0,
             f"--eval-global-batch-size ({gbs}) must be divisible by --eval-micro-batch-size "
             f"({mbs}) x data-parallel size ({dp}), as Megatron-LM checks")
    args.eval_num_microbatches = gbs // (mbs * dp)
    try:
        _check_schedule_shape(args, args.eval_num_microbatches)
    except ValueError as err:
        raise ArgumentError(f"--eval-global-batch-size {gbs} / --eval-micro-batch-size {mbs}:"
                            f" {args.eval_num_microbatches} microbatches per evaluation step "
                            f"do not suit the schedule: {err}")


def _check_model_shape(args):
    tp = args.tensor_model_parallel_size
    # as Megatron-LM (its validate_args asserts it)
    _require(not args.fp16_lm_cross_entropy or args.fp16,
             "--fp16-lm-cross-entropy needs --fp16 (as in Megatron-LM)")
    if args.padded_vocab_size is not None:
        _require(args.padded_vocab_size > 0 and args.padded_vocab_size % tp == 0,
                 f"--padded-vocab-size ({args.padded_vocab_size}) must be a positive multiple "
                 f"of --tensor-model-parallel-size ({tp}): each TP rank holds an equal slice "
                 f"of the vocabulary")
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})")
    _require(args.hidden_size % args.num_attention_heads == 0 or args.kv_channels,
             f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
             f"({args.num_attention_heads}), or set --kv-channels")
    if args.num_query_groups is not None and not args.group_query_attention:
        args.group_query_attention = True
    if args.group_query_attention:
        if args.num_query_groups is None:
            args.num_query_groups = 1  # Megatron-LM's default
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
    _require(not (args.squared_relu and args.swiglu),
             "--squared-relu and --swiglu are two MLP activations; keep one")
    _require(not (args.quick_geglu and (args.swiglu or args.squared_relu)),
             "--quick-geglu is another MLP activation than --swiglu and --squared-relu; keep one")
    for flag, value, unset in (("--glu-linear-offset", args.glu_linear_offset, 0.0),
                               ("--activation-func-clamp-value",
                                args.activation_func_clamp_value, None)):
        # megatron-core applies them in its unfused gated MLP only: Megatron-LM's default
        # fused SwiGLU ignores them
        _require(value == unset or args.quick_geglu,
                 f"{flag} shapes --quick-geglu's gated MLP: add --quick-geglu or drop it")
    _require(args.activation_func_clamp_value is None or args.activation_func_clamp_value > 0,
             f"--activation-func-clamp-value must be > 0, got {args.activation_func_clamp_value}")
    _require(not args.use_rope_scaling or args.position_embedding_type == "rope",
             "--use-rope-scaling scales RoPE: it needs --position-embedding-type rope")
    if not args.disable_bias_linear:  # as Megatron-LM: biased linear layers bias QKV too
        args.add_qkv_bias = True
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
    if args.sequence_parallel and tp == 1:  # as Megatron-LM, which says so too
        args.sequence_parallel = False
        args.flag_notes.append("note: disabling sequence parallelism (--sequence-parallel) "
                               "because tensor model parallelism is disabled")


# --recompute-modules recomputed here under sequence splits: megatron-core's own
# checkpoints of per-token modules (layernorm, mlp, shared_experts, mla_up_proj), each
# rerunning the split it saved; core attention's kernel (seqsplit/recompute.py) and
# whole MoE layers (seqsplit/moe.py) with the whole microbatch's routing statistics
RECOMPUTE_MODULES = {"core_attn", "moe", "layernorm", "mlp", "shared_experts", "mla_up_proj"}


def _recompute_module_refusal(modules):
    if "moe_act" in modules:
        return ("megatron-core recomputes the expert activation only inside its grouped-GEMM "
                "experts (Transformer Engine's), which are not built here (the experts run "
                "as megatron-core's SequentialMLP); use --recompute-modules moe to recompute "
                "whole MoE layers")
    if "gdn_norm_out" in modules:
        return "gated delta-net attention is not built here"
    return ("not a module Megatron-LM recomputes; choose from "
            + ", ".join(sorted(RECOMPUTE_MODULES | {"moe_act"})))


def _check_recompute(args):
    if args.recompute_activations:  # as Megatron-LM: it overrides --recompute-granularity
        args.recompute_granularity = "selective"
    if args.recompute_granularity is None and args.recompute_num_layers is not None:
        args.no_op_flags.append(("--recompute-num-layers", "only used with "
                                 "--recompute-granularity full (as in Megatron-LM)"))
        args.recompute_num_layers = None
    if args.moe_layer_recompute:
        # Megatron-LM's meaning (megatron-core's config): selective, with "moe" added to
        # the modules (by default core attention's)
        _require(args.recompute_granularity != "full",
                 "--moe-layer-recompute does not go with --recompute-granularity full (as in "
                 "Megatron-LM): full recomputation recomputes the MoE layers already")
        args.recompute_granularity = "selective"
        modules = args.recompute_modules or ["core_attn"]
        args.recompute_modules = modules + ["moe"] if "moe" not in modules else modules
    if args.recompute_modules is not None:
        others = sorted(set(args.recompute_modules) - RECOMPUTE_MODULES)
        _require(not others, f"--recompute-modules {' '.join(others)} is refused: "
                             f"{_recompute_module_refusal(others)}")
        selective = args.recompute_granularity == "selective"  # else unused (Megatron-LM)
        _require(not selective or "mla_up_proj" not in args.recompute_modules
                 or getattr(args, "multi_latent_attention", False),
                 "--recompute-modules mla_up_proj needs --multi-latent-attention (as in "
                 "Megatron-LM)")
        if ("moe" in args.recompute_modules and args.num_experts is None
                and not args.moe_layer_recompute):  # (that one is noted with the MoE flags)
            args.flag_notes.append("note: --recompute-modules moe without --num-experts: "
                                   "there is no MoE layer to recompute")
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


def _derive_training_length(args):
    """--train-iters or --train-samples (never both), and the learning-rate schedule's
    lengths in samples, as Megatron-LM counts them."""
    gbs = args.global_batch_size
    if args.train_samples is None:
        _require(args.rampup_batch_size is None,
                 "--rampup-batch-size needs --train-samples instead of --train-iters "
                 "(as in Megatron-LM)")
        for flag, value, unset in (("--lr-decay-samples", args.lr_decay_samples, None),
                                   ("--lr-warmup-samples", args.lr_warmup_samples, 0),
                                   ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples, None)):
            _require(value == unset, f"{flag} counts samples: use it with --train-samples, "
                                     f"or {flag.replace('samples', 'iters')} with --train-iters")
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        decay = args.lr_decay_iters * gbs
        warmup = args.lr_warmup_iters * gbs
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
        args.train_samples_total = args.train_iters * gbs
        args.wd_incr_steps = args.train_iters * gbs
        warmup_flag = "--lr-warmup-iters"
    else:
        _require(args.train_iters is None,
                 "--train-iters and --train-samples are mutually exclusive; keep one")
        for flag, value, unset in (("--lr-decay-iters", args.lr_decay_iters, None),
                                   ("--lr-warmup-iters", args.lr_warmup_iters, 0),
                                   ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters, None)):
            _require(value == unset, f"{flag} counts iterations: use it with --train-iters, "
                                     f"or {flag.replace('iters', 'samples')} with "
                                     "--train-samples")
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup = args.lr_warmup_samples
        wsd = args.lr_wsd_decay_samples
        args.train_iters = _iterations_for_samples(args)
        args.train_samples_total = args.train_samples
        args.wd_incr_steps = args.train_samples
        warmup_flag = "--lr-warmup-samples"
    if args.lr_warmup_fraction is not None:
        _require(warmup == 0, f"--lr-warmup-fraction and {warmup_flag} are mutually "
                              "exclusive; keep one")
        _require(0 <= args.lr_warmup_fraction <= 1,
                 f"--lr-warmup-fraction must be within [0, 1], got {args.lr_warmup_fraction}")
        warmup = int(args.lr_warmup_fraction * decay)
    args.lr_warmup_steps, args.lr_decay_steps, args.lr_wsd_decay_steps = warmup, decay, wsd


def _iterations_for_samples(args):
    """Iterations that --train-samples takes, with the batch sizes the ramp-up uses
    (megatron-core's calculator, as Megatron-LM counts them)."""
    if args.step_batch_schedule is not None:
        from megatron.trainer.batch_schedule import iterations_for_samples

        return iterations_for_samples(args.step_batch_schedule, args.train_samples)
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    from megatron.trainer.data import rampup_calculator

    ramp_samples = args.rampup_batch_size[2]
    calculator = rampup_calculator(args)
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= args.train_samples:
        calculator.update(consumed, False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    return iterations + (args.train_samples - consumed) // args.global_batch_size


def _check_learning_rate(args):
    _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    _require(args.clip_grad >= 0, "--clip-grad must be >= 0 (0 disables clipping)")
    _require(args.lr_warmup_steps <= args.lr_decay_steps or args.lr_decay_style == "constant"
             or args.train_iters == 0,
             f"the warm-up ({args.lr_warmup_steps} samples) must not exceed the decay "
             f"({args.lr_decay_steps} samples): check --lr-warmup-* against --lr-decay-*")
    if args.lr_decay_style == "WSD":
        _require(args.lr_wsd_decay_steps is not None,
                 "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples "
                 "with --train-samples)")
    if args.decoupled_min_lr is not None:
        _require(args.decoupled_lr is not None, "--decoupled-min-lr needs --decoupled-lr")
    if args.weight_decay_incr_style == "constant":
        _require(args.start_weight_decay is None and args.end_weight_decay is None,
                 "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style "
                 "linear or cosine")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        _require(args.start_weight_decay is not None and args.end_weight_decay is not None,
                 f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
                 "--start-weight-decay and --end-weight-decay")


def _check_data_flags(args, check_files):
    _take_data_sources(args, check_files)
    per_split = args.data_path_per_split is not None or args.per_split_data_args_path
    sources = [flag for flag, given in (
        ("--mock-data", args.mock_data),
        ("--data-path", args.data_path is not None or args.data_args_path),
        ("--train/--valid/--test-data-path", per_split)) if given]
    _require(len(sources) <= 1, f"{' and '.join(sources)} are mutually exclusive: give one "
                                f"data source (as Megatron-LM asserts)")
    _require(bool(sources) and args.data_path != [],
             "no training data: pass --data-path PREFIX (see tools/preprocess_data.py) "
             "or --mock-data")
    if per_split:
        _require(args.data_path_per_split is None or args.data_path_per_split[0],
                 "--valid-data-path/--test-data-path without --train-data-path: no training "
                 "data; give --train-data-path PREFIX")
        _require(args.split is None,
                 f"--split {args.split} divides --data-path; with --train-data-path, "
                 f"--valid-data-path and --test-data-path each blend is read whole (megatron-core "
                 f"asserts 'split and blend_per_split are incompatible'): drop --split")
    else:
        args.split = args.split or "969,30,1"  # Megatron-LM's legacy default
        args.split = args.split.strip("'\"")  # launch scripts sometimes pass the quotes along
    _require(args.mid_level_dataset_surplus >= 0,
             f"--mid-level-dataset-surplus must be >= 0, got {args.mid_level_dataset_surplus}")
    _require(args.dataloader_type in (None, "single"),
             f"--dataloader-type {args.dataloader_type} is not supported: the data here is one "
             f"pass over megatron-core's shuffled GPT samples (Megatron-LM's 'single'; 'cyclic' "
             f"reshuffles them per epoch, 'external' takes your own loader); use single")
    args.dataloader_type = "single"
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data else "GPT2BPETokenizer"
    if args.tokenizer_type == "NullTokenizer":
        _require(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type == "GPT2BPETokenizer":
        _require(args.vocab_file and args.merge_file,
                 "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            _require(not check_files or os.path.isfile(path), f"{flag} {path}: no such file")
    options = tokenizer_option_problems(args.tokenizer_type, args.vocab_size,
                                        args.special_tokens, args.null_tokenizer_eod_id,
                                        args.null_tokenizer_pad_id)
    if options:
        raise ArgumentErrors(options)
    _require(args.tokenizer_type not in REFUSED_TOKENIZER_TYPES,
             f"--tokenizer-type {args.tokenizer_type} is refused: "
             f"{REFUSED_TOKENIZER_TYPES.get(args.tokenizer_type)}")
    if args.tokenizer_type in SENTENCEPIECE_TYPES:
        _require(_sentencepiece_importable(),
                 f"--tokenizer-type {args.tokenizer_type} needs the sentencepiece package: "
                 "pip install sentencepiece")
        _require(args.tokenizer_model, f"--tokenizer-type {args.tokenizer_type} needs "
                                       "--tokenizer-model (a .model file)")
        _require(not check_files or os.path.isfile(args.tokenizer_model),
                 f"--tokenizer-model {args.tokenizer_model}: no such file")
    if args.tokenizer_type in ("HuggingFaceTokenizer", "SFTTokenizer"):
        _require(args.tokenizer_model, f"--tokenizer-type {args.tokenizer_type} needs "
                                       "--tokenizer-model (a tokenizer.json file or directory)")
        _require(not check_files or os.path.exists(args.tokenizer_model),
                 f"--tokenizer-model {args.tokenizer_model}: no such file or directory "
                 "(nothing is downloaded: give a local tokenizer.json or its directory)")
    if args.data_path and check_files:
        args.flag_notes = getattr(args, "flag_notes", []) + _check_data(args.data_path, args.split,
                                       ["train"] + (["valid"] if validates(args) else []),
                                       args.seq_length, args.sft)
    if args.data_path_per_split is not None and check_files:
        args.flag_notes = getattr(args, "flag_notes", []) + _check_data_per_split(
            args.data_path_per_split, args.seq_length, args.sft)


def _take_data_sources(args, check_files):
    """Megatron-LM's data sources read into args.data_path (a list) or
    args.data_path_per_split ([train, valid, test] lists or None), its files read here so
    their errors name the flag (not without check_files: the files may be elsewhere)."""
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if args.data_args_path is not None:
        _require(args.data_path is None, "--data-args-path and --data-path are mutually "
                                         "exclusive: give the list in one of them")
        if check_files:
            args.data_path = _read_data_args(args.data_args_path, "--data-args-path").split()
    if args.per_split_data_args_path is not None:
        _require(all(path is None for path in per_split),
                 "--per-split-data-args-path and --train/--valid/--test-data-path are mutually "
                 "exclusive: give the lists in one of them")
        if check_files:
            per_split = _read_per_split_data_args(args.per_split_data_args_path)
    for part, path in zip(("train", "valid", "test"), per_split):
        _require(path != [], f"--{part}-data-path: no dataset given (a prefix, or "
                             f"'w1 p1 w2 p2 ...')")
    args.data_path_per_split = (None if all(path is None for path in per_split)
                                else list(per_split))


def _read_data_args(path, flag):
    try:
        with open(path) as stream:
            return stream.read()
    except OSError as error:
        raise ArgumentError(f"{flag} {path}: cannot be read ({error.strerror})") from None


def _read_per_split_data_args(path):
    import json

    flag = "--per-split-data-args-path"
    try:
        lists = json.loads(_read_data_args(path, flag))
    except json.JSONDecodeError as error:
        raise ArgumentError(f"{flag} {path}: not JSON ({error})") from None
    _require(isinstance(lists, dict) and all(part in lists for part in ("train", "valid", "test")),
             f"{flag} {path}: give a JSON object with the keys \"train\", \"valid\" and "
             f"\"test\" (each a list or a string of 'prefix' or 'weight prefix' items, or null), "
             f"as Megatron-LM reads it")
    per_split = []
    for part in ("train", "valid", "test"):
        value = lists[part]
        _require(value is None or isinstance(value, (str, list)),
                 f"{flag} {path}: \"{part}\" must be a list, a string or null, got "
                 f"{type(value).__name__}")
        per_split.append(value.split() if isinstance(value, str) else
                         None if value is None else [str(item) for item in value])
    return per_split


def _sentencepiece_importable() -> bool:
    try:
        import sentencepiece  # noqa: F401
        return True
    except ImportError:
        return False


def _check_checkpoint_flags(args, check_files):
    # Megatron-LM asserts --save-interval with --save, and never saves without --save
    _require(args.save is None or args.save_interval is not None,
             "--save needs --save-interval N (as in Megatron-LM; a checkpoint is also "
             "written when training ends)")
    if args.save_interval is not None:
        _require(args.save_interval >= 1, "--save-interval must be >= 1")
    _check_override_ckpt_iteration(args)
    if args.use_mp_args_from_checkpoint_args and not args.use_checkpoint_args:
        args.flag_notes.append("note: --use-mp-args-from-checkpoint-args has no effect "
                               "without --use-checkpoint-args (as in Megatron-LM)")
    for flag in ("finetune", "use_checkpoint_args"):
        _require(not getattr(args, flag) or args.load is not None
                 or args.pretrained_checkpoint is not None,
                 f"--{flag.replace('_', '-')} needs --load DIR (or --pretrained-checkpoint DIR)")
    if args.pretrained_checkpoint is not None and check_files:
        from megatron.trainer.checkpointing import TRACKER_FILE, has_checkpoint, load_source

        source, flag = load_source(args)
        _require(flag == "--load" or has_checkpoint(source),
                 f"--pretrained-checkpoint {source}: no checkpoint there ({TRACKER_FILE} "
                 f"missing), and " + (f"--load {args.load} holds none either"
                                      if args.load else "no --load is given")
                 + ": give the directory a run saved into (its --save)")
    if (args.load is not None and args.exit_on_missing_checkpoint and check_files
            and args.pretrained_checkpoint is None):
        _require(os.path.isdir(args.load), f"--load {args.load}: no such directory "
                                           "(--exit-on-missing-checkpoint)")
    # megatron-core asserts this pair; say which flags and what each does
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "--override-opt_param-scheduler (take this command line's schedule) and "
             "--use-checkpoint-opt_param-scheduler (keep the checkpoint's) contradict each "
             "other: keep one")
    for flag, label in (("save_wgrads_interval", "wgrads"), ("save_params_interval", "params"),
                        ("save_activations_interval", "activations"),
                        ("save_dgrads_interval", "dgrads")):
        interval, name = getattr(args, flag), "--" + flag.replace("_", "-")
        if interval is not None:
            _require(interval >= 1, f"{name} must be >= 1, got {interval}")
            _require(args.save is not None,
                     f"{name} writes its files under --save DIR/{label}: give --save")
    # as Megatron-LM asserts: with the overlapped all-gather the parameters after the step
    # are not all in place yet
    _require(args.save_params_interval is None or not args.overlap_param_gather,
             "--save-params-interval with --overlap-param-gather: the parameters after the "
             "step are gathered during the next forward, so the files would hold stale "
             "shards (Megatron-LM asserts it too); drop one of them")
    if args.save_retain_interval is not None and args.save and args.save_interval:
        _require(args.save_retain_interval > 0,
                 f"--save-retain-interval must be > 0, got {args.save_retain_interval}")
        _require(args.save_retain_interval % args.save_interval == 0,
                 f"--save-retain-interval ({args.save_retain_interval}) must be a multiple of "
                 f"--save-interval ({args.save_interval}), as in Megatron-LM: the retained "
                 f"iterations must be saved ones")
    if not args.perform_initialization:
        # every weight must come from the checkpoint: uninitialised memory otherwise
        _require(args.load is not None or args.pretrained_checkpoint is not None,
                 "--no-initialization leaves the weights uninitialised until a checkpoint "
                 "loads: give --load DIR (or --pretrained-checkpoint DIR), or drop the flag")
        _require(args.dist_ckpt_strictness in ("assume_ok_unexpected", "raise_unexpected",
                                               "raise_all"),
                 f"--no-initialization with --dist-ckpt-strictness "
                 f"{args.dist_ckpt_strictness}: weights the checkpoint lacks would keep "
                 f"uninitialised memory; use the default strictness (a missing weight stops "
                 f"the load) or drop --no-initialization")
    if args.skip_train:
        args.no_load_optim = True  # as Megatron-LM: no training, no optimizer state


def _check_override_ckpt_iteration(args):
    """--override-ckpt-iteration N rewinds (or advances) a resumed checkpoint: as
    Megatron-LM, never with --finetune, which starts at iteration 0."""
    iteration = args.override_ckpt_iteration
    if iteration is None:
        return
    _require(iteration >= 0, f"--override-ckpt-iteration must be >= 0, got {iteration}")
    _require(args.load is not None,
             f"--override-ckpt-iteration {iteration} sets the iteration of the checkpoint "
             f"this run resumes: give --load DIR")
    _require(not args.finetune,
             f"--override-ckpt-iteration {iteration} and --finetune contradict each other "
             f"(--finetune starts at iteration 0 with the weights only, as in Megatron-LM): "
             f"keep one")


def _check_rerun_mode(args):
    """--rerun-mode and its flags (megatron-core's rerun state machine)."""
    _require(args.error_injection_rate >= 0,
             f"--error-injection-rate must be >= 0, got {args.error_injection_rate}")
    if args.rerun_mode == "disabled":
        _require(args.error_injection_rate == 0,
                 "--error-injection-rate injects into the rerun engine's validation: add "
                 "--rerun-mode validate_results")
    if args.rerun_mode == "report_stats" and not _report_stats_works():
        raise ArgumentError(
            "--rerun-mode report_stats: the installed megatron-core's report reads a "
            "Caller.filename its Caller no longer has (fixed in megatron-core 0.19): use "
            "megatron-core >= 0.19, or --rerun-mode validate_results")


def _report_stats_works():
    if _LIGHT:  # it reads megatron-core (and torch): left to the full parse
        return True
    from megatron import mcore_compat

    return mcore_compat.rerun_report_stats_works()


def _check_per_token_router_losses(args):
    """megatron-core 0.16's router multiplies its MoE losses under
    --calculate-per-token-loss by its local tokens only: with TP x CP > 1 their gradient
    is not the model's (megatron-core 0.19 multiplies by TP x CP too); one process, and
    TP = CP = 1, are right on both."""
    ranks = args.tensor_model_parallel_size * args.context_parallel_size
    if not (args.calculate_per_token_loss and ranks > 1 and router_losses_on(args)):
        return
    _require(_router_counts_tp_cp(),
             f"--calculate-per-token-loss with MoE auxiliary or z-losses and "
             f"--tensor-model-parallel-size x --context-parallel-size = {ranks}: this "
             f"megatron-core's router scales those losses by its local tokens alone, so their "
             f"gradient is off by a factor of {ranks} (megatron-core 0.19 fixed it): install "
             f"megatron-core >= 0.19, or drop --calculate-per-token-loss")


def _router_counts_tp_cp():
    if _LIGHT:  # it reads megatron-core (and torch): left to the full parse
        return True
    from megatron import mcore_compat

    return mcore_compat.per_token_router_loss_counts_tp_cp()


def _check_exit_flags(args):
    _require(args.eval_interval >= 1, "--eval-interval must be >= 1")
    _require(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
             f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    _require(args.exit_interval is None or args.exit_interval >= 1,
             f"--exit-interval must be >= 1, got {args.exit_interval}")
    _require(args.eval_iters >= 0, "--eval-iters must be >= 0")
    _require(args.start_eval_at_iter is None or args.start_eval_at_iter >= 0,
             f"--start-eval-at-iter must be >= 0, got {args.start_eval_at_iter}")
    bad = [i for i in args.iterations_to_skip if i < 1]
    _require(not bad, f"--iterations-to-skip counts iterations from 1, got {bad}")
    _require(args.manual_gc_interval >= 0,
             f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.profile:
        _require(0 <= args.profile_step_start < args.profile_step_end,
                 f"--profile-step-start ({args.profile_step_start}) must be below "
                 f"--profile-step-end ({args.profile_step_end})")
    _check_logging_flags(args)
    _check_deterministic_mode(args)
    if args.wandb_project:
        _require(args.wandb_exp_name, "--wandb-project needs --wandb-exp-name (as in "
                                      "Megatron-LM)")
        try:
            import wandb

            wandb.init  # noqa: B018 - runs its code here: lazy_imports defers it to a name's read
        except ImportError:
            raise ArgumentError("--wandb-project needs the wandb package: pip install wandb "
                                "(or drop the flag)")


def _check_deterministic_mode(args):
    if args.deterministic_mode:
        from megatron.trainer.determinism import environment_problems

        for problem in environment_problems(os.environ):
            raise ArgumentError(problem)


def _check_logging_flags(args):
    _require(args.tensorboard_queue_size >= 1,
             f"--tensorboard-queue-size must be >= 1, got {args.tensorboard_queue_size}")
    _require(args.log_memory_interval is None or args.log_memory_interval >= 1,
             f"--log-memory-interval must be >= 1, got {args.log_memory_interval}")
    if getattr(args, "device", "cuda") != "cpu":
        return
    # logging only: a CPU run has no CUDA allocator whose statistics these report
    for flag, given in (("--log-memory-to-tensorboard", args.log_memory_to_tensorboard),
                        ("--log-memory-interval", args.log_memory_interval is not None)):
        if given:
            args.flag_notes.append(
                f"note: {flag} reports the CUDA allocator's memory; this run computes on the "
                f"CPU and reports none (the iteration line shows its peak memory)")


def _resolve_pipeline_schedule(args):
    """--pipeline-schedule from the flags given; contradictions refused by the schedule
    registry's rules, the library's too (``megatron.schedules.registry.resolve``)."""
    slices_flag = next((flag for flag, value in (
        ("--slimpipe-slices", args.slimpipe_slices),
        ("--slimpipe-slice-length", args.slimpipe_slice_length)) if value is not None), None)
    try:
        args.pipeline_schedule = schedule_registry.resolve(
            args.pipeline_schedule, seq1f1b_splits=args.seq1f1b_splits,
            slices_flag=slices_flag, balance_method=args.seq1f1b_balance_method,
            attention_balance=args.slimpipe_attention_balance)
    except schedule_registry.ScheduleChoiceError as error:
        raise ArgumentError(str(error)) from None


def _take_pipeline_layout(args):
    """--pipeline-model-parallel-layout: every model chunk's transformer layers
    (``args.chunk_layer_counts``, pipeline order) and the virtual stages per rank, as
    Megatron-LM derives them from the string; the other ways of shaping stages are
    refused beside it, as there."""
    args.chunk_layer_counts = None
    layout = args.pipeline_model_parallel_layout
    if layout is None:
        return
    others = [flag for flag, given in (
        ("--num-layers-per-virtual-pipeline-stage",
         args.num_layers_per_virtual_pipeline_stage is not None),
        ("--virtual-pipeline-model-parallel-size / --num-virtual-stages-per-pipeline-rank",
         args.virtual_pipeline_model_parallel_size is not None),
        ("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers
         is not None),
        ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers
         is not None),
        ("--account-for-embedding-in-pipeline-split",
         args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split))
        if given]
    _require(not others, f"--pipeline-model-parallel-layout gives every stage's layers and "
                         f"the virtual stages; drop {', '.join(others)} (as Megatron-LM)")
    try:
        chunks = layout_chunk_layer_counts(layout, args.pipeline_model_parallel_size,
                                           args.num_layers,
                                           getattr(args, "mtp_num_layers", None) or 0)
    except UnevenSplitError as error:
        raise ArgumentError(str(error)) from None
    args.chunk_layer_counts = chunks
    args.virtual_pipeline_model_parallel_size = len(chunks) // args.pipeline_model_parallel_size


def _validate_virtual_pipeline(args):
    """Interleaved 1F1B flags, with megatron-core's constraints checked up front."""
    pp = args.pipeline_model_parallel_size
    per_stage = args.num_layers_per_virtual_pipeline_stage
    vp = args.virtual_pipeline_model_parallel_size
    if per_stage is not None:
        _require(vp is None, "give --num-layers-per-virtual-pipeline-stage or "
                             "--virtual-pipeline-model-parallel-size, not both")
        _require(per_stage >= 1, "--num-layers-per-virtual-pipeline-stage must be >= 1")
        # Megatron-LM's rule: a per-chunk layer count cannot describe unequal stages
        _require(args.decoder_first_pipeline_num_layers is None
                 and args.decoder_last_pipeline_num_layers is None,
                 "with --decoder-first/last-pipeline-num-layers give the virtual stages as "
                 "--num-virtual-stages-per-pipeline-rank, not "
                 "--num-layers-per-virtual-pipeline-stage")
        # as Megatron-LM: an embedding / loss counted as a layer fills a slot of its chunk
        slots = (args.num_layers + int(args.account_for_embedding_in_pipeline_split)
                 + int(args.account_for_loss_in_pipeline_split))
        counted = "" if slots == args.num_layers else " plus the counted embedding/loss"
        _require(slots % (pp * per_stage) == 0,
                 f"--num-layers ({args.num_layers}){counted} must be divisible by "
                 f"--pipeline-model-parallel-size ({pp}) x "
                 f"--num-layers-per-virtual-pipeline-stage ({per_stage})")
        vp = slots // (pp * per_stage)
    if vp is None or vp == 1:
        args.virtual_pipeline_model_parallel_size = None  # the group size is then unused
        return
    _require(vp >= 1, f"--virtual-pipeline-model-parallel-size must be >= 1, got {vp}")
    _require(pp >= 2, "virtual pipeline stages need --pipeline-model-parallel-size >= 2")
    _require(_unequal_stages(args)  # stage_layer_counts names what is wrong
             or args.num_layers % (pp * vp) == 0,
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


def _check_data_per_split(per_split, seq_length, conversations=False):
    """Each part's blend as megatron-core will read it (whole), before any process group
    (also a part no evaluation reads: a wrong path is a mistake either way).
    ``conversations``: --sft's JSON-lines files."""
    from megatron.dataprep.gpt_datasets import (DataPathError, parse_data_path,
                                                smaller_than_a_sample)

    notes = []
    for part, path in zip(("train", "valid", "test"), per_split):
        if path is None:
            continue
        flag = f"--{part}-data-path"
        try:
            prefixes, _ = parse_data_path(path, flag, conversations)
        except DataPathError as error:
            raise ArgumentError(str(error)) from None
        if part == "train" and not conversations:
            notes += smaller_than_a_sample(prefixes, "1,0,0", seq_length, flag)
    return notes


def _check_data(data_path, split, used, seq_length=None, conversations=False):
    """The data files and the split, as the dataset builder will read them, checked
    before any process group exists (its errors name the flag). ``conversations``:
    --sft's JSON-lines files (each record a sample: none is smaller than one)."""
    from megatron.dataprep.gpt_datasets import (DataPathError, check_splits, parse_data_path,
                                                smaller_than_a_sample)

    try:
        prefixes, _ = parse_data_path(data_path, conversations=conversations)
        check_splits(prefixes, split, used, conversations)
    except DataPathError as error:
        raise ArgumentError(str(error)) from None
    if conversations or not seq_length:
        return []
    return smaller_than_a_sample(prefixes, split, seq_length)


def _validate_seq1f1b(args):
    splits = args.seq1f1b_splits  # >= 1: checked with the schedule (registry.resolve)
    alignment = args.seq1f1b_split_alignment
    # each context-parallel rank holds an equal part of a split, and sequence parallelism
    # divides that part over the TP ranks
    unit = args.context_parallel_size * (args.tensor_model_parallel_size
                                         if args.sequence_parallel else 1)
    alignment = alignment * unit // _gcd(alignment, unit)
    args.seq1f1b_alignment = alignment
    _require(args.seq1f1b_kv_cache != "chunked" or args.attention_dropout == 0.0,
             f"--seq1f1b-kv-cache chunked has no attention dropout: add --attention-dropout 0 "
             f"(got {args.attention_dropout}) or use --seq1f1b-kv-cache buffer")
    if splits > 1 or args.context_parallel_size > 1:
        _require(args.seq_length % alignment == 0,
                 f"--seq-length ({args.seq_length}) must be a multiple of the split alignment "
                 f"({alignment}) with --seq1f1b-splits or --context-parallel-size: every split "
                 "is a multiple of --seq1f1b-split-alignment, divided equally over the "
                 "context-parallel ranks and over the TP ranks under --sequence-parallel")
    if splits <= 1:
        return
    _require(splits <= args.seq_length // alignment,
             f"--seq1f1b-splits ({splits}) exceeds the {args.seq_length // alignment} aligned "
             f"positions of --seq-length {args.seq_length}; use fewer splits")
    unsupported = {
        "--transformer-impl transformer_engine": args.transformer_impl == "transformer_engine",
    }
    for flag, used in unsupported.items():
        _require(not used, f"{flag} is not supported with --seq1f1b-splits > 1 yet; "
                           "drop it or use --seq1f1b-splits 1")


def _validate_context_parallel(args):
    """--context-parallel-size > 1: the split-aware attention gathers each split's K/V over
    the context-parallel ranks; what it is not built with yet is refused here."""
    cp = args.context_parallel_size
    if cp == 1:
        return  # the sequence's alignment to the ranks: _validate_seq1f1b
    not_yet = [flag for flag, used in (
        # SlimPipe's exchange moves K/V chunks between pipeline ranks, one split's each
        ("--slimpipe-attention-balance", args.slimpipe_attention_balance),
        ("--transformer-impl transformer_engine",
         args.transformer_impl == "transformer_engine")) if used]
    if not_yet:  # every one at once, as the other checks report theirs
        raise ArgumentErrors([
            f"{flag} is not supported with --context-parallel-size {cp} yet: context "
            "parallelism here runs under the Seq1F1B schedules with the split-aware local "
            "layers; drop one of them" for flag in not_yet])


def _check_context_parallel_communication(args):
    """Megatron-LM's checks of its CP communication flags, which here change nothing
    (every type computes the same attention) but stop a command line Megatron-LM stops."""
    sizes = no_op_value(args, "--hierarchical-context-parallel-sizes")
    types = no_op_value(args, "--cp-comm-type") or ["p2p"]
    if sizes is not None:
        try:
            product = math.prod(int(size) for size in sizes)
        except ValueError:
            raise ArgumentError(f"--hierarchical-context-parallel-sizes {' '.join(sizes)}: "
                                f"give integers (group sizes)")
        _require(product == args.context_parallel_size,
                 f"--hierarchical-context-parallel-sizes {' '.join(sizes)}: their product "
                 f"({product}) must be --context-parallel-size ({args.context_parallel_size}),"
                 f" as Megatron-LM checks")
    _require(sizes is not None or "a2a+p2p" not in types,
             "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (as "
             "Megatron-LM checks)")


def _validate_slimpipe(args):
    """SlimPipe: uniform slices, n a multiple of p (or a slice length dividing the
    sequence). Sets ``args.slimpipe_slices`` and ``args.slimpipe_slice_length``."""
    if args.pipeline_schedule != "slimpipe":
        return  # slice flags and attention balance outside SlimPipe: refused by the registry
    seq, pp = args.seq_length, args.pipeline_model_parallel_size
    slices, length = args.slimpipe_slices, args.slimpipe_slice_length
    _require(slices is not None or length is not None,
             f"--pipeline-schedule slimpipe needs --slimpipe-slices N (a multiple of "
             f"--pipeline-model-parallel-size {pp}) or --slimpipe-slice-length L (dividing "
             f"--seq-length {seq})")
    _require(slices is None or length is None,
             "give --slimpipe-slices or --slimpipe-slice-length, not both")
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
    # paired units exchange attention layer by layer, so both stages need the same layers
    _require(not _unequal_stages(args),
             f"{flag} pairs the layers of two pipeline stages one to one and needs equal "
             "stages; drop it or --decoder-first/last-pipeline-num-layers and "
             "--account-for-embedding/loss-in-pipeline-split")


def _unequal_stages(args):
    """Any flag that makes pipeline stages hold unequal layer counts:
    --decoder-first/last-pipeline-num-layers, an embedding / loss counted as a layer
    (--account-for-embedding/loss-in-pipeline-split), or --pipeline-model-parallel-layout."""
    return (args.decoder_first_pipeline_num_layers is not None
            or args.decoder_last_pipeline_num_layers is not None
            or args.account_for_embedding_in_pipeline_split
            or args.account_for_loss_in_pipeline_split
            or args.pipeline_model_parallel_layout is not None)


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def parse_args(argv=None, extra_args_provider=None, world_size=None, cuda_available=None,
               check_files=True, _light=False):
    """Parse and validate a command line; every problem (unknown flags, refused
    Megatron-LM features, bad values, failed checks) is raised together."""
    parser = build_parser(extra_args_provider)
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, refused, accepted_defaults = take_refused(argv)
    problems = [f"{flag} is refused: {reason}" for flag, reason in refused]
    args, unknown = parser.parse_known_args(argv)
    problems += parser.problems
    problems += [_unknown_flag(parser, token) for token in unknown if token.startswith("-")]
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cuda_available is None and not _light:
        import torch

        cuda_available = torch.cuda.is_available()
    if not problems:
        args = validate_args(args, world_size, cuda_available, check_files)
        args.no_op_flags += accepted_defaults
        return args
    try:  # the checks that still make sense, so that one run shows everything
        validate_args(args, world_size, cuda_available, check_files)
    except ArgumentErrors as error:
        problems += error.problems
    except Exception:  # a consequence of a value already reported as bad
        pass
    raise ArgumentErrors(problems)


def _unknown_flag(parser, token):
    import difflib

    flag = token.split("=", 1)[0]
    known = [s for action in parser._actions for s in action.option_strings
             if s.startswith("--")]
    # only a near miss (a typo): a loose match proposes a flag of another meaning
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.85)
    hint = f"; did you mean {close[0]}?" if close else f" (see `{parser.prog} --help`)"
    return f"unknown flag {flag}: neither this trainer nor its Megatron-LM lists know it{hint}"


_LIGHT = False  # True while check_flags_early runs: nothing may import torch


def _cuda_known_absent():
    """False (no CUDA) where torch's own wheel says it is a CPU build, else None: unknown
    without importing torch (the device checks then wait for the full parse)."""
    from importlib import metadata

    try:
        return False if "+cpu" in metadata.version("torch") else None
    except metadata.PackageNotFoundError:
        return None


def early_problems(argv, extra_args_provider=None):
    """The flag problems of ``argv`` that need neither torch nor megatron-core nor the
    files the flags name (empty: none found; the full parse checks the rest). Never
    imports torch."""
    global _LIGHT
    # --use-checkpoint-args takes the model's shape from --load, megatron-core parses
    # --pipeline-model-parallel-layout: left to the full parse
    if any(token.split("=", 1)[0] in ("--use-checkpoint-args", "--pipeline-model-parallel-layout",
                                      "-h", "--help")
           for token in argv):
        return []
    _LIGHT = True
    try:
        parse_args(argv, extra_args_provider, cuda_available=_cuda_known_absent(),
                   check_files=False, _light=True)
    except ArgumentError as error:
        return str(error).splitlines()
    finally:
        _LIGHT = False
    return []


def check_flags_early(argv=None, extra_args_provider=None):
    """Flag problems found before torch and megatron-core load (a flag error used to take
    as long as importing them on every rank: up to a minute on a busy node): print them
    (rank 0) and exit 2. The device checks (where torch is not a CPU build) and the file
    checks come with the full parse (``parse_args_or_exit``) once these pass. An installed
    megatron-core outside the supported range is said first (its imports would fail)."""
    from megatron.mcore_compat import unsupported_megatron_core

    version_problem = unsupported_megatron_core()
    if version_problem:
        _stop_on_command_line_problems([version_problem])
    problems = early_problems(list(sys.argv[1:] if argv is None else argv),
                              extra_args_provider)
    if problems:
        _stop_on_command_line_problems(problems)


# how long ranks other than 0 wait before exiting on a command-line mistake (rank 0 exits
# at once and the launcher then stops them)
OTHER_RANKS_WAIT_ON_ERRORS_S = 30


def _stop_on_command_line_problems(lines):
    """Rank 0 prints the problems, one ``error:`` line each, and exits 2. The other ranks
    found the same ones; they exit 2 too, but only after a wait: a launcher that sees
    another rank fail first (torchrun) stops the rest, rank 0 possibly before it has
    printed (seen under load: the job ended with no error line). No process group exists
    yet to wait on (megatron/trainer/agreed_stop.py waits on one later). Ranks started
    otherwise (by hand, a test) exit at once."""
    if int(os.environ.get("RANK", "0")) == 0:
        for line in lines:
            print(f"error: {line}", file=sys.stderr, flush=True)
    elif _launcher_stops_the_others():
        time.sleep(OTHER_RANKS_WAIT_ON_ERRORS_S)
    sys.exit(2)


def _launcher_stops_the_others():
    """Whether a launcher that ends every rank once one fails started this one: torchrun
    (its elastic agent sets TORCHELASTIC_RUN_ID) or SLURM's srun (with --kill-on-bad-exit)."""
    return any(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"))


def parse_args_or_exit(argv=None, extra_args_provider=None):
    """Parse and validate; on mistakes print them, one per line (rank 0 only), and exit 2
    on every rank."""
    try:
        args = parse_args(argv, extra_args_provider)
    except ArgumentError as error:
        _stop_on_command_line_problems(str(error).splitlines())
    if int(os.environ.get("RANK", "0")) == 0:
        for flag, reason in args.no_op_flags:
            print(f"note: {flag} has no effect here: {reason}", flush=True)
        for note in args.flag_notes:
            print(note, flush=True)
        if getattr(args, "transformer_impl_note", None):
            print(args.transformer_impl_note, flush=True)
        if args.save_interval is not None and args.save is None:
            print("note: --save-interval without --save: no checkpoints are written "
                  "(as in Megatron-LM)", flush=True)
    return args
