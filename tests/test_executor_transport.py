"""The executor's transport seam and its failure context, in one process: a toy stage
runs as rank r of a p-stage pipeline with synthetic neighbours (no process group)."""

import traceback

import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.schedules.actions import Unit, format_action, units_of
from megatron.schedules.executor import (PipelineExecutor, ScheduleSettings,
                                         SplitNotConsumedError, failure_note)
from megatron.schedules.seq1f1b import seq1f1b_rank_units
from megatron.schedules.transport import SyntheticNeighbours, Transport
from megatron.seqsplit.split_context import CONSUMERS

HIDDEN, SEQ, BATCH = 8, 12, 2


class ToyStage(torch.nn.Module):
    """One stage: the first reads tokens, the others the received activation."""

    def __init__(self):
        super().__init__()
        self.config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1,
                                        pipeline_dtype=torch.float32)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.input_tensor = None
        self.received = []  # the activations given to each forward

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self, tokens):
        if self.input_tensor is None:  # [b, l] -> [l, b, h]
            x = tokens.t().float().unsqueeze(-1).expand(-1, -1, HIDDEN)
        else:
            self.received.append(self.input_tensor)
            x = self.input_tensor
        return self.proj(x)


def forward_step(data_iterator, model, consume=True, fail_at=None):
    split = data_iterator.split
    if fail_at == (split.microbatch_id, split.split_index):
        raise RuntimeError("boom in forward_step")
    if consume:  # what the split-aware attention and RoPE report
        for part in CONSUMERS:
            split.mark_consumed(part)
    output = model(next(data_iterator)["tokens"])

    def loss(out):
        loss_sum = out.float().pow(2).sum()
        return loss_sum, torch.tensor(out[..., 0].numel()), {"loss": loss_sum.detach()}

    return output, loss


def executor(rank, pp, microbatches=3, splits=2, transport=None, observers=(), **step):
    model = ToyStage()
    batches = [{"tokens": torch.randint(0, 5, (BATCH, SEQ))} for _ in range(microbatches)]
    return PipelineExecutor(
        settings=ScheduleSettings(num_splits=splits, observers=list(observers)),
        forward_step_func=lambda data, chunk: forward_step(data, chunk, **step),
        chunks=[model], iterators=[iter(batches)], num_microbatches=microbatches,
        seq_length=SEQ, micro_batch_size=BATCH, forward_only=False,
        transport=transport or SyntheticNeighbours(rank, pp))


class UnitLog:
    def __init__(self):
        self.units = []

    def on_unit_start(self, rank, unit):
        self.units.append((rank, unit))

    def on_unit_end(self, rank, unit):
        pass


def test_synthetic_neighbours_run_rank_r_of_p_alone():
    log = UnitLog()
    ex = executor(rank=1, pp=3, observers=[log])
    assert isinstance(ex.transport, Transport)
    assert ex.run() == []  # only the last stage holds the loss
    # the shared generator's units, in order, as rank 1 of 3
    assert [u for _, u in log.units] == seq1f1b_rank_units(1, 3, 3, 2)
    assert {r for r, _ in log.units} == {1}
    # every forward got an activation of its split's shape that backward can reach
    model = ex.chunks[0]
    assert [tuple(x.shape) for x in model.received] == [(SEQ // 2, BATCH, HIDDEN)] * 6
    assert all(x.requires_grad and x.dtype == torch.float32 for x in model.received)
    assert all(x.grad is not None for x in model.received)
    assert model.proj.weight.grad is not None


def test_last_stage_reports_one_loss_per_microbatch():
    reports = executor(rank=2, pp=3).run()
    assert len(reports) == 3 and all(set(r) == {"loss"} for r in reports)


def test_synthetic_neighbours_time_nothing():
    names = []

    class Timers:
        def __call__(self, name, log_level=None):
            names.append(name)
            return self

        def start(self, barrier=False):
            pass

        def stop(self, barrier=False):
            pass

    ex = executor(rank=0, pp=2)
    ex.config.timers = Timers()
    ex.run()
    assert names and set(names) == {"backward-compute"}  # megatron-core's backward_step


def test_synthetic_neighbours_refuse_attention_exchanges():
    with pytest.raises(NotImplementedError, match="attention exchange"):
        SyntheticNeighbours(0, 2).global_rank(1)
    with pytest.raises(ValueError, match="rank 2 is not a stage of a 2-stage pipeline"):
        SyntheticNeighbours(2, 2)


def test_failing_forward_names_rank_action_and_program():
    ex = executor(rank=1, pp=2, fail_at=(1, 0))
    with pytest.raises(RuntimeError, match="boom in forward_step") as info:
        ex.run()
    error = info.value
    index = ex.program.index(Unit("F", 1, 0))
    (note,) = error.__notes__
    before = " ".join(format_action(a) for a in ex.program[index - 3:index])
    after = " ".join(format_action(a) for a in ex.program[index + 1:index + 4])
    assert note == (f"pipeline rank 1 of 2 failed at action {index} of {len(ex.program)} "
                    f"(F1.0): ... {before} >> F1.0 << {after} ...")
    # the original traceback is kept: it ends in forward_step, and printing shows the note
    printed = "".join(traceback.format_exception(error))
    assert "in forward_step" in printed and ">> F1.0 <<" in printed


def test_failing_batch_is_marked_in_its_printed_form():
    class LosingNeighbours(SyntheticNeighbours):
        def exchange(self, batch, tensors):
            if any(m.kind == "recv" and not m.unit.is_forward for m in batch):
                raise ConnectionError("peer gone")
            super().exchange(batch, tensors)

    ex = executor(rank=0, pp=2, transport=LosingNeighbours(0, 2))
    with pytest.raises(ConnectionError, match="peer gone") as info:
        ex.run()
    (note,) = info.value.__notes__
    index = next(i for i, a in enumerate(ex.program) if not isinstance(a, Unit)
                 and any(m.kind == "recv" and not m.unit.is_forward for m in a))
    assert f"pipeline rank 0 of 2 failed at action {index} " in note
    assert f">> {format_action(ex.program[index])} <<" in note
    assert format_action(ex.program[index]).startswith("[")


def test_split_not_consumed_keeps_its_message():
    ex = executor(rank=0, pp=2, consume=False)
    with pytest.raises(SplitNotConsumedError, match="returned without the split reaching") as info:
        ex.run()
    assert info.value.__notes__ == [failure_note(ex.program, 0, 0, 2)]
    assert info.value.__notes__[0].startswith("pipeline rank 0 of 2 failed at action 0 of ")


def test_failure_note_at_the_program_edges():
    program = [Unit("F", 0), Unit("B", 0)]
    assert failure_note(program, 0, 0, 1) == "pipeline rank 0 of 1 failed at action 0 of 2 " \
                                            "(F0.0): >> F0.0 << B0.0"
    assert units_of(program) == program
