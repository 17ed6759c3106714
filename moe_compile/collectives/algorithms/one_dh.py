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
four for all but small messages (ScheMoE Fig. 9).

Every rank runs the same ops: a non-leader holds zero rows between the gather
and the scatter and joins a zero-byte exchange on its own ``inter`` group (one
latency α, concurrent with the leaders'). Only split sizes differ between a
leader's graph and a non-leader's, so passes that reason about the collectives
of a graph (AOTAutograd's partitioner, which copies forward collectives into the
backward; ``drop_dead_collectives``) decide the same on every rank. With the
middle step on leaders only, they did not, and the ranks' collectives stopped
matching in a compiled training step.
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
        held = rows if topology.local_rank == 0 else 0  # rows per block a rank holds between gather and scatter
        nothing = [0] * (m - 1)
        gathered = all_to_all(x, [p * held] * m, [p * rows] + nothing, topology.intra.name)     # [l_s][n'][l']
        buf = permute_blocks(gathered, (m, n_nodes, m), (1, 0, 2), held)                        # [n'][l_s][l']
        recv = all_to_all(buf, [m * m * held] * n_nodes, [m * m * held] * n_nodes, topology.inter.name)
        buf = permute_blocks(recv, (n_nodes, m, m), (2, 0, 1), held)                            # [l'][n_s][l_s]
        return all_to_all(buf, [p * rows] + nothing, [p * held] * m, topology.intra.name)

    def split_matrix(self, x, matrix, topology) -> Tensor:
        n_nodes, m, r = topology.num_nodes, topology.ranks_per_node, topology.rank
        node = topology.node_rank
        leader = topology.local_rank == 0
        nothing = [0] * (m - 1)
        grid = itertools.product

        def held(src_node, src_local, dst_node, dst_local):  # rows of a block this rank holds mid-way
            return matrix[src_node * m + src_local][dst_node * m + dst_local] if leader else 0

        sent = [held(node, ls, n2, l2) for ls, n2, l2 in grid(range(m), range(n_nodes), range(m))]    # [l_s][n'][l']
        receive = [sum(sent[ls * n_nodes * m:(ls + 1) * n_nodes * m]) for ls in range(m)]
        gathered = all_to_all(x, receive, [sum(matrix[r])] + nothing, topology.intra.name)
        buf = reorder_blocks(gathered, sent, grid_order((m, n_nodes, m), (1, 0, 2)))                # [n'][l_s][l']
        send = [sum(held(node, ls, n2, l2) for ls, l2 in grid(range(m), range(m))) for n2 in range(n_nodes)]
        got = [held(ns, ls, node, l2) for ns, ls, l2 in grid(range(n_nodes), range(m), range(m))]    # [n_s][l_s][l']
        receive = [sum(got[ns * m * m:(ns + 1) * m * m]) for ns in range(n_nodes)]
        recv = all_to_all(buf, receive, send, topology.inter.name)
        buf = reorder_blocks(recv, got, grid_order((n_nodes, m, m), (2, 0, 1)))                     # [l'][n_s][l_s]
        send = [sum(held(ns, ls, node, l2) for ns, ls in grid(range(n_nodes), range(m))) for l2 in range(m)]
        return all_to_all(buf, [sum(row[r] for row in matrix)] + nothing, send, topology.intra.name)
