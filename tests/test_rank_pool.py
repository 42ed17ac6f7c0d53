"""The kept ranks' pool (`autopar.testing.rank_pool`): a rank's native crash is named as
the cause of its peers' failures (they fail in their next collective, "Connection closed
by peer", which names nothing), with the crashed thread's Python stack."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from autopar.testing.parity import test_backend
from autopar.testing.rank_pool import RankPool


def _abort_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os.abort()  # what glibc does on heap corruption
    dist.barrier()


@pytest.mark.multiproc
@pytest.mark.own_ranks
def test_a_crashed_rank_is_named_with_its_signal() -> None:
    pool = RankPool(2, test_backend(2))
    try:
        with pytest.raises(RuntimeError, match=r"rank 1 died \(SIGABRT; its native error") as e:
            pool.run(_abort_on_rank_1, (), timeout_s=120.0)
        # the crashed thread's Python stack, which the peers' errors do not show
        assert "Fatal Python error: Aborted" in str(e.value)
        assert "in _abort_on_rank_1" in str(e.value)
    finally:
        pool.close()
