"""--step-batch-size-schedule "THRESHOLD:BATCH ...": Megatron-LM's step-wise global batch.

As megatron-core's StepBatchsizeNumMicroBatchesCalculator (0.19+; written here so that
0.16 runs it too): thresholds take K/M/B/T suffixes and count tokens (Megatron-LM always
passes --seq-length, so THRESHOLD // seq_length samples); the batch in force is that of
the last threshold reached by the samples consumed so far, so a resumed run continues
the schedule where it stopped, and the data order is the same sequential one.
"""

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class ScheduleError(ValueError):
    """The schedule string is malformed (the message names the entry)."""


def _number(text, entry):
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    if scale != 1:
        text = text[:-1]
    try:
        return int(float(text) * scale)
    except ValueError:
        raise ScheduleError(f"entry {entry!r}: {text!r} is not a number") from None


def parse_schedule(text, seq_length):
    """[(threshold in samples, global batch)], ascending, first threshold 0."""
    schedule = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ScheduleError(f"entry {entry!r} is not THRESHOLD:BATCH")
        threshold, batch = entry.split(":", 1)
        schedule.append((_number(threshold, entry) // seq_length, _number(batch, entry)))
    schedule.sort(key=lambda step: step[0])
    if not schedule:
        raise ScheduleError("it has no THRESHOLD:BATCH entry")
    if schedule[0][0] != 0:
        raise ScheduleError(f"the first threshold must be 0 (got {schedule[0][0]} samples)")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ScheduleError(f"thresholds must increase ({before} then {after} samples, "
                                f"tokens // --seq-length)")
    if any(batch <= 0 for _, batch in schedule):
        raise ScheduleError("every batch size must be > 0")
    return schedule


def batch_at(schedule, consumed_samples):
    """The global batch in force after `consumed_samples` samples."""
    batch = schedule[0][1]
    for threshold, size in schedule:
        if consumed_samples >= threshold:
            batch = size
    return batch


def iterations_for_samples(schedule, train_samples):
    """Iterations --train-samples takes (Megatron-LM's update_train_iters: the last
    iteration may pass train_samples)."""
    iterations = consumed = 0
    while consumed < train_samples:
        consumed += batch_at(schedule, consumed)
        iterations += 1
    return iterations
