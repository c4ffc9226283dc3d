"""Megatron-LM's model flags (issue #28 point 2) reach the config, the layer spec and the
model as Megatron-LM sets them, and RoPE interleaved / Llama-3 scaled at a split's offset
gives split attention equal to unsplit attention. In-process, no processes; the trained
runs are in tests/test_model_flags_exactness.py."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.seqsplit.attention_backends import get_backend
from megatron.seqsplit.kv_cache import KVCacheStore, split_causal_attention
from megatron.seqsplit.model import SequenceParallelTorchNorm, split_aware_local_spec
from megatron.trainer import model as trainer_model
from megatron.trainer.arguments import ArgumentErrors, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "1", "--mock-data", "--vocab-size", "128",
        "--micro-batch-size", "1", "--global-batch-size", "1"]


def args_of(*flags):
    return parse_args(BASE + list(flags), world_size=1, cuda_available=False,
                      check_files=False)


def config_of(*flags):
    return trainer_model.transformer_config_from_args(args_of(*flags))


@pytest.fixture(autouse=True)
def one_stage(monkeypatch):
    """The layer count of a stage without megatron-core's parallel state (no processes)."""
    import megatron.seqsplit.model as seqsplit_model

    monkeypatch.setattr(seqsplit_model, "get_num_layers_to_build",
                        lambda config, vp_stage=None: config.num_layers)


def test_qk_layernorm_reaches_config_and_split_aware_spec():
    config = config_of("--qk-layernorm", "--normalization", "RMSNorm")
    assert config.qk_layernorm
    block = split_aware_local_spec(config, normalization="RMSNorm", qk_layernorm=True)
    attention = block.layer_specs[0].submodules.self_attention.submodules
    # the sequence-parallel-capable torch norm (per head: hidden size = head dim)
    assert attention.q_layernorm is SequenceParallelTorchNorm
    assert attention.k_layernorm is SequenceParallelTorchNorm
    norm = SequenceParallelTorchNorm(config, 8, eps=1e-5)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.shape == (8,)
    plain = split_aware_local_spec(config_of(), normalization="RMSNorm")
    assert "IdentityOp" in repr(plain.layer_specs[0].submodules.self_attention.submodules
                                .q_layernorm)


def test_qk_layernorm_spec_from_the_trainer_with_the_chunked_cache():
    args = args_of("--qk-layernorm", "--seq1f1b-kv-cache", "chunked", "--attention-dropout",
                   "0", "--transformer-impl", "local")
    config = trainer_model.transformer_config_from_args(args)
    block = trainer_model.layer_spec(args, config)
    attention = block.layer_specs[0].submodules.self_attention.submodules
    assert attention.k_layernorm is SequenceParallelTorchNorm
    assert attention.core_attention.params["kv_cache"] == "chunked"


def test_add_qkv_bias_as_megatron_lm():
    config = config_of("--disable-bias-linear", "--add-qkv-bias")
    assert config.add_qkv_bias and not config.add_bias_linear
    assert not config_of("--disable-bias-linear").add_qkv_bias
    assert config_of().add_qkv_bias  # Megatron-LM: biased linear layers bias QKV too


def test_squared_relu_activation():
    config = config_of("--squared-relu")
    assert config.activation_func is squared_relu and not config.gated_linear_unit
    assert config_of().activation_func is trainer_model.tanh_gelu  # Megatron-LM fuses bias+GeLU
    assert config_of("--no-bias-gelu-fusion").activation_func is F.gelu
    assert config_of("--swiglu").activation_func is F.silu
    with pytest.raises(ArgumentErrors, match="--squared-relu and --swiglu"):
        args_of("--squared-relu", "--swiglu")


def test_rotary_interleaved_and_rope_scaling_reach_config_and_model(monkeypatch):
    args = args_of("--position-embedding-type", "rope", "--rotary-interleaved",
                   "--use-rope-scaling", "--rope-scaling-factor", "4")
    config = trainer_model.transformer_config_from_args(args)
    assert config.rotary_interleaved
    seen = {}
    monkeypatch.setattr(trainer_model, "SeqSplitGPTModel", lambda **kw: seen.update(kw))
    monkeypatch.setattr(trainer_model, "layer_spec", lambda *a, **k: None)
    args.padded_vocab_size = 128
    trainer_model.gpt_model_provider(args, config)
    assert seen["rope_scaling"] is True and seen["rope_scaling_factor"] == 4.0
    assert not config_of("--position-embedding-type", "rope").rotary_interleaved
    with pytest.raises(ArgumentErrors, match="--use-rope-scaling"):
        args_of("--use-rope-scaling")  # learned absolute positions: nothing to scale


def test_embedding_init_std_is_its_own():
    config = config_of("--init-method-std", "0.02", "--embedding-init-method-std", "0.5")
    assert (config.init_method_std, config.embedding_init_method_std) == (0.02, 0.5)
    weights = torch.empty(4096, 64)
    config.embedding_init_method(weights)  # what megatron-core's embedding initialises with
    assert 0.45 < weights.std().item() < 0.55
    assert config_of("--init-method-std", "0.03").embedding_init_method_std == 0.03


def test_xavier_uniform_init_as_megatron_lm_means_it():
    """--init-method-xavier-uniform: every layer's weights (and the embedding's, which
    megatron-core initialises with the layers' method) Xavier-uniform: inside
    sqrt(6 / (fan_in + fan_out)) with a uniform's spread. (Megatron-LM 0.19 passes the
    output layers' method as ``scaled_init_method``, which its TransformerConfig rejects.)"""
    config = config_of("--init-method-xavier-uniform")
    assert config.init_method is torch.nn.init.xavier_uniform_
    assert config.output_layer_init_method is torch.nn.init.xavier_uniform_
    for init in (config.init_method, config.output_layer_init_method,
                 config.embedding_init_method):
        weights = torch.empty(256, 64)
        init(weights)
        bound = (6 / (256 + 64)) ** 0.5
        assert weights.abs().max() <= bound
        assert abs(weights.std().item() - bound / 3 ** 0.5) < 0.05 * bound
    normal = config_of()  # megatron-core's normal init of std 0.02 otherwise
    weights = torch.empty(256, 64)
    normal.init_method(weights)
    assert 0.018 < weights.std().item() < 0.022
    with pytest.raises(TypeError, match="scaled_init_method"):  # Megatron-LM 0.19's call
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                          init_method=torch.nn.init.xavier_uniform_,
                          scaled_init_method=torch.nn.init.xavier_uniform_)


def test_precision_flags_reach_the_config_and_model(monkeypatch):
    """--fp16-lm-cross-entropy (GPTModel's fp16 loss; needs --fp16, as Megatron-LM
    asserts) and --disable-bf16-reduced-precision-matmul (megatron-core's config field: it
    sets torch's CUDA flag with --bf16); --openai-gelu changes nothing, as in Megatron-LM
    0.19, which parses it and applies it nowhere."""
    with pytest.raises(ArgumentErrors, match="--fp16-lm-cross-entropy needs --fp16"):
        args_of("--fp16-lm-cross-entropy")
    disabled = config_of("--disable-bf16-reduced-precision-matmul")
    assert disabled.disable_bf16_reduced_precision_matmul
    assert not config_of().disable_bf16_reduced_precision_matmul
    args = args_of()
    args.fp16_lm_cross_entropy = True  # (--fp16 itself needs CUDA: its rule is above)
    seen = {}
    monkeypatch.setattr(trainer_model, "SeqSplitGPTModel", lambda **kw: seen.update(kw))
    monkeypatch.setattr(trainer_model, "layer_spec", lambda *a, **k: None)
    args.padded_vocab_size = 128
    trainer_model.gpt_model_provider(args, trainer_model.transformer_config_from_args(args))
    assert seen["fp16_lm_cross_entropy"] is True
    gelu = args_of("--openai-gelu")
    assert config_of("--openai-gelu").activation_func is config_of().activation_func
    assert any(flag == "--openai-gelu" for flag, _ in gelu.no_op_flags)


# --- RoPE at a split's offset: split attention equals unsplit attention ------------------

D, HQ, G, B = 8, 4, 2, 2
LENGTHS = [5, 3, 6]
L = sum(LENGTHS)


class Split:
    def __init__(self, index, offset, length):
        self.microbatch_id, self.split_index, self.num_splits = 0, index, len(LENGTHS)
        self.offset, self.length, self.seq_length = offset, length, L
        self.document_ids = None


def _rope(interleaved, scaling):
    config = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ,
                               rotary_interleaved=interleaved, apply_rope_fusion=False)
    rotary = RotaryEmbedding(D, rotary_percent=1.0, rotary_interleaved=interleaved,
                             rotary_base=10000, rope_scaling=scaling,
                             rope_scaling_factor=4.0, use_cpu_initialization=True)
    return config, rotary


@pytest.mark.parametrize("layout", ["buffer", "chunked"])
@pytest.mark.parametrize("interleaved,scaling", [(True, False), (False, True), (True, True)])
def test_split_attention_with_rope_at_offsets_equals_unsplit(monkeypatch, layout, interleaved,
                                                             scaling):
    # megatron-core moves inv_freq to torch.cuda.current_device() (the trainer's
    # cpu_support does this for the whole process); here for this test only
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config, rotary = _rope(interleaved, scaling)
    # Llama-3 scaling changes the low frequencies: it must be on, not a no-op
    assert torch.equal(rotary.inv_freq, _rope(interleaved, False)[1].inv_freq) != scaling
    gen = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(L, B, h, D, generator=gen, dtype=torch.float64)
                  for h in (HQ, G, G, HQ))
    backend, scale = get_backend("sdpa"), D ** -0.5

    def attend(q_, k_, v_, emb, split, store):
        # what megatron-core's apply_rotary_pos_emb runs for [s, b, h, d] without
        # context parallelism (its public entry point asks for the CP group)
        q_ = _apply_rotary_pos_emb_bshd(q_, emb, rotary_interleaved=config.rotary_interleaved)
        k_ = _apply_rotary_pos_emb_bshd(k_, emb, rotary_interleaved=config.rotary_interleaved)
        return split_causal_attention(q_, k_, v_, backend=backend, softmax_scale=scale,
                                      kv_cache=layout, split=split, store=store, layer_key=0)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    whole = Split(0, 0, L)
    whole.num_splits = 1
    out_full = attend(*full, rotary.get_emb(L).double(), whole, KVCacheStore())
    out_full.backward(w)

    store, leaves, outs, offset = KVCacheStore(), [], [], 0
    for j, length in enumerate(LENGTHS):
        part = slice(offset, offset + length)
        mine = [t[part].clone().requires_grad_() for t in (q, k, v)]
        # what SeqSplitGPTModel does for a split: the embedding from the split's offset
        # (RotaryEmbedding.forward is get_emb, then the context-parallel slice: none here)
        outs.append(attend(*mine, rotary.get_emb(length, offset=offset).double(),
                           Split(j, offset, length), store))
        leaves.append(mine)
        offset += length
    offset = L
    for j in reversed(range(len(LENGTHS))):
        offset -= LENGTHS[j]
        outs[j].backward(w[offset:offset + LENGTHS[j]])
    torch.testing.assert_close(torch.cat([o.detach() for o in outs]), out_full.detach(),
                               rtol=0, atol=1e-10)
    for i in range(3):
        torch.testing.assert_close(torch.cat([leaf[i].grad for leaf in leaves]),
                                   full[i].grad, rtol=0, atol=1e-10)
