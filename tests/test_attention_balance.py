"""The attention-redistribution plan (`megatron.schedules.attention_balance`), no processes.

For a grid of SlimPipe shapes: pairs are symmetric and well formed, paired units start
together in the plan's timeline, the timeline respects every dependency, the lowered
programs run under blocking rendezvous with the pairs as rendezvous (no deadlock), and
the cost model's iteration is never longer than without pairing. The rendezvous check
itself is shown to catch a pairing that cannot run. The kernel pieces the runtime uses
(partials placed after their keys, merged by log-sum-exp) equal one attention call in
float64.
"""

import itertools

import pytest
import torch

from megatron.schedules.simulate import ScheduleDeadlock, ScheduleError, dependencies, simulate
from megatron.schedules.attention_balance import (
    ASK,
    HELP,
    SliceCosts,
    balanced_slimpipe,
    checked_balanced_programs,
    moved_fraction,
    unit_cost,
)
from megatron.schedules.lowering import lower
from megatron.schedules.slimpipe import slimpipe_rank_units
from megatron.schedules.actions import BACKWARD, FORWARD, Unit
from megatron.seqsplit.lse_attention import (
    lse_attention_backward,
    lse_attention_forward,
    lse_attention_partial,
    merge_partials,
)

SHAPES = [(p, m, v, n) for p, v, n, m in itertools.product((2, 4), (1, 2, 4), (4, 8), (1, 2, 3, 5))
          if n % p == 0 and not (v > 1 and n < p) and p * v * n * m <= 160]
COSTS = [SliceCosts(gemm=2.0), SliceCosts(gemm=6.0, exchange=0.1)]


@pytest.mark.parametrize("costs", COSTS, ids=["gemm2", "gemm6"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "p%d_m%d_v%d_n%d" % s)
def test_plan_is_well_formed_and_runs(shape, costs):
    p, m, v, n = shape
    programs, plan = checked_balanced_programs(p, m, v, n, costs)  # raises on deadlock
    assert [list(u) for u in plan.units] == [slimpipe_rank_units(r, p, m, v, n)
                                            for r in range(p)]
    for rank, offloads in enumerate(plan.offloads):
        for unit, o in offloads.items():
            back = plan.offloads[o.peer][o.peer_unit]
            assert o.peer != rank and back.peer == rank and back.peer_unit == unit
            assert {o.role, back.role} == {ASK, HELP} and back.asker == o.asker
            assert o.num_chunks == back.num_chunks and 1 <= o.num_chunks <= o.asker.split
            assert (o.role == ASK) == (unit == o.asker)
            assert plan.start[(rank, unit)] == plan.start[(o.peer, o.peer_unit)]
    # the timeline respects every dependency and each rank's order
    for rank, units in enumerate(plan.units):
        for before, after in zip(units, units[1:]):
            assert plan.end[(rank, before)] <= plan.start[(rank, after)] + 1e-9
        for unit in units:
            for dep_rank, dep in dependencies(rank, unit, p, v, n):
                assert plan.end[(dep_rank, dep)] <= plan.start[(rank, unit)] + 1e-9
    assert plan.makespan <= plan.makespan_unbalanced + 1e-9
    assert len(programs) == p


def test_long_slices_are_paired_and_shorten_the_iteration():
    plan = balanced_slimpipe(4, 2, 2, 4, SliceCosts(gemm=2.0))
    assert sum(len(o) for o in plan.offloads) > 0
    assert plan.makespan < plan.makespan_unbalanced
    assert 0 < moved_fraction(plan) < 0.5


def test_rendezvous_check_catches_a_pairing_that_cannot_run():
    # rank 1's first forward needs rank 0's forward of the same slice: pairing the two
    # would make each wait for the other
    p, m, v, n = 2, 1, 1, 2
    units = [slimpipe_rank_units(r, p, m, v, n) for r in range(p)]
    first = Unit(FORWARD, 0, 0)
    partners = {(0, first): (1, first), (1, first): (0, first)}
    with pytest.raises(ScheduleDeadlock):
        simulate(units, lambda r, u: 1.0, partners=partners)
    programs = lower(units, v)
    with pytest.raises(ScheduleDeadlock, match="deadlock"):
        simulate(programs, partners=partners)


def test_simulated_partners_start_together():
    p, m, v, n = 2, 2, 1, 2
    units = [slimpipe_rank_units(r, p, m, v, n) for r in range(p)]
    # rank 0's second forward runs while rank 1 runs its first forward: pair them
    a, b = (0, Unit(FORWARD, 0, 1)), (1, Unit(FORWARD, 0, 0))
    sim = simulate(units, lambda r, u: 1.0 if u.kind == FORWARD else 2.0,
                   partners={a: b, b: a})
    starts = {(t.rank, t.unit): t.start for timed in sim.ranks for t in timed}
    assert starts[a] == starts[b]


def test_unit_costs_grow_with_the_prefix():
    costs = SliceCosts(gemm=4.0)
    assert unit_cost(Unit(FORWARD, 0, 3), costs) - unit_cost(Unit(FORWARD, 0, 0), costs) == 3
    assert unit_cost(Unit(BACKWARD, 0, 1), costs) > unit_cost(Unit(FORWARD, 0, 1), costs)


def test_costs_from_model_shape():
    from megatron.model_shape import ModelShape

    shape = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_query_groups=32, ffn_hidden_size=16384, swiglu=False,
                       vocab_size=50304)
    # per layer: linear 2 * 12 h^2 per token vs 4 h l per token and chunk: 6 h / l
    assert SliceCosts.from_model(shape, 4096).gemm == pytest.approx(6.0)


def _qkv(lq, chunk_lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, lq, 8, generator=gen, dtype=torch.float64)
    keys = [torch.randn(2, 2, n, 8, generator=gen, dtype=torch.float64) for n in chunk_lengths]
    values = [torch.randn(2, 2, n, 8, generator=gen, dtype=torch.float64) for n in chunk_lengths]
    return q, keys, values


@pytest.mark.parametrize("moved", [1, 2, 3])
def test_prefix_partial_and_merge_equal_one_call(moved):
    lengths = [5, 3, 4, 6]
    q, keys, values = _qkv(lengths[-1], lengths)
    scale = 0.35
    full_out, full_lse = lse_attention_forward(q, keys, values, softmax_scale=scale)
    local = lse_attention_partial(q, keys[moved:], values[moved:], softmax_scale=scale)
    remote = lse_attention_partial(q, keys[:moved], values[:moved], softmax_scale=scale,
                                   query_start=sum(lengths[:-1]))
    out, lse = merge_partials(*local, *remote)
    assert torch.allclose(out, full_out, atol=1e-12, rtol=0)
    assert torch.allclose(lse, full_lse, atol=1e-12, rtol=0)
    grad = torch.randn_like(full_out)
    dq, dks, dvs = lse_attention_backward(grad, q, full_out, full_lse, keys, values,
                                          softmax_scale=scale)
    dq_l, dks_l, dvs_l = lse_attention_backward(grad, q, out, lse, keys[moved:],
                                                values[moved:], softmax_scale=scale)
    dq_r, dks_r, dvs_r = lse_attention_backward(grad, q, out, lse, keys[:moved],
                                                values[:moved], softmax_scale=scale,
                                                query_start=sum(lengths[:-1]))
    assert torch.allclose(dq_l + dq_r, dq, atol=1e-12, rtol=0)
    for got, want in zip(dks_r + dks_l + dvs_r + dvs_l, dks + dvs):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_pairs_keep_plain_slimpipe_messages_in_place():
    """Lowered on plain SlimPipe's timed run, the benchmark's shape (pp 2, m 4, v 2, n 8,
    GEMM work 6 chunk attentions) keeps every message batch where plain SlimPipe has it
    (lowering on the cost model's timeline moved them and cost 13% on CPU)."""
    from megatron.schedules.lowering import checked_programs

    programs, plan = checked_balanced_programs(2, 4, 2, 8, SliceCosts(gemm=6.0))
    assert sum(len(o) for o in plan.offloads) > 0
    assert programs == checked_programs(2, 4, 2, 8, None, False, schedule="slimpipe")


def test_exchange_cost_is_counted():
    from megatron.model_shape import ModelShape

    shape = ModelShape(num_layers=8, hidden_size=256, num_attention_heads=8,
                       num_query_groups=2, ffn_hidden_size=1024, swiglu=False, vocab_size=1024)
    costs = SliceCosts.from_model(shape, 256, exchange=0.5)
    assert costs.exchange == 0.5 and costs.query_exchange == pytest.approx(0.5 * 8 / 2)
    with pytest.raises(ValueError, match=">= 0"):
        SliceCosts.from_model(shape, 256, exchange=-1)
    free = balanced_slimpipe(4, 2, 2, 4, SliceCosts(gemm=2.0))
    costly = balanced_slimpipe(4, 2, 2, 4, SliceCosts(gemm=2.0, exchange=5.0))
    assert sum(map(len, free.offloads)) > 0 and sum(map(len, costly.offloads)) == 0
    assert costly.makespan == costly.makespan_unbalanced
