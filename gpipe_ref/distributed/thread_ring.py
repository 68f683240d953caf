"""A ring of ranks as threads in one process, for exercises on ring collectives (notebook 08, exercise 08.3).

``run_ring`` runs ``answer(flat, rank, world_size, exchange)`` on every rank at once; ``exchange`` is the ring's
one link: send a tensor to the right neighbour, receive the left neighbour's (as in notebook 01's ring).
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

__all__ = ["EXCHANGE_WAIT", "ring_buffers", "run_ring"]


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


EXCHANGE_WAIT = 5.0  # seconds a rank waits for the others at an exchange before the ring is declared stuck


def ring_buffers(world: int, chunk: int, seed: int) -> list[torch.Tensor]:
    """Each rank's flat gradient for a case: ``world`` chunks of ``chunk`` elements, seeded."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(world * chunk, generator=generator) for _ in range(world)]


def run_ring(answer, world: int, chunk: int, seed: int):
    """Run ``answer(flat, rank, world_size, exchange)`` on ``world`` ranks at once (threads) on
    ``ring_buffers(world, chunk, seed)``; ``exchange(t)`` sends ``t`` to the right neighbour and returns the left
    neighbour's. Returns ``{"shards": each rank's result, "sent": elements each rank sent}``, or a text saying
    what went wrong."""
    buffers = ring_buffers(world, chunk, seed)
    slots: list[torch.Tensor | None] = [None] * world
    results: list[Any] = [None] * world
    errors: list[str | BaseException | None] = [None] * world
    sent = [0] * world
    barrier = threading.Barrier(world, timeout=EXCHANGE_WAIT)

    def rank_main(rank: int) -> None:
        def exchange(tensor: torch.Tensor) -> torch.Tensor:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"exchange takes a tensor, got {type(tensor).__name__}")
            slots[rank] = tensor.detach().clone()
            sent[rank] += tensor.numel()
            barrier.wait()
            received = cast(torch.Tensor, slots[(rank - 1) % world]).clone()  # set before the barrier
            barrier.wait()
            return received

        try:
            results[rank] = answer(buffers[rank].clone(), rank, world, exchange)
        except threading.BrokenBarrierError:
            errors[rank] = "stuck"
        except BaseException as error:  # noqa: BLE001 - re-raised in the case's thread
            errors[rank] = error
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    raised = next((e for e in errors if isinstance(e, BaseException)), None)
    if raised is not None:
        raise raised
    if any(errors):
        calls = "the ranks called exchange a different number of times (each call waits for every rank)"
        return f"the ring got stuck: {calls}"
    for rank, result in enumerate(results):
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != (chunk,):
            return f"rank {rank} returned {_short(result)}: return this rank's shard, a tensor of shape " \
                   f"({chunk},)"
    return {"shards": [r.detach().float().clone() for r in results], "sent": sent}
