"""All-to-all algorithms (ScheMoE §3.1 AbsAlltoAll) and the registry the ``all_to_all`` option names.

Every algorithm returns, byte for byte, what one ``all_to_all_single`` on the
whole EP group returns, and is built from functional collectives, so it traces
and is differentiable (:mod:`.base`). They differ in the route the bytes take
over a :class:`Topology` of nodes (:mod:`.topology`):

==========  ==========================  ===============================================
name        class                       route
==========  ==========================  ===============================================
``flat``    :class:`FlatAllToAll`       one all-to-all on the EP group
``1dh``     :class:`OneDHierarchical`   gather to a node leader, leaders exchange, scatter (Hetu)
``2dh``     :class:`TwoDHierarchical`   intra-node then inter-node with stride copies (Tutel Alg. 3)
``pipe``    :class:`PipeAllToAll`       intra-node and inter-node halves issued together (ScheMoE §5)
==========  ==========================  ===============================================

Usage::

    topology = make_topology("world", ranks_per_node=8)      # on every rank, same order
    y = ALL_TO_ALLS["2dh"]()(x, None, None, topology)        # == all_to_all_single(x, None, None, group)
"""
from .base import AllToAll, HierarchicalAllToAll, flat_all_to_all
from .flat import FlatAllToAll
from .one_dh import OneDHierarchical
from .pipe import PipeAllToAll
from .topology import Topology, clear_topology_cache, make_topology
from .two_dh import TwoDHierarchical

ALL_TO_ALLS: dict[str, type[AllToAll]] = {
    cls.name: cls for cls in (FlatAllToAll, OneDHierarchical, TwoDHierarchical, PipeAllToAll)
}

__all__ = [
    "ALL_TO_ALLS",
    "AllToAll",
    "FlatAllToAll",
    "HierarchicalAllToAll",
    "OneDHierarchical",
    "PipeAllToAll",
    "Topology",
    "TwoDHierarchical",
    "clear_topology_cache",
    "flat_all_to_all",
    "make_topology",
]
