"""Weighted mixtures: realised shares match the weights, the order is deterministic, resumes
bit-exactly mid-way and does not depend on the data-parallel size."""

import numpy as np
import pytest
import torch

from moetron.core.config import ConfigError
from moetron.data.loader import DataConfig, DataSource, MixtureSource
from moetron.data.sampler import GlobalBatchSampler, MixtureSampler
from moetron.data.tokenizer import DataError
from tests.data.token_writers import write_dolma_npy, write_megatron

SEQ = 8


@pytest.fixture
def two_sources(tmp_path, write_token_file):
    """Source "web" (ids 1..99, two moetron files, 120 samples) and "code" (ids 100..199, one Dolma
    file and one Megatron dataset, 25 samples): a row's ids tell which source it came from."""
    rng = np.random.default_rng(0)
    web = [write_token_file(tmp_path / f"web_{i}", rng.integers(1, 100, size=60 * SEQ + 1), vocab_size=300)
           for i in range(2)]
    code = [write_dolma_npy(tmp_path / "code_a.npy", [rng.integers(100, 200, size=15 * SEQ).tolist()]),
            write_megatron(tmp_path / "code_b", [rng.integers(100, 200, size=10 * SEQ + 1).tolist()])]
    return web, code


def mixture_config(two_sources, weights=(0.7, 0.3), seed=5, **kw):
    web, code = two_sources
    mixture = [MixtureSource(paths=web, weight=weights[0], name="web"), MixtureSource(paths=code, weight=weights[1])]
    return DataConfig(source=DataSource.files, mixture=mixture, seq_len=SEQ, global_batch_size=8, seed=seed, **kw)


def source_of_rows(batch):
    return (batch[:, 0] >= 100).long()  # 0 = web, 1 = code


def test_two_source_mixture_realises_its_weights(two_sources):
    data = mixture_config(two_sources).build(vocab_size=300)
    rows = torch.cat([source_of_rows(data.next_batch()) for _ in range(125)])  # 1000 sequences
    share_code = rows.float().mean().item()
    assert abs(share_code - 0.3) < 0.01 and len(rows) == 1000
    metrics = data.metrics()
    assert metrics["data/consumed_samples"] == 1000
    assert metrics["data/share/web"] == pytest.approx(1 - share_code) and metrics["data/share/code_a"] == pytest.approx(share_code)
    assert metrics["data/epochs/code_a"] == pytest.approx(300 / 25)  # the small source repeats
    # Weights need not sum to 1; every prefix of steps stays within one sample per source.
    sampler = MixtureSampler([10, 10, 10], [5, 3, 2], 7, seed=1)
    for step in range(1, 50):
        sampler.next_indices()
        assert np.all(np.abs(sampler.counts_M - np.array([0.5, 0.3, 0.2]) * 7 * step) < 1.0 + 1e-9)


def test_each_source_is_a_permutation_per_epoch():
    sampler = MixtureSampler([13, 40], [1, 1], 6, seed=2)
    got = np.concatenate([sampler.next_indices() for _ in range(13)])  # 78 samples, 39 each
    first = got[got < 13]
    # 3 epochs of the small source: every sample exactly 3 times (epoch ends may fall inside a
    # step, whose rows are shuffled), and no repeat in the 4 steps before the first epoch ends.
    assert len(first) == 39 and np.bincount(first).tolist() == [3] * 13 and len(set(first[:12].tolist())) == 12
    second = got[got >= 13]
    assert len(set(second.tolist())) == len(second) == 39  # no repeat within the first epoch of 40


@pytest.mark.parametrize("stop", [1, 7, 40])
def test_stop_and_resume_gives_the_same_batches(two_sources, stop):
    steps = 50  # past several epochs of the small source
    straight = mixture_config(two_sources).build(vocab_size=300)
    reference = [straight.next_batch() for _ in range(steps)]
    first = mixture_config(two_sources).build(vocab_size=300)
    got = [first.next_batch() for _ in range(stop)]
    state = first.state_dict()
    resumed = mixture_config(two_sources).build(vocab_size=300)  # a fresh process's loader
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(steps - stop)]
    assert all(torch.equal(a, b) for a, b in zip(reference, got)) and len(got) == steps
    assert resumed.metrics() == straight.metrics()


def test_ranks_union_is_the_single_rank_batch_and_resume_on_other_dp(two_sources):
    single = mixture_config(two_sources).build(vocab_size=300)
    ranks = [mixture_config(two_sources).build(vocab_size=300, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(9):
        assert torch.equal(single.next_batch(), torch.cat([d.next_batch() for d in ranks]))
    four = [mixture_config(two_sources).build(vocab_size=300, dp_rank=r, dp_size=4) for r in range(4)]
    for d in four:
        d.load_state_dict(ranks[0].state_dict())
    assert torch.equal(single.next_batch(), torch.cat([d.next_batch() for d in four]))


def test_resume_refuses_changed_mixture(two_sources):
    data = mixture_config(two_sources).build(vocab_size=300)
    data.next_batch()
    state = data.state_dict()
    with pytest.raises(DataError, match=r"checkpoint has weights=.*this run has weights="):
        mixture_config(two_sources, weights=(0.5, 0.5)).build(vocab_size=300).load_state_dict(state)
    with pytest.raises(DataError, match="checkpoint has seed=5"):
        mixture_config(two_sources, seed=6).build(vocab_size=300).load_state_dict(state)
    plain = GlobalBatchSampler(100, 8)
    with pytest.raises(DataError, match="written with data.mixture"):
        plain.load_state_dict(state["sampler"])
    with pytest.raises(DataError, match="written without a mixture"):
        data.sampler.load_state_dict(plain.state_dict())


def test_mixture_config_from_the_command_line_and_yaml(two_sources, tmp_path):
    web, code = two_sources
    cfg = DataConfig(source=DataSource.files)  # tools/pretrain.py spells the key --data.mixture
    cfg.apply_overrides([f"--mixture=[{{paths: [{web[0]}, {web[1]}], weight: 7, name: web}}, {{paths: {code[0]}, weight: 3}}]"])
    assert [(m.paths, m.weight, m.resolved_name()) for m in cfg.mixture] == [(web, 7.0, "web"), ([code[0]], 3.0, "code_a")]
    cfg.to_yaml(tmp_path / "c.yaml")
    assert DataConfig.from_yaml(tmp_path / "c.yaml").mixture == cfg.mixture
    assert MixtureSource(paths=["data/web/*.npy"]).resolved_name() == "web"


def test_mixture_validation(two_sources):
    web, code = two_sources
    with pytest.raises(ConfigError, match="train_paths and data.mixture both"):
        DataConfig(source=DataSource.files, train_paths=web, mixture=[MixtureSource(paths=code)]).validate()
    with pytest.raises(ConfigError, match=r"mixture\[1\].weight=0 must be a positive"):
        DataConfig(source=DataSource.files, mixture=[MixtureSource(paths=web), MixtureSource(paths=code, weight=0)]).validate()
    with pytest.raises(ConfigError, match="2 sources named 'web_0'"):
        DataConfig(source=DataSource.files, mixture=[MixtureSource(paths=web), MixtureSource(paths=web)]).validate()
    with pytest.raises(ConfigError, match=r"mixture\[0\] has no paths"):
        DataConfig(source=DataSource.files, mixture=[MixtureSource()]).validate()
    with pytest.raises(ConfigError, match="only read with data.source=files"):
        DataConfig(mixture=[MixtureSource(paths=web)]).validate()
