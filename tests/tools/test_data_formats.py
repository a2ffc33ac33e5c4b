"""The tiny model trains on token data written by other pipelines (Dolma .npy, Megatron .bin/.idx)
and on a weighted mixture, through tools/pretrain.py's build; a mixture's position is in the
checkpoint, so a resumed run continues with exactly the batches and losses of a straight one."""

import numpy as np
import pytest
import torch

from tests.data.token_writers import random_documents, write_dolma_npy, write_megatron
from tests.parallel.test_equivalence import TINY


def build(tmp_path, monkeypatch, *args, checkpointer=False):
    import pretrain

    from moetron.core.checkpoint import Checkpointer

    monkeypatch.setenv("MOETRON_DATA_DIR", str(tmp_path / "unused"))
    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, f"--trainer.run_dir={tmp_path}/run",
                                  f"--checkpoint.dir={tmp_path}/ckpt", "--data.source=files", *args])
    ckpt = Checkpointer(cfg.checkpoint) if checkpointer else None
    trainer, _ = pretrain.build(cfg, torch.device("cpu"), 1, ckpt)
    return trainer, ckpt


def steps(trainer, count):
    batches, losses = [], []
    for _ in range(count):
        batches.append(trainer.data.next_batch())
        losses.append(trainer.train_step(batches[-1])[0].item())
        trainer.step += 1
    return batches, losses


@pytest.fixture
def foreign_files(tmp_path):
    docs = random_documents(0, 80, 512)  # ids < the tiny model's vocab of 512, EOS 0
    return {
        "dolma_npy": write_dolma_npy(tmp_path / "olmo.npy", docs),
        "megatron": write_megatron(tmp_path / "megatron_text_document", [[*d, 0] for d in docs], split_at=5),
    }


@pytest.mark.parametrize("fmt", ["dolma_npy", "megatron"])
def test_tiny_model_trains_on_foreign_token_files(tmp_path, monkeypatch, foreign_files, fmt):
    path = foreign_files[fmt]
    expected = np.concatenate([np.asarray(d + [0]) for d in random_documents(0, 80, 512)])
    for explicit in ("auto", fmt):
        trainer, _ = build(tmp_path, monkeypatch, f"--data.train_paths=[{path}]", f"--data.format={explicit}")
        assert trainer.data.train_dataset.files[0].format == fmt
        batches, losses = steps(trainer, 3)
        for row in torch.cat(batches):  # every row is a window of the written stream
            start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(expected, 17) == row.numpy(), axis=1))[0])
            assert start % 16 == 0
        assert all(np.isfinite(losses))


def test_mixture_trains_and_resumes_exactly_from_a_checkpoint(tmp_path, monkeypatch, foreign_files):
    mix = (f"--data.mixture=[{{paths: [{foreign_files['dolma_npy']}], weight: 3, name: dolma}}, "
           f"{{paths: [{foreign_files['megatron']}], weight: 1}}]")
    trainer, _ = build(tmp_path / "a", monkeypatch, mix)
    straight_batches, straight_losses = steps(trainer, 4)
    assert trainer.data.metrics()["data/share/dolma"] == 0.75  # 32 sequences, 24 + 8

    first, ckpt = build(tmp_path / "b", monkeypatch, mix, checkpointer=True)
    steps(first, 2)
    first.save()
    resumed, ckpt = build(tmp_path / "b", monkeypatch, mix, checkpointer=True)  # a fresh start
    resumed.load(ckpt.latest())
    assert resumed.step == 2 and resumed.data.sampler.step == 2
    batches, losses = steps(resumed, 2)
    assert all(torch.equal(a, b) for a, b in zip(batches, straight_batches[2:]))
    assert losses == straight_losses[2:]


def test_mixture_shares_reach_the_log(tmp_path, monkeypatch, foreign_files):
    mix = (f"--data.mixture=[{{paths: [{foreign_files['dolma_npy']}], weight: 3, name: dolma}}, "
           f"{{paths: [{foreign_files['megatron']}], weight: 1, name: megatron}}]")
    trainer, _ = build(tmp_path, monkeypatch, mix, "--trainer.steps=2", "--trainer.log_interval=1",
                       "--trainer.eval_batches=0")
    history = trainer.fit()
    assert history[-1]["data/share/dolma"] == 0.75 and history[-1]["data/share/megatron"] == 0.25
    assert history[-1]["data/consumed_samples"] == 16
