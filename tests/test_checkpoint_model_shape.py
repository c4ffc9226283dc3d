"""What a checkpoint records of the model's shape and how a load compares it
(checkpointing.model_shape / _check_model_shape), without processes: MoE and MLA sizes
count only when their gate (--num-experts, --multi-latent-attention) is set, so a dense
model's unused defaults never stop a resume."""

from argparse import Namespace

import pytest

from megatron.trainer import checkpointing
from megatron.trainer.checkpointing import GATED_SHAPE_FLAGS, MODEL_SHAPE_FLAGS, model_shape

GATED = {flag for flags in GATED_SHAPE_FLAGS.values() for flag in flags}


def _args(**changes):
    values = {flag: None for flag in MODEL_SHAPE_FLAGS + tuple(GATED)}
    values.update(num_layers=2, hidden_size=8, num_attention_heads=2, multi_latent_attention=False,
                  kv_lora_rank=32, qk_head_dim=128, moe_ffn_hidden_size=16, moe_router_topk=2)
    values.update(changes)
    return Namespace(**values)


def _load_problem(saved, now):
    """The line a load of a checkpoint saved with `saved` args prints under `now`, or None."""
    try:
        checkpointing._check_model_shape(now, "ckpt/iter_0000002",
                                         {"model_shape": model_shape(saved)})
    except SystemExit as stop:
        return str(stop.code)
    return None


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch):
    monkeypatch.setattr(checkpointing, "_rank", lambda: 0)


def test_a_dense_model_records_no_moe_or_mla_sizes():
    shape = model_shape(_args())
    # a biased GeLU MLP also records which GeLU it computes (--no-bias-gelu-fusion)
    assert set(shape) == set(MODEL_SHAPE_FLAGS) | {"bias_gelu_fusion"}
    assert not GATED & set(shape)
    # a dense run given another (unused) MLA rank resumes
    assert _load_problem(_args(), _args(kv_lora_rank=64)) is None


def test_moe_and_mla_sizes_are_compared_when_gated_on():
    moe = _args(num_experts=8)
    assert _load_problem(moe, _args(num_experts=8, moe_ffn_hidden_size=32)) == (
        "error: --load ckpt/iter_0000002 holds another model shape: --moe-ffn-hidden-size "
        "saved 16, now 32")
    assert "--num-experts saved 8, now None" in _load_problem(moe, _args())
    mla = _args(multi_latent_attention=True)
    assert "--qk-head-dim saved 128, now 192" in _load_problem(
        mla, _args(multi_latent_attention=True, qk_head_dim=192))
    assert _load_problem(mla, _args(multi_latent_attention=True)) is None


def test_an_older_checkpoint_without_the_new_entries_still_loads():
    old = {"model_shape": {f: v for f, v in model_shape(_args()).items()
                           if f not in ("num_experts", "multi_latent_attention")}}
    checkpointing._check_model_shape(_args(num_experts=8), "ckpt", old)  # nothing to compare


def test_a_checkpoint_of_the_exact_gelu_stops_a_tanh_gelu_resume_and_says_how():
    """Before --no-bias-gelu-fusion was honoured, a biased GeLU MLP computed the exact
    GeLU; resuming it under Megatron-LM's default (the fused tanh GeLU) would change the
    model's function silently."""
    legacy = {"model_shape": {f: v for f, v in model_shape(_args()).items()
                              if f != "bias_gelu_fusion"}}
    problem = None
    try:
        checkpointing._check_model_shape(_args(), "ckpt", legacy)
    except SystemExit as stop:
        problem = str(stop.code)
    assert problem == (
        "error: --load ckpt holds another model shape: --bias-gelu-fusion saved False, now "
        "True (that checkpoint's MLP computes the exact GeLU: add --no-bias-gelu-fusion, or "
        "--use-checkpoint-args, to continue it)")
    checkpointing._check_model_shape(_args(bias_gelu_fusion=False), "ckpt", legacy)
    assert _load_problem(_args(bias_gelu_fusion=False), _args(bias_gelu_fusion=False)) is None
    # SwiGLU: the flag changes nothing, recorded or not
    assert _load_problem(_args(swiglu=True), _args(swiglu=True, bias_gelu_fusion=False)) is None


def test_a_null_tokenizer_checkpoint_of_the_old_vocabulary_says_how_to_continue():
    """NullTokenizer's --vocab-size N held N + 1 entries here before 2026-12-08 (Megatron-LM
    0.17's rule); since, N (0.18+'s). Where the padding differs (N a multiple of 128) the
    resume stops, saying which --vocab-size continues the checkpoint."""
    old = _args(padded_vocab_size=384, tokenizer_type="NullTokenizer", vocab_size=257)
    now = _args(padded_vocab_size=256, tokenizer_type="NullTokenizer", vocab_size=256)
    assert _load_problem(old, now) == (
        "error: --load ckpt/iter_0000002 holds another model shape: --padded-vocab-size saved "
        "384, now 256 (NullTokenizer's --vocab-size is its whole vocabulary since 2026-12-08, "
        "as in Megatron-LM 0.18+; a checkpoint saved before with --vocab-size 256 held 257 "
        "entries, the last the end-of-document: give --vocab-size 257 to continue it)")
    assert "give --vocab-size" not in _load_problem(
        old, _args(padded_vocab_size=256, tokenizer_type="GPT2BPETokenizer", vocab_size=None))


YARN = dict(position_embedding_type="yarn", rotary_scaling_factor=4.0,
            yarn_original_max_position_embeddings=4096, yarn_beta_fast=None,
            yarn_beta_slow=None, mscale=1.0, mscale_all_dim=0.0,
            yarn_correction_range_round_to_int=None)


def test_yarn_records_its_settings_and_plain_rope_does_not():
    shape = model_shape(_args(**YARN))
    assert {flag: shape[flag] for flag in checkpointing.YARN_SHAPE_FLAGS} == {
        flag: YARN[flag] for flag in checkpointing.YARN_SHAPE_FLAGS}
    assert not set(checkpointing.YARN_SHAPE_FLAGS) & set(model_shape(
        _args(position_embedding_type="rope")))
    assert "--rotary-scaling-factor saved 4.0, now 8.0" in _load_problem(
        _args(**YARN), _args(**dict(YARN, rotary_scaling_factor=8.0)))


def test_extending_the_context_of_a_checkpoint_needs_finetune(capsys):
    """RoPE's position scaling (YaRN, interpolation, Llama-3 scaling) changes how positions
    are read, not the weights: a resume that changes it stops (a forgotten flag would
    change the model's function), a --finetune start from the weights says so and loads."""
    rope = _args(position_embedding_type="rope")
    extended = [_args(**YARN), _args(position_embedding_type="rope",
                                     rotary_seq_len_interpolation_factor=4),
                _args(position_embedding_type="rope", use_rope_scaling=True,
                      rope_scaling_factor=8.0)]
    for now in extended:
        problem = _load_problem(rope, now)
        assert problem.startswith("error: --load ckpt/iter_0000002 holds another model shape: ")
        assert problem.endswith(
            " (only RoPE's position scaling differs: to extend the context from this "
            "checkpoint, start a run from its weights with --finetune; to resume it, give "
            "its settings or --use-checkpoint-args)")
        now.finetune = True
        assert _load_problem(rope, now) is None
        note = capsys.readouterr().out
        assert note.startswith("  note: --load ckpt/iter_0000002: RoPE reads positions "
                               "differently from that checkpoint's run ("), note
        assert note.endswith("): its weights start this run (--finetune), as when extending "
                             "the context\n")
    assert "--position-embedding-type saved 'rope', now 'yarn'" in _load_problem(
        rope, _args(**YARN))
    # learned positions are weights: --finetune does not bridge them to YaRN
    learned = _args(position_embedding_type="learned_absolute")
    problem = _load_problem(learned, _args(finetune=True, **YARN))
    assert "saved 'learned_absolute', now 'yarn'" in problem and "--finetune" not in problem
    # nor does it bridge another shape beside a scaling change
    problem = _load_problem(rope, _args(finetune=True, hidden_size=16, **YARN))
    assert "--hidden-size saved 8, now 16" in problem and "--finetune" not in problem


def test_layers_without_rope_are_recorded_as_their_pattern():
    """--no-rope-freq 2 and the pattern it stands for are the same model (megatron-core
    expands N the same way); another pattern is another model."""
    every_second = _args(num_layers=4, no_rope_freq=2)
    assert model_shape(every_second)["no_rope_freq"] == [0, 1, 0, 1]
    assert _load_problem(every_second, _args(num_layers=4, no_rope_freq=[0, 1, 0, 1])) is None
    assert "--no-rope-freq saved [0, 1, 0, 1], now [1, 0, 0, 0]" in _load_problem(
        every_second, _args(num_layers=4, no_rope_freq=[1, 0, 0, 0]))


def test_windows_and_sinks_are_part_of_the_model_shape():
    """--window-size, its layers (N or the pattern it stands for) and --softmax-type are
    the model's function; a resume that changes them stops, naming them."""
    windowed = _args(num_layers=4, window_size=(128, 0), window_attn_skip_freq=2,
                     softmax_type="learnable")
    shape = model_shape(windowed)
    assert (shape["window_size"], shape["window_attn_skip_freq"]) == ([128, 0], [1, 0, 1, 0])
    assert _load_problem(windowed, _args(num_layers=4, window_size=(128, 0),
                                         window_attn_skip_freq=[1, 0, 1, 0],
                                         softmax_type="learnable")) is None
    problem = _load_problem(windowed, _args(num_layers=4, softmax_type="vanilla"))
    assert "--window-size saved [128, 0], now None" in problem
    assert "--softmax-type saved 'learnable', now 'vanilla'" in problem
    assert _load_problem(_args(), _args(window_attn_skip_freq=2)) is None  # moot unwindowed


def test_the_mtp_depths_are_part_of_the_model_shape():
    """--mtp-num-layers adds layers (and --mtp-use-repeated-layer decides how many): a
    resume with another depth count stops naming it; a dense model's unused repeated-layer
    flag does not."""
    mtp = _args(mtp_num_layers=2, mtp_use_repeated_layer=False)
    assert model_shape(mtp)["mtp_use_repeated_layer"] is False
    assert "--mtp-num-layers saved 2, now 1" in _load_problem(mtp, _args(mtp_num_layers=1))
    assert "--mtp-num-layers saved 2, now None" in _load_problem(mtp, _args())
    assert "--mtp-use-repeated-layer saved False, now True" in _load_problem(
        mtp, _args(mtp_num_layers=2, mtp_use_repeated_layer=True))
    assert "mtp_use_repeated_layer" not in model_shape(_args(mtp_use_repeated_layer=True))


def test_optimizer_state_across_an_expert_parallel_change():
    """A distributed-optimizer checkpoint saved without megatron-core's chain prefix
    loads into another number of chained optimizers (EP change; trained in
    tests/test_moe_exactness.py); an older one with the prefix, or the non-distributed
    optimizer's state, stops with one line naming the change and --no-load-optim."""
    class Chained:
        chained_optimizers = [object(), object()]  # EP > 1: dense and expert

    saved = {"optimizer_parts": 1, "expert_model_parallel_size": 1,
             "chained_optim_avoid_prefix": True}

    def problem(common, distributed=True):
        try:
            checkpointing._check_optimizer_parts(
                Namespace(use_distributed_optimizer=distributed,
                          expert_model_parallel_size=2), "ckpt", common, Chained())
        except SystemExit as stop:
            return str(stop.code)
        return None

    assert problem(saved) is None
    assert problem({"optimizer_parts": 1}) is None  # one optimizer never had a prefix
    assert problem({**saved, "optimizer_parts": 2}, distributed=False) is None  # same chain
    head = ("error: --load ckpt: its optimizer state is 1 chained optimizer(s) (saved with "
            "--expert-model-parallel-size 1) and this run builds 2 "
            "(--expert-model-parallel-size 2): ")
    tail = (", so it does not load across that change; keep the flag, or pass "
            "--no-load-optim to load the weights (they reshard)")
    older = {"optimizer_parts": 3, "expert_model_parallel_size": 1}  # before the record
    assert problem(older).startswith("error: --load ckpt: its optimizer state is 3 chained")
    assert problem({**saved, "chained_optim_avoid_prefix": False}) == (
        head + "its keys carry megatron-core's per-optimizer prefix (saved by an earlier "
        "version of this project)" + tail)
    assert problem(saved, distributed=False) == (
        head + "the non-distributed optimizer's state keeps one list of param groups per "
        "chained optimizer" + tail)


def test_ckpt_step_names_the_iterations_saved_when_its_checkpoint_is_missing(tmp_path):
    """--ckpt-step N loads iteration N whatever the tracker names (as Megatron-LM; the
    resumes of tests/test_moe_exactness.py use it); a missing one is one line."""
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / checkpointing.TRACKER_FILE).write_text("2")
    with pytest.raises(SystemExit) as stop:
        checkpointing.load_checkpoint(Namespace(load=str(tmp_path), ckpt_step=5), None, None,
                                      None)
    assert str(stop.value.code) == (
        f"error: --ckpt-step 5: {tmp_path / 'iter_0000005'} does not exist (iterations "
        f"saved in --load {tmp_path}: 1, 2)")


def test_saved_parallel_sizes_come_from_the_layout_and_the_records():
    """--use-mp-args-from-checkpoint-args reads PP and TP from the layout every checkpoint
    records, EP and (since 2026-12-07) the virtual stages from their own records."""
    common = {"layout": [4, 2, 8], "expert_model_parallel_size": 2,
              "virtual_pipeline_model_parallel_size": 3}
    assert checkpointing.saved_parallel_sizes(common) == {
        "pipeline_model_parallel_size": 4, "tensor_model_parallel_size": 2,
        "expert_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 3}
    older = {"layout": [2, 1, 1]}  # before the records: EP 1, the virtual stages not known
    assert checkpointing.saved_parallel_sizes(older) == {
        "pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 1,
        "expert_model_parallel_size": 1}
    assert checkpointing.saved_parallel_sizes({"args": None}) is None  # Megatron-LM's


# command lines whose model shape a checkpoint Megatron-LM saved must give back
MEGATRON_LM_SHAPES = {
    "llama": ["--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm",
              "--position-embedding-type", "rope", "--rotary-interleaved",
              "--group-query-attention", "--num-query-groups", "2",
              "--untie-embeddings-and-output-weights"],
    "qwen": ["--add-qkv-bias", "--qk-layernorm", "--apply-layernorm-1p",
             "--position-embedding-type", "rope", "--use-rope-scaling"],
    "moe": ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0,1,1,1]",
            "--moe-shared-expert-intermediate-size", "24",
            "--moe-router-score-function", "sigmoid"],
    "mla": ["--multi-latent-attention", "--kv-lora-rank", "12", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--q-lora-rank", "16",
            "--position-embedding-type", "rope"],
    "windows": ["--position-embedding-type", "rope", "--window-size", "4,0",
                "--window-attn-skip-freq", "2", "--no-rope-freq", "2"],
}


@pytest.mark.parametrize("name", MEGATRON_LM_SHAPES)
def test_use_checkpoint_args_reads_a_checkpoint_megatron_lm_saved(name):
    """--use-checkpoint-args on a checkpoint Megatron-LM saved reads the shape from its
    saved args (Megatron-LM's dests: add_bias_linear, layernorm_zero_centered_gamma): the
    shape of the same command line parsed here. Megatron-LM's own parser (0.19's; skipped
    without it) stands in for its saved args, its derived sizes (FFN, K/V channels, query
    groups, vocabulary), which its validation fills in, taken from ours."""
    from distributed import TINY_MODEL
    from megatron_lm_parser import megatron_lm_args
    from megatron.trainer.arguments import parse_args

    argv = TINY_MODEL + ["--global-batch-size", "2", "--train-iters", "1"]
    flags = MEGATRON_LM_SHAPES[name]
    saved = megatron_lm_args(argv + flags)
    if saved is None:
        pytest.skip("Megatron-LM's parser is not installed (megatron-core < 0.19)")
    ours = parse_args(argv + flags)
    ours.padded_vocab_size = 256
    for dest in ("ffn_hidden_size", "kv_channels", "padded_vocab_size", "moe_ffn_hidden_size",
                 "virtual_pipeline_model_parallel_size"):
        if getattr(saved, dest, None) is None:
            setattr(saved, dest, getattr(ours, dest))
    saved.add_qkv_bias = saved.add_qkv_bias or saved.add_bias_linear  # its validation's rule
    plain = parse_args(argv)  # the command line of a run with --use-checkpoint-args
    plain.padded_vocab_size = 200
    assert checkpointing.saved_model_shape({"args": saved}, plain) == model_shape(ours)
    assert checkpointing.saved_parallel_sizes({"args": saved}) == {
        "pipeline_model_parallel_size": 1, "tensor_model_parallel_size": 1,
        "expert_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None}
