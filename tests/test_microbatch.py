"""microbatch.py: scatter a batch into m micro-batches and gather them back."""

from __future__ import annotations

import pytest
import torch

from gpipe_ref.microbatch import gather, scatter, sizes


@pytest.mark.parametrize("n,chunks", [(n, c) for n in range(1, 12) for c in range(1, n + 1)])
def test_scatter_gives_exactly_chunks_pieces_differing_by_at_most_one(n, chunks):
    x = torch.arange(n * 2).reshape(n, 2)
    parts = scatter(x, chunks)
    assert len(parts) == chunks
    assert [len(p) for p in parts] == sizes(x, chunks)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [len(p) for p in parts] == [n // chunks + 1] * (n % chunks) + [n // chunks] * (chunks - n % chunks)
    assert torch.equal(gather(parts), x)


def test_scatter_tuples():
    x, y = torch.randn(5, 3), torch.randn(5)
    parts = scatter((x, y), 2)
    assert [tuple(t.shape[0] for t in p) for p in parts] == [(3, 3), (2, 2)]
    gx, gy = gather(parts)
    assert torch.equal(gx, x) and torch.equal(gy, y)


@pytest.mark.parametrize("batch,chunks,error,message", [
    ([1, 2], 1, TypeError, "batch must be a tensor or a tuple of tensors, got list"),
    ((torch.ones(2), "x"), 1, TypeError, "got tuple holding"),
    (torch.ones(4), 5, ValueError, r"chunks must be an integer in \[1, 4\], got 5"),
    (torch.ones(4), 0, ValueError, r"chunks must be an integer in \[1, 4\], got 0"),
    ((torch.ones(4), torch.ones(3)), 1, ValueError, r"must share the batch size \(dim 0\), got sizes \[4, 3\]"),
    (torch.tensor(3.0), 1, ValueError, "must have a batch dimension"),
])
def test_scatter_bad_input(batch, chunks, error, message):
    with pytest.raises(error, match=message):
        scatter(batch, chunks)
