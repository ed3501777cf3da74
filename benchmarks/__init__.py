"""Benchmarks: scripts that measure retrieval, generation, rollouts and learning and write docs/benchmarks.md.

They may import ``experiments``, ``algos``, ``policies`` and ``envs``; nothing imports them.
"""
