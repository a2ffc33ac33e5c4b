import numpy as np
import pytest
import torch

from moetron.core.config import ConfigError
from moetron.data.dataset import PackedDataset
from moetron.data.loader import DataConfig, DataSource
from moetron.data.sampler import GlobalBatchSampler
from moetron.data.tokenizer import DataError


@pytest.fixture
def token_files(tmp_path, write_token_file):
    rng = np.random.default_rng(0)
    train = [write_token_file(tmp_path / f"train_{i}", rng.integers(0, 300, size=400 + 37 * i), vocab_size=300,
                              tokenizer="tok.model") for i in range(3)]
    val = write_token_file(tmp_path / "val", rng.integers(0, 300, size=300), vocab_size=300)
    return train, val


def files_config(token_files, **kw):
    train, val = token_files
    return DataConfig(source=DataSource.files, train_paths=train, val_paths=[val], seq_len=16, global_batch_size=8, seed=3, **kw)


def test_validate_messages(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="data.source=files needs data.train_paths"):
        DataConfig(source=DataSource.files).validate()
    with pytest.raises(ConfigError, match="only read with data.source=files"):
        DataConfig(train_paths=["x"]).validate()
    with pytest.raises(ConfigError, match="seq_len=0 must be positive"):
        DataConfig(seq_len=0).validate()
    with pytest.raises(ConfigError, match="corpus_vocab_size=100 is too small"):
        DataConfig(corpus_vocab_size=100).validate()
    monkeypatch.setenv("MOETRON_DATA_DIR", str(tmp_path / "env_dir"))
    assert DataConfig().data_dir == str(tmp_path / "env_dir")
    monkeypatch.delenv("MOETRON_DATA_DIR")
    assert DataConfig().data_dir == "data_cache"
    cfg = DataConfig.from_dict({"source": "files", "train_paths": "a,b", "global_batch_size": "32"})
    assert cfg.source is DataSource.files and cfg.train_paths == ["a", "b"] and cfg.global_batch_size == 32


def hand_windows(prefixes, seq_len):
    """Every sample of the files, sliced by hand from the raw .bin files (the documented layout)."""
    windows = []
    for p in prefixes:
        tokens = np.fromfile(p + ".bin", dtype="<u2").astype(np.int64)
        windows += [tokens[j * seq_len : j * seq_len + seq_len + 1] for j in range((len(tokens) - 1) // seq_len)]
    return windows


def test_files_source_batches_follow_sampler(token_files):
    cfg = files_config(token_files)
    data = cfg.build(vocab_size=300)
    ds = PackedDataset(token_files[0], 16, 300)
    ref = GlobalBatchSampler(len(ds), 8, seed=3)
    windows = hand_windows(token_files[0], 16)
    steps_per_epoch = len(windows) // 8
    for step in range(len(ds) // 8 + 3):  # past an epoch boundary
        batch = data.next_batch()
        assert batch.shape == (8, 17) and batch.dtype == torch.int64
        assert torch.equal(batch, ds.get_batch(ref.next_indices()))
        # Independent of the loader's code: the documented order over hand-sliced windows.
        epoch, t = divmod(step, steps_per_epoch)
        perm = np.random.Generator(np.random.PCG64(3 + epoch)).permutation(len(windows))
        assert batch.numpy().tolist() == [windows[i].tolist() for i in perm[t * 8 : (t + 1) * 8]]
    assert data.num_train_tokens == 400 + 437 + 474
    assert data.tokenizer_path.endswith("tok.model")
    with pytest.raises(DataError, match="vocab_size is 200"):
        cfg.build(vocab_size=200)


def test_dp_ranks_union_and_resume_on_other_dp(token_files):
    cfg = files_config(token_files)
    single = cfg.build(300)
    full = [single.next_batch() for _ in range(6)]
    ranks = [cfg.build(300, dp_rank=r, dp_size=2) for r in range(2)]
    for step in range(4):
        parts = [r.next_batch() for r in ranks]
        assert all(p.shape == (4, 17) for p in parts)
        assert torch.equal(torch.cat(parts), full[step])
    state = ranks[0].state_dict()
    resumed = [cfg.build(300, dp_rank=r, dp_size=4) for r in range(4)]
    for r in resumed:
        r.load_state_dict(state)
    for step in (4, 5):
        assert torch.equal(torch.cat([r.next_batch() for r in resumed]), full[step])
    with pytest.raises(ConfigError, match="not divisible by dp_size=3"):
        cfg.build(300, dp_rank=0, dp_size=3)
    changed = files_config(token_files).replace(global_batch_size=4).build(300)
    with pytest.raises(DataError, match="changed since the checkpoint"):
        changed.load_state_dict(state)


def test_val_batches_fixed_and_sharded(token_files):
    cfg = files_config(token_files)
    data = cfg.build(300)
    first = data.val_batches(4)
    data.next_batch()
    again = data.val_batches(4)
    assert len(first) == (299 // 16) // 4 and all(b.shape == (4, 17) for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # Every val sample appears at most once, and the union over ranks is the dp=1 set.
    val_ds = PackedDataset([token_files[1]], 16, 300)
    rows = {tuple(val_ds[i].tolist()) for i in range(len(val_ds))}
    seen = [tuple(r.tolist()) for b in first for r in b]
    assert len(set(seen)) == len(seen) and set(seen) <= rows
    shards = [cfg.build(300, dp_rank=r, dp_size=2).val_batches(4) for r in range(2)]
    for b, full in enumerate(first):
        assert torch.equal(torch.cat([shards[0][b], shards[1][b]]), full)
    assert len(data.val_batches(4, max_batches=2)) == 2
    with pytest.raises(DataError, match="fewer than one val batch"):
        data.val_batches(1000)
    no_val = DataConfig(source=DataSource.files, train_paths=token_files[0], seq_len=16, global_batch_size=8).build(300)
    with pytest.raises(DataError, match="no held-out data"):
        no_val.val_batches(4)


def test_missing_train_path(tmp_path):
    cfg = DataConfig(source=DataSource.files, train_paths=[str(tmp_path / "absent")], seq_len=16, global_batch_size=8)
    with pytest.raises(DataError, match="absent"):
        cfg.build(300)
    cfg = DataConfig(source=DataSource.files, train_paths=[str(tmp_path / "none_*")], seq_len=16, global_batch_size=8)
    with pytest.raises(DataError, match="matches no"):
        cfg.build(300)


def test_default_corpus_source(tmp_path):
    cfg = DataConfig(data_dir=str(tmp_path), corpus_vocab_size=512, corpus_max_bytes=120_000, seq_len=32,
                     global_batch_size=4)
    data = cfg.build(vocab_size=512)
    batch = data.next_batch()
    assert batch.shape == (4, 33) and int(batch.max()) < 512
    assert data.tokenizer_path.endswith("tokenizer.model") and data.num_train_tokens > 10_000
    assert len(data.val_batches(2)) >= 1
    with pytest.raises(DataError, match=r"set --model.vocab_size >= 512"):
        cfg.build(vocab_size=256)
