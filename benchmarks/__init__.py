"""Benchmarks: scripts that measure retrieval, generation, rollouts and learning and write docs/benchmarks.md (the
engineering figures) and the learning studies' READMEs under results/ (``studies.py``).

They may import ``experiments``, ``algos``, ``policies`` and ``envs``; nothing imports them.
"""
