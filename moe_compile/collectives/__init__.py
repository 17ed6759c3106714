"""Collectives of expert parallelism: the EP group and the all-to-all emitted into graphs.

- :mod:`.group`: ``options["ep_group"]`` → :class:`EPGroup` (name, size P, rank).
- :mod:`.nodes`: the flat all-to-all (one ``all_to_all_single``) and the small
  all-reduce that agrees on a capacity, as functional-collective graph nodes.
- :mod:`.compressors`: the compressor registry and the ``moe::compress`` /
  ``moe::decompress`` ops around the all-to-all.
"""
from .compressors import Compressor, compressor_names, get_compressor, register_compressor
from .nodes import emit_all_reduce_max, emit_all_to_all
from .group import EPGroup, resolve_group

__all__ = [
    "Compressor",
    "EPGroup",
    "compressor_names",
    "emit_all_reduce_max",
    "emit_all_to_all",
    "get_compressor",
    "register_compressor",
    "resolve_group",
]
