"""What one transformer layer saves for backward per split, with and without selective
recomputation of core attention (CPU, one process, no pipeline).

    python tools/selective_saved_bytes.py                   # L=2048, hidden 256, 8 heads
    python tools/selective_saved_bytes.py --splits 1 2 4 --json out.json
    python tools/selective_saved_bytes.py --document-length 300  # packed documents
    python tools/selective_saved_bytes.py --no-rope         # learned positions (no RoPE)

For each split count s and each mode the layer (this repository's split-aware local
spec) runs forward over the s splits of one microbatch with ``saved_tensors_hooks``
installed, as the pipeline probe (megatron/schedules/memory_probe.py) does: the bytes
of every storage saved for backward are counted once, parameters and the KV-cache
buffers (held by the store whatever the mode) excluded. Saves are attributed to core
attention when they are made inside it (including megatron-core's checkpoint around
it), otherwise to the rest of the layer. Modes:

* ``none``        no recomputation;
* ``selective``   ``--recompute-granularity selective`` as the model runs it
                  (``SplitSelfAttention``: the attention kernel is checkpointed after
                  the KV-cache write);
* ``selective-mcore``  megatron-core's own selective path (its reentrant checkpoint
                  around the whole core attention), the behaviour before.

Backward then runs split by split in reverse; the input gradient and every parameter
gradient are compared with the ``none`` run.
"""

import argparse
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

MODES = ("none", "selective", "selective-mcore")


def _init():
    from megatron import cpu_support
    cpu_support.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random
    # an in-process store: no port to pick (tests run this tool beside others)
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    mp_random.initialize_rng_tracker(force_reset=True)
    mp_random.get_cuda_rng_tracker().add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, 1234)


def _attention_frame(stack):
    for frame in stack:
        if frame.name == "_checkpointed_attention_forward" or (
                frame.name == "forward" and frame.filename.endswith("core_attention.py")):
            return True
    return False


def measure(mode, num_splits, args):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.seqsplit import kv_cache
    from megatron.seqsplit.kv_cache import KVCacheStore
    from megatron.seqsplit.model import split_aware_local_spec
    from megatron.seqsplit.split_lengths import plan_splits, split_offsets
    from megatron.seqsplit.split_context import SplitContext

    L, H = args.seq_length, args.hidden_size
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False,
        recompute_granularity=None if mode == "none" else "selective")
    spec = split_aware_local_spec(config)
    if mode == "selective-mcore":
        spec.layer_specs[0].submodules.self_attention.module = SelfAttention
    torch.manual_seed(1)
    block = TransformerBlock(config, spec, pre_process=True, post_process=False)
    block.train()
    # without RoPE (learned positions: the embedding adds them before the layer) the
    # query reaches the kernel as a view of the fused QKV output
    rope = None if args.no_rope else RotaryEmbedding(kv_channels=H // args.heads,
                                                     rotary_percent=1.0)
    params = {kv_cache.storage_id(p) for p in block.parameters()}

    saved = {}  # storage_id -> [bytes, in core attention, split]
    split_now = [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = kv_cache.storage_id(tensor)
        if key not in params and storage.nbytes() and key not in saved:
            saved[key] = [storage.nbytes(), _attention_frame(traceback.extract_stack()),
                          split_now[0]]
        return tensor

    writes = [0]  # K/V cache writes (first forwards and recomputed forwards)
    write_and_expose = kv_cache._write_and_expose

    def counted_write(*a, **k):
        writes[0] += 1
        return write_and_expose(*a, **k)

    kv_cache._write_and_expose = counted_write
    store = KVCacheStore(forward_only=False)
    lengths = plan_splits(L, num_splits, "average") if num_splits > 1 else [L]
    x = torch.randn(L, 1, H, generator=torch.Generator().manual_seed(2))
    grad_out = torch.randn(L, 1, H, generator=torch.Generator().manual_seed(3))
    documents = None
    if args.document_length:  # packed documents: per-document causal attention
        documents = (torch.arange(L) // args.document_length).unsqueeze(0)
    inputs, outputs = [], []
    for j, (offset, length) in enumerate(zip(split_offsets(lengths), lengths)):
        split = SplitContext(microbatch_id=0, split_index=j, num_splits=num_splits,
                             offset=offset, length=length, seq_length=L, kv_store=store,
                             document_ids=documents)
        split_now[0] = j
        leaf = x[offset:offset + length].clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(leaf, attention_mask=None, packed_seq_params=split,
                        rotary_pos_emb=rope(length, offset=offset) if rope else None)
        inputs.append(leaf)
        outputs.append(out)
    kv = store.storage_ids()
    per_split = []
    for j, length in enumerate(lengths):
        items = [(n, attn) for key, (n, attn, sj) in saved.items() if sj == j and key not in kv]
        attention = sum(n for n, attn in items if attn)
        per_split.append({"length": length, "attention_bytes": attention,
                          "layer_bytes": sum(n for n, _ in items)})
    kv_bytes = store.cached_bytes()
    for j in reversed(range(len(lengths))):
        offset = sum(lengths[:j])
        outputs[j].backward(grad_out[offset:offset + lengths[j]])
    assert store.num_entries() == 0
    kv_cache._write_and_expose = write_and_expose
    grads = [torch.cat([leaf.grad for leaf in inputs])] + [p.grad.clone() for p in block.parameters()]
    return {"per_split": per_split, "kv_bytes": kv_bytes, "cache_writes": writes[0]}, grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--query-groups", type=int, default=None)
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--document-length", type=int, default=0,
                        help="pack documents of this many tokens (explicit per-document mask)")
    parser.add_argument("--no-rope", action="store_true",
                        help="no rotary embedding (a model with learned positions)")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    _init()

    mib = 2 ** 20
    print(f"# python tools/selective_saved_bytes.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"# one layer, L={args.seq_length} hidden={args.hidden_size} heads={args.heads} "
          f"groups={args.query_groups or args.heads} "
          f"{f'documents of {args.document_length} tokens ' if args.document_length else ''}"
          f"{'no RoPE ' if args.no_rope else 'RoPE '}fp32 CPU, torch {torch.__version__}; "
          "MiB saved for backward per split (KV-cache buffers excluded), "
          "core attention's share in brackets")
    print("| s | split | length | none | selective (kernel checkpoint) | "
          "selective-mcore (core-attention checkpoint) | selective - none | "
          "selective-mcore - none |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for s in args.splits:
        runs, grads = {}, {}
        for mode in MODES:
            runs[mode], grads[mode] = measure(mode, s, args)
        diffs = {mode: max((a - b).abs().max().item() for a, b in zip(grads[mode], grads["none"]))
                 for mode in MODES[1:]}
        for j in range(s):
            row = {mode: runs[mode]["per_split"][j] for mode in MODES}
            cells = [f"{row[m]['layer_bytes'] / mib:.3f} ({row[m]['attention_bytes'] / mib:.3f})"
                     for m in MODES]
            d1 = (row["selective"]["layer_bytes"] - row["none"]["layer_bytes"]) / mib
            d2 = (row["selective-mcore"]["layer_bytes"] - row["none"]["layer_bytes"]) / mib
            print(f"| {s} | {j} | {row['none']['length']} | {cells[0]} | {cells[1]} | {cells[2]} | "
                  f"{d1:+.3f} | {d2:+.3f} |")
        totals = {m: sum(p["layer_bytes"] for p in runs[m]["per_split"]) for m in MODES}
        print(f"| {s} | all | {args.seq_length} | {totals['none'] / mib:.3f} | "
              f"{totals['selective'] / mib:.3f} | {totals['selective-mcore'] / mib:.3f} | "
              f"{(totals['selective'] - totals['none']) / mib:+.3f} | "
              f"{(totals['selective-mcore'] - totals['none']) / mib:+.3f} |")
        results.append({"splits": s, "runs": runs, "max_grad_diff_vs_none": diffs,
                        "kv_cache_bytes": runs["none"]["kv_bytes"]})
    for r in results:
        print(f"# s={r['splits']}: KV cache {r['kv_cache_bytes'] / mib:.1f} MiB (all modes); "
              "K/V cache writes " + ", ".join(
                  f"{m} {r['runs'][m]['cache_writes']}" for m in MODES)
              + "; max |grad - grad(none)|: " + ", ".join(
                  f"{m} {d:.1e}" for m, d in r["max_grad_diff_vs_none"].items()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": "python tools/selective_saved_bytes.py " + " ".join(sys.argv[1:]),
                       "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
