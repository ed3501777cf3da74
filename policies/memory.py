"""Peak memory of a stretch of work (a learner update, a benchmark phase), per device.

CUDA: ``torch.cuda.max_memory_allocated`` of the device, reset at the start: the tensors alone (the caching
allocator's reserve and the CUDA context are not counted). CPU: the process's peak resident set size (Linux's
``VmHWM``, reset at the start through ``/proc/self/clear_refs``): the whole process, weights, Python and libraries
included; where it cannot be reset, the peak since the process started (``getrusage``).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch

from policies.memory_plan import GIB

_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")
_RESET_PEAK_RSS = "5"  # proc(5): writing 5 to clear_refs resets the peak resident set size


def reset_peak_memory(device: torch.device | str) -> None:
    """Start measuring: wait for queued GPU work and reset the device's peak counter."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    elif _CLEAR_REFS.exists():
        with contextlib.suppress(OSError):  # not permitted here: the peak since the start of the process then
            _CLEAR_REFS.write_text(_RESET_PEAK_RSS)


def peak_memory_gib(device: torch.device | str) -> float:
    """GiB at the peak since :func:`reset_peak_memory` (see the module docstring for what is counted)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    if _STATUS.exists():
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB  # bytes on macOS, KiB elsewhere


def release_cached_memory(device: torch.device | str) -> None:
    """Hand the CUDA caching allocator's unused blocks back to the driver (``torch.cuda.empty_cache``; nothing on
    another device): after the learner's build, whose transients would otherwise stay reserved, out of reach of an
    engine that starts later on the same GPU."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
