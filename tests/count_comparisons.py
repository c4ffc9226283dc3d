"""Count what a test run compares: the asserted configurations, before and after a change.

    python tests/count_comparisons.py [OUT.json] -- [pytest arguments]
    python tests/count_comparisons.py /tmp/after.json -- -q tests/test_seq1f1b_exactness.py

Runs pytest with a plugin that counts, per test, every comparison the distributed
suites make through the shared helpers: ``assert_close_series`` (one per configuration
and quantity: loss, grad norm, validation loss against each reference),
``assert_params_close`` (every parameter of one configuration against one reference),
``check_reports`` (the schedule's per-microbatch reports) and ``check_split_units``
(what the last stage ran), each counted only when it passed. It prints, per module,
the collected test cases, the tests passed and the comparisons by kind, and writes
{test id: {kind: count}} to OUT.json, so two runs can be diffed test by test
(docs/testing.md gives the counts of the suite). A speed-up of the suite must leave
these numbers unchanged.
"""

import collections
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = {"distributed": ("assert_close_series", "assert_params_close"),
         "split_checks": ("check_reports", "check_split_units")}


class ComparisonLedger:
    def __init__(self):
        self.current = None
        self.counts = collections.defaultdict(collections.Counter)
        self.collected = collections.Counter()
        self.passed = collections.Counter()

    def _wrap(self, function):
        def counted(*args, **kwargs):
            result = function(*args, **kwargs)
            self.counts[self.current][function.__name__] += 1
            return result

        return counted

    def pytest_configure(self, config):
        # before collection: the test modules' `from distributed import ...` get the
        # counting versions
        sys.path.insert(0, HERE)
        for module_name, names in KINDS.items():
            module = __import__(module_name)
            for name in names:
                setattr(module, name, self._wrap(getattr(module, name)))

    def pytest_collection_modifyitems(self, items):
        for item in items:
            self.collected[item.nodeid.split("::")[0]] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        self.current = item.nodeid  # module fixtures set up within their first test
        yield
        self.current = None

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            self.passed[report.nodeid.split("::")[0]] += 1

    def summary(self):
        modules = collections.defaultdict(collections.Counter)
        for nodeid, kinds in self.counts.items():
            modules[nodeid.split("::")[0]].update(kinds)
        kinds = [name for names in KINDS.values() for name in names]
        rows = [["module", "cases", "passed", *kinds, "comparisons"]]
        for module in sorted(set(self.collected) | set(modules)):
            counts = [modules[module][kind] for kind in kinds]
            rows.append([module, self.collected[module], self.passed[module], *counts,
                         sum(counts)])
        totals = [sum(row[i] for row in rows[1:]) for i in range(1, len(rows[0]))]
        rows.append(["total", *totals])
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(str(cell).rjust(width) if i else str(cell).ljust(width)
                                   for i, (cell, width) in enumerate(zip(row, widths)))
                         for row in rows)


def main(argv):
    sys.path.insert(0, os.path.dirname(HERE))  # as `python -m pytest` run from the root
    out, pytest_args = None, argv
    if "--" in argv:
        split = argv.index("--")
        out, pytest_args = (argv[:split] or [None])[0], argv[split + 1:]
    ledger = ComparisonLedger()
    status = pytest.main(pytest_args, plugins=[ledger])
    print(ledger.summary())
    if out:
        with open(out, "w") as handle:
            json.dump({k: dict(v) for k, v in sorted(ledger.counts.items())}, handle, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
