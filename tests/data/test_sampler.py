import numpy as np
import pytest

from moetron.core.config import ConfigError
from moetron.data.sampler import GlobalBatchSampler
from moetron.data.tokenizer import DataError


def reference_steps(num_samples, global_batch, seed, num_steps):
    """Independent reference: the documented order, written as a plain loop."""
    steps, epoch = [], 0
    while len(steps) < num_steps:
        perm = np.random.Generator(np.random.PCG64(seed + epoch)).permutation(num_samples)
        for s in range(num_samples // global_batch):
            steps.append(perm[s * global_batch : (s + 1) * global_batch].tolist())
        epoch += 1
    return steps[:num_steps]


def take(sampler, n):
    return [sampler.next_indices().tolist() for _ in range(n)]


def test_order_matches_reference_and_drops_tail():
    s = GlobalBatchSampler(num_samples=23, global_batch_size=4, seed=3)
    got = take(s, 12)  # 5 steps per epoch (3 samples dropped): crosses two epoch boundaries
    assert got == reference_steps(23, 4, 3, 12)
    first_epoch = sum(got[:5], [])
    assert len(set(first_epoch)) == 20 and got[5] != got[0]
    assert s.consumed_samples == 48


def test_seed_determinism():
    a = take(GlobalBatchSampler(100, 8, seed=0), 5)
    b = take(GlobalBatchSampler(100, 8, seed=0), 5)
    c = take(GlobalBatchSampler(100, 8, seed=1), 5)
    assert a == b and a != c


@pytest.mark.parametrize("dp_size", [2, 4, 8])
def test_union_of_ranks_is_single_rank(dp_size):
    single = take(GlobalBatchSampler(50, 8, seed=7), 9)
    ranks = [take(GlobalBatchSampler(50, 8, dp_rank=r, dp_size=dp_size, seed=7), 9) for r in range(dp_size)]
    for step in range(9):
        assert sum((ranks[r][step] for r in range(dp_size)), []) == single[step]
        assert all(len(ranks[r][step]) == 8 // dp_size for r in range(dp_size))


@pytest.mark.parametrize("stop", [2, 6, 7])  # mid-epoch, exactly at the epoch end (6 steps/epoch), after it
def test_resume_gives_exact_continuation(stop):
    full = take(GlobalBatchSampler(30, 5, seed=11), 15)
    s = GlobalBatchSampler(30, 5, seed=11)
    take(s, stop)
    state = s.state_dict()
    assert state["consumed_samples"] == stop * 5 and state["seed"] == 11
    resumed = GlobalBatchSampler(30, 5, seed=11)
    resumed.load_state_dict(state)
    assert take(resumed, 15 - stop) == full[stop:]


def test_resume_on_another_dp_size():
    full = take(GlobalBatchSampler(40, 8, seed=5), 10)
    s = GlobalBatchSampler(40, 8, dp_rank=1, dp_size=2, seed=5)
    take(s, 7)
    state = s.state_dict()
    ranks = []
    for r in range(4):
        t = GlobalBatchSampler(40, 8, dp_rank=r, dp_size=4, seed=5)
        t.load_state_dict(state)
        ranks.append(take(t, 3))
    for step in range(3):
        assert sum((ranks[r][step] for r in range(4)), []) == full[7 + step]


def test_resume_refuses_changed_data_or_batch():
    s = GlobalBatchSampler(40, 8, seed=5)
    take(s, 2)
    state = s.state_dict()
    for kwargs in (dict(num_samples=41, global_batch_size=8, seed=5), dict(num_samples=40, global_batch_size=4, seed=5),
                   dict(num_samples=40, global_batch_size=8, seed=6)):
        with pytest.raises(DataError, match="the data or batch changed since the checkpoint"):
            GlobalBatchSampler(**kwargs).load_state_dict(state)


def test_bad_sizes():
    with pytest.raises(ConfigError, match=r"global_batch_size=10 is not divisible by dp_size=4.*8, 12.*1, 2, 5, 10"):
        GlobalBatchSampler(100, 10, dp_rank=0, dp_size=4)
    with pytest.raises(DataError, match="fewer than one global batch"):
        GlobalBatchSampler(3, 4)
    with pytest.raises(ConfigError):
        GlobalBatchSampler(100, 4, dp_rank=2, dp_size=2)
