"""``2dh``: Tutel's two-dimensional hierarchical all-to-all (Tutel §4.3, Algorithm 3).

Intra-node all-to-all first, then inter-node all-to-all, each preceded by a
stride memory copy that groups the blocks by the peer of the next step. With
``N`` nodes of ``M`` ranks, rank ``(n, l)``, blocks named by (source, destination)
rank and written ``[a][b]`` for "a-major, then b"::

    x                            blocks to (n', l')       layout [n'][l']
    stride copy                                           layout [l'][n']
    all-to-all on intra (M)      from (n, l_s) to (n', l) layout [l_s][n']
    stride copy (layout transform)                        layout [n'][l_s]
    all-to-all on inter (N)      from (n_s, l_s) to (n, l) layout [n_s][l_s]  = flat's output

The inter-node step has ``N - 1`` peers instead of ``P - M`` (merged messages, fewer
latencies α), at the price of two copies and every byte crossing the node twice.
"""
from __future__ import annotations

import itertools

from torch import Tensor

from .base import HierarchicalAllToAll, all_to_all, grid_order, permute_blocks, reorder_blocks

__all__ = ["TwoDHierarchical"]


class TwoDHierarchical(HierarchicalAllToAll):
    name = "2dh"
    cost_model = "2dh"

    def equal_splits(self, x, rows, topology) -> Tensor:
        n_nodes, m = topology.num_nodes, topology.ranks_per_node
        buf = permute_blocks(x, (n_nodes, m), (1, 0), rows)                                      # [l'][n']
        recv = all_to_all(buf, [n_nodes * rows] * m, [n_nodes * rows] * m, topology.intra.name)  # [l_s][n']
        buf = permute_blocks(recv, (m, n_nodes), (1, 0), rows)                                   # [n'][l_s]
        return all_to_all(buf, [m * rows] * n_nodes, [m * rows] * n_nodes, topology.inter.name)  # [n_s][l_s]

    def split_matrix(self, x, matrix, topology) -> Tensor:
        n_nodes, m, r = topology.num_nodes, topology.ranks_per_node, topology.rank
        node, local = topology.node_rank, topology.local_rank

        def rows(src_node, src_local, dst_node, dst_local):
            return matrix[src_node * m + src_local][dst_node * m + dst_local]

        buf = reorder_blocks(x, list(matrix[r]), grid_order((n_nodes, m), (1, 0)))
        send = [sum(rows(node, local, n2, l2) for n2 in range(n_nodes)) for l2 in range(m)]
        got = [rows(node, ls, n2, local) for ls, n2 in itertools.product(range(m), range(n_nodes))]   # [l_s][n']
        receive = [sum(got[ls * n_nodes:(ls + 1) * n_nodes]) for ls in range(m)]
        recv = all_to_all(buf, receive, send, topology.intra.name)
        buf = reorder_blocks(recv, got, grid_order((m, n_nodes), (1, 0)))                            # [n'][l_s]
        send = [sum(got[ls * n_nodes + n2] for ls in range(m)) for n2 in range(n_nodes)]
        receive = [sum(rows(ns, ls, node, local) for ls in range(m)) for ns in range(n_nodes)]
        return all_to_all(buf, receive, send, topology.inter.name)
