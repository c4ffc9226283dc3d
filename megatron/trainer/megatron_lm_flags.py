"""Megatron-LM flags this trainer accepts without effect, and those it refuses.

A Megatron-LM launch script carries flags for fusions, deprecated switches and
features this trainer does not build. Each one is listed here with the reason, so the
script either runs (no-ops, shown in ``--help`` and noted once at start-up) or stops
with the reason and the alternative, never with "unrecognized arguments". A flag that
would change the model's math, the data, the learning rate or what is saved is never a
no-op. tests/test_megatron_lm_flag_coverage.py checks every flag of Megatron-LM's own
parser (and of the original Seq1F1B fork's) against these tables.
"""

from megatron.trainer.mla_arguments import MLA_FLAGS
from megatron.trainer.moe_arguments import MOE_FLAGS

# flag -> (takes a value: False, True or "+" for one or more as in Megatron-LM; reason
# shown in --help and in the start-up note)
NO_OP_FLAGS = {
    "--use-mcore-models": (False, "models are always megatron-core's"),
    "--no-async-tensor-model-parallel-allreduce": (
        False, "deprecated in Megatron-LM; megatron-core decides the TP all-reduce overlap"),
    "--no-gradient-accumulation-fusion": (
        False, "the fused weight-gradient accumulation (an apex/TE CUDA kernel) is never used "
               "here"),
    "--no-masked-softmax-fusion": (
        False, "there is no fused masked softmax: attention runs in SDPA, flash-attn, "
               "FlexAttention or the chunked kernel"),
    "--no-bias-swiglu-fusion": (False, "the bias+SwiGLU fusion is always off here"),
    "--no-bias-dropout-fusion": (False, "the bias+dropout fusion is always off here"),
    "--no-persist-layer-norm": (False, "the persistent apex LayerNorm is never used here"),
    "--no-rope-fusion": (False, "the fused RoPE kernel is always off here"),
    "--cross-entropy-loss-fusion": (
        False, "the loss uses megatron-core's vocab-parallel cross entropy (same values, "
               "unfused)"),
    "--attention-softmax-in-fp32": (
        False, "the attention kernels here accumulate the softmax in fp32 already"),
    "--no-scatter-gather-tensors-in-pipeline": (
        False, "pipeline p2p always sends whole tensors here"),
    "--distribute-saved-activations": (
        False, "not implemented: under full recomputation the checkpointed layer input is "
               "kept whole on each TP rank (use --sequence-parallel to divide it by TP)"),
    "--no-overlap-p2p-communication": (
        False, "p2p overlap is chosen by the schedule (interleaved stages overlap it)"),
    "--no-one-logger": (False, "NVIDIA's one-logger is never used here"),
    "--no-barrier-with-level-1-timing": (
        False, "level-1 timers here never add a barrier"),
    "--ckpt-fully-parallel-save": (
        False, "torch_dist saves are written by all ranks in parallel here already"),
    "--no-ckpt-fully-parallel-save": (
        False, "torch_dist saves are written by all ranks in parallel here; this cannot be "
               "turned off"),
    "--ckpt-fully-parallel-load": (
        False, "torch_dist loads are read by all ranks in parallel here already"),
    "--use-dist-ckpt": (False, "checkpoints are always megatron-core distributed ones "
                               "(torch_dist)"),
    "--auto-detect-ckpt-format": (False, "only torch_dist checkpoints exist here"),
    "--tiktoken-pattern": (True, "only for --tokenizer-type TikTokenizer, which is not "
                                 "supported here"),
    "--openai-gelu": (False, "Megatron-LM 0.19 parses it and applies it nowhere: GeLU is "
                             "megatron-core's (--swiglu, --squared-relu, --quick-geglu choose "
                             "others)"),
    "--cp-comm-type": (
        "+", "context parallelism here always all-gathers each split's keys and values over "
             "the context-parallel ranks (and reduce-scatters their gradients); every "
             "communication type computes the same attention"),
    "--hierarchical-context-parallel-sizes": (
        "+", "the group sizes of the a2a+p2p communication type (checked as Megatron-LM "
             "does: their product is --context-parallel-size); each split's keys and values "
             "are all-gathered over the context-parallel ranks here, the same attention"),
    "--enable-experimental": (
        False, "megatron-core's experimental switch gates only paths not built here (fused "
               "permutation with fp8 padding, experimental inference and FSDP APIs); the "
               "model computes the same without it"),
}


def _table(reason, flags):
    """{flag: (takes a value, reason)} from 'flag' (no value), 'flag=V' (one value) and
    'flag=V+' (one or more) words: a no-op flag consumes what Megatron-LM's consumes."""
    table = {}
    for word in flags.split():
        flag, _, value = word.partition("=")
        table[flag] = ("+" if value.endswith("+") else bool(value), reason)
    return table


for _reason, _flags in (
    ("pure logging this trainer does not do (its iteration line and TensorBoard scalars "
     "are listed in docs/megatron_lm.md)",
     "--log-device-memory-used --log-max-attention-logit "
     "--log-energy --log-progress --config-logger-dir=DIR "
     "--log-straggler --straggler-ctrlr-port=N --straggler-minmax-count=N "
     "--disable-straggler-on-startup --run-workload-inspector-server "
     "--one-logger-project=V --one-logger-run-name=V --one-logger-async "
     "--app-tag-run-name=V --app-tag-run-version=V"),
    ("a profiler option this trainer's --profile trace does not record (use "
     "--activation-memory-file for memory)",
     "--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack "
     "--pytorch-profiler-collect-chakra --record-memory-history --memory-snapshot-path=PATH "
     "--record-shapes --nvtx-ranges"),
    ("NCCL flight-recorder debugging dumps are not configured here",
     "--flight-recorder-dump-path=PATH --flight-recorder-trace-buffer-size=N "
     "--no-flight-recorder-dump-on-timeout --disable-flight-recorder-dump-on-timeout "
     "--flight-recorder-include-stack-trace --no-flight-recorder-include-only-active "
     "--disable-flight-recorder-include-only-active --no-flight-recorder-extra-dump-on-exec "
     "--disable-flight-recorder-extra-dump-on-exec"),
    ("Transformer Engine's userbuffers overlap of the TP collectives with the GEMMs (a "
     "performance setting) is not set up here: the TP collectives run unoverlapped, with "
     "the same values", "--tp-comm-overlap --tp-comm-overlap-rs-dgrad "
     "--tp-comm-overlap-cfg=FILE --tp-comm-bootstrap-backend=V"),
    ("TP communication overlap (--tp-comm-overlap, Transformer Engine userbuffers) is "
     "never on here, and Megatron-LM ignores this flag without it",
     "--no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad "
     "--disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag "
     "--no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs --no-tp-comm-split-ag "
     "--disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs"),
    ("a kernel or fusion choice of Transformer Engine / megatron-core that is not used "
     "here: the layers run in PyTorch with the same math",
     "--cross-entropy-fusion-impl=V --fused-residual-rmsnorm "
     "--use-transformer-engine-op-fuser --disable-jit-fuser"),
    ("the installed flash-attn is used (--attention-backend flash)",
     "--flash-attention-version=N"),
    ("a memory detail of megatron-core's embedding under sequence parallelism; its default "
     "(clone the output) is kept", "--no-clone-scatter-output-in-embedding "
     "--disable-clone-scatter-output-in-embedding"),
    ("models are not exported to ONNX here", "--onnx-safe=V"),
    ("a communication or overlap performance setting; megatron-core's default is used here",
     "--pipeline-model-parallel-comm-backend=V --nccl-communicator-config-path=PATH "
     "--use-sharp --sharp-enabled-group=V --high-priority-stream-groups=V+ "
     "--disable-gloo-process-groups --use-nccl-ub --disable-symmetric-registration "
     "--create-all-gather-group --symmetric-ar-type=V --ddp-num-buckets=N "
     "--ddp-bucket-size=N --ddp-pad-buckets-for-high-nccl-busbw "
     "--overlap-p2p-communication-warmup-flush --defer-embedding-wgrad-compute "
     "--wgrad-deferral-limit=N --overlap-param-gather-with-optimizer-step "
     "--no-align-param-gather --train-sync-interval=N"),
    ("with --overlap-grad-reduce each pipeline stage here starts its reductions when its "
     "own backward ends (Megatron-LM's --no-align-grad-reduce behaviour)",
     "--no-align-grad-reduce --disable-align-grad-reduce"),
    ("the local rank is read from LOCAL_RANK (set by torchrun)", "--local-rank=N"),
    ("every process group keeps --distributed-timeout-minutes",
     "--distributed-timeout-seconds-after-init=N"),
    ("a debugging check that is not run here", "--check-weight-hash-across-dp-replicas-interval=N "
     "--gpu-sniff-test-interval=N"),
    ("only used by --optimizer muon/lion, which are not supported here (--optimizer "
     "adam or sgd); Megatron-LM ignores it with adam and sgd too",
     "--muon-momentum=X --muon-no-split-qkv --muon-nesterov --muon-use-nesterov "
     "--muon-scale-mode=V --muon-fp32-matmul-prec=V --muon-coefficient-type=V "
     "--muon-num-ns-steps=N --muon-tp-mode=V --muon-extra-scale-factor=X "
     "--muon-scalar-optimizer=V --lion-beta1=X --lion-beta2=X --no-use-layer-wise-param-layout"),
    ("only used by BERT/T5 datasets; Megatron-LM's GPT dataset ignores it too",
     "--mask-prob=X --short-seq-prob=X"),
    ("a dataset-building performance setting; megatron-core's builder defaults are used",
     "--dataloader-fast-cache-load --dataloader-defer-npy-index-mmap "
     "--num-dataset-builder-threads=N"),
    ("a distributed-checkpoint performance setting; megatron-core's defaults are used",
     "--ckpt-fully-parallel-load-exchange-algo=V --ckpt-fully-parallel-save-process-group=V "
     "--ckpt-fully-parallel-load-process-group=V --ckpt-assume-constant-structure"),
    ("the sharding-integrity check of a distributed-checkpoint load stays on here",
     "--no-ckpt-load-validate-sharding-integrity --disable-ckpt-load-validate-sharding-integrity"),
    ("the distributed optimizer's state is always saved fully reshardable (by the "
     "memory-efficient gloo path) here", "--dist-ckpt-optim-fully-reshardable "
     "--distrib-optim-fully-reshardable-mem-efficient"),
    ("saves always carry checksums.json (size and sha256 of every file), verified at load",
     "--verify-integrity"),
    ("only for asynchronous saves, FSDP DTensor checkpoints or quantized (fp8/fp4) "
     "parameters, none of which exist here",
     "--dist-ckpt-workers=N --no-strict-fsdp-dtensor-load --disable-strict-fsdp-dtensor-load "
     "--no-stream-ckpt-dequant --disable-stream-ckpt-dequant"),
    ("--use-checkpoint-args takes the model shape only, never the tokenizer",
     "--no-use-tokenizer-model-from-checkpoint-args "
     "--disable-use-tokenizer-model-from-checkpoint-args"),
    ("the Multi-Storage Client is never used (Megatron-LM: deprecated, no effect)",
     "--disable-msc"),
    ("how an HF tokenizer encodes text: training reads the token ids tools/preprocess_data.py "
     "wrote (which takes these flags) and the tokenizer gives only its vocabulary size and "
     "special ids, the same either way",
     "--tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens --trust-remote-code "
     # Megatron-LM 0.17's spellings of the defaults
     "--tokenizer-hf-use-fast --tokenizer-hf-include-special-tokens"),
    ("a chat template given to Megatron-LM's tokenizer is read only by its inference "
     "(apply_chat_template); training reads token ids, and --sft writes conversations in "
     "--sft-tokenizer-prompt-format (Megatron-LM's SFTTokenizer ignores it too)",
     "--chat-template=V"),
    # the original Seq1F1B fork's (Megatron-LM of 2023) flags that Megatron-LM dropped
    ("gradients are reduced by megatron-core's DistributedDataParallel, with contiguous "
     "buffers", "--DDP-impl=V --no-contiguous-buffers-in-local-ddp"),
    ("the .bin/.idx files are read by megatron-core's indexed dataset (memory-mapped "
     "unless --no-mmap-bin-files)", "--data-impl=V --mmap-warmup"),
    ("the learning rate and the batch size are always written to TensorBoard here",
     "--no-log-learnig-rate-to-tensorboard --log-batch-size-to-tensorboard"),
    ("query-key layer scaling is never applied here (as with this flag)",
     "--no-query-key-layer-scaling"),
    ("query-key layer scaling divides the attention scores by the layer number before an "
     "fp16 softmax and multiplies them back inside it (an fp16 range guard computing the "
     "same function); the attention kernels here keep the softmax in fp32",
     "--apply-query-key-layer-scaling"),
    ("p2p overlap is chosen by the schedule (interleaved stages overlap it)",
     "--overlap-p2p-communication"),
    ("the local rank is read from LOCAL_RANK (set by torchrun)", "--local_rank=N"),
    ("only megatron-core's FSDP gradient buffers read it (FSDP is not supported here; "
     "the DDP reduction divides as without it)", "--no-gradient-reduce-div-fusion"),
    # MoE options that change no value here
    ("overlaps the shared expert with the token dispatch on CUDA streams (a performance "
     "setting); here the shared expert runs beside the routed experts with the same values",
     "--moe-shared-expert-overlap"),
    ("a fused kernel of Transformer Engine for the MoE token permutation or the router; "
     "here the unfused megatron-core code runs with the same math",
     "--moe-permute-fusion --moe-router-fusion"),
    ("a setting of the flex dispatcher's communication kernels (DeepEP, HybridEP, NCCL EP); "
     "--moe-token-dispatcher-type flex runs as the all-to-all dispatcher here (the same "
     "tokens reach the same experts)",
     "--moe-flex-dispatcher-num-sms=N --moe-deepep-num-sms=N --moe-hybridep-num-sms=N "
     "--moe-hybridep-num-sms-preprocessing=N --moe-hybridep-num-blocks-permute=N "
     "--moe-hybridep-num-blocks-unpermute=N --moe-hybridep-pad-uneven-dispatch-inputs "
     "--moe-permute-fusion-into-hybridep --moe-ncclep-static-shape --moe-ncclep-zero-copy"),
):
    NO_OP_FLAGS.update(_table(_reason, _flags))

_MOE = ("this mixture-of-experts option is not implemented here (the implemented MoE "
        "flags are listed in --help under 'mixture of experts'); drop it or train this "
        "model with Megatron-LM")
_MLA_INFERENCE = ("an inference-time MLA option (latent cache, absorbed decode): "
                  "training here keeps the decompressed K/V; drop it")
_ENCODER = ("encoder-decoder and encoder models are not built here (decoder-only GPT); "
            "drop the flag or use Megatron-LM")
_OTHER_MODEL = ("this model family is not built here (decoder-only GPT only); "
                "use Megatron-LM")

# flag or flag prefix (ending in '-') -> reason and alternative
REFUSED_FLAGS = {
    "--moe-": _MOE,
    "--fp8-": ("fp8 needs Transformer Engine layers, which the sequence-split schedules do "
               "not support yet; use --bf16"),
    "--no-fp8-wgrad": ("fp8 is not supported here; use --bf16"),
    "--encoder-": _ENCODER,
    "--decoder-num-layers": _ENCODER,
    "--decoder-seq-length": _ENCODER,
    "--pipeline-model-parallel-split-rank": _ENCODER,
    "--hybrid-": "Mamba/hybrid models are not built here (transformer GPT only)",
    "--mamba-": "Mamba/hybrid models are not built here (transformer GPT only)",
    "--spec": "custom layer specs are not loaded from the command line here",
    "--retro-": _OTHER_MODEL,
    "--bert-": _OTHER_MODEL,
    "--vision-": _OTHER_MODEL,
    "--dino-": _OTHER_MODEL,
    "--biencoder-": _OTHER_MODEL,
    "--ict-": _OTHER_MODEL,
    "--retriever-": _OTHER_MODEL,
    "--inference-": "inference is not part of this trainer; use Megatron-LM's inference",
    "--use-legacy-models": ("Megatron-LM's legacy models are gone; this trainer builds "
                            "megatron-core models: drop the flag"),
    "--use-torch-fsdp2": ("FSDP is not supported with the pipeline schedules here; use "
                          "--use-distributed-optimizer (ZeRO-1 sharding)"),
    "--use-custom-fsdp": ("FSDP is not supported with the pipeline schedules here; use "
                          "--use-distributed-optimizer (ZeRO-1 sharding)"),
    "--use-megatron-fsdp": ("FSDP is not supported with the pipeline schedules here; use "
                            "--use-distributed-optimizer (ZeRO-1 sharding)"),
    "--yaml-cfg": "YAML configuration files are not read here; pass the flags",
    "--optimizer-cpu-offload": "optimizer CPU offload is not supported here",
    "--enable-cuda-graph": ("CUDA graphs do not fit the sequence-split schedules (shapes "
                            "change per split); drop it"),
    "--use-ring-exchange-p2p": "ring-exchange p2p is not supported; drop it",
}

_NOT_YET = ("changes the model's math and is not implemented yet (a later change will add "
            "it); drop it only if the model does not need it, else train this model with "
            "Megatron-LM for now")
_UNEVEN = ("this way of unequal pipeline stages is not supported; give an embedding-only "
           "first stage with --pipeline-model-parallel-layout (e.g. 'E|t*8|t*8L'), or the "
           "first and last stages' layer counts with --decoder-first-pipeline-num-layers / "
           "--decoder-last-pipeline-num-layers")
_CHANGES = ("not supported here, and ignoring it would change the model, the data, the "
            "learning rate or what is saved; drop it")
_FSDP = REFUSED_FLAGS["--use-torch-fsdp2"]
_INFERENCE = REFUSED_FLAGS["--inference-"]
_FP8 = REFUSED_FLAGS["--fp8-"]

# flag (or prefix, ending in '-') words -> reason; each flag changes what a run computes,
# reads or saves, so it is refused rather than ignored
for _reason, _flags in (
    (_NOT_YET, "--fp32-residual-connection "
               "--embedding-weights-in-fp32 "
               "--relative-attention-"),
    ("Transformer Engine's RNG tracker (for CUDA graphs) is not used here; drop it",
     "--te-rng-tracker"),
    (_MLA_INFERENCE, "--cache-mla-latents"),
    ("the fused MLA down-projection is a Transformer Engine kernel, not used here (the "
     "unfused projections compute the same model); drop it", "--mla-down-proj-fusion"),
    ("QK-clip (MuonClip's rescaling of query/key weights after each step) is not "
     "implemented; drop it", "--qk-clip --qk-clip-"),
    (_MOE, "--overlap-moe-expert-parallel-comm --delay-wgrad-compute "
           "--overlap-dispatch-backward-with-experts-wgrad --ep-overlap-early-attn-memory-release "
           "--use-fused-weighted-squared-relu --high-priority-a2a-comm-stream "
           "--use-grouped-gemm-for-shared-expert --expert-tensor-parallel-num-weight-shards"),
    ("MTP in a standalone pipeline stage (a virtual stage of its own in "
     "--pipeline-model-parallel-layout) is not supported here: drop it and keep the MTP "
     "layers on the loss's stage (e.g. '...tmL')", "--mtp-standalone"),
    ("megatron-core's partial distributed optimizer (several instances, each sharding "
     "the optimizer state over a part of the data-parallel ranks and all-reducing between "
     "them on CUDA streams) is not set up here: --use-distributed-optimizer shards it over "
     "all data-parallel ranks", "--num-distributed-optimizer-instances"),
    ("hybrid (Mamba) models are not built here; use Megatron-LM",
     "--mtp-hybrid-override-pattern"),
    ("this attention or layer variant is not built here (standard softmax attention "
     "only); use Megatron-LM", "--experimental-attention-variant --dsa- --no-dsa- "
     "--disable-dsa- --linear- --use-kitchen-attention --kitchen-attention-backend "
     "--mrope-section --is-hybrid-model --disable-mamba-mem-eff-path "
     "--heterogeneous-"),
    ("MuP parameterisation is not implemented (it changes initialisation, learning rates "
     "and the attention scale); drop it", "--use-mup --mup-"),
    (_UNEVEN, "--standalone-embedding-stage"),
    (_FP8, "--fp4- --disable-fp8-wgrad --first-last-layers-bf16 --num-layers-at-start-in-bf16 "
           "--num-layers-at-end-in-bf16 --use-grouped-gemm-for-dense-mlp "
           "--reuse-grad-buf-for-mxfp8-param-ag --keep-fp8-transpose-cache "
           "--te-precision-config-file"),
    (_FSDP, "--fsdp- --megatron-fsdp- --torch-fsdp2-no-reshard-after-forward "
            "--enable-full-sharding-in-hsdp --data-parallel-sharding-strategy "
            "--outer-dp-sharding-strategy --suggested-communication-unit-size "
            "--init-model-with-meta-device"),
    (_INFERENCE, "--flash-decode --nccl-all-reduce-for-prefill --mlp-chunks-for-prefill "
                 "--max-tokens-to-oom --output-bert-embeddings --use-legacy-static-engine "
                 "--decode-only-cuda-graphs --enable-chunked-prefill --num-speculative-tokens "
                 "--no-inference- --use-same-sampling-seed-across-dp-ranks"),
    (REFUSED_FLAGS["--enable-cuda-graph"], "--cuda-graph- --external-cuda-graph "
                                           "--optimizer-cuda-graph"),
    ("Transformer Engine's activation kernels are not used here (PyTorch's run, whose "
     "values may differ); drop it", "--use-te-activation-func"),
    ("activation and optimizer CPU offloading are not supported here; use "
     "--recompute-granularity to save memory", "--cpu-offloading- "
     "--fine-grained-activation-offloading --offload-modules --min-offloaded-tensor-size "
     "--delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks "
     "--activation-offload-fraction --fine-grained-offloading-max-inflight-offloads "
     "--optimizer-offload-fraction --use-torch-optimizer-for-cpu-offload "
     "--overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads --no-pin-cpu-params"),
    ("RL training is not part of this trainer (GPT pretraining only); use Megatron-LM",
     "--rl- --no-rl- --grpo- --langrl-env-config --perform-rl-step --refit-method"),
    ("knowledge distillation from saved logits is not supported here", "--logits-"),
    ("fault-tolerance and restart packages (nvidia-resiliency-ext, ADLR autoresume) are "
     "not used here; use --exit-signal-handler and --exit-duration-in-mins with a "
     "restarting launcher", "--inprocess- --enable-ft-package --calc-ft-timeouts "
     "--ft-num-warmup-iters --adlr-autoresume --adlr-autoresume-interval --fault-injector-"),
    (_OTHER_MODEL, "--titles-data-path --query-in-block-prob --use-one-sent-docs "
                   "--evidence-data-path --block-data-path --embedding-path --indexer- "
                   "--num-classes --img-h --img-w --num-channels --patch-dim "
                   "--classes-fraction --data-per-class-fraction --no-data-sharding "
                   "--head-lr-mult --swin-backbone-type --mask-type --mask-factor "
                   "--iter-per-epoch"),
    ("non-persistent, local and replicated checkpoints are not supported: checkpoints "
     "here are torch_dist saves in --save every --save-interval",
     "--non-persistent- --persistent-save-interval --replication --replication-jump "
     "--replication-factor"),
    ("--async-save here uses megatron-core's own strategy (mcore) with its defaults; the "
     "nvidia-resiliency-ext strategy and the writer's CPU/IO priorities, shared-memory "
     "staging and cached metadata are not configurable; drop it",
     "--async-strategy --async-ckpt-"),
    ("this trainer's datasets come from --data-path with --split, or --train-data-path, "
     "--valid-data-path and --test-data-path (or the files naming them) only; give the "
     "blend there", "--per-dataset-sequences-path "
     "--sample-rate --object-storage-cache-path --enable-msc"),
    ("the tokenizer is configured by --tokenizer-type, --vocab-file, --merge-file and "
     "--tokenizer-model only; this option would change the token ids",
     "--vocab-extra-ids --tokenizer-metadata "
     "--tiktoken-num-special-tokens --tokenizer-sentencepiece-legacy "
     "--no-tokenizer-sentencepiece-ignore-extra-whitespaces "
     "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces"),
    ("evaluation here runs --eval-iters batches (of --eval-global-batch-size samples), or "
     "the whole validation set with --full-validation, every --eval-interval iterations; "
     "this evaluation option is not implemented", "--test-mode"),
    ("the MLP in sequence chunks (megatron-core's mlp_chunks_for_training) is not run "
     "here; drop it: --seq1f1b-splits runs every layer one split of the sequence at a time, "
     "and --recompute-modules mlp frees the MLP's activations",
     "--mlp-chunks-for-training"),
    ("deprecated in Megatron-LM, which stops on it: use --micro-batch-size",
     "--batch-size"),
    ("deprecated in Megatron-LM, which stops on it: use --lr-warmup-fraction or "
     "--lr-warmup-iters", "--warmup"),
    ("deprecated in Megatron-LM, which stops on it: use --tensor-model-parallel-size",
     "--model-parallel-size"),
    ("deprecated in Megatron-LM, which stops on it: use --recompute-activations or "
     "--recompute-granularity with --recompute-method", "--checkpoint-activations"),
    ("deprecated in Megatron-LM: use --ckpt-format torch_dist", "--dist-ckpt-format"),
    (_CHANGES, "--batch-invariant-mode "
               "--freeze-all-layers "
               "--dump-param-to-param-group-map "
               "--save-tokens-per-expert-interval --load-main-params-from-ckpt "
               "--ckpt-convert- --dist-ckpt-save-pre-mcore-014 "
               "--lazy-mpu-init "
               "--ddp-reduce-scatter-with-fp32-accumulation "
               "--ddp-param-name-patterns-for-fp32-local-accumulation "
               "--fake-process-group "
               "--tensor-parallel-num-weight-shards --max-seqlen-per-dp-cp-rank "
               "--use-precision-aware-optimizer --main-grads-dtype "
               "--main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype"),
):
    REFUSED_FLAGS.update(dict.fromkeys(_flags.split(), _reason))


# Refused flags given the value that asks for what this trainer does anyway (Megatron-LM's
# default, or its "off"): launch scripts spell defaults out. flag -> (accepted values,
# what the start-up note says); any other value is refused with the flag's reason.
DEFAULT_VALUES_ACCEPTED = {
    "--cuda-graph-impl": (("none",), "Megatron-LM's default: no CUDA graphs (none are "
                                     "captured here)"),
    "--async-strategy": (("mcore",), "--async-save here writes with megatron-core's own "
                                     "strategy (mcore), as asked"),
    "--num-distributed-optimizer-instances": (
        ("1",), "Megatron-LM's default: one distributed-optimizer instance over all the "
                "data-parallel ranks, as here"),
    "--main-grads-dtype": (("fp32",), "Megatron-LM's default: main gradients are fp32 here"),
    "--main-params-dtype": (("fp32",), "Megatron-LM's default: the optimizer's main "
                                       "parameters are fp32 here"),
    "--exp-avg-dtype": (("fp32",), "Megatron-LM's default: Adam's first moment is fp32 here"),
    "--exp-avg-sq-dtype": (("fp32",), "Megatron-LM's default: Adam's second moment is fp32 "
                                      "here"),
    "--mlp-chunks-for-training": (("1",), "Megatron-LM's default: the MLP is not run in "
                                          "sequence chunks"),
    "--vocab-extra-ids": (("0",), "Megatron-LM's default: no extra sentinel tokens"),
    "--cpu-offloading-num-layers": (("0",), "Megatron-LM's default: no layer is offloaded"),
}


def _same_value(given, accepted):
    if given == accepted:
        return True
    try:
        return float(given) == float(accepted)
    except ValueError:
        return False


def _default_value_note(flag, values):
    """The start-up note for a refused flag given only a value it accepts, else None."""
    accepted, note = DEFAULT_VALUES_ACCEPTED.get(flag, ((), None))
    if len(values) == 1 and any(_same_value(values[0], value) for value in accepted):
        return note
    return None


def refusal_for(flag: str):
    """The reason a Megatron-LM flag is refused here, or None."""
    if flag in MOE_FLAGS or flag in MLA_FLAGS or flag in NO_OP_FLAGS:
        return None  # implemented or accepted (MoE's under a refused prefix)
    if flag in REFUSED_FLAGS:
        return REFUSED_FLAGS[flag]
    for prefix, reason in REFUSED_FLAGS.items():
        if prefix.endswith("-") and flag.startswith(prefix):
            return reason
    return None


def take_refused(argv):
    """Split argv into (the rest, [(flag, reason)] refused, [(flag, note)] accepted):
    refused flags and their values are taken out before parsing, so every other flag is
    still checked; one given only the value this trainer follows anyway is accepted."""
    rest, refused, accepted, index = [], [], [], 0
    while index < len(argv):
        token = argv[index]
        flag, _, value = token.partition("=")
        reason = refusal_for(flag) if token.startswith("--") else None
        if reason is None:
            rest.append(token)
            index += 1
            continue
        index += 1
        values = [value] if "=" in token else []
        # its values (the tokens up to the next flag: numbers may be negative; this
        # command line has no positional arguments)
        while "=" not in token and index < len(argv) and not _is_flag(argv[index]):
            values.append(argv[index])
            index += 1
        note = _default_value_note(flag, values)
        if note is None:
            if flag in DEFAULT_VALUES_ACCEPTED:
                reason += f" (accepted: {flag} {'/'.join(DEFAULT_VALUES_ACCEPTED[flag][0])})"
            refused.append((flag, reason))
        else:
            accepted.append((flag, note))
    return rest, refused, accepted


def _is_flag(token: str) -> bool:
    if not token.startswith("-"):
        return False
    try:
        float(token)
        return False
    except ValueError:
        return True


def add_no_op_flags(parser):
    group = parser.add_argument_group(
        "Megatron-LM flags accepted without effect",
        "Each is accepted so that Megatron-LM launch scripts run unchanged; the reason "
        "says why it changes nothing here. A note at start-up lists the ones given.")
    for flag, (takes_value, reason) in NO_OP_FLAGS.items():
        dest = _no_op_dest(flag)
        if takes_value:
            group.add_argument(flag, dest=dest, default=None, metavar="VALUE", help=reason,
                               nargs=None if takes_value is True else takes_value)
        else:
            group.add_argument(flag, dest=dest, action="store_true", help=reason)
    group = parser.add_argument_group(
        "Megatron-LM features refused",
        "These stop the run before any work, with the reason and the alternative: "
        + "; ".join(f"{flag}{'*' if flag.endswith('-') else ''}"
                    for flag in REFUSED_FLAGS) + ". Given the value this trainer follows "
        "anyway, these are accepted: " + ", ".join(
            f"{flag} {'/'.join(values)}"
            for flag, (values, _) in DEFAULT_VALUES_ACCEPTED.items()) + ".")


def _no_op_dest(flag):
    return "noop" + flag  # the flag itself: --local-rank and --local_rank stay apart


def no_op_value(args, flag):
    """The value(s) a no-op flag was given on the command line (None: not given)."""
    return getattr(args, _no_op_dest(flag), None)


def no_op_flags_given(args):
    """(flag, reason) for every no-op flag on the command line."""
    given = []
    for flag, (takes_value, reason) in NO_OP_FLAGS.items():
        value = no_op_value(args, flag)
        if (value is not None) if takes_value else value:
            given.append((flag, reason))
    return given
