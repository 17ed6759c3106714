"""Counters of what the backend did, process-wide: ``moe_compile.counters``.

Keys: ``graphs`` (graphs compiled), ``regions_found``, ``regions_rewritten``,
``regions_skipped`` and ``pattern:<name>`` per matched pattern. Tests and users
read them after a compile; ``counters.clear()`` resets.
"""
from collections import Counter

counters: Counter[str] = Counter()
