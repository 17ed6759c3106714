"""``pipe``: ScheMoE's pipelined all-to-all, Pipe-A2A (ScheMoE §5, Fig. 7).

The flat all-to-all's Send/Recv pairs ``SR(i, j)`` split by whether ``j`` is on
this rank's node. Both halves are issued before either is waited on, on two
different process groups, so they run concurrently::

    head, local, tail = x.split(rows for the nodes before / this node / the nodes after)
    inter = all_to_all(cat(head, tail), this node's splits set to 0, EP group)   # issued
    intra = all_to_all(local, intra group)                                      # issued
    before, after = wait(inter).split(rows from the nodes before / after)
    y = cat(before, wait(intra), after)                                         # flat's order

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
            shape = f"{topology.num_nodes} node(s) of {topology.ranks_per_node} rank(s)"
            log_fallback(self.name, f"{shape}: one of the two halves is empty")
            return flat_all_to_all(x, output_split_sizes, input_split_sizes, topology)
        plan = local_splits(x, output_split_sizes, input_split_sizes, topology.size)
        send, receive = plan.input, plan.output
        lo = topology.node_rank * topology.ranks_per_node
        hi = lo + topology.ranks_per_node
        zeros = [0] * topology.ranks_per_node
        # split, not slices: each piece has one user, so the backward is a cat, never a sum
        # of zero-filled slice gradients (x + 0.0 turns -0.0 into +0.0 and can change the
        # bits of a compressed payload that travels as float words)
        head, local, tail = x.split([sum(send[:lo]), sum(send[lo:hi]), sum(send[hi:])])
        inter = issue_all_to_all(
            torch.cat([head, tail]), receive[:lo] + zeros + receive[hi:], send[:lo] + zeros + send[hi:],
            topology.group.name,
        )
        intra = issue_all_to_all(local, receive[lo:hi], send[lo:hi], topology.intra.name)
        inter, intra = wait(inter), wait(intra)
        before, after = inter.split([sum(receive[:lo]), sum(receive[hi:])])
        return torch.cat([before, intra, after])
