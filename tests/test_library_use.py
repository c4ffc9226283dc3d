"""Library use of `megatron.schedules` (`get_forward_backward_func`,
`forward_backward_pipelining_seq1f1b`) is safe.

* megatron-core's positional call `get_forward_backward_func(pp_size, vp_size)` works and
  returns what megatron-core returns;
* `forward_backward_pipelining_seq1f1b` takes megatron-core's schedule arguments, and
  with the split settings on the model config (no `settings`) trains exactly;
* with splits (Seq1F1B or SlimPipe), a stock megatron-core `GPTModel` (local spec) and a
  plain `forward_step`, or our model with a `forward_step` that leaves the split out, are
  refused at the first unit, before any backward, with one message naming what to use;
* the docstring's `forward_step` and loss function with `SeqSplitGPTModel` train: 4
  splits give the unsplit losses and gradients.

The distributed part runs in one child process (gloo, world size 1), so this pytest
process keeps no process group and no CPU patches.
"""

import functools
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.core.pipeline_parallel import schedules as mcore_schedules  # noqa: E402

from megatron.schedules import dispatch  # noqa: E402
from megatron.schedules import forward_backward_pipelining_seq1f1b  # noqa: E402

SEQ, MBS, SPLITS, MICROBATCHES, VOCAB = 16, 2, 4, 2, 64
pytestmark = pytest.mark.distributed  # the library run is a child process


def test_signature_starts_as_megatron_cores():
    ours = list(inspect.signature(dispatch.get_forward_backward_func).parameters)
    theirs = list(inspect.signature(mcore_schedules.get_forward_backward_func).parameters)
    assert ours[:len(theirs)] == theirs


@pytest.mark.parametrize("pp, vp", [(1, None), (2, None), (4, None), (2, 1)])
def test_positional_call_is_megatron_cores(pp, vp):
    expected = mcore_schedules.get_forward_backward_func(pp, vp)
    assert dispatch.get_forward_backward_func(pp, vp) is expected
    assert dispatch.get_forward_backward_func(pp_size=pp, vp_size=vp) is expected


def test_seq1f1b_takes_megatron_cores_schedule_arguments():
    """The same keyword arguments, defaults and order as megatron-core's
    `forward_backward_pipelining_without_interleaving`, plus the optional `settings`."""
    ours = inspect.signature(forward_backward_pipelining_seq1f1b).parameters
    theirs = inspect.signature(
        mcore_schedules.forward_backward_pipelining_without_interleaving).parameters
    assert [n for n in ours if n != "settings"] == list(theirs)
    for name, parameter in theirs.items():
        assert ours[name].default == parameter.default, name
        assert ours[name].kind == parameter.kind, name
    assert ours["settings"].default is None


def _is_our_executor(func, splits):
    return (isinstance(func, functools.partial)
            and func.func is forward_backward_pipelining_seq1f1b
            and func.keywords["settings"].num_splits == splits)


def test_positional_call_with_splits_or_virtual_stages_runs_our_executor():
    assert _is_our_executor(dispatch.get_forward_backward_func(2, 2), 1)
    assert _is_our_executor(dispatch.get_forward_backward_func(2, None, seq1f1b_splits=4), 4)


# --- the child process ------------------------------------------------------------------

def _setup():
    import datetime

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron import cpu_support

    cpu_support.apply()
    # an in-process store: no port to pick (one picked free can be taken by the tests
    # running beside before it is bound)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1,
                                         timeout=datetime.timedelta(minutes=2))
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False)


def _batches():
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": torch.ones(MBS, SEQ),
                    "position_ids": torch.arange(SEQ).expand(MBS, SEQ)})
    return out


# the docstring's loss function and forward_step (dispatch.get_forward_backward_func)
def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    reported = torch.stack([loss_sum.detach(), loss_mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": reported}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], None,
                          labels=batch["labels"],
                          packed_seq_params=getattr(data_iterator, "split", None))
    return output_tensor, functools.partial(loss_func, batch["loss_mask"])


def plain_forward_step(data_iterator, model, calls):
    """megatron-core's usual forward_step: no split in sight."""
    calls.append(1)
    batch = next(data_iterator)
    output_tensor = model(batch["tokens"], batch["position_ids"], None,
                          labels=batch["labels"])
    return output_tensor, functools.partial(loss_func, batch["loss_mask"])


def _stock_model(config, rope=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(1)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ)


def _our_model(config):
    from megatron.seqsplit.model import SeqSplitGPTModel, split_aware_local_spec

    torch.manual_seed(1)
    return SeqSplitGPTModel(config=config,
                            transformer_layer_spec=split_aware_local_spec(config),
                            vocab_size=VOCAB, max_sequence_length=SEQ,
                            position_embedding_type="rope")


def _train_once(func, step, model):
    model.zero_grad(set_to_none=True)
    reports = func(forward_step_func=step, data_iterator=iter(_batches()), model=model,
                   num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
    loss = sum(r["lm loss"][0] for r in reports) / sum(r["lm loss"][1] for r in reports)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return float(loss), grads


def _refusal(func, step, model, calls):
    try:
        func(forward_step_func=step, data_iterator=iter(_batches()), model=model,
             num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
    except Exception as error:  # noqa: BLE001 - the test checks the type
        return {"type": type(error).__name__, "message": str(error), "calls": len(calls),
                "grads": sum(p.grad is not None for p in model.parameters())}
    return {"type": None, "calls": len(calls)}


def child(out_path):
    _setup()
    from megatron.schedules.dispatch import get_forward_backward_func

    config = _config()
    split_func = get_forward_backward_func(seq1f1b_splits=SPLITS)
    result = {"fallback_is_no_pipelining": get_forward_backward_func()
              is mcore_schedules.forward_backward_no_pipelining}

    calls = []
    result["stock"] = _refusal(split_func, functools.partial(plain_forward_step, calls=calls),
                               _stock_model(config), calls)
    calls = []
    slimpipe = get_forward_backward_func(schedule="slimpipe", slimpipe_slices=SPLITS)
    result["stock_slimpipe"] = _refusal(
        slimpipe, functools.partial(plain_forward_step, calls=calls), _stock_model(config), calls)
    calls = []
    result["split_left_out"] = _refusal(
        split_func, functools.partial(plain_forward_step, calls=calls), _our_model(config),
        calls)

    # the stock model unsplit, through the positional call: megatron-core's schedule
    loss, _ = _train_once(get_forward_backward_func(1, None), forward_step, _stock_model(config))
    result["stock_unsplit_loss"] = loss

    model = _our_model(config)
    unsplit_loss, unsplit = _train_once(get_forward_backward_func(1, None), forward_step, model)
    split_loss, split = _train_once(split_func, forward_step, model)
    result["ours"] = {
        "unsplit_loss": unsplit_loss, "split_loss": split_loss,
        "max_grad_diff": max(float((split[n] - unsplit[n]).abs().max()) for n in unsplit),
        "max_grad": max(float(unsplit[n].abs().max()) for n in unsplit)}

    # megatron-core's call of the schedule itself, the splits read from the model config
    from megatron.schedules import forward_backward_pipelining_seq1f1b as seq1f1b

    config.seq1f1b_splits = SPLITS
    config_loss, from_config = _train_once(seq1f1b, forward_step, model)
    result["from_config"] = {
        "split_loss": config_loss,
        "max_grad_diff": max(float((from_config[n] - unsplit[n]).abs().max()) for n in unsplit)}
    with open(out_path, "w") as handle:
        json.dump(result, handle)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def library_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("library") / "out.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _assert_refused_at_first_unit(refusal):
    assert refusal["type"] == "SplitNotConsumedError", refusal
    assert refusal["calls"] == 1  # the first forward unit, nothing after it
    assert refusal["grads"] == 0  # no backward ran
    message = refusal["message"]
    for needed in ("unit F0.0", "wrong gradients", "SeqSplitGPTModel",
                   "split_aware_local_spec", "packed_seq_params=data_iterator.split",
                   "get_forward_backward_func's docstring"):
        assert needed in message, (needed, message)


@pytest.mark.parametrize("schedule", ["stock", "stock_slimpipe"])
def test_stock_gpt_model_with_splits_is_refused_at_the_first_unit(library_run, schedule):
    _assert_refused_at_first_unit(library_run[schedule])
    assert "attention and positions" in library_run[schedule]["message"]


def test_forward_step_leaving_the_split_out_is_refused(library_run):
    _assert_refused_at_first_unit(library_run["split_left_out"])


def test_stock_gpt_model_unsplit_still_trains(library_run):
    assert library_run["fallback_is_no_pipelining"]
    assert 3.0 < library_run["stock_unsplit_loss"] < 6.0  # ~ln(64) at initialisation


def test_docstring_forward_step_with_our_model_is_exact(library_run):
    ours = library_run["ours"]
    assert abs(ours["split_loss"] - ours["unsplit_loss"]) <= 1e-5 * ours["unsplit_loss"]
    assert ours["max_grad"] > 0
    assert ours["max_grad_diff"] <= 1e-5 * ours["max_grad"], ours


def test_seq1f1b_with_splits_from_the_model_config_is_exact(library_run):
    ours, from_config = library_run["ours"], library_run["from_config"]
    assert abs(from_config["split_loss"] - ours["unsplit_loss"]) <= 1e-5 * ours["unsplit_loss"]
    assert from_config["max_grad_diff"] <= 1e-5 * ours["max_grad"], from_config


if __name__ == "__main__":
    child(sys.argv[1])
