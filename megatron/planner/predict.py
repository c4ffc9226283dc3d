"""Predict memory, bubble and throughput of one training configuration.

``predict(PlanConfig(...))`` validates the configuration, builds the schedule with
the shared generators (``megatron.schedules``), times it with the cost model in
``costs.py`` through the event simulator in ``simulate.py`` and returns a
``Prediction`` (``.to_json()`` gives the ``--json`` object of ``tools/plan.py``).
"""

from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Tuple, Union

from megatron.model_shape import ModelShape
from megatron.planner.costs import KV_LAYOUTS, CostModel, Parallel, Recompute
from megatron.planner.gpus import GIB, GPU, get_gpu
from megatron.schedules.actions import Unit
from megatron.schedules.attention_balance import ASK, BalancedSchedule, SliceCosts, balanced_slimpipe
from megatron.schedules.interleaved import check_interleaved_shape
from megatron.schedules import registry
from megatron.schedules.lowering import schedule_units
from megatron.schedules.simulate import MemoryEffect, SimResult, simulate
from megatron.schedules.slimpipe import check_slimpipe_shape
from megatron.seqsplit.split_lengths import BALANCE_METHODS, SplitPlanError, plan_splits

# the registry's schedules, and 1F1B over virtual stages under its own name (the planner
# takes the virtual stages from the flags and checks that they match the name)
SCHEDULES = registry.NAMES + (registry.SCHEDULES["1f1b"].interleaved_name,)
MIN_AUTO_SPLIT_TOKENS = 256
AUTO_SPLIT_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32)


class PlanError(ValueError):
    """A configuration that cannot run; the message names the flag to change."""


@dataclass(frozen=True)
class PlanConfig:
    model: ModelShape
    seq_length: int
    parallel: Parallel
    schedule: str = "1f1b"
    splits: Union[int, str] = 1  # int or "auto" (seq1f1b only); slimpipe: its slices
    balance_method: str = "average"
    split_alignment: Optional[int] = None  # default: t with SP, else 1
    recompute: Recompute = Recompute()
    gpu: str = "a100-80g"
    kv_layout: str = "buffer"
    microbatch_group_size: Optional[int] = None  # interleaved: default p
    attention_balance: bool = False  # SlimPipe's attention workload redistribution
    # its plan's communication cost per K/V chunk (SliceCosts.exchange); None: derived
    # from the GPU model (CostModel.balance_exchange_cost)
    attention_balance_exchange_cost: Optional[float] = None
    act_bytes: int = 2  # activation/weight dtype: 2 with --bf16/--fp16, 4 in fp32
    packed_documents: bool = False  # --reset-attention-mask: per-document attention


@dataclass
class Prediction:
    config: PlanConfig
    splits: int
    split_lengths: List[int]
    stages: List[Dict[str, float]]  # GB (GiB), one dict per pipeline rank
    bubble_fraction: float
    pipeline_time_s: float
    iteration_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    tflops_per_gpu_full_attention: float
    oom: bool
    gpu: GPU
    sim: SimResult = field(repr=False)
    cost: CostModel = field(repr=False)
    auto_candidates: Optional[List[Dict]] = None
    # --slimpipe-attention-balance: the summary (to_json's "attention_balance"), the
    # unbalanced simulation, the plan, and per unit the time it waits inside its pair
    attention_balance: Optional[Dict] = None
    sim_unbalanced: Optional[SimResult] = field(default=None, repr=False)
    balance_plan: Optional[BalancedSchedule] = field(default=None, repr=False)
    pair_waits: Optional[Dict[Tuple[int, Unit], float]] = field(default=None, repr=False)

    @property
    def peak_memory_gb(self) -> float:
        """Allocated bytes at the worst stage's peak (max_memory_allocated)."""
        return max(s["total"] for s in self.stages)

    @property
    def peak_reserved_gb(self) -> float:
        """The allocator's reserved estimate (max_memory_reserved); the OOM verdict."""
        return max(s["reserved"] for s in self.stages)

    def to_json(self) -> Dict:
        c = self.config
        p = c.parallel
        out = {
            "schedule": c.schedule,
            "splits": self.splits,
            "split_lengths": self.split_lengths,
            "balance_method": c.balance_method,
            "stages": self.stages,
            "peak_memory_gb": round(self.peak_memory_gb, 3),
            "peak_reserved_gb": round(self.peak_reserved_gb, 3),
            "gpu_memory_gb": round(self.gpu.memory_gib, 3),
            "usable_memory_gb": round(self.gpu.usable_bytes / GIB, 3),
            "oom": self.oom,
            "bubble_fraction": round(self.bubble_fraction, 5),
            "pipeline_time_s": self.pipeline_time_s,
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": round(self.tflops_per_gpu, 3),
            "tflops_per_gpu_full_attention": round(self.tflops_per_gpu_full_attention, 3),
            "gpu": self.gpu.name,
            "model": asdict(c.model),
            "seq_length": c.seq_length,
            "parallel": {
                "tensor_model_parallel_size": p.tp,
                "pipeline_model_parallel_size": p.pp,
                "data_parallel_size": p.dp,
                "virtual_pipeline_stages": p.num_chunks,
                # layers of each pipeline rank (uneven with --decoder-first/last-...)
                "stage_layers": list(p.stage_layers or [c.model.num_layers // p.pp] * p.pp),
                # layers of each model chunk in pipeline order (chunk c of rank r at c pp + r)
                "chunk_layers": p.chunk_counts(c.model.num_layers),
                "micro_batch_size": p.micro_batch_size,
                "global_batch_size": p.global_batch_size,
                "num_microbatches": p.num_microbatches,
                "sequence_parallel": p.sequence_parallel,
                "use_distributed_optimizer": p.distributed_optimizer,
                "world_size": p.world_size,
                "expert_model_parallel_size": p.ep,
                "expert_tensor_parallel_size": p.expert_tp,
                "moe_token_dispatcher_type": p.moe_dispatcher,
            },
            "parameters": {"total": c.model.parameter_count(),
                           "active": c.model.parameter_count(active=True)},
            "recompute": {
                "granularity": c.recompute.granularity,
                "method": c.recompute.method,
                "num_layers": c.recompute.num_layers,
                "modules": (list(c.recompute.modules)
                            if c.recompute.granularity == "selective" else None),
            },
            "kv_cache_layout": c.kv_layout,
            "activation_dtype_bytes": c.act_bytes,
            "slimpipe_attention_balance": c.attention_balance,
        }
        if c.model.num_experts is not None:
            out["moe_comm_bytes_per_layer"] = [
                self.cost.moe_comm_bytes(p.micro_batch_size * n) for n in self.split_lengths]
        if self.attention_balance is not None:
            out["attention_balance"] = self.attention_balance
        if self.auto_candidates is not None:
            out["auto_candidates"] = self.auto_candidates
        return out


# ----------------------------------------------------------------------- validation
def validate(c: PlanConfig) -> None:
    """Raise ``PlanError`` naming the flag for configurations Megatron cannot run."""
    m, p = c.model, c.parallel
    if c.schedule not in SCHEDULES:
        raise PlanError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {c.schedule!r}")
    positive = {
        "--num-layers": m.num_layers,
        "--hidden-size": m.hidden_size,
        "--num-attention-heads": m.num_attention_heads,
        "--num-query-groups": m.num_query_groups,
        "--ffn-hidden-size": m.ffn_hidden_size,
        "--vocab-size": m.vocab_size,
        "--seq-length": c.seq_length,
        "--tensor-model-parallel-size": p.tp,
        "--pipeline-model-parallel-size": p.pp,
        "--data-parallel-size": p.dp,
        "--micro-batch-size": p.micro_batch_size,
        "--global-batch-size": p.global_batch_size,
    }
    for flag, value in positive.items():
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{flag} must be a positive integer, got {value!r}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise PlanError(
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
            f"{m.num_attention_heads}; change one or pass --kv-channels"
        )
    if m.num_attention_heads % m.num_query_groups:
        raise PlanError(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--num-query-groups {m.num_query_groups}"
        )
    if p.chunk_layers is not None:
        # a rank's chunks differ: one count per chunk (none: a layout's embedding- or
        # loss-only stage), summing to each rank's count and to the model
        by_rank = [sum(p.chunk_layers[rank::p.pp]) for rank in range(p.pp)]
        if (len(p.chunk_layers) != p.pp * p.num_chunks or min(p.chunk_layers) < 0
                or sum(p.chunk_layers) != m.num_layers
                or (p.stage_layers is not None and list(p.stage_layers) != by_rank)):
            raise PlanError(f"per-chunk layers {list(p.chunk_layers)} do not split "
                            f"--num-layers {m.num_layers} over {p.pp} stages x "
                            f"{p.num_chunks} virtual stages")
    elif p.stage_layers is not None:
        # uneven stages: as many counts as ranks, summing to the model, each rank's
        # count dividing among its chunks (the trainer checked the flags themselves)
        if (len(p.stage_layers) != p.pp or sum(p.stage_layers) != m.num_layers
                or any(n < 0 or n % p.num_chunks for n in p.stage_layers)):
            raise PlanError(f"per-stage layers {list(p.stage_layers)} do not split "
                            f"--num-layers {m.num_layers} over {p.pp} stages x "
                            f"{p.num_chunks} virtual stages")
    elif m.num_layers % p.pp:
        raise PlanError(
            f"--num-layers {m.num_layers} is not divisible by "
            f"--pipeline-model-parallel-size {p.pp}"
        )
    elif m.num_layers % (p.pp * p.num_chunks):
        raise PlanError(
            f"--num-layers {m.num_layers} is not divisible by pipeline size {p.pp} x "
            f"{p.num_chunks} virtual stages; change --num-layers-per-virtual-pipeline-stage"
        )
    for flag, value in (
        ("--num-attention-heads", m.num_attention_heads),
        ("--num-query-groups", m.num_query_groups),
        ("--ffn-hidden-size", m.ffn_hidden_size),
    ):
        if value % p.tp:
            raise PlanError(
                f"{flag} {value} is not divisible by --tensor-model-parallel-size {p.tp}"
            )
    if p.global_batch_size % (p.micro_batch_size * p.dp):
        raise PlanError(
            f"--global-batch-size {p.global_batch_size} is not divisible by "
            f"--micro-batch-size {p.micro_batch_size} x --data-parallel-size {p.dp}"
        )
    if p.sequence_parallel and p.tp > 1 and c.seq_length % p.tp:
        raise PlanError(
            f"--seq-length {c.seq_length} is not divisible by --tensor-model-parallel-size "
            f"{p.tp}, which --sequence-parallel needs"
        )
    if c.balance_method not in BALANCE_METHODS:
        raise PlanError(
            f"--seq1f1b-balance-method must be one of {', '.join(BALANCE_METHODS)}, "
            f"got {c.balance_method!r}"
        )
    if c.kv_layout not in KV_LAYOUTS:
        raise PlanError(f"--kv-cache-layout must be one of {', '.join(KV_LAYOUTS)}")
    rc = c.recompute
    if rc.granularity not in (None, "selective", "full"):
        raise PlanError(f"--recompute-granularity must be full or selective, got {rc.granularity!r}")
    if rc.method not in ("uniform", "block"):
        raise PlanError(f"--recompute-method must be uniform or block, got {rc.method!r}")
    if rc.granularity == "full":
        per_chunk = (max(p.chunk_layers) if p.chunk_layers
                     else max(p.stage_layers or [m.num_layers // p.pp]) // p.num_chunks)
        if rc.num_layers < 1 or rc.num_layers > per_chunk:
            raise PlanError(
                f"--recompute-num-layers {rc.num_layers} must be in [1, {per_chunk}] "
                f"(layers per pipeline chunk)"
            )
    if c.schedule == "interleaved-1f1b" and p.num_chunks < 2:
        raise PlanError(
            "--schedule interleaved-1f1b needs --num-layers-per-virtual-pipeline-stage "
            "smaller than the layers per pipeline stage (at least 2 virtual stages)"
        )
    if c.schedule == "1f1b" and p.num_chunks > 1:
        raise PlanError(
            "--schedule 1f1b does not use virtual stages; drop "
            "--num-layers-per-virtual-pipeline-stage or use --schedule interleaved-1f1b"
        )
    if p.num_chunks > 1 and p.pp < 2:
        raise PlanError(
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2"
        )
    if c.splits != "auto" and (not isinstance(c.splits, int) or c.splits < 1):
        raise PlanError(f"--seq1f1b-splits must be a positive integer or 'auto', got {c.splits!r}")
    if c.attention_balance and c.schedule != "slimpipe":
        raise PlanError(f"--slimpipe-attention-balance needs --schedule slimpipe "
                        f"(got --schedule {c.schedule})")
    if c.attention_balance and c.kv_layout != "chunked":
        raise PlanError("--slimpipe-attention-balance needs --seq1f1b-kv-cache chunked, as in "
                        f"training (got --kv-cache-layout {c.kv_layout})")
    if c.schedule == "slimpipe":
        _validate_slimpipe(c)
        return
    if c.schedule != "seq1f1b" and c.splits not in (1, None):
        raise PlanError(
            f"--seq1f1b-splits {c.splits} needs --schedule seq1f1b (got --schedule {c.schedule})"
        )
    if p.num_chunks > 1:
        try:
            check_interleaved_shape(
                p.pp, p.num_microbatches, p.num_chunks, c.microbatch_group_size,
                1 if c.splits == "auto" else c.splits,
            )
        except ValueError as err:
            raise PlanError(str(err)) from None


def _validate_slimpipe(c: PlanConfig) -> None:
    """SlimPipe: ``c.splits`` uniform slices, a multiple of p dividing the sequence."""
    p = c.parallel
    n = c.splits
    if not isinstance(n, int) or n < 1:
        raise PlanError(f"--schedule slimpipe needs --slimpipe-slices N (a multiple of "
                        f"--pipeline-model-parallel-size {p.pp}), got {n!r}")
    if c.microbatch_group_size is not None:
        raise PlanError("--microbatch-group-size-per-virtual-pipeline-stage does not apply to "
                        "--schedule slimpipe (a group is one microbatch's slices)")
    if c.balance_method != "average":
        raise PlanError(f"SlimPipe slices are uniform; --seq1f1b-balance-method "
                        f"{c.balance_method} does not apply")
    if n % p.pp:
        raise PlanError(f"--slimpipe-slices {n} must be a multiple of "
                        f"--pipeline-model-parallel-size {p.pp}")
    if c.seq_length % n:
        raise PlanError(f"--slimpipe-slices {n} does not divide --seq-length {c.seq_length}; "
                        "slices are uniform")
    if (c.seq_length // n) % split_alignment(c):
        raise PlanError(f"slice length {c.seq_length // n} must be a multiple of the split "
                        f"alignment {split_alignment(c)}; use fewer slices")
    try:
        check_slimpipe_shape(p.pp, p.num_microbatches, p.num_chunks, n)
    except ValueError as err:
        raise PlanError(str(err)) from None


def split_alignment(c: PlanConfig) -> int:
    if c.split_alignment is not None:
        return c.split_alignment
    p = c.parallel  # each context-parallel part divided over TP under SP
    return (p.tp if p.sequence_parallel and p.tp > 1 else 1) * p.cp


def training_shape(c: PlanConfig) -> ModelShape:
    """The model shape as training plans its splits: the padded vocabulary."""
    return replace(c.model, vocab_size=c.model.padded_vocab_size(c.parallel.tp))


def split_lengths(c: PlanConfig, num_splits: int) -> List[int]:
    try:
        return plan_splits(
            c.seq_length,
            num_splits,
            c.balance_method,
            alignment=split_alignment(c),
            model=training_shape(c),
        )
    except SplitPlanError as err:
        raise PlanError(str(err)) from None


def build_schedule(c: PlanConfig, num_splits: int):
    """Every rank's units, as the executor gets them (SlimPipe, or Seq1F1B: interleaved
    with virtual stages)."""
    p = c.parallel
    return schedule_units("slimpipe" if c.schedule == "slimpipe" else "seq1f1b", p.pp,
                          p.num_microbatches, p.num_chunks, num_splits, c.microbatch_group_size)


# ------------------------------------------------------------------------ predict
def _predict_fixed(c: PlanConfig, num_splits: int) -> Prediction:
    gpu = get_gpu(c.gpu)
    lengths = split_lengths(c, num_splits)
    cost = CostModel(c.model, c.parallel, gpu, c.seq_length, lengths, c.recompute, c.kv_layout,
                     c.act_bytes, packed_documents=c.packed_documents)
    schedule = build_schedule(c, num_splits)
    balance = None
    if c.attention_balance:
        balance = _attention_balance(c, cost, schedule, num_splits)
        sim = balance["sim"]
    else:
        sim = simulate(schedule, cost.unit_time, cost.p2p_time, cost.memory_effect)
    p = c.parallel
    stages = []
    for rank in range(p.pp):
        static = cost.static_memory(rank)
        peak, _, parts = sim.memory[rank].peak()
        row = {k: v / GIB for k, v in static.items()}
        row["activations"] = parts.get("activations", 0.0) / GIB
        row["kv_cache"] = parts.get("kv_cache", 0.0) / GIB
        row["total"] = sum(static.values()) / GIB + peak / GIB
        row["reserved"] = reserved_bytes(gpu, sum(static.values()), peak) / GIB
        row["in_flight_units_peak"] = sim.in_flight_peak(rank)
        stages.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    pipeline = sim.makespan
    tail = max(cost.grad_sync_time(r) + cost.optimizer_time(r) for r in range(p.pp))
    iteration = pipeline + tail
    tokens = p.global_batch_size * c.seq_length
    # model FLOPs over the unpadded vocabulary (training's metrics count the padded one)
    flops = p.global_batch_size * c.model.iteration_flops(c.seq_length)
    flops_full = p.global_batch_size * c.model.iteration_flops(c.seq_length, causal=False)
    peak = max(s["reserved"] for s in stages) * GIB
    bubble = sim.bubble_fraction() if balance is None else balance["summary"]["bubble_fraction"]
    return Prediction(
        config=replace(c, splits=num_splits),
        splits=num_splits,
        split_lengths=lengths,
        stages=stages,
        bubble_fraction=bubble,
        pipeline_time_s=pipeline,
        iteration_time_s=iteration,
        tokens_per_s=tokens / iteration,
        tflops_per_gpu=flops / iteration / p.world_size / 1e12,
        tflops_per_gpu_full_attention=flops_full / iteration / p.world_size / 1e12,
        oom=peak > gpu.usable_bytes,
        gpu=gpu,
        sim=sim,
        cost=cost,
        attention_balance=None if balance is None else balance["summary"],
        sim_unbalanced=None if balance is None else balance["sim_unbalanced"],
        balance_plan=None if balance is None else balance["plan"],
        pair_waits=None if balance is None else balance["waits"],
    )


def _attention_balance(c: PlanConfig, cost: CostModel, schedule, num_splits: int) -> Dict:
    """SlimPipe with attention redistribution, timed by the planner's cost model.

    The pairs come from ``balanced_slimpipe`` (the plan every rank computes from the
    model's relative slice costs and the exchange cost per K/V chunk, derived here from
    the GPU model unless given; training takes the same number); the planner re-times
    them with its own costs. An
    unpaired unit takes ``unit_time``; both units of a pair take
    ``max(asker - moved, helper + moved) + exchange`` where ``moved`` is the asker's
    attention time in the moved prefix chunks and ``exchange`` the per-layer messages
    of the pair (``CostModel.exchange_time``).

    Memory is unchanged: the helper keeps nothing after the exchange (the moved query
    and K/V chunks and the partial results live only during one layer's exchange; those
    transient receive buffers are not counted) and the asker keeps what it kept before.

    Bubble: the time a paired unit waits for its partner or the exchange counts as idle,
    so with and without balancing the bubble is ``1 - compute / (p * pipeline time)``
    over the same total compute.
    """
    p = c.parallel
    exchange_cost = c.attention_balance_exchange_cost
    if exchange_cost is None:
        exchange_cost = cost.balance_exchange_cost()
    plan = balanced_slimpipe(p.pp, p.num_microbatches, p.num_chunks, num_splits,
                             SliceCosts.from_model(c.model, cost.split_lengths[0],
                                                   exchange_cost))
    if [list(units) for units in plan.units] != [list(units) for units in schedule]:
        raise AssertionError("attention balance plan does not follow the SlimPipe schedule")
    durations: Dict[Tuple[int, Unit], float] = {}
    waits: Dict[Tuple[int, Unit], float] = {}
    moved_total = exchange_total = 0.0
    for rank, offloads in enumerate(plan.offloads):
        for unit, o in offloads.items():
            if o.role != ASK:
                continue
            helper = (o.peer, o.peer_unit)
            asker_time = cost.unit_time(rank, unit)
            helper_time = cost.unit_time(*helper)
            moved = cost.moved_attention_time(rank, unit, o.num_chunks)
            exchange = cost.exchange_time(rank, o.peer, unit, o.num_chunks)
            both = max(asker_time - moved, helper_time + moved) + exchange
            durations[(rank, unit)] = durations[helper] = both
            waits[(rank, unit)] = both - (asker_time - moved)
            waits[helper] = both - (helper_time + moved)
            moved_total += moved
            exchange_total += exchange

    def duration(rank: int, unit: Unit) -> float:
        t = durations.get((rank, unit))
        return cost.unit_time(rank, unit) if t is None else t

    sim = simulate(schedule, duration, cost.p2p_time, cost.memory_effect,
                   partners=plan.partners())
    unbalanced = simulate(schedule, cost.unit_time, cost.p2p_time)
    attention = sum(_attention_time(cost, rank, unit)
                    for rank, units in enumerate(schedule) for unit in units)
    compute = sum(unbalanced.busy(r) for r in range(p.pp))
    span = sim.makespan
    summary = {
        "pairs": len(durations) // 2,
        "paired_units": len(durations),
        "units": sum(len(units) for units in schedule),
        "moved_attention_fraction": round(moved_total / attention, 6) if attention else 0.0,
        "exchange_time_s": exchange_total,
        "exchange_cost": round(exchange_cost, 6),
        "bubble_fraction": round(1.0 - compute / (p.pp * span), 5) if span > 0 else 0.0,
        "pipeline_time_s": span,
        "bubble_fraction_unbalanced": round(unbalanced.bubble_fraction(), 5),
        "pipeline_time_s_unbalanced": unbalanced.makespan,
    }
    return {"sim": sim, "sim_unbalanced": unbalanced, "plan": plan, "waits": waits,
            "summary": summary}


def _attention_time(cost: CostModel, rank: int, unit: Unit) -> float:
    """Attention time of one unit as ``unit_time`` counts it (backward 2.5x forward)."""
    attention = cost.forward_time_parts(rank, unit)["attention"]
    return attention if unit.is_forward else 2.5 * attention


def auto_split_candidates(c: PlanConfig) -> List[int]:
    """Split counts ``auto`` tries: ``AUTO_SPLIT_COUNTS`` with >= 256 tokens per split."""
    align = split_alignment(c)
    out = []
    for s in AUTO_SPLIT_COUNTS:
        if c.seq_length // s < MIN_AUTO_SPLIT_TOKENS and s > 1:
            break
        if s > c.seq_length // align:
            break
        if c.parallel.num_chunks > 1:
            try:
                check_interleaved_shape(
                    c.parallel.pp, c.parallel.num_microbatches, c.parallel.num_chunks,
                    c.microbatch_group_size, s,
                )
            except ValueError:
                continue
        out.append(s)
    return out


def _smallest_fitting_slices(c: PlanConfig) -> Prediction:
    """``--slimpipe-slices auto``: the smallest slice count n (a multiple of p dividing
    the sequence, slices aligned) whose reserved estimate fits; more slices only cost
    kernel launches, so the first that fits is the one to train with. None fits: the
    largest n tried, marked OOM."""
    p = c.parallel.pp
    tried = []
    for n in range(p, c.seq_length + 1, p):
        if c.seq_length % n or (c.seq_length // n) % split_alignment(c):
            continue
        if c.seq_length // n < MIN_AUTO_SPLIT_TOKENS and tried:
            break
        pred = predict(replace(c, splits=n))
        tried.append(pred)
        if not pred.oom:
            break
    if not tried:
        raise PlanError(f"--slimpipe-slices auto found no slice count for --seq-length "
                        f"{c.seq_length} and --pipeline-model-parallel-size {p}")
    best = tried[-1]
    best.auto_candidates = [{"splits": r.splits, "tokens_per_s": r.tokens_per_s,
                             "peak_memory_gb": round(r.peak_memory_gb, 3), "oom": r.oom,
                             "bubble_fraction": round(r.bubble_fraction, 5)} for r in tried]
    return best


def predict(c: PlanConfig) -> Prediction:
    """Validate and predict; with ``splits="auto"`` pick the fastest split count that fits."""
    if c.schedule == "slimpipe" and c.splits is None:
        raise PlanError("--schedule slimpipe needs --slimpipe-slices N or --slimpipe-slice-length L")
    if c.schedule == "slimpipe" and c.splits == "auto":
        return _smallest_fitting_slices(c)
    if c.schedule == "seq1f1b" and c.splits is None:
        c = replace(c, splits="auto")
    if c.splits is None:
        c = replace(c, splits=1)
    validate(c)
    if c.splits != "auto":
        return _predict_fixed(c, c.splits)
    results = []
    for s in auto_split_candidates(c):
        try:
            results.append(_predict_fixed(c, s))
        except PlanError:
            continue
    if not results:
        raise PlanError(
            f"--seq1f1b-splits auto found no usable split count for --seq-length {c.seq_length}"
        )
    fitting = [r for r in results if not r.oom]
    best = (
        max(fitting, key=lambda r: r.tokens_per_s)
        if fitting
        else min(results, key=lambda r: r.peak_memory_gb)
    )
    best.auto_candidates = [
        {
            "splits": r.splits,
            "tokens_per_s": r.tokens_per_s,
            "peak_memory_gb": round(r.peak_memory_gb, 3),
            "oom": r.oom,
            "bubble_fraction": round(r.bubble_fraction, 5),
        }
        for r in results
    ]
    return best


def reserved_bytes(gpu: GPU, static: float, dynamic_peak: float) -> float:
    """Estimated ``torch.cuda.max_memory_reserved``: static buffers (weights, gradients,
    optimizer states) are allocated once and fit their blocks; the activations and K/V,
    allocated and freed in varying sizes every unit, leave ``allocator_overhead`` of
    cached but unused blocks on top of their peak."""
    return static + (1.0 + gpu.allocator_overhead) * dynamic_peak


def boundary_activation_peaks(pred: Prediction) -> List[float]:
    """Per pipeline rank, the peak bytes of activations + K/V cache sampled at unit
    boundaries (what ``--activation-memory-file`` measures): what lives only inside a
    backward (memory rebuilt by full recomputation, a K/V gradient stash before the
    unit frees its activations) is left out."""
    cost = pred.cost

    def effect(rank, unit):  # a unit's whole change, seen after it ends
        e = cost.memory_effect(rank, unit)
        keys = set(e.at_start) | set(e.at_end)
        return MemoryEffect({}, {k: e.at_start.get(k, 0.0) + e.at_end.get(k, 0.0)
                                 for k in keys}, {})

    schedule = build_schedule(pred.config, pred.splits)
    sim = simulate(schedule, cost.unit_time, cost.p2p_time, effect)
    return [sim.memory[rank].peak()[0] for rank in range(pred.config.parallel.pp)]
