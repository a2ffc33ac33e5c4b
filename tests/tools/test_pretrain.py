"""tools/pretrain.py end to end in fresh processes: resume is bit-exact, bad input fails clearly."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "tools", "pretrain.py")

SMALL = [
    "--model.d_model=64", "--model.n_layers=2", "--model.vocab_size=512", "--model.mlp_hidden=128",
    "--model.attention.n_heads=4", "--model.attention.n_kv_heads=2", "--model.sliding_window=16",
    "--data.seq_len=32", "--data.global_batch_size=4", "--data.corpus_vocab_size=512",
    "--data.corpus_max_bytes=400000", "--trainer.log_interval=1", "--trainer.eval_interval=0",
    "--trainer.eval_batches=2", "--precision.recipe=fp32", "--scheduler.warmup_steps=2", "--trainer.device=cpu",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))


def run(args, data_dir, check=True, env_extra=None):
    env = dict(os.environ, MOETRON_DATA_DIR=data_dir, OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, PRETRAIN, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"pretrain failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def losses(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


def final_weights(ckpt_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_"))[-1]
    out = os.path.join(ckpt_dir, "flat.pt")
    dcp_to_torch_save(os.path.join(ckpt_dir, latest), out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items()} if "model" in state else state


def test_resume_is_bit_exact(tmp_path, data_dir):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run([*SMALL, "--trainer.steps=6", f"--trainer.run_dir={straight}"], data_dir)
    run([*SMALL, "--trainer.steps=6", "--trainer.stop_at_step=3", f"--trainer.run_dir={split}"], data_dir)
    assert sorted(losses(split)) == [1, 2, 3]
    out = run(["--config", f"{split}/config.yaml", "--trainer.stop_at_step=null", "--resume"], data_dir)
    assert "resumed from" in out.stdout
    a, b = losses(straight), losses(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b  # exact float equality, not a tolerance
    wa, wb = final_weights(f"{straight}/checkpoints"), final_weights(f"{split}/checkpoints")
    assert wa.keys() == wb.keys() and len(wa) > 0
    for k in wa:
        if torch.is_tensor(wa[k]):
            assert torch.equal(wa[k], wb[k]), k


def test_loss_falls(tmp_path, data_dir):
    d = str(tmp_path / "run")
    run([*SMALL, "--trainer.steps=30", "--optimizer.lr=5e-3", f"--trainer.run_dir={d}"], data_dir)
    l = losses(d)
    assert l[1] > 6.0 and l[30] < l[1] - 0.6, l  # ln(512) = 6.24 at init


def test_two_ranks_gloo(tmp_path, data_dir):
    d = str(tmp_path / "ddp")
    env = dict(os.environ, MOETRON_DATA_DIR=data_dir, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", PRETRAIN,
           *SMALL, "--trainer.steps=3", f"--trainer.run_dir={d}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(losses(d)) == [1, 2, 3]
    # Two ranks split the same global batches: the run must follow the one-process run.
    single = str(tmp_path / "single")
    run([*SMALL, "--trainer.steps=3", f"--trainer.run_dir={single}"], data_dir)
    for step, loss in losses(single).items():
        assert losses(d)[step] == pytest.approx(loss, rel=1e-4), (step, losses(d), losses(single))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model.n_layer=3"], "unknown config key 'model.n_layer'"),
        (["--trainer.steps=ten"], "trainer.steps: expected an integer"),
        (["--data.source=files", "--data.train_paths=[/nonexistent/x]"], "/nonexistent/x"),
        (["--resume"], "holds no complete checkpoint"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, data_dir, args, message):
    proc = run([*SMALL, f"--trainer.run_dir={tmp_path}/r", *args], data_dir, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_existing_checkpoints_are_never_overwritten(tmp_path, data_dir):
    d = str(tmp_path / "run")
    run([*SMALL, "--trainer.steps=2", f"--trainer.run_dir={d}"], data_dir)
    before = sorted(os.listdir(f"{d}/checkpoints"))
    proc = run([*SMALL, "--trainer.steps=2", f"--trainer.run_dir={d}"], data_dir, check=False)
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    assert sorted(os.listdir(f"{d}/checkpoints")) == before


def test_resume_with_another_model_is_refused(tmp_path, data_dir):
    d = str(tmp_path / "run")
    run([*SMALL, "--trainer.steps=2", f"--trainer.run_dir={d}"], data_dir)
    proc = run([*SMALL, "--trainer.steps=4", "--model.n_layers=3", f"--trainer.run_dir={d}", "--resume"],
               data_dir, check=False)
    assert proc.returncode == 2 and "different model" in proc.stderr and "n_layers" in proc.stderr


def test_init_from_weights_starts_a_new_run(tmp_path, data_dir):
    first = str(tmp_path / "first")
    run([*SMALL, "--trainer.steps=4", f"--trainer.run_dir={first}"], data_dir)
    ckpt = os.path.join(first, "checkpoints", "step_00000004")
    second = str(tmp_path / "second")
    out = run([*SMALL, "--trainer.steps=2", f"--trainer.run_dir={second}", f"--checkpoint.init_from={ckpt}"], data_dir)
    assert "initialized the model from" in out.stdout
    fresh = str(tmp_path / "fresh")
    run([*SMALL, "--trainer.steps=2", f"--trainer.run_dir={fresh}"], data_dir)
    # starting from trained weights, the first loss is far below a fresh model's
    assert losses(second)[1] < losses(fresh)[1] - 0.1
    bad = run([*SMALL, "--trainer.steps=2", "--model.n_layers=3", f"--trainer.run_dir={tmp_path}/bad",
               f"--checkpoint.init_from={ckpt}"], data_dir, check=False)
    assert bad.returncode == 2 and "blocks.2" in bad.stderr, bad.stderr  # the tensor the model lacks is named
