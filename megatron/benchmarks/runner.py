"""Train several configurations in one torchrun launch and time every iteration.

    torchrun --nproc-per-node P -m megatron.benchmarks.runner SPEC.json OUT.json

SPEC is a JSON list of runs ``{"name": str, "config": str, "kind": str, "argv": [...]}``
(``argv``: ``pretrain_gpt.py`` flags). Each run is one in-process call of
``megatron.trainer.training.pretrain`` with ``pretrain_gpt``'s providers, so every
configuration trains the same model on the same data from the same seed. OUT
(written by the last rank) lists, per run, its name, config, kind, the wall time of
every ``train_step`` on every rank, the per-iteration losses, the runtime that ran the
pipeline schedule (``runtime``: ``megatron-core`` or ``executor``, from the function
``get_forward_backward_func`` returned) and the CPU load of other processes on the
host during the run (``foreign_cores``). A run with
``"quiet": {"threshold": C, "max_wait": S, "retries": N}`` first waits (up to S
seconds) until other processes use fewer than C cores, and is repeated (up to N
times) when they used C or more during it; the last attempt is kept. A run with
``"interleave": [{"config": name, "schedule": {...}}, ...]`` changes schedule at every
iteration (``interleaved_schedules``) and is written as one record per configuration,
named ``name#round`` (``split_interleaved``).

Timing: ``train_step`` (forward-backward of all microbatches + optimizer step) is
timed on every rank by wrapping ``megatron.trainer.training.train_step`` for the
duration of the run; on CUDA the device is synchronised before the clock is read.
Nothing else in the training loop changes.
"""

import contextlib
import json
import os
import resource
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megatron.benchmarks.pipeline import runtime_of  # noqa: E402
from megatron.trainer import gpt as pretrain_gpt  # noqa: E402 - pretrain_gpt.py's providers
from megatron.trainer import training  # noqa: E402
from megatron.trainer.initialize import destroy_groups_except  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed_train_steps(durations):
    """Append the wall time of every ``train_step`` call to ``durations``."""
    original = training.train_step

    def timed(*args, **kwargs):
        _sync()
        start = time.perf_counter()
        out = original(*args, **kwargs)
        _sync()
        durations.append(time.perf_counter() - start)
        return out

    training.train_step = timed
    try:
        yield
    finally:
        training.train_step = original


@contextlib.contextmanager
def recorded_runtimes(runtimes):
    """Append the runtime of every schedule function the trainer gets (``runtime_of``):
    with observers (``--timeline-file``, ``--activation-memory-file``) 1F1B runs our
    executor instead of megatron-core's schedule, and the records must say so."""
    original = training.get_forward_backward_func

    def recording(*args, **kwargs):
        func = original(*args, **kwargs)
        runtimes.append(runtime_of(func))
        return func

    training.get_forward_backward_func = recording
    try:
        yield
    finally:
        training.get_forward_backward_func = original


@contextlib.contextmanager
def interleaved_schedules(entries, ran):
    """Change the pipeline schedule at every iteration of one ``pretrain`` call.

    ``entries``: one dict per configuration, ``{"config": name, "schedule": {...}}`` with
    the keywords of ``get_forward_backward_func`` that select it (splits, balance
    method). Cycle ``c`` (one iteration of every configuration) runs the entries
    rotated by ``c``, so each configuration runs early and late in a cycle and after
    every other one. Neighbouring iterations see the same machine, which pairs them far
    more tightly than separate runs on a host whose speed drifts within minutes. The
    schedules are exact, so the model trains as under any one of them. ``ran`` gets each
    iteration's configuration name."""
    original_get, original_step = training.get_forward_backward_func, training.train_step
    funcs, current = {}, {}

    def get(*args, **kwargs):
        for entry in entries:
            funcs[entry["config"]] = original_get(*args, **{**kwargs, **entry["schedule"]})
        return lambda **call: funcs[current["config"]](**call)

    def step(*args, **kwargs):
        cycle, position = divmod(len(ran), len(entries))
        current["config"] = entries[(position + cycle) % len(entries)]["config"]
        ran.append(current["config"])
        return original_step(*args, **kwargs)

    training.get_forward_backward_func, training.train_step = get, step
    try:
        yield
    finally:
        training.get_forward_backward_func, training.train_step = original_get, original_step


def system_busy_seconds():
    """CPU seconds all processes of this host spent busy so far (None off Linux)."""
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    busy = sum(values[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    """CPU seconds of this process (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ForeignLoad:
    """CPU cores busy with work other than this launch's processes, over an interval.

    Every rank calls ``start`` and ``stop`` together (collectives); ``stop`` returns
    (host busy CPU seconds - CPU seconds of all ranks) / wall seconds, i.e. the average
    number of cores other processes used, or None where /proc/stat is missing.
    All ranks must share one host (the CPU benchmark)."""

    def start(self):
        torch.distributed.barrier(group=_GROUP)
        self.t0, self.sys0, self.own0 = time.perf_counter(), system_busy_seconds(), own_cpu_seconds()

    def stop(self):
        torch.distributed.barrier(group=_GROUP)
        wall = time.perf_counter() - self.t0
        sys1, own = system_busy_seconds(), own_cpu_seconds() - self.own0
        total = torch.tensor([own], dtype=torch.float64)
        torch.distributed.all_reduce(total, group=_GROUP)
        if self.sys0 is None or sys1 is None or wall <= 0:
            return None
        return max(0.0, (sys1 - self.sys0 - total.item()) / wall)


def wait_for_quiet(threshold, max_wait, probe_s=1.0):
    """Sleep until other processes use fewer than ``threshold`` cores over ``probe_s``
    (or ``max_wait`` seconds passed); returns (seconds waited, last foreign load)."""
    meter, waited, load = ForeignLoad(), 0.0, None
    while True:
        meter.start()
        time.sleep(probe_s)
        load = meter.stop()
        decision = torch.tensor([1.0 if (load is None or load < threshold
                                         or waited >= max_wait) else 0.0])
        torch.distributed.broadcast(decision, src=0, group=_GROUP)  # rank 0's reading decides
        if decision.item() == 1.0:
            return waited, load
        waited += probe_s


def destroy_leftover_groups():
    """Destroy every process group but the default one and the runner's own."""
    destroy_groups_except(keep=(_GROUP,))


def thread_count():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


@contextlib.contextmanager
def thread_clock_timelines(enabled):
    """With ``enabled``, ``--timeline-file`` records each unit with the CPU time of the
    thread that runs it (``time.thread_time``) instead of the wall clock: durations are
    the unit's own work, without the time the thread waited for a core. Start times of
    different ranks are then on unrelated clocks (only durations mean something)."""
    if not enabled:
        yield
        return
    from megatron.schedules.timeline import TimelineRecorder

    original = training.timeline_recorder

    def recorder(args):
        made = original(args)
        if made is not None:
            made = TimelineRecorder(rank=made.rank, sync=made.sync, clock=time.thread_time)
        return made

    training.timeline_recorder = recorder
    try:
        yield
    finally:
        training.timeline_recorder = original


def run_one(run):
    """Train one configuration (or, with ``interleave``, several in turn); returns
    (per-iteration seconds on this rank, losses, the schedules' runtimes, the
    configuration each iteration ran: empty without ``interleave``)."""
    durations, runtimes, ran = [], [], []
    thread_clock = run.get("meta", {}).get("clock") == "thread"
    interleave = run.get("interleave")
    with timed_train_steps(durations), thread_clock_timelines(thread_clock), \
            recorded_runtimes(runtimes), (interleaved_schedules(interleave, ran) if interleave
                                          else contextlib.nullcontext()):
        result = training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                   pretrain_gpt.forward_step, argv=run["argv"])
    destroy_leftover_groups()
    return durations, list(result.losses), runtimes, ran


def split_interleaved(run, gathered):
    """One record per configuration of an interleaved run: the iterations it ran (per
    rank) and its runtime; ``losses`` is the whole run's (one model trained throughout)."""
    ran = next(names for _, _, _, names in gathered if names)
    out = []
    for index, entry in enumerate(run["interleave"]):
        mine = [i for i, name in enumerate(ran) if name == entry["config"]]
        runtimes = {names[index] for _, _, names, _ in gathered if len(names) > index}
        out.append({"name": f"{entry['config']}#{run['meta']['round']}", "config": entry["config"],
                    "kind": run["kind"], "meta": dict(run["meta"], interleaved=True),
                    "iteration_seconds": [[d[i] for i in mine] for d, _, _, _ in gathered],
                    "runtime": ", ".join(sorted(runtimes)) or None})
    return out


_GROUP = None  # a gloo group for the runner's own (CPU tensor) collectives


def init_processes():
    """The default process group as the trainer would create it (torchrun's env), plus a
    gloo group for the load meter; ``pretrain`` then finds the default group ready."""
    global _GROUP
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0"))
                                  % torch.cuda.device_count())
        torch.distributed.init_process_group(backend=backend)
    _GROUP = torch.distributed.new_group(backend="gloo")


def main(spec_path, out_path):
    runs = json.load(open(spec_path))
    results = []
    init_processes()
    world = torch.distributed.get_world_size()
    for index, run in enumerate(runs):
        quiet = run.get("quiet")  # {"threshold": cores, "max_wait": s, "retries": n}
        attempts = []
        for attempt in range((quiet or {}).get("retries", 0) + 1):
            waited = 0.0
            if quiet:
                waited, _ = wait_for_quiet(quiet["threshold"], quiet.get("max_wait", 300))
            meter = ForeignLoad()
            meter.start()
            durations, losses, runtimes, ran = run_one(run)
            foreign = meter.stop()
            attempts.append({"foreign_cores": foreign, "waited_s": waited})
            if not quiet or foreign is None or foreign < quiet["threshold"]:
                break
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, (durations, losses, runtimes, ran),
                                            group=_GROUP)
        if torch.distributed.get_rank() == world - 1:
            all_losses = next((l for _, l, _, _ in reversed(gathered) if l), [])
            if run.get("interleave"):
                entries = split_interleaved(run, gathered)
            else:
                runtime = ", ".join(sorted({n for _, _, names, _ in gathered for n in names}))
                entries = [{"name": run["name"], "config": run.get("config", run["name"]),
                            "kind": run.get("kind", "timed"), "meta": run.get("meta", {}),
                            "iteration_seconds": [d for d, _, _, _ in gathered],
                            "runtime": runtime or None}]
            for entry in entries:
                entry.update({"losses": all_losses,
                              "foreign_cores": attempts[-1]["foreign_cores"],
                              "attempts": attempts, "threads_after": thread_count()})
                results.append(entry)
                per_iter = [max(step) for step in zip(*entry["iteration_seconds"])]
                load = entry["foreign_cores"]
                print(f"[bench] {index + 1}/{len(runs)} {entry['name']} ({entry['runtime']}"
                      f"{', interleaved' if run.get('interleave') else ''}): ms/iteration "
                      f"{' '.join(f'{1000 * t:.0f}' for t in per_iter)} | final loss "
                      f"{all_losses[-1] if all_losses else float('nan'):.6f} | other processes "
                      f"{'n/a' if load is None else f'{load:.2f}'} cores | threads "
                      f"{entry['threads_after']}"
                      f"{f' (attempt {len(attempts)})' if len(attempts) > 1 else ''}", flush=True)
            with open(out_path + ".partial", "w") as handle:
                json.dump(results, handle)
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        os.replace(out_path + ".partial", out_path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1], sys.argv[2])
