"""Split planning for Seq1F1B: how to cut one microbatch's sequence into splits.

Pure functions only. `plan_splits` returns split LENGTHS in sequence order; the
schedule and the attention cache derive offsets from them with `split_offsets`.

`uniform_comp` balances the forward FLOPs of `megatron.model_shape.ModelShape`: a
split of `l` tokens after a prefix of `P` costs a * l + b * (l * P + l * (l + 1) / 2)
(a: linear FLOPs per token, b: attention FLOPs per causal pair), which is the
difference C(P + l) - C(P) of the prefix cost C(x) = a * x + b * x * (x + 1) / 2.
"""

import math

from megatron.model_shape import ModelShape

BALANCE_METHODS = ("average", "uniform_comp")


class SplitPlanError(ValueError):
    """A split plan that cannot be built; the message names the flag to change."""


def split_offsets(lengths: list[int]) -> list[int]:
    """Start position of each split inside the sequence."""
    offsets, pos = [], 0
    for length in lengths:
        offsets.append(pos)
        pos += length
    return offsets


def split_flops(lengths: list[int], model: ModelShape) -> list[float]:
    """Forward FLOPs of each split over the whole model."""
    return [model.forward_flops(l, p) for l, p in zip(lengths, split_offsets(lengths))]


def plan_splits(
    seq_length: int,
    num_splits: int,
    method: str = "average",
    *,
    alignment: int = 1,
    model: ModelShape | None = None,
) -> list[int]:
    """Lengths of the `num_splits` splits of a `seq_length` sequence.

    Every length is a positive multiple of `alignment` and they sum to `seq_length`.
    `average`: equal lengths; a remainder of `r` alignment units goes one unit each
    to the first `r` splits (they attend over shorter prefixes, so they are cheaper).
    `uniform_comp`: equal forward FLOPs per split under `model` (earlier splits longer).
    """
    _validate(seq_length, num_splits, method, alignment, model)
    units = seq_length // alignment
    if num_splits == 1:
        return [seq_length]
    if method == "average":
        base, rem = divmod(units, num_splits)
        return [(base + (1 if i < rem else 0)) * alignment for i in range(num_splits)]
    if model.window_layers:  # sliding windows: a split's cost is no longer quadratic
        ends = _balanced_ends_by_bisection(seq_length, num_splits, model)
    else:
        ends = _balanced_ends(seq_length, num_splits, model)
    return _round_to_units(ends, units, alignment)


def _validate(seq_length, num_splits, method, alignment, model) -> None:
    if method not in BALANCE_METHODS:
        raise SplitPlanError(
            f"--seq1f1b-balance-method must be one of {', '.join(BALANCE_METHODS)}, "
            f"got {method!r}"
        )
    if not isinstance(num_splits, int) or num_splits < 1:
        raise SplitPlanError(f"--seq1f1b-splits must be >= 1, got {num_splits!r}")
    if alignment < 1:
        raise SplitPlanError(f"split alignment must be >= 1, got {alignment}")
    if seq_length < 1 or seq_length % alignment:
        raise SplitPlanError(
            f"--seq-length {seq_length} must be a positive multiple of the split "
            f"alignment {alignment}; change --seq-length or the alignment"
        )
    if num_splits > seq_length // alignment:
        raise SplitPlanError(
            f"--seq1f1b-splits {num_splits} is more than the {seq_length // alignment} "
            f"aligned positions of --seq-length {seq_length} (alignment {alignment}); "
            f"use fewer splits or a longer sequence"
        )
    if method == "uniform_comp" and model is None:
        raise SplitPlanError(
            "--seq1f1b-balance-method uniform_comp needs the model shape "
            "(layers, hidden, heads, FFN, vocab) to count FLOPs; pass `model` or "
            "use --seq1f1b-balance-method average"
        )


def _balanced_ends(seq_length: int, num_splits: int, model: ModelShape) -> list[float]:
    """Real-valued split end positions giving each split total/num_splits FLOPs.

    Walking back from the end E of the sequence, the split [E - l, E) costs
    a*l + b*(l*E - l^2/2 + l/2) = T, i.e. (b/2) l^2 - (a + b*E + b/2) l + T = 0.
    The wanted root is the smaller one (l <= E); it is computed as
    2T / (B + sqrt(B^2 - 2bT)) to avoid cancellation (and to cover b == 0).
    """
    a, b = model.linear_flops_per_token(), model.attention_flops_per_pair()
    target = model.forward_flops(seq_length) / num_splits
    ends, end = [float(seq_length)], float(seq_length)
    for _ in range(num_splits - 1):
        big_b = a + b * end + b / 2
        end -= 2 * target / (big_b + math.sqrt(max(big_b * big_b - 2 * b * target, 0.0)))
        ends.append(end)
    return ends[::-1]  # ends of splits 0..s-1; the last one is seq_length


def _balanced_ends_by_bisection(seq_length: int, num_splits: int,
                                model: ModelShape) -> list[float]:
    """As `_balanced_ends` for any cost that grows with a split's length (sliding-window
    layers: a query's cost stops growing at the window): walking back from the end, each
    split's start is found by bisection on ``model.forward_flops``."""
    target = model.forward_flops(seq_length) / num_splits
    ends, end = [float(seq_length)], float(seq_length)
    for _ in range(num_splits - 1):
        low, high = 0.0, end  # the split's length
        for _ in range(60):
            mid = (low + high) / 2
            if model.forward_flops(mid, end - mid) < target:
                low = mid
            else:
                high = mid
        end -= (low + high) / 2
        ends.append(end)
    return ends[::-1]


def _round_to_units(ends: list[float], units: int, alignment: int) -> list[int]:
    """Round real split ends to aligned integers, keeping every split >= 1 unit."""
    n = len(ends)
    bounds, prev = [], 0
    for i, end in enumerate(ends[:-1]):
        b = round(end / alignment)
        # Leave at least one unit for this split and for each split after it.
        b = min(max(b, prev + 1), units - (n - 1 - i))
        bounds.append(b)
        prev = b
    bounds.append(units)
    lengths = [hi - lo for lo, hi in zip([0] + bounds[:-1], bounds)]
    # Rounding can invert two neighbours whose real lengths differ by under two
    # units; put the longer first, where tokens are cheaper.
    return [u * alignment for u in sorted(lengths, reverse=True)]
