"""``pipe``: ScheMoE's pipelined all-to-all, Pipe-A2A (ScheMoE §5, Fig. 7).

The flat all-to-all's Send/Recv pairs ``SR(i, j)`` split by whether ``j`` is on
this rank's node. Both halves are issued before either is waited on, on two
different process groups, so they run concurrently::

    inter = all_to_all(x without this node's blocks, this node's splits set to 0, EP group)   # issued
    intra = all_to_all(this node's blocks of x, intra group)                                 # issued
    y     = cat(wait(inter)[:before], wait(intra), wait(inter)[before:])                     # flat's order

Why the inter half runs on the EP group, not on the ``inter`` sub-group: it
talks straight to every rank on another node (ScheMoE's reference code issues
it on a second world-sized NCCL communicator), and the ``inter`` sub-group only
links ranks with the same local rank. Its same-node entries are zero-length,
which NCCL and gloo skip. Only this rank's splits are needed, so equal, unequal
and zero splits all work, eager and traced.

What overlaps: on CUDA/NCCL each process group has its own communicator and
internal stream; the functional collective enqueues on that stream and
``wait_tensor`` only makes the compute stream wait, so the two halves overlap on
the GPU (the Intra-Stream and Inter-Stream of the paper) and NVLink and the
network are busy together. On CPU/gloo each process group runs its work on its
own worker threads, so the two halves also run concurrently, but on one machine
both go over loopback through the same memory, so nothing is gained there.
Costs: the rows for other nodes are copied once on each side (the ``cat``s).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .base import AllToAll, flat_all_to_all, issue_all_to_all, local_splits, log_fallback, wait

__all__ = ["PipeAllToAll"]


class PipeAllToAll(AllToAll):
    name = "pipe"
    cost_model = "pipe"

    def __call__(self, x, output_split_sizes, input_split_sizes, topology) -> Tensor:
        if topology.num_nodes == 1 or topology.ranks_per_node == 1:
            log_fallback(self.name, f"{topology.num_nodes} node(s) of {topology.ranks_per_node} rank(s): nothing to pipeline")
            return flat_all_to_all(x, output_split_sizes, input_split_sizes, topology)
        plan = local_splits(x, output_split_sizes, input_split_sizes, topology.size)
        send, receive = plan.input, plan.output
        lo = topology.node_rank * topology.ranks_per_node
        hi = lo + topology.ranks_per_node
        zeros = [0] * topology.ranks_per_node
        start = sum(send[:lo])
        stop = start + sum(send[lo:hi])
        before = sum(receive[:lo])
        inter = issue_all_to_all(
            torch.cat([x[:start], x[stop:]]),
            receive[:lo] + zeros + receive[hi:],
            send[:lo] + zeros + send[hi:],
            topology.group.name,
        )
        intra = issue_all_to_all(x[start:stop], receive[lo:hi], send[lo:hi], topology.intra.name)
        inter, intra = wait(inter), wait(intra)
        return torch.cat([inter[:before], intra, inter[before:]])
