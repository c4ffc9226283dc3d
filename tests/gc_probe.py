"""Train configurations in turn in this one process and record its garbage collections.

    python tests/gc_probe.py SPEC.json OUT.json     (RANK/WORLD_SIZE/MASTER_* set)

SPEC maps a run name to its pretrain_gpt flags. OUT maps each name to:
``collections``: [generation, forward_step calls so far] of every collection that ran
while automatic collection was off (so: an explicit ``gc.collect``); ``gc_enabled_in_forward``:
the values of ``gc.isenabled()`` seen inside ``forward_step``; ``gc_enabled_after``:
``gc.isenabled()`` once the run returned. A line ``=== run NAME`` precedes each run's output.
"""

import gc
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_gpt  # noqa: E402
from megatron.trainer.training import pretrain  # noqa: E402


def probe(argv):
    calls, enabled, collections = [0], set(), []

    def forward_step(data_iterator, model, args=None):
        calls[0] += 1
        enabled.add(gc.isenabled())
        return pretrain_gpt.forward_step(data_iterator, model, args=args)

    def on_collection(phase, info):
        if phase == "start" and not gc.isenabled():
            collections.append([info["generation"], calls[0]])

    gc.callbacks.append(on_collection)
    try:
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, forward_step,
                 argv=argv)
    finally:
        gc.callbacks.remove(on_collection)
    return {"collections": collections, "gc_enabled_in_forward": sorted(enabled),
            "gc_enabled_after": gc.isenabled()}


def main(spec_path, out_path):
    results = {}
    for name, argv in json.load(open(spec_path)).items():
        print(f"=== run {name}", flush=True)
        results[name] = probe(argv)
    with open(out_path, "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
