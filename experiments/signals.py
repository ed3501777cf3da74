"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (``timeout``, job schedulers) without losing work.

The first signal stops the run: at once (``StopRequested`` is raised where the main thread is) when
``can_interrupt()`` says that is safe, otherwise at the next ``check()``. Every later signal is reported on one
line and ignored, so a second Ctrl-C cannot interrupt the checkpoint being saved. The exit status follows the
shell's convention, 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TextIO

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopRequested(BaseException):
    """A stop signal arrived (a BaseException, like KeyboardInterrupt, so ``except Exception`` lets it pass)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class GracefulStop:
    """Context manager that turns SIGINT / SIGTERM into one orderly stop; the old handlers come back on exit."""

    def __init__(self, can_interrupt: Callable[[], bool] = lambda: True, stream: TextIO | None = None) -> None:
        self.can_interrupt = can_interrupt
        self.stream = stream
        self.requested: int | None = None  # the first signal's number
        self._raised = False
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int:
        return 128 + self.requested if self.requested is not None else 0

    def __enter__(self) -> GracefulStop:
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> bool:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False

    def _say(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            self._say(f"{name}: already stopping (saving the checkpoint); wait for it to finish")
            return
        self.requested = signum
        if self.can_interrupt():
            self._raised = True
            raise StopRequested(signum)
        self._say(f"{name}: stopping after the current update")

    def check(self) -> None:
        """Raise ``StopRequested`` if a signal arrived that could not interrupt at once."""
        if self.requested is not None and not self._raised:
            self._raised = True
            raise StopRequested(self.requested)
