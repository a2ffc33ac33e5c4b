"""tools/pretrain.py end to end in new processes (tests/processes.py): resume is bit-exact, bad input fails clearly."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from tests.processes import run_python

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

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
    proc = run_python([PRETRAIN, *args], env=env, cwd=ROOT)
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


def test_deterministic_through_the_entry_point_and_its_resume(tmp_path, data_dir):
    """--trainer.deterministic=true through tools/pretrain.py: the run says so, its resolved config keeps it, the
    process that resumes from that config turns it on again, and every step of the data, the loop, the
    checkpoint and the resume has a deterministic kernel (torch raises naming any op without one). On the CPU,
    whose kernels are deterministic anyway, the losses are the plain run's bit for bit."""
    plain, det = str(tmp_path / "plain"), str(tmp_path / "det")
    run([*SMALL, "--trainer.steps=4", f"--trainer.run_dir={plain}"], data_dir)
    out = run([*SMALL, "--trainer.steps=4", "--trainer.stop_at_step=2", "--trainer.deterministic=true",
               f"--trainer.run_dir={det}"], data_dir)
    said = "trainer.deterministic: torch's deterministic algorithms are on"
    assert said in out.stdout
    with open(f"{det}/config.yaml", encoding="utf-8") as f:
        assert yaml.safe_load(f)["trainer"]["deterministic"] is True
    out = run(["--config", f"{det}/config.yaml", "--trainer.stop_at_step=null", "--resume"], data_dir)
    assert "resumed from" in out.stdout and said in out.stdout
    assert losses(det) == losses(plain) and sorted(losses(det)) == [1, 2, 3, 4]


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


BAD_INPUT = [  # (arguments, what stderr must say)
    (["--model.n_layer=3"], "unknown config key 'model.n_layer'"),
    (["--trainer.steps=ten"], "trainer.steps: expected an integer"),
    (["--data.source=files", "--data.train_paths=[/nonexistent/x]"], "/nonexistent/x"),
    (["--resume"], "holds no complete checkpoint"),
    (["--trainer.grad_clip=-1"], "trainer.grad_clip must be"),
    (["--trainer.eval_batch_size=0"], "trainer.eval_batch_size must be positive"),
    (["--checkpoint.init_from=/nonexistent/ckpt"], "/nonexistent/ckpt does not exist"),
    (["--trainer.device=cuda"], "CUDA is not available"),
    (["--config", "/"], "is a directory"),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory, data_dir):
    """Every BAD_INPUT case as ``python tools/pretrain.py ...`` runs it (tests/cli_runs.py), each with
    its own run directory: [(exit status, stdout, stderr)]."""
    from tests.cli_runs import run_command_lines

    root = tmp_path_factory.mktemp("bad_input")
    cases = [("pretrain.py", [*SMALL, f"--trainer.run_dir={root}/r{i}", *args]) for i, (args, _) in enumerate(BAD_INPUT)]
    return run_command_lines(cases, env=dict(os.environ, MOETRON_DATA_DIR=data_dir, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[m for _, m in BAD_INPUT])
def test_bad_input_is_one_clear_error(case, bad_input_runs):
    args, message = BAD_INPUT[case]
    if "--trainer.device=cuda" in args and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    status, _, stderr = bad_input_runs[case]
    assert status == 2, stderr
    assert message in stderr and "Traceback" not in stderr, stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_dir):
    """A finished 4-step SMALL run (its one checkpoint: step 4, the final save), made once; tests that
    run on it take a copy (``copy_of``), so one that changed it could not change another's."""
    d = str(tmp_path_factory.mktemp("finished") / "run")
    run([*SMALL, "--trainer.steps=4", f"--trainer.run_dir={d}"], data_dir)
    return d


def copy_of(run_dir, tmp_path) -> str:
    import shutil

    return shutil.copytree(run_dir, str(tmp_path / "run"))


def test_existing_checkpoints_are_never_overwritten(tmp_path, data_dir, finished_run):
    d = copy_of(finished_run, tmp_path)
    before = sorted(os.listdir(f"{d}/checkpoints"))
    proc = run([*SMALL, "--trainer.steps=4", f"--trainer.run_dir={d}"], data_dir, check=False)
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    assert sorted(os.listdir(f"{d}/checkpoints")) == before


def test_resume_with_another_model_is_refused(tmp_path, data_dir, finished_run):
    d = copy_of(finished_run, tmp_path)
    proc = run([*SMALL, "--trainer.steps=6", "--model.n_layers=3", f"--trainer.run_dir={d}", "--resume"],
               data_dir, check=False)
    assert proc.returncode == 2 and "different model" in proc.stderr and "n_layers" in proc.stderr


def test_init_from_weights_starts_a_new_run(tmp_path, data_dir, finished_run):
    ckpt = os.path.join(finished_run, "checkpoints", "step_00000004")  # read only
    second = str(tmp_path / "second")
    out = run([*SMALL, "--trainer.steps=2", f"--trainer.run_dir={second}", f"--checkpoint.init_from={ckpt}"], data_dir)
    assert "initialized the model from" in out.stdout
    # starting from trained weights, the first loss is far below a fresh model's (the finished run's
    # first loss: measured before any update)
    assert losses(second)[1] < losses(finished_run)[1] - 0.1
    bad = run([*SMALL, "--trainer.steps=2", "--model.n_layers=3", f"--trainer.run_dir={tmp_path}/bad",
               f"--checkpoint.init_from={ckpt}"], data_dir, check=False)
    assert bad.returncode == 2 and "blocks.2" in bad.stderr, bad.stderr  # the tensor the model lacks is named


# ---- hardening: resume, held-out data, NaN, logs, set-up errors ----------------------------

MOE = ["--preset", "tiny-moe", *SMALL, "--model.moe.num_experts=4", "--model.moe.expert_hidden=32",
       "--model.moe.router.top_k=2"]


def strict_rows(path):
    """metrics.jsonl rows, refusing the NaN/Infinity constants that strict JSON does not have."""
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}: not valid JSON")
    return [json.loads(line, parse_constant=refuse) for line in open(path)]


def test_resume_with_quantized_expert_copies_is_bit_exact(tmp_path, data_dir):
    """mxfp8 emulated with the optimizer writing the expert copies quantized (precision.quantized_expert_copies):
    the copies are not in the checkpoint, so the load rewrites them (refresh_compute_copies) and the
    resumed run equals the straight one bit for bit."""
    _assert_resume_at_2_of_4_is_bit_exact(
        [*MOE, "--precision.recipe=mxfp8", "--precision.backend=emulated", "--precision.expert_weight_copies=optimizer",
         "--precision.expert_grads_bf16=true", "--precision.quantized_expert_copies=true",
         "--optimizer.state_dtype=bf16", "--optimizer.impl=torch"], tmp_path, data_dir)


def _assert_resume_at_2_of_4_is_bit_exact(args: list[str], tmp_path, data_dir) -> dict:
    """A MoE run of 4 steps straight, and stopped at 2 then resumed: the same losses and final weights
    bit for bit (the experts' among them); the final weights."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run([*args, "--trainer.steps=4", f"--trainer.run_dir={straight}"], data_dir)
    run([*args, "--trainer.steps=4", "--trainer.stop_at_step=2", f"--trainer.run_dir={split}"], data_dir)
    run(["--config", f"{split}/config.yaml", "--trainer.stop_at_step=null", "--resume"], data_dir)
    a, b = losses(straight), losses(split)
    assert sorted(a) == [1, 2, 3, 4] and a == b
    wa, wb = final_weights(f"{straight}/checkpoints"), final_weights(f"{split}/checkpoints")
    assert any("w_down" in k for k in wa) and all(torch.equal(wa[k], wb[k]) for k in wa if torch.is_tensor(wa[k]))
    return wa


def test_resume_with_split_masters_is_bit_exact(tmp_path, data_dir):
    """optimizer.split_master through the real loop: the trainer saves at the stop (the pre-save check
    and the save joining the split masters), the resumed run loads them and splits them again; the
    same losses and final weights as the straight run, bit for bit, and the checkpoint holds fp32
    masters (the unsplit format)."""
    wa = _assert_resume_at_2_of_4_is_bit_exact(
        [*MOE, "--precision.recipe=bf16", "--precision.expert_weight_copies=optimizer",
         "--precision.expert_grads_bf16=true", "--precision.dense_weight_copies=true",
         "--precision.head_weight_copy=true", "--optimizer.state_dtype=bf16", "--optimizer.impl=torch",
         "--optimizer.split_master=true"], tmp_path, data_dir)
    assert all(wa[k].dtype == torch.float32 for k in wa if torch.is_tensor(wa[k]) and k.endswith("weight"))


def test_rejected_resumes_leave_config_yaml_and_name_the_settings(tmp_path, data_dir):
    d = str(tmp_path / "run")
    run([*SMALL, "--trainer.steps=4", "--trainer.stop_at_step=2", f"--trainer.run_dir={d}"], data_dir)
    before = open(f"{d}/config.yaml").read()
    # fails in the load itself (the sampler refuses another data seed)
    bad = run(["--config", f"{d}/config.yaml", "--data.seed=5", "--resume"], data_dir, check=False)
    assert bad.returncode == 2 and "seed" in bad.stderr, bad.stderr
    assert open(f"{d}/config.yaml").read() == before
    # settings the checkpoint would silently override are refused by name
    bad = run(["--config", f"{d}/config.yaml", "--optimizer.lr=1e-3", "--trainer.steps=8", "--resume"], data_dir,
              check=False)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "optimizer.lr: checkpoint 0.003 vs now 0.001" in bad.stderr and "trainer.steps: checkpoint 4 vs now 8" in bad.stderr
    assert "Traceback" not in bad.stderr and open(f"{d}/config.yaml").read() == before
    # the documented resume command still works
    out = run(["--config", f"{d}/config.yaml", "--trainer.stop_at_step=null", "--resume"], data_dir)
    assert "resumed from" in out.stdout and sorted(losses(d)) == [1, 2, 3, 4]


def test_a_resume_may_change_how_the_masters_are_held():
    """optimizer.split_master is how a run holds its fp32 masters between steps, and a checkpoint holds them as
    fp32 either way (tests/core/test_split_master.py resumes across it): a resume may change it, from a value
    to auto (the default, resolved per run) or to another value, while optimizer.lr stays refused by name."""
    import pretrain  # tools/ (tests/conftest.py puts it on the path)

    from moetron.core.config import ConfigError
    from moetron.run.config import PretrainConfig

    class Saved:
        def __init__(self, cfg):
            self.meta = {"config": cfg.to_dict()}

        def read_metadata(self, path):
            return self.meta

    saved = Saved(PretrainConfig().apply_overrides(["--optimizer.split_master=true"]))
    for now in ([], ["--optimizer.split_master=false"], ["--optimizer.split_master=auto"]):
        pretrain.check_resume_settings(saved, "ckpt", PretrainConfig().apply_overrides(now))
    with pytest.raises(ConfigError, match="optimizer.lr: checkpoint 0.003 vs now 0.001") as info:
        pretrain.check_resume_settings(saved, "ckpt", PretrainConfig().apply_overrides(["--optimizer.lr=1e-3"]))
    assert "split_master" not in str(info.value)


def test_resume_from_an_earlier_checkpoint_keeps_one_log(tmp_path, data_dir):
    d = str(tmp_path / "run")
    run([*MOE, "--trainer.steps=4", "--trainer.stop_at_step=3", "--checkpoint.interval=1", "--checkpoint.keep_last=0",
         f"--trainer.run_dir={d}"], data_dir)
    out = run(["--config", f"{d}/config.yaml", "--trainer.stop_at_step=null",
               f"--resume={d}/checkpoints/step_00000002"], data_dir)
    assert "dropped 1 metrics.jsonl rows" in out.stdout
    assert [r["step"] for r in strict_rows(f"{d}/metrics.jsonl")] == [1, 2, 3, 4]  # step 3 once, re-trained
    import numpy as np
    np.testing.assert_array_equal(np.load(f"{d}/moe_load.npz")["step"], [1, 2, 3, 4])


def test_files_without_val_paths_train_and_save(tmp_path, data_dir):
    from moetron.data.corpus import ensure_default_corpus

    train = ensure_default_corpus(data_dir, 512, 400000)["train"]
    d = str(tmp_path / "run")
    out = run([*SMALL, "--trainer.steps=2", "--data.source=files", f"--data.train_paths=[{train}]",
               f"--trainer.run_dir={d}"], data_dir)
    assert "held-out evaluation is off" in out.stdout
    assert os.listdir(f"{d}/checkpoints") == ["step_00000002"]


def test_too_small_held_out_set_fails_at_start(tmp_path, data_dir):
    proc = run([*SMALL, "--trainer.steps=2", "--trainer.eval_batch_size=100000", f"--trainer.run_dir={tmp_path}/r"],
               data_dir, check=False)
    assert proc.returncode == 2 and "fewer than one val batch" in proc.stderr, proc.stderr
    assert "step      1" not in proc.stdout


def test_nonfinite_stops_with_valid_metrics_and_no_checkpoint(tmp_path, data_dir):
    d = str(tmp_path / "run")
    proc = run([*SMALL, "--trainer.steps=3", "--model.init_std=1e30", f"--trainer.run_dir={d}"], data_dir, check=False)
    assert proc.returncode == 2 and "error: step 1 had a non-finite" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not os.path.exists(f"{d}/checkpoints")
    assert strict_rows(f"{d}/metrics.jsonl")[0]["loss"] is None


def test_checkpoint_dir_null_writes_no_checkpoints(tmp_path, data_dir):
    d = str(tmp_path / "run")
    out = run([*SMALL, "--trainer.steps=2", "--checkpoint.dir=null", f"--trainer.run_dir={d}"], data_dir)
    assert "writes no checkpoints" in out.stdout and "saved checkpoint" not in out.stdout
    assert sorted(os.listdir(d)) == ["config.yaml", "metrics.jsonl"]


def test_checkpoint_dir_null_and_unset_in_yaml(tmp_path):
    import pretrain

    (tmp_path / "null.yaml").write_text("checkpoint:\n  dir: null\n")
    (tmp_path / "unset.yaml").write_text("checkpoint:\n  interval: 5\n")
    assert pretrain.parse_args(["--config", str(tmp_path / "null.yaml")])[0].checkpoint.dir is None
    assert pretrain.parse_args(["--checkpoint.dir=null"])[0].checkpoint.dir is None
    cfg, _ = pretrain.parse_args(["--config", str(tmp_path / "unset.yaml"), "--trainer.run_dir=r"])
    assert cfg.checkpoint.dir == os.path.join("r", "checkpoints")


def test_resume_check_ignores_fields_that_keep_the_shapes(tmp_path):
    import pretrain
    from moetron.core.checkpoint import CheckpointError

    class Saved:  # a checkpoint's meta.json, without the checkpoint
        def __init__(self, cfg):
            self.meta = {"config": cfg.to_dict()}

        def read_metadata(self, path):
            return self.meta

    cfg, _ = pretrain.parse_args(SMALL)
    other, _ = pretrain.parse_args([*SMALL, "--model.norm_eps=1e-5", "--model.attention.rope_theta=5e5"])
    pretrain.check_resumable(Saved(cfg), "ckpt", other)  # no shape changes: allowed
    bigger, _ = pretrain.parse_args([*SMALL, "--model.mlp_hidden=256", "--model.norm_eps=1e-5"])
    with pytest.raises(CheckpointError) as e:
        pretrain.check_resumable(Saved(cfg), "ckpt", bigger)
    msg = str(e.value)
    assert "model.mlp_hidden: checkpoint 128 vs now 256" in msg and "model.norm_eps" in msg
    assert "'d_model'" not in msg  # the differing leaves, not the whole dicts


def test_example_recipe_runs_with_few_steps(tmp_path, data_dir):
    env = dict(os.environ, MOETRON_DATA_DIR=data_dir, OMP_NUM_THREADS="1", MOETRON_PYTHON=sys.executable,
               STEPS="4", RUN_DIR=str(tmp_path / "run"))
    small = [a for a in SMALL if not a.startswith("--scheduler.warmup_steps")]  # the recipe's own warmup
    proc = subprocess.run(["bash", "examples/pretrain_moe_1t.sh", *small, "--model.moe.num_experts=4",
                           "--model.moe.expert_hidden=32", "--model.moe.router.top_k=2"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== summary" in proc.stdout and sorted(losses(str(tmp_path / "run"))) == [1, 2, 3, 4]
