"""Counting, progress lines and the final summary of a preprocessing run."""

import sys
import time
from collections import defaultdict
from typing import Dict, List, Sequence

from megatron.dataprep.encode import SKIP_REASONS

FIRST_LOCATIONS = 5  # how many file:line locations a summary lists per reason


class Report:
    def __init__(self, keys: Sequence[str], log_interval: int, stream=None):
        self.keys = list(keys)
        self.log_interval = log_interval
        self.stream = stream
        self.start = time.perf_counter()
        self.read = 0
        self.text_bytes = 0
        self.written: Dict[str, int] = {k: 0 for k in keys}
        self.tokens: Dict[str, int] = {k: 0 for k in keys}
        # key -> reason -> (count, first locations)
        self.skipped: Dict[str, Dict[str, List]] = {
            k: defaultdict(lambda: [0, []]) for k in keys
        }
        self._next_log = log_interval

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def skip(self, key: str, reason: str, where: str) -> None:
        entry = self.skipped[key][reason]
        entry[0] += 1
        if len(entry[1]) < FIRST_LOCATIONS:
            entry[1].append(where)

    def advance(self, items: int, text_bytes: int) -> None:
        self.read += items
        self.text_bytes += text_bytes
        if self.read >= self._next_log:
            self._next_log = (self.read // self.log_interval + 1) * self.log_interval
            self._print(f"processed {self.read} documents ({self._rates()})")

    def skip_reasons(self, key: str) -> str:
        """': N lines skipped: reason (what) at file:line, ...' for one line of text;
        empty when nothing was skipped."""
        skipped = self.skipped[key]
        if not skipped:
            return ""
        parts = []
        for reason in SKIP_REASONS:
            if reason in skipped:
                count, where = skipped[reason]
                more = ", ..." if count > len(where) else ""
                parts.append(f"{reason} {count} ({SKIP_REASONS[reason]}) at "
                             f"{', '.join(where)}{more}")
        total = sum(count for count, _ in skipped.values())
        return f": {total} skipped: {'; '.join(parts)}"

    def summary(self, outputs: Dict[str, str]) -> None:
        lines = [f"done in {self.elapsed:.2f} s: {self.read} documents read "
                 f"({self.text_bytes / 1e6:.2f} MB of text; {self._rates()})"]
        for key in self.keys:
            skipped = self.skipped[key]
            total = sum(c for c, _ in skipped.values())
            lines.append(f"  {key}: {self.written[key]} written, {total} skipped, "
                         f"{self.tokens[key]} tokens -> {outputs[key]}.{{bin,idx}}")
            for reason in SKIP_REASONS:
                if reason in skipped:
                    count, where = skipped[reason]
                    more = ", ..." if count > len(where) else ""
                    lines.append(f"    {reason}: {count} ({SKIP_REASONS[reason]}) "
                                 f"at {', '.join(where)}{more}")
        self._print("\n".join(lines))

    def _rates(self) -> str:
        t = max(self.elapsed, 1e-9)
        return f"{self.read / t:.1f} docs/s, {self.text_bytes / t / 1e6:.2f} MB/s"

    def _print(self, text: str) -> None:
        print(f"preprocess_data: {text}", file=self.stream or sys.stderr, flush=True)
