"""--sft (Megatron-LM's supervised fine-tuning data): the SFTTokenizer's prompt formats and
their loss masks, the chat template rendered as transformers renders it, the packing of a
record's conversations into a sample (positions, document ids, context-parallel padding,
the cut of a long record, counted), the conversation files' checks, the flags, and
training: at pp 2 with Seq1F1B splits, and with data or context parallelism, a run equals
one process, validation included (averaged per microbatch, as Megatron-LM's --sft).

The packing was also checked against Megatron-LM's own SFTDataset and SFTTokenizer
(megatron-core 0.19.2 with transformers 5.25 installed by hand, which this project does
not depend on): 288 samples of 12 records, the four prompt formats, 3 sequence lengths and
CP 1 and 2, tokens, loss masks, trained labels, positions and conversation boundaries
equal (docs/megatron_lm.md).
"""

import json

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer

from distributed import (TINY_MODEL, TINY_MODEL_WITHOUT_DATA, argument_problems,
                         assert_close_series, init_run)
from megatron.dataprep.sft_dataset import (ConversationFile, ConversationFileError,
                                           pack_conversations)
from megatron.dataprep.sft_tokenizer import IGNORE_INDEX, SFTTokenizer, conversations_of
from megatron.dataprep.tokenizer import TokenizerError, build_tokenizer
from test_dataprep_fixtures import gpt2_files, write_jsonl  # noqa: F401

SPECIALS = ["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>", "<unk>"]
# a template using what transformers gives templates: loop controls, a generation block,
# tojson, raise_exception, and eos_token (an ordinary vocabulary entry in tokenizer.json)
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
            "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
            "{% if m['role'] == 'assistant' %}{% generation %}<a>{{ m['content'] }}"
            "{% endgeneration %}{% else %}{{ m['role'] | tojson }}:{{ m['content'] }}{% endif %}"
            "{{ eos_token }}{% endfor %}")


def _tokenizer_dir(directory, gpt2_files, specials=SPECIALS, template=TEMPLATE):
    hf = build_tokenizer("GPT2BPETokenizer", *gpt2_files)._hf
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    hf.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "unk_token": "<unk>"}
    if template:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, gpt2_files):  # noqa: F811
    return _tokenizer_dir(tmp_path_factory.mktemp("sft_tokenizer"), gpt2_files)


CONVERSATION = [
    {"role": "system", "content": " Be brief. "},
    {"role": "user", "content": "print a list /think"},
    {"role": "assistant", "content": " print(x) "},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "done"},
]


def _trained_text(tokenizer, conversation):
    tokens, targets = tokenizer.tokenize_conversation(conversation)
    assert len(tokens) == len(targets)
    assert np.array_equal(targets[targets != IGNORE_INDEX], tokens[targets != IGNORE_INDEX])
    return tokenizer.detokenize(tokens), tokenizer.detokenize(
        [t for t in targets if t != IGNORE_INDEX])


# ---- prompt formats ------------------------------------------------------------------------

def test_nemotron_h_aligned_trains_on_the_assistant_turns(tokenizer_dir):
    tokenizer = SFTTokenizer(tokenizer_dir, "nemotron-h-aligned")
    text, trained = _trained_text(tokenizer, CONVERSATION)
    assert text == ("<SPECIAL_10>System\nBe brief.\n<SPECIAL_11>User\nprint a list /think\n"
                    "<SPECIAL_11>Assistant\nprint(x)\ndone\n")
    assert trained == "print(x)\ndone\n"
    assert tokenizer.pad == tokenizer.token_id("<SPECIAL_233>")


def test_nemotron_nano_v2_drops_thinking_switches_and_masks_the_assistant_prefix(
        tokenizer_dir):
    tokenizer = SFTTokenizer(tokenizer_dir, "nemotron-nano-v2")
    text, trained = _trained_text(tokenizer, CONVERSATION)
    assert text == ("<SPECIAL_10>System\nBe brief.\n<SPECIAL_11>User\nprint a list\n"
                    "<SPECIAL_11>Assistant\nprint(x)\n<SPECIAL_12>\n"
                    "<SPECIAL_11>Assistant\ndone\n<SPECIAL_12>\n")
    # the first 3 tokens of each assistant turn are not trained on (Megatron-LM's
    # assistant_prefix_len for this format)
    tokens, targets = tokenizer.tokenize_conversation(CONVERSATION[1:3])
    user = len(tokenizer.tokenize_conversation(CONVERSATION[1:2])[0])
    assert (targets[:user + 3] == IGNORE_INDEX).all() and (targets[user + 3:] >= 0).all()
    assert tokenizer.pad == tokenizer.token_id("<unk>")
    assert trained.endswith("done\n<SPECIAL_12>\n")


def test_identity_and_default_train_on_every_token(tokenizer_dir):
    identity = SFTTokenizer(tokenizer_dir, "identity")
    assert _trained_text(identity, CONVERSATION) == (" Be brief. print a list /think print(x) "
                                                     "okdone",) * 2
    default = SFTTokenizer(tokenizer_dir, "default")
    text, trained = _trained_text(default, CONVERSATION)
    assert text == trained == ('"system": Be brief. <|endoftext|>"user":print a list /think'
                               '<|endoftext|><a> print(x) <|endoftext|><a>done<|endoftext|>')
    # eos_token is one token in the rendered text, as transformers makes it on loading
    # (tokenizer.json has it as an ordinary vocabulary entry)
    tokens, _ = default.tokenize_conversation(CONVERSATION[:1])
    assert tokens[-1] == default.eod and default.pad == default.eod  # no pad_token: EOS


# A ChatML template in the style of Qwen's (a default system turn, a namespace, loop
# variables, string methods, whitespace control, tool turns merged into one user turn)
CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant") %}
        {%- set ns.turns = ns.turns + 1 %}
        {%- if message.role == "assistant" and '</think>' in message.content %}
            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def test_a_chatml_template_renders_as_transformers_renders_it(tmp_path, gpt2_files):  # noqa: F811
    """The text below is what transformers 5.25's apply_chat_template rendered for this
    template (checked by hand; Megatron-LM's SFTTokenizer gave the same tokens)."""
    directory = tmp_path / "chatml"
    directory.mkdir()
    _tokenizer_dir(directory, gpt2_files, specials=["<|im_start|>", "<|im_end|>"],
                   template=CHATML_TEMPLATE)
    tokenizer = SFTTokenizer(str(directory), "default")
    conversation = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhmm</think>\n\nanswer"},
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
        {"role": "tool", "content": "t1"}, {"role": "tool", "content": "t2"}]
    assert tokenizer.render(conversation) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nq"
        "<|im_end|>\n<|im_start|>assistant\nanswer<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
        "<|im_start|>assistant\ny<|im_end|>\n<|im_start|>user\n<tool_response>\nt1\n"
        "</tool_response>\n<tool_response>\nt2\n</tool_response><|im_end|>\n")
    tokens, targets = tokenizer.tokenize_conversation(conversation)
    assert np.array_equal(tokens, targets)  # the default format trains on every token
    assert tokens[0] == tokenizer.token_id("<|im_start|>") != tokens[1]


def test_template_errors_and_missing_tokens_are_clear(tmp_path, tokenizer_dir,
                                                      gpt2_files):  # noqa: F811
    with pytest.raises(Exception, match="bad role narrator"):
        SFTTokenizer(tokenizer_dir, "default").tokenize_conversation(
            [{"role": "narrator", "content": "x"}])
    plain = tmp_path / "plain"
    plain.mkdir()
    _tokenizer_dir(plain, gpt2_files, specials=[], template=None)
    with pytest.raises(TokenizerError, match="prompt-format nemotron-h-aligned pads with "
                                             "<SPECIAL_233>, which .* does not hold"):
        SFTTokenizer(str(plain), "nemotron-h-aligned")
    with pytest.raises(TokenizerError, match="tokenizer_config.json has no chat_template"):
        SFTTokenizer(str(plain), "default")
    broken = tmp_path / "broken"
    broken.mkdir()
    _tokenizer_dir(broken, gpt2_files, template="{% for m in messages %}")
    with pytest.raises(TokenizerError, match="not a valid Jinja template"):
        SFTTokenizer(str(broken), "default")


def test_conversations_start_at_each_system_message():
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}
    assert conversations_of([user, system, user, system, system]) == [
        [user], [system, user], [system], [system]]


# ---- packing ------------------------------------------------------------------------------

PAD = 99


def _piece(tokens, trained_from=0):
    tokens = np.asarray(tokens)
    targets = tokens.copy()
    targets[:trained_from] = IGNORE_INDEX
    return tokens, targets


def test_packing_restarts_positions_and_pads_the_last_conversation():
    sample, cut, left_out = pack_conversations(
        [_piece([1, 2, 3], trained_from=1), _piece([4, 5], trained_from=1)], 8, PAD)
    assert (cut, left_out) == (0, 0)
    assert sample["tokens"].tolist() == [1, 2, 3, 4, 5, PAD, PAD, PAD]
    assert sample["labels"].tolist() == [2, 3, 4, 5, PAD, PAD, PAD, PAD]
    # trained: targets kept by the format, never padding; a masked label is still the
    # next token (5 -> label 4 is the next conversation's masked first token)
    assert sample["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    assert sample["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_context_parallel_pads_each_conversation_to_twice_cp():
    sample, _, _ = pack_conversations([_piece([1, 2, 3]), _piece([4, 5])], 12, PAD,
                                      context_parallel=2)
    assert sample["tokens"].tolist() == [1, 2, 3, PAD, 4, 5, PAD, PAD, PAD, PAD, PAD, PAD]
    assert sample["document_ids"].tolist() == [0] * 4 + [1] * 8
    assert sample["position_ids"].tolist() == [0, 1, 2, 3] + list(range(8))
    assert sample["loss_mask"].tolist() == [1, 1, 0, 1, 1] + [0] * 7


def test_a_long_record_is_cut_and_its_later_conversations_counted():
    sample, cut, left_out = pack_conversations(
        [_piece([1, 2, 3]), _piece([4, 5, 6, 7, 8]), _piece([9]), _piece([10])], 6, PAD)
    assert (cut, left_out) == (1, 2)
    assert sample["tokens"].tolist() == [1, 2, 3, 4, 5, 6]
    assert sample["labels"].tolist() == [2, 3, 4, 5, 6, PAD]  # the cut's last label: pad
    assert sample["loss_mask"].tolist() == [1, 1, 1, 1, 1, 0]
    assert sample["document_ids"].tolist() == [0, 0, 0, 1, 1, 1]


def test_a_target_equal_to_the_pad_id_is_not_trained_on():
    # as Megatron-LM: the loss mask drops every label equal to the pad id
    sample, _, _ = pack_conversations([_piece([1, PAD, 3, 4])], 4, PAD)
    assert sample["loss_mask"].tolist() == [0, 1, 1, 0]


# ---- conversation files -------------------------------------------------------------------

def _messages(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


GOOD = _messages(("system", "s"), ("user", "hi"), ("assistant", "hello"))


@pytest.mark.parametrize("line, message", [
    (b"{not json", "line 3: not JSON"),
    (json.dumps({"text": "x"}).encode(), "line 3: not an SFT record"),
    (json.dumps(_messages(("narrator", "x"))).encode(), "line 3: message 0 is .* needs a role"),
    (json.dumps(_messages(("system", "s"), ("assistant", "a"))).encode(),
     "line 3: message 1 is an assistant turn after a system turn"),
    (json.dumps(_messages(("user", "u"), ("assistant", ""))).encode(),
     "line 3: message 1 is an empty assistant turn"),
])
def test_a_bad_line_is_named_before_training(tmp_path, line, message):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, b"", line, GOOD])
    with pytest.raises(ConversationFileError, match=f"{path} {message}"):
        ConversationFile(path)


def test_records_are_read_by_line_and_blank_lines_counted(tmp_path, capsys):
    other = _messages(("user", "u"), ("assistant", "a"))
    path = write_jsonl(tmp_path / "chat.jsonl", [b"", GOOD, b"  ", other])
    records = ConversationFile(path)
    assert (len(records), records.blank_lines) == (2, 2)
    assert f"note: --sft: {path}: 2 blank line(s) skipped" in capsys.readouterr().out
    assert records[1] == other["messages"] and records[0] == GOOD["messages"]
    assert [records.line_of(0), records.line_of(1)] == [2, 4]


# ---- the flags and the trainer's datasets -------------------------------------------------

def _chat_records(count=24, seed=5):
    """Records of 1-3 conversations, each a system message and 1-3 exchanges."""
    rng = np.random.default_rng(seed)
    words = "list sort key value map file path read write open loop index error".split()

    def text(low, high):
        return " ".join(rng.choice(words, int(rng.integers(low, high))))

    records = []
    for _ in range(count):
        turns = []
        for _ in range(int(rng.integers(1, 4))):
            turns.append(("system", text(1, 4)))
            for _ in range(int(rng.integers(1, 4))):
                turns += [("user", text(2, 12)), ("assistant", text(1, 16))]
        records.append(_messages(*turns))
    return records


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("sft_data") / "chat.jsonl", _chat_records())


def _sft_model(tokenizer_dir, chat_file, *flags, seq_length=64):
    model = list(TINY_MODEL_WITHOUT_DATA)
    model[model.index("--seq-length") + 1] = str(seq_length)
    model[model.index("--max-position-embeddings") + 1] = str(seq_length)
    return model + [
        "--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tokenizer_dir,
        "--data-path", chat_file, "--split", "100,0,0", "--global-batch-size", "4",
        "--micro-batch-size", "1", "--train-iters", "2"] + list(flags)


def test_trainer_samples_are_the_records_in_file_order(tokenizer_dir, chat_file, capsys):
    from megatron.trainer.arguments import parse_args
    from megatron.trainer.gpt import datasets_provider

    args = parse_args(_sft_model(tokenizer_dir, chat_file, "--split", "80,20,0",
                                 "--eval-iters", "1"))
    assert args.reset_attention_mask and args.transformer_impl == "local"
    train, valid, test, tokenizer = datasets_provider(args)
    assert test is None and tokenizer.prompt_format == "nemotron-h-aligned"
    records = ConversationFile(chat_file)
    cut = 0
    for dataset, first in ((train, 0), (valid, 19)):  # 80% of 24 records: 0-18 train
        for i in range(6):
            record = first + i % (19 if first == 0 else 5)
            pieces = [tokenizer.tokenize_conversation(c)
                      for c in conversations_of(records[record])]
            expected, was_cut, _ = pack_conversations(pieces, 64, tokenizer.pad)
            cut += was_cut
            sample = dataset[i]
            assert sorted(sample) == sorted(expected)
            for key in expected:
                assert torch.equal(torch.as_tensor(sample[key]), expected[key]), (i, key)
    # some records are longer than 64 tokens: rank 0 says so, with counts
    assert cut
    assert "is longer than --seq-length 64 + 1 tokens and was cut" in capsys.readouterr().out


def test_per_split_paths_read_their_files_whole(tokenizer_dir, chat_file, tmp_path):
    """--train-data-path / --valid-data-path name conversation files, each read whole."""
    from megatron.trainer.arguments import parse_args
    from megatron.trainer.gpt import datasets_provider

    valid_file = write_jsonl(tmp_path / "valid.jsonl", _chat_records(count=3, seed=9))
    argv = _sft_model(tokenizer_dir, chat_file, "--eval-iters", "1")
    argv = argv[:argv.index("--data-path")] + argv[argv.index("--data-path") + 2:]
    argv = [a for a in argv if a not in ("--split", "100,0,0")]
    args = parse_args(argv + ["--train-data-path", chat_file, "--valid-data-path", valid_file])
    train, valid, _, tokenizer = datasets_provider(args)
    valid_records = ConversationFile(valid_file)
    for i in range(4):  # the 3 records, then the first again
        pieces = [tokenizer.tokenize_conversation(c)
                  for c in conversations_of(valid_records[i % 3])]
        expected, _, _ = pack_conversations(pieces, 64, tokenizer.pad)
        assert torch.equal(valid[i]["tokens"], expected["tokens"]), i
    assert torch.equal(train[23]["tokens"], pack_conversations(
        [tokenizer.tokenize_conversation(c) for c in conversations_of(
            ConversationFile(chat_file)[23])], 64, tokenizer.pad)[0]["tokens"])


def test_sft_flags_problems_name_the_flag(tokenizer_dir, chat_file, tmp_path):
    problems, _ = argument_problems(TINY_MODEL + ["--global-batch-size", "2", "--sft",
                                          "--reset-position-ids", "--fim-data"])
    assert ("--sft needs --tokenizer-type SFTTokenizer (a Hugging Face tokenizer directory "
            "in --tokenizer-model), got NullTokenizer") in problems
    for flag in ("--mock-data", "--fim-data", "--reset-position-ids"):
        assert any(p.startswith(f"--sft with {flag} is not supported") for p in problems), flag
    # the format's pad token is checked with the flags
    problems, _ = argument_problems(_sft_model(tokenizer_dir, chat_file,
                                               "--sft-tokenizer-prompt-format", "default"))
    assert problems == []
    problems, _ = argument_problems(_sft_model(tokenizer_dir, str(tmp_path / "none.jsonl")))
    assert any(f"--data-path: {tmp_path}/none.jsonl not found" in p for p in problems)
    problems, args = argument_problems(_sft_model(tokenizer_dir, chat_file, "--eod-mask-loss"))
    assert problems == [] and any(n.startswith("note: --eod-mask-loss has no effect with --sft")
                                  for n in args.flag_notes)
    problems, args = argument_problems(TINY_MODEL + [
        "--global-batch-size", "2", "--train-iters", "1", "--sft-tokenizer-prompt-format",
        "identity"])
    assert "note: --sft-tokenizer-prompt-format has no effect without --tokenizer-type " \
           "SFTTokenizer (as in Megatron-LM)" in args.flag_notes


def test_preprocess_refuses_the_sft_tokenizer(tokenizer_dir, tmp_path, capsys):
    from test_dataprep_fixtures import run_preprocess

    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    code = run_preprocess("--input", source, "--output-prefix", tmp_path / "out",
                          "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tokenizer_dir)
    assert code != 0
    assert "SFT data is not preprocessed" in capsys.readouterr().err


def test_sft_validation_averages_each_microbatch(monkeypatch):
    """--sft's validation loss is the mean of the microbatches' own token averages
    (Megatron-LM's), other losses are token averages; one process, gloo."""
    from megatron.core import parallel_state

    from megatron.trainer.training import reduce_losses

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        reports = [{"lm loss": torch.tensor([6.0, 2.0])}, {"lm loss": torch.tensor([1.0, 4.0])},
                   {"lm loss": torch.tensor([0.0, 0.0])}]
        assert reduce_losses(reports)["lm loss"] == pytest.approx(7.0 / 6.0)
        assert reduce_losses(reports, per_microbatch=True)["lm loss"] == pytest.approx(
            (3.0 + 0.25 + 0.0) / 3)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


# ---- training -----------------------------------------------------------------------------

def plan(tmp, corpus):
    """The training runs, in the exactness suites' shared launches (tests/conftest.py):
    one process, pp 2 with Seq1F1B splits (both balance methods), dp 2, and cp 2 with
    splits, from one set of weights, validating at iteration 2."""
    from distributed import Plan
    from megatron.dataprep.train_bpe import train_gpt2_bpe
    from test_dataprep_fixtures import TRAINING_TEXT

    (tmp / "bpe").mkdir()
    (tmp / "tokenizer").mkdir()
    tokenizer = _tokenizer_dir(tmp / "tokenizer",
                               train_gpt2_bpe(TRAINING_TEXT, 300, str(tmp / "bpe")))
    chat = write_jsonl(tmp / "chat.jsonl", _chat_records())

    def model(*flags):
        return _sft_model(tokenizer, chat, "--split", "80,20,0", "--eval-iters", "2",
                          "--eval-interval", "2", "--train-iters", "3",
                          "--position-embedding-type", "rope", *flags)

    init, start = init_run("init", tmp / "init", model())
    return Plan([init], {
        1: [{"name": "one", "argv": model() + start}],
        2: [{"name": "pp2_s4_average", "argv": model(
                "--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "4") + start},
            {"name": "pp2_s3_uniform_comp", "argv": model(
                "--pipeline-model-parallel-size", "2", "--seq1f1b-splits", "3",
                "--seq1f1b-balance-method", "uniform_comp") + start},
            {"name": "dp2", "argv": model() + start},
            {"name": "cp2_s2", "argv": model("--context-parallel-size", "2",
                                             "--seq1f1b-splits", "2") + start}]})


@pytest.mark.distributed
def test_split_and_parallel_sft_runs_equal_one_process(exactness_runs):
    """The training losses, grad norms and validation losses (per microbatch) of every
    layout in `plan` equal one process's."""
    runs = exactness_runs[__name__]
    one = runs["one"]
    assert len(one["losses"]) == 3 and len(one["validation_losses"]) == 1
    for name in ("pp2_s4_average", "pp2_s3_uniform_comp", "dp2", "cp2_s2"):
        assert_close_series(runs[name]["losses"], one["losses"], 1e-5, name)
        assert_close_series(runs[name]["validation_losses"], one["validation_losses"], 1e-5,
                            name)
        assert_close_series(runs[name]["grad_norms"], one["grad_norms"], 1e-4, name)


def _merging_tokenizer(directory):
    """Characters, plus one merge ("\\n" + "p") that crosses the boundary between a
    nemotron user turn (ending "Assistant\\n") and an assistant turn starting with p."""
    from tokenizers import models

    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,\n()_"))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["\np"] = len(vocab)
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[("\n", "p")]))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in SPECIALS + ["<eos>"]])
    hf.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return str(directory)


@pytest.mark.distributed
@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_record_that_cannot_be_masked_by_turn_stops_the_run_naming_it(tmp_path, workers):
    from distributed import pretrain

    tokenizer = _merging_tokenizer(tmp_path)
    fine = _messages(("user", "hi"), ("assistant", "x"))
    chat = write_jsonl(tmp_path / "chat.jsonl", [fine] * 3 + [
        _messages(("user", "hi"), ("assistant", "print"))] + [fine] * 4)
    run = pretrain(_sft_model(tokenizer, chat, "--num-workers", workers, "--train-iters", "3",
                              "--global-batch-size", "2", seq_length=32))
    assert run.returncode == 1, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {chat} line 4: turn 0 (user) tokenizes differently alone than "
                      "inside its conversation (the tokenizer merges across the turn "
                      "boundary), so its tokens cannot be masked by turn"], run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert " iteration        1/       3 " in run.stdout  # the record is sample 3


# ---- tools/check_sft_data.py --------------------------------------------------------------

def test_check_sft_data_reports_cuts_and_the_records_that_would_stop_training(
        tmp_path, tokenizer_dir, chat_file, capsys):
    from megatron.dataprep.sft_survey import main

    assert main(["--tokenizer-model", tokenizer_dir, "--seq-length", "256", chat_file]) == 0
    out = capsys.readouterr().out
    tokenizer = SFTTokenizer(tokenizer_dir, "nemotron-h-aligned")
    records = ConversationFile(chat_file)
    packed = [pack_conversations([tokenizer.tokenize_conversation(c)
                                  for c in conversations_of(records[i])], 256, tokenizer.pad)
              for i in range(len(records))]
    cut = sum(was_cut for _, was_cut, _ in packed)
    left_out = sum(n for _, _, n in packed)
    assert f"{chat_file}: 24 records (0 blank lines skipped)" in out
    assert (f"at --seq-length 256: {cut} records cut on the right ({100 * cut / 24:.1f}%), "
            f"{left_out} conversations left out after a cut") in out
    assert 0 < cut < 24
    # a tokenizer that merges across a turn boundary: the records that would stop a run
    merging = tmp_path / "merging"
    merging.mkdir()
    fine = _messages(("user", "hi"), ("assistant", "x"))
    chat = write_jsonl(tmp_path / "chat.jsonl", [fine, _messages(
        ("system", "s"), ("user", "hi"), ("assistant", "x"), ("system", "t"), ("user", "hi"),
        ("assistant", "print")), fine])
    assert main(["--tokenizer-model", _merging_tokenizer(merging), "--seq-length", "32",
                 chat]) == 1
    out = capsys.readouterr().out
    assert ("1 records cannot be tokenized in this prompt format (training stops at the "
            "first one it reads):\n    line 2: conversation 1, turn 1 (user) tokenizes "
            "differently alone") in out
    assert main(["--tokenizer-model", tokenizer_dir, "--seq-length", "32",
                 str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.distributed
def test_a_bad_line_stops_the_run_before_training_in_one_line(tmp_path, tokenizer_dir):
    """Every rank indexes the files alike: an agreed stop, one line naming file and line,
    exit 2, no iteration trained."""
    from distributed import pretrain

    fine = _messages(("user", "hi"), ("assistant", "x"))
    chat = write_jsonl(tmp_path / "chat.jsonl", [fine, fine, _messages(
        ("system", "s"), ("assistant", "a")), fine])
    run = pretrain(_sft_model(tokenizer_dir, chat, seq_length=32))
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {chat} line 3: message 1 is an assistant turn after a system "
                      "turn; an assistant answers a user or tool turn"], run.stderr[-3000:]
    assert "Traceback" not in run.stderr and " iteration " not in run.stdout
