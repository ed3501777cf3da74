"""Progress lines for the long, once-per-corpus work (offset scans, index builds, passage encoding), on stderr.

On the paper's corpus (21M passages) a build takes minutes to hours; a process that says nothing meanwhile looks
hung. Loading a cached index says nothing: it takes seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

PREFIX = "[retrieval]"


def report(message: str) -> None:
    """One progress line on stderr (stdout stays for results: run.py's one line per iteration)."""
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


@contextmanager
def timed(what: str) -> Iterator[None]:
    """``what ...`` before the work, ``what: done in X s`` after it (nothing after a failure: its error says)."""
    report(f"{what} ...")
    start = time.perf_counter()
    yield
    report(f"{what}: done in {time.perf_counter() - start:.1f} s")


class Percent:
    """Counted work reported at every ``step`` of its total (10%, 20%, ...), each line once."""

    def __init__(self, what: str, total: int, step: float = 0.1) -> None:
        self.what, self.total, self.step = what, total, step
        self.reported = 0  # steps already reported

    def __call__(self, done: int) -> None:
        """``done`` of ``total`` items are finished."""
        steps = int(done / self.total / self.step + 1e-9) if self.total else 0
        if steps > self.reported:
            self.reported = steps
            report(f"{self.what}: {done}/{self.total} ({done / self.total:.0%})")
