"""Prefix caching under tensor parallelism: two gloo ranks, each caching its own heads' K/V in blocks
chosen by rank 0, commit the same tokens as one rank, on a prefix hit as well as on a miss."""

from __future__ import annotations

import pytest
import torch
from helpers import import_test_file

_caching = import_test_file("engine/test_prefix_caching.py")
BS, PREFIX, _llm, _params = _caching.BS, _caching.PREFIX, _caching._llm, _caching._params

pytestmark = pytest.mark.usefixtures("single_threaded_workers")


@pytest.fixture(autouse=True)
def single_threaded_rank_zero():
    """Rank 0 (this process) on one thread as well: two threads waiting in every op for a core the
    other rank holds made the test take ~50 s instead of ~7 s on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _generate_with_a_hit(tiny: str, tp: int) -> tuple[list[list[int]], list[int]]:
    """A request alone, then one sharing the first two blocks of its prompt: (tokens, cached tokens)."""
    with _llm(tiny, True, max_num_seqs=1, tensor_parallel_size=tp) as llm:
        outs = [llm.generate([prompt], _params(), use_tqdm=False)[0]
                for prompt in (PREFIX + [60, 61, 62], PREFIX[:36] + [70, 71])]
        assert not llm.engine.has_unfinished() and llm.engine.kv.full.used == 0
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_two_ranks_with_prefix_caching_equal_one_rank(tiny):
    one, cached_one = _generate_with_a_hit(tiny, 1)
    two, cached_two = _generate_with_a_hit(tiny, 2)
    assert cached_one == cached_two == [0, 2 * BS]  # the second request hit the first's prefix
    assert all(len(tokens) == 16 for tokens in one)
    assert two == one
