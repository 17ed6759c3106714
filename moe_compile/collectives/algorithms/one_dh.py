"""``1dh``: Hetu's one-dimensional hierarchical all-to-all, as ScheMoE runs it (§2.3, §6.4).

Each node's local rank 0 is its leader. Every rank's whole input is gathered at
the leader, the leaders exchange among themselves, the leaders scatter. With
``N`` nodes of ``M`` ranks, on node ``n``::

    gather: all-to-all on intra, everything to l=0  leader holds [l_s][n'][l']
    layout transform                                 [n'][l_s][l']
    all-to-all among leaders (inter of l=0)          [n_s][l_s][l']    (from (n_s,l_s) to (n,l'))
    reverse layout transform                         [l'][n_s][l_s]
    scatter: all-to-all on intra, from l=0           rank (n,l') holds [n_s][l_s] = flat's output

Every byte goes through one leader per node, which makes 1DH the slowest of the
four for all but small messages (ScheMoE Fig. 9). Non-leaders skip the middle
step, so the traced graph of a leader and of a non-leader differ (each rank
compiles its own; both are SPMD-consistent).
"""
from __future__ import annotations

import itertools

from torch import Tensor

from .base import HierarchicalAllToAll, all_to_all, grid_order, permute_blocks, reorder_blocks

__all__ = ["OneDHierarchical"]


class OneDHierarchical(HierarchicalAllToAll):
    name = "1dh"
    cost_model = "1dh"

    def equal_splits(self, x, rows, topology) -> Tensor:
        n_nodes, m, p = topology.num_nodes, topology.ranks_per_node, topology.size
        leader = topology.local_rank == 0
        nothing = [0] * (m - 1)
        gathered = all_to_all(x, [p * rows] * m if leader else [0] * m, [p * rows] + nothing, topology.intra.name)
        if leader:
            buf = permute_blocks(gathered, (m, n_nodes, m), (1, 0, 2), rows)
            recv = all_to_all(buf, [m * m * rows] * n_nodes, [m * m * rows] * n_nodes, topology.inter.name)
            gathered = permute_blocks(recv, (n_nodes, m, m), (2, 0, 1), rows)
        return all_to_all(gathered, [p * rows] + nothing, [p * rows] * m if leader else [0] * m, topology.intra.name)

    def split_matrix(self, x, matrix, topology) -> Tensor:
        n_nodes, m, r = topology.num_nodes, topology.ranks_per_node, topology.rank
        node = topology.node_rank
        leader = topology.local_rank == 0
        nothing = [0] * (m - 1)
        grid = itertools.product

        def rows(src_node, src_local, dst_node, dst_local):
            return matrix[src_node * m + src_local][dst_node * m + dst_local]

        receive = [sum(matrix[node * m + ls]) for ls in range(m)] if leader else [0] * m
        gathered = all_to_all(x, receive, [sum(matrix[r])] + nothing, topology.intra.name)
        send_back = [0] * m
        if leader:
            held = [rows(node, ls, n2, l2) for ls, n2, l2 in grid(range(m), range(n_nodes), range(m))]
            buf = reorder_blocks(gathered, held, grid_order((m, n_nodes, m), (1, 0, 2)))
            send = [sum(rows(node, ls, n2, l2) for ls, l2 in grid(range(m), range(m))) for n2 in range(n_nodes)]
            got = [rows(ns, ls, node, l2) for ns, ls, l2 in grid(range(n_nodes), range(m), range(m))]
            receive = [sum(got[ns * m * m:(ns + 1) * m * m]) for ns in range(n_nodes)]
            recv = all_to_all(buf, receive, send, topology.inter.name)
            gathered = reorder_blocks(recv, got, grid_order((n_nodes, m, m), (2, 0, 1)))
            send_back = [sum(rows(ns, ls, node, l2) for ns, ls in grid(range(n_nodes), range(m))) for l2 in range(m)]
        return all_to_all(gathered, [sum(row[r] for row in matrix)] + nothing, send_back, topology.intra.name)
