import json
import multiprocessing
import os

import pytest

from moetron.data import corpus as corpus_mod
from moetron.data.corpus import corpus_dir, ensure_default_corpus, list_corpus_files
from moetron.data.preprocess import open_token_file
from moetron.data.tokenizer import DataError, SentencePieceTokenizer

TINY = 120_000  # bytes of text: builds in well under a second
VOCAB = 512


def check_corpus(paths, max_bytes=TINY):
    tok = SentencePieceTokenizer.from_file(paths["tokenizer"])
    assert tok.vocab_size <= VOCAB
    with open(os.path.join(os.path.dirname(paths["train"]), "corpus.json")) as f:
        manifest = json.load(f)
    files = dict(list_corpus_files(max_bytes))
    assert sorted(manifest["train_files"] + manifest["val_files"]) == sorted(files)
    assert not set(manifest["train_files"]) & set(manifest["val_files"])
    for split in ("train", "val"):
        tokens, meta = open_token_file(paths[split])
        assert meta["vocab_size"] == tok.vocab_size and meta["eos_id"] == tok.eos_id
        assert meta["num_documents"] == len(manifest[f"{split}_files"])
        # Independent check: the file is exactly encode(file text) + EOS per corpus file.
        expected = []
        for rel in manifest[f"{split}_files"]:
            expected += tok.encode(files[rel]) + [tok.eos_id]
        assert tokens.tolist() == expected


def test_list_corpus_files_is_capped_and_clean():
    files = list_corpus_files(TINY)
    total = sum(len(t.encode("utf-8")) for _, t in files)
    assert 0.9 * TINY < total <= TINY
    assert all("site-packages" not in r and "/test/" not in f"/{r}" and not r.startswith("test/") for r, _ in files)
    assert files == list_corpus_files(TINY)


def test_build_then_reuse(tmp_path, capfd):
    paths = ensure_default_corpus(str(tmp_path), VOCAB, TINY)
    assert paths["train"] == os.path.join(corpus_dir(str(tmp_path), VOCAB, TINY), "train")
    assert "building" in capfd.readouterr().err
    check_corpus(paths)
    mtime = os.path.getmtime(paths["train"] + ".bin")
    again = ensure_default_corpus(str(tmp_path), VOCAB, TINY)
    assert again == paths and os.path.getmtime(paths["train"] + ".bin") == mtime
    assert "building" not in capfd.readouterr().err
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(corpus_dir(str(tmp_path), VOCAB, TINY)),
                                                   os.path.basename(corpus_dir(str(tmp_path), VOCAB, TINY)) + ".lock"])


def test_crash_mid_build_leaves_nothing_and_broken_cache_is_rebuilt(tmp_path, monkeypatch, capfd):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash while tokenizing")

    monkeypatch.setattr(corpus_mod, "tokenize_documents", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_default_corpus(str(tmp_path), VOCAB, TINY)
    assert [n for n in os.listdir(tmp_path) if not n.endswith(".lock")] == []
    monkeypatch.undo()
    paths = ensure_default_corpus(str(tmp_path), VOCAB, TINY)
    # Truncate the cached train.bin: the next call notices and rebuilds a valid corpus.
    with open(paths["train"] + ".bin", "r+b") as f:
        f.truncate(100)
    capfd.readouterr()
    assert ensure_default_corpus(str(tmp_path), VOCAB, TINY) == paths
    assert "building" in capfd.readouterr().err
    check_corpus(paths)


def _race(data_dir, queue):
    queue.put(ensure_default_corpus(data_dir, VOCAB, TINY))


def test_concurrent_callers_get_one_complete_corpus(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(r == results[0] for r in results)
    check_corpus(results[0])
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n or ".broken" in n]


def test_bad_arguments(tmp_path):
    with pytest.raises(DataError, match="too small"):
        ensure_default_corpus(str(tmp_path), 100, TINY)
    with pytest.raises(DataError, match="must be positive"):
        ensure_default_corpus(str(tmp_path), VOCAB, 0)


def _killed_build(data_dir):
    """A build that dies mid-way without running any cleanup (as SIGKILL or the OOM killer would)."""
    corpus_mod.tokenize_documents = lambda *args, **kwargs: os._exit(9)
    ensure_default_corpus(data_dir, VOCAB, TINY)


def test_killed_build_leftovers_are_removed_by_the_next_build(tmp_path, capfd):
    name = os.path.basename(corpus_dir(str(tmp_path), VOCAB, TINY))
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_killed_build, args=(str(tmp_path),))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 9
    left = [n for n in os.listdir(tmp_path) if n.startswith(name + ".tmp-")]
    assert len(left) == 1 and os.listdir(tmp_path / left[0])  # what a dead build leaves today
    (tmp_path / f"{name}.broken-12345").mkdir()  # killed while deleting a broken cache
    other = tmp_path / (os.path.basename(corpus_dir(str(tmp_path), VOCAB, 2 * TINY)) + ".tmp-live")
    other.mkdir()  # another corpus's build (its own lock): not ours to touch
    paths = ensure_default_corpus(str(tmp_path), VOCAB, TINY)
    check_corpus(paths)
    assert "left by an interrupted build" in capfd.readouterr().err
    assert sorted(os.listdir(tmp_path)) == sorted([name, name + ".lock", other.name])
