import numpy as np
import pytest
import torch

from moetron.data.dataset import PackedDataset
from moetron.data.preprocess import tokenize_documents
from moetron.data.tokenizer import DataError


def test_samples_are_hand_sliced_windows(tmp_path, write_token_file):
    a = list(range(100, 123))  # 23 tokens -> (23-1)//5 = 4 samples
    b = list(range(500, 512))  # 12 tokens -> 2 samples
    pa = write_token_file(tmp_path / "a", a)
    pb = write_token_file(tmp_path / "b", b, dtype="uint32")
    ds = PackedDataset([pa, pb + ".bin"], seq_len=5, vocab_size=1000)
    windows = [a[0:6], a[5:11], a[10:16], a[15:21], b[0:6], b[5:11]]
    assert len(ds) == len(windows)
    for i, w in enumerate(windows):
        assert ds[i].dtype == torch.int64 and ds[i].tolist() == w
    assert ds[-1].tolist() == windows[-1]
    batch = ds.get_batch(np.array([5, 0, 3]))
    assert batch.shape == (3, 6) and batch.dtype == torch.int64
    assert batch.tolist() == [windows[5], windows[0], windows[3]]
    # inputs/labels convention: consecutive windows overlap by exactly one token.
    assert ds[1][0] == ds[0][-1]
    with pytest.raises(IndexError):
        ds[6]
    assert ds.num_tokens == 35
    # Negative indices count from the end; the caller's index array is left as it was.
    order = np.array([-1, -6, 2])
    assert ds.get_batch(order).tolist() == [windows[5], windows[0], windows[2]] and order.tolist() == [-1, -6, 2]
    assert ds.get_batch([]).shape == (0, 6)
    with pytest.raises(IndexError, match="sample 6 out of range"):
        ds.get_batch([0, 6])
    with pytest.raises(IndexError, match="sample -7 out of range"):
        ds.get_batch([-7])


@pytest.mark.gpu
def test_pinned_batches(tmp_path, write_token_file):
    a = list(range(100, 123))
    ds = PackedDataset([write_token_file(tmp_path / "a", a)], seq_len=5, vocab_size=1000)
    batch = ds.get_batch([3, 1], pin_memory=True)
    assert batch.is_pinned() and batch.tolist() == [a[15:21], a[5:11]]
    assert not ds.get_batch([3, 1]).is_pinned()


def test_text_to_batches_end_to_end(tmp_path, tokenizer):
    docs = ["import os\nprint(os.getcwd())\n", "A sentence about tokens.", "x = [i * i for i in range(10)]"]
    tokenize_documents(docs, str(tmp_path / "t"), tokenizer, progress=False)
    stream = []
    for d in docs:
        stream += tokenizer.encode(d) + [tokenizer.eos_id]
    seq_len = 8
    ds = PackedDataset([str(tmp_path / "t")], seq_len, vocab_size=tokenizer.vocab_size)
    assert len(ds) == (len(stream) - 1) // seq_len
    for i in range(len(ds)):
        assert ds[i].tolist() == stream[i * seq_len : i * seq_len + seq_len + 1]


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"nope.*does not exist"):
        PackedDataset([str(tmp_path / "nope")], 4, 100)


def test_ids_beyond_model_vocab(tmp_path, write_token_file):
    p = write_token_file(tmp_path / "big", [1, 2, 70, 3, 4], vocab_size=100)
    ds = PackedDataset([p], 2, vocab_size=100)  # fine for a model of 100
    assert len(ds) == 2
    with pytest.raises(DataError) as e:
        PackedDataset([p], 2, vocab_size=50)
    # The sidecar's vocab_size (100) bounds the ids: X = 99.
    assert str(e.value) == (
        f"token ids up to 99 in {p}.bin but the model's vocab_size is 50: "
        f"set --model.vocab_size >= 100 or re-tokenize"
    )


def test_sidecar_that_lies_is_caught(tmp_path, write_token_file):
    # The data holds id 4000 but the sidecar claims a 64-token vocabulary with max id 9.
    p = write_token_file(tmp_path / "liar", [1, 2, 4000, 3, 4, 5], vocab_size=64, max_token_id=9)
    with pytest.raises(DataError, match=r"token ids up to 4000 in .*liar\.bin but the model's vocab_size is 100: set --model.vocab_size >= 4001"):
        PackedDataset([p], 2, vocab_size=100)
    # Even when the model could take it, a sidecar under-reporting its max id is corruption.
    with pytest.raises(DataError, match=r"liar\.bin holds id 4000 but its sidecar says max_token_id=9"):
        PackedDataset([p], 2, vocab_size=5000)
    # The scan is chunked: a big id in the last chunk is found too.
    tokens = [1] * 1000 + [77]
    q = write_token_file(tmp_path / "tail", tokens, vocab_size=64, max_token_id=9)
    from moetron.data.dataset import scan_max_token_id
    from moetron.data.preprocess import open_token_file

    assert scan_max_token_id(open_token_file(q)[0], chunk=64) == 77
    with pytest.raises(DataError, match="up to 77"):
        PackedDataset([q], 2, vocab_size=64)


def test_file_too_short(tmp_path, write_token_file):
    p = write_token_file(tmp_path / "short", [1, 2, 3, 4])
    with pytest.raises(DataError, match=r"short\.bin' has 4 tokens, fewer than one sample of seq_len\+1=5"):
        PackedDataset([p], 4, vocab_size=1000)
    assert len(PackedDataset([p], 3, vocab_size=1000)) == 1


def test_truncated_file_through_dataset(tmp_path, write_token_file):
    p = write_token_file(tmp_path / "trunc", list(range(20)))
    with open(p + ".bin", "r+b") as f:
        f.truncate(30)
    with pytest.raises(DataError, match="truncated"):
        PackedDataset([p], 4, vocab_size=1000)
