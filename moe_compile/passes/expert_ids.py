"""Expert ids: the router's choices followed from its selection to the ids the experts are indexed by.

The selection's indices are followed through integer reshapes to ``[T, k]`` and ``cat`` along the last dim
(sparsemixer picks one expert at a time: ``cat((ids_1, ids_2), -1)``), and through a skip expert's
``masked_fill`` (Zaya's skip expert, LongCat-Flash's zero-computation experts: the router's last classes compute
nothing, their choices become a real expert with weight 0)::

    Before:  _, idx = topk(scores, 1); idx2 = ...; ids = cat((idx, idx2), -1)
             ids = ids.masked_fill(ids == E, 0)                 # Zaya: class E is the skip expert
    Read:    extend_ids(idx) -> the masked_fill; skip_fill(it, E + 1) -> 1 (one skip class)

Used by :mod:`.routing` (:func:`~.routing.read_router`) and its gate-weight walk.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .graph_utils import example_value, is_call, same_size, shape_of

__all__ = ["extend_ids", "skip_fill"]


def extend_ids(ids: Node, num_tokens, num_classes=None) -> Node:
    """Follow the selection's indices through integer reshapes to ``[T, k]``, ``cat`` along the last dim
    (one pick per ``max``, concatenated) and a skip expert's ``masked_fill`` (:func:`skip_fill`) to the ids
    the experts are indexed by."""
    while True:
        nxt = [u for u in ids.users if _ids_step(u, ids, num_tokens) or skip_fill(u, num_classes, ids)]
        if len(nxt) != 1:
            return ids
        ids = nxt[0]


def skip_fill(node: Node, num_classes, ids: Node | None = None) -> int:
    """``x.masked_fill(ids == E - 1, c)``: Zaya's skip expert, the router's last class (``E - 1`` of its
    ``E`` scores), that computes nothing: its choices' ids become a real expert (``c`` in ``[0, E - 1)``) and
    their weights 0. ``x.masked_fill(ids >= E - Z, c)``: the last Z classes so (LongCat-Flash's
    zero-computation experts, whose tokens the model adds back itself). Returns Z (0: no such fill).
    ``ids``: only when ``node`` fills them (else: any ``x``, the weights with ``c = 0``)."""
    if num_classes is None or not is_call(node, torch.masked_fill, method=("masked_fill",)) or len(node.args) != 3:
        return 0
    source, mask, fill = node.args
    if ids is not None and source is not ids:
        return 0
    if is_call(mask, operator.eq, torch.eq, method=("eq",)) and len(mask.args) == 2:
        chosen, cls = mask.args
        if not isinstance(cls, int) or not same_size(num_classes - 1, cls):
            return 0
        count = 1
    elif is_call(mask, operator.ge, torch.ge, method=("ge",)) and len(mask.args) == 2:
        chosen, cls = mask.args
        if not isinstance(cls, int) or cls < 1 or not statically_known_true(num_classes - cls >= 1):
            return 0
        count = num_classes - cls
    else:
        return 0
    value = example_value(source)
    if not isinstance(chosen, Node) or example_value(chosen) is None or example_value(chosen).is_floating_point():
        return 0
    if value.is_floating_point():
        return count if fill == 0 else 0
    return count if isinstance(fill, int) and 0 <= fill < cls and source is chosen else 0


def _ids_step(user: Node, ids: Node, num_tokens) -> bool:
    shape = shape_of(user)
    value = example_value(user)
    if shape is None or len(shape) != 2 or value.is_floating_point() or not same_size(shape[0], num_tokens):
        return False
    if is_call(user, torch.cat, torch.concat, method=()):
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        return dim in (-1, 1)
    return is_call(user, method=("unsqueeze", "view", "reshape", "long", "int", "to")) and user.args[0] is ids
