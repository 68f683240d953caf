"""Ring all-reduce built from point-to-point messages, for teaching.

Each of n ranks cuts its tensor into n chunks. Reduce-scatter: in n-1 steps
every rank sends one chunk to its right neighbour and adds the chunk arriving
from its left, so that rank r ends up holding the full sum of chunk r+1.
All-gather: in n-1 more steps the summed chunks travel round the ring. Each
rank sends 2(n-1)/n of the tensor, whatever n is: the reason rings scale
(Patarasuk & Yuan 2009; used by Horovod, Sergeev & Del Balso 2018, and NCCL).
The two halves also stand alone, in place on a flat buffer: ZeRO's reduce-scatter and all-gather.
Which chunk each rank sends when, and the ring run on plain numbers, live in :mod:`gpipe_ref.ring_steps` (no torch).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ring_steps import RING_PHASES, RingState, ring_chunk_to_send, ring_states

# the ring's steps re-exported: where notebooks and exercises find them
__all__ = ["RING_PHASES", "RingState", "check_same_shape", "ring_all_gather", "ring_all_reduce", "ring_chunk_to_send",
           "ring_reduce_scatter", "ring_states"]


def check_same_shape(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank, naming the shapes, if the ranks' tensors differ (instead of hanging)."""
    n = dist.get_world_size(group)
    mine = torch.zeros(9, dtype=torch.long)
    mine[0] = tensor.dim()
    mine[1:1 + min(tensor.dim(), 8)] = torch.tensor(tensor.shape[:8], dtype=torch.long)
    everyone = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(everyone, mine, group=group)
    shapes = [tuple(t[1:1 + int(t[0])].tolist()) for t in everyone]
    if len(set(shapes)) > 1:
        raise ValueError(f"tensor must have the same shape on every rank, got {shapes} (by rank)")


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum ``tensor`` over the ranks of ``group`` in place, by send/recv around a ring.

    Returns the bytes this rank sent. Equal to ``dist.all_reduce(tensor)`` for any
    size, including sizes the world size does not divide.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    n = dist.get_world_size(group)
    if n == 1:
        return 0
    rank = dist.get_rank(group)
    check_same_shape(tensor, group)
    right = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    left = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    flat = tensor.data.view(-1) if tensor.is_contiguous() else tensor.data.reshape(-1).clone()
    chunks = list(torch.tensor_split(flat, n))
    sent = 0

    def exchange(send_index: int, recv_index: int) -> torch.Tensor:
        nonlocal sent
        incoming = torch.empty_like(chunks[recv_index])
        requests = [dist.isend(chunks[send_index].contiguous(), right, group=group),
                    dist.irecv(incoming, left, group=group)]
        for request in requests:
            assert request is not None  # None only on a rank outside the group, and this rank is in it
            request.wait()
        sent += chunks[send_index].numel() * chunks[send_index].element_size()
        return incoming

    for step in range(n - 1):  # reduce-scatter
        send = ring_chunk_to_send(rank, step, n, "reduce_scatter")
        receive = (send - 1) % n
        chunks[receive] += exchange(send, receive)
    for step in range(n - 1):  # all-gather
        send = ring_chunk_to_send(rank, step, n, "all_gather")
        receive = (send - 1) % n
        chunks[receive].copy_(exchange(send, receive))
    if not tensor.is_contiguous():
        tensor.data.copy_(flat.view_as(tensor))
    return sent


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    requests = [dist.isend(send.contiguous(), right), dist.irecv(recv, left)]
    for request in requests:
        assert request is not None  # None only on a rank outside the world, and this rank is in it
        request.wait()


def ring_reduce_scatter(flat: torch.Tensor) -> int:
    """Sum ``flat`` (N equal chunks) over the ranks by a ring, in place: afterwards chunk r of rank r holds the
    sum of every rank's chunk r (the other chunks hold partial sums). Returns the bytes this rank sent."""
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = flat.view(n, -1)
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):  # send the chunk summed so far, add the left neighbour's to the next one
        send, receive = (rank - step - 1) % n, (rank - step - 2) % n  # the last step completes chunk `rank`
        _exchange(chunks[send], incoming, (rank + 1) % n, (rank - 1) % n)
        chunks[receive] += incoming
    return (n - 1) * chunks[0].nbytes


def ring_all_gather(flat: torch.Tensor) -> int:
    """Chunk r of rank r travels round the ring to every rank, in place. Returns the bytes this rank sent."""
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = flat.view(n, -1)
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):  # pass on the chunk received last (first: our own)
        send, receive = (rank - step) % n, (rank - step - 1) % n
        _exchange(chunks[send], incoming, (rank + 1) % n, (rank - 1) % n)
        chunks[receive].copy_(incoming)
    return (n - 1) * chunks[0].nbytes
