"""tools/upcycle.py end to end: native and HF inputs, printed counts, the pretrain.yaml it writes
(pretrain continues from it), and one-line errors that leave nothing behind."""

import os
import re

import pytest
import torch

from moetron.core.checkpoint import CheckpointConfig, CheckpointError, Checkpointer
from moetron.core.config import ConfigError
from moetron.core.weights import save_weights
from moetron.models import ModelConfig
from tests.hf_models import save_tiny_olmo3
from tests.processes import run_python

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UPCYCLE = os.path.join(ROOT, "tools", "upcycle.py")
PRETRAIN = os.path.join(ROOT, "tools", "pretrain.py")


def dense_cfg() -> ModelConfig:
    cfg = ModelConfig(d_model=64, n_layers=2, vocab_size=512, mlp_hidden=128, sliding_window=16)
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 4, 2
    return cfg


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    torch.manual_seed(0)
    cfg = dense_cfg()
    model = cfg.build().eval()
    sd = model.state_dict()
    path = str(tmp_path_factory.mktemp("dense") / "step_0")
    save_weights(path, {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}, lambda n: sd[n],
                 {"config": {"model": cfg.to_dict()}})
    return cfg, model, path


def run(args, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return run_python([UPCYCLE, *args], env=env, cwd=ROOT)


TOKENS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))


def load_moe(path):
    meta = Checkpointer(CheckpointConfig()).read_metadata(path)
    cfg = ModelConfig.from_dict(meta["config"]["model"])
    model = cfg.build().eval()
    Checkpointer(CheckpointConfig()).load(path, model, None, {}, model_only=True)
    return cfg, model


def test_native_upcycle_matches_dense_and_counts(dense, tmp_path):
    cfg, model, path = dense
    out = str(tmp_path / "moe")
    proc = run([path, "--output", out, "--num-experts", "8", "--top-k", "4", "--granularity", "2",
                "--shared-expert", "--layers", "every_other", "--ep", "4"])
    assert proc.returncode == 0, proc.stderr
    moe_cfg, moe = load_moe(out)
    assert moe_cfg.moe.num_experts == 8 and moe_cfg.moe.expert_hidden == 64 and moe_cfg.moe.dense_layers == [0]
    assert moe_cfg.moe.num_shared_experts == 1 and moe_cfg.moe.shared_expert_hidden == 128
    m = re.search(r"params: active (\d+) / total (\d+)", proc.stdout)
    assert (int(m[1]), int(m[2])) == (moe_cfg.num_active_params(), moe_cfg.num_params())
    assert int(m[2]) == sum(p.numel() for p in moe.parameters())
    assert "equals the dense model" in proc.stdout and "EP=4" in proc.stdout
    with torch.no_grad():
        torch.testing.assert_close(moe(TOKENS), model(TOKENS), rtol=0, atol=1e-4)
    from pretrain import PretrainConfig

    pc = PretrainConfig.from_yaml(os.path.join(out, "pretrain.yaml"))
    assert pc.model == moe_cfg and pc.checkpoint.init_from == out


def test_existing_output_overwrite_and_seed(dense, tmp_path):
    _, _, path = dense
    out = str(tmp_path / "moe")
    assert run([path, "--output", out, "--seed", "3"]).returncode == 0
    first = load_moe(out)[1].state_dict()
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)}
    proc = run([path, "--output", out, "--seed", "3"])
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "already holds a checkpoint" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert {f: os.path.getmtime(os.path.join(out, f)) for f in os.listdir(out)} == before
    proc = run([path, "--output", out, "--seed", "3", "--overwrite"])
    assert proc.returncode == 0, proc.stderr
    second = load_moe(out)[1].state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)  # same seed, same weights


@pytest.mark.parametrize("args,message", [
    (["--num-experts", "4", "--top-k", "5"], "top_k=5 exceeds"),
    (["--num-experts", "6", "--granularity", "3", "--top-k", "3"], "does not divide the dense MLP hidden"),
    (["--num-experts", "8", "--granularity", "3"], "not a multiple of granularity"),
    (["--layers", "0,7"], "are not layers"),
    (["--ep", "3"], "--ep=3 does not divide"),
])
def test_bad_input_writes_nothing(dense, tmp_path, args, message):
    """In-process (the script turns these exceptions into one 'error:' line, exit 2: checked above)."""
    import upcycle as upcycle_tool

    _, _, path = dense
    out = str(tmp_path / "moe")
    with pytest.raises((ConfigError, CheckpointError), match=re.escape(message)):
        upcycle_tool.main([path, "--output", out, *args])
    assert not os.path.exists(out) and os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError, match="not a directory"):
        upcycle_tool.main([str(tmp_path / "nothing"), "--output", out])
    assert os.listdir(tmp_path) == []


def test_bad_input_script_exit(dense, tmp_path):
    _, _, path = dense
    proc = run([path, "--output", str(tmp_path / "moe"), "--num-experts", "4", "--top-k", "5"])
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "top_k=5 exceeds" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path) == []


def test_pretrain_continues_from_upcycled(dense, tmp_path):
    """The written pretrain.yaml starts a run from the upcycled weights; training moves the copies apart."""
    _, _, path = dense
    out = str(tmp_path / "moe")
    assert run([path, "--output", out, "--num-experts", "4", "--top-k", "2"]).returncode == 0
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, MOETRON_DATA_DIR=str(tmp_path / "data"), OMP_NUM_THREADS="1")
    proc = run_python([PRETRAIN, "--config", os.path.join(out, "pretrain.yaml"), "--trainer.steps=3",
                       f"--trainer.run_dir={run_dir}", "--data.seq_len=32", "--data.global_batch_size=4",
                       "--data.corpus_vocab_size=512", "--data.corpus_max_bytes=300000", "--trainer.eval_interval=0",
                       "--precision.recipe=fp32", "--scheduler.warmup_steps=1", "--trainer.device=cpu"],
                      env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"initialized the model from {out}" in proc.stdout
    ckpts = os.path.join(run_dir, "checkpoints")
    _, trained = load_moe(os.path.join(ckpts, sorted(os.listdir(ckpts))[-1]))
    w = trained.blocks["0"].mlp.experts.w_gate_up
    assert not torch.equal(w[0], w[1])


def test_hf_input(tmp_path):
    pytest.importorskip("transformers")
    hf_dir = str(tmp_path / "hf")
    hf = save_tiny_olmo3(hf_dir, vocab_size=512)
    out = str(tmp_path / "moe")
    proc = run([hf_dir, "--output", out, "--num-experts", "4", "--top-k", "2"])
    assert proc.returncode == 0, proc.stderr
    _, moe = load_moe(out)
    with torch.no_grad():
        want = hf(input_ids=TOKENS).logits
        torch.testing.assert_close(moe(TOKENS), want, rtol=0, atol=1e-4)
