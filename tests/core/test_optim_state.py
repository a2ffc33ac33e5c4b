"""optimizer.state_dtype: PrecisionAwareAdamW against torch.optim.AdamW (the oracle).

- fp32 state: the same numbers as torch's AdamW, bit for bit (single-tensor and foreach paths), with
  chunks small enough that tensors are split and packed.
- bf16 state: within a stated tolerance of torch's fp32-state AdamW after 40 steps; state_dict and a
  DCP checkpoint round trip keep bf16 moments and resume bit-exactly; a tiny MoE trains through the
  trainer as well as with fp32 state.
- 8-bit state (q8, fp8): the tiny MoE trains through the trainer as well as with fp32 state (their oracle tests:
  tests/core/test_moments_q8.py).
- FSDP2 over gloo (2 processes, float64 parameters): bf16-state and 8-bit-state losses equal the single process's,
  with dp_shard=2, with ep=2 (expert DTensors), with parallel.fsdp_offload; a DCP save under FSDP2
  resumes exactly.
"""

import copy
import os

import pytest
import torch
from torch import nn

from moetron.core.adamw import PrecisionAwareAdamW
from moetron.core.checkpoint import CheckpointConfig, Checkpointer
from moetron.core.config import ConfigError
from moetron.core.optim import OptimizerConfig
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

SHAPES = [(7, 5), (300,), (3, 4, 5), (1,), (0, 4)]


def _params(seed=0):
    torch.manual_seed(seed)
    return [nn.Parameter(torch.randn(s)) for s in SHAPES]


def _groups(ps):
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]


def _drive(opts_and_params, steps, seed=1):
    """Step every optimizer with the same random gradients (one parameter skips every third step)."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for opt, ps in opts_and_params:
            for i, (p, g) in enumerate(zip(ps, grads)):
                p.grad = None if (i == 2 and step % 3 == 2) else g.clone()
            opt.step()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("chunk_numel", [2**25, 64])
def test_fp32_state_is_torch_adamw_bit_for_bit(foreach, chunk_numel):
    ref, mine = _params(), _params()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    torch_opt = torch.optim.AdamW(_groups(ref), foreach=foreach, **kw)
    opt = PrecisionAwareAdamW(_groups(mine), state_dtype=torch.float32, chunk_numel=chunk_numel, **kw)
    _drive([(torch_opt, ref), (opt, mine)], 12)
    for r, m in zip(ref, mine):
        assert torch.equal(r, m)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch_opt.state[r][key], opt.state[m][key]), key


def test_bf16_state_stays_close_to_fp32_adamw():
    """Tolerance: each step's moments differ from fp32 ones by their bf16 rounding (relative 2^-9 at
    most), so each update differs by well under 1% of its size (at most about lr); after N steps a
    parameter is within 1% of the largest distance it can move, 0.01 * lr * N (measured: 0.23%), and a
    moment within 2% of its largest entry (measured: 0.8%, bf16 rounding of a running average)."""
    steps, lr = 40, 1e-2
    ref, mine = _params(), _params()
    torch_opt = torch.optim.AdamW(_groups(ref), lr=lr, betas=(0.9, 0.95))
    opt = PrecisionAwareAdamW(_groups(mine), lr=lr, betas=(0.9, 0.95), chunk_numel=100, state_dtype=torch.bfloat16)
    _drive([(torch_opt, ref), (opt, mine)], steps)
    drift = max((r - m).abs().max().item() for r, m in zip(ref, mine) if r.numel())
    assert 0 < drift <= 0.01 * lr * steps
    for r, m in zip(ref, mine):
        state = opt.state[m]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        for key in ("exp_avg", "exp_avg_sq"):
            want = torch_opt.state[r][key]
            scale = want.abs().max().item() if want.numel() else 0.0
            torch.testing.assert_close(state[key].float(), want, rtol=0, atol=0.02 * scale, msg=key)


def test_state_dict_round_trip_keeps_bf16_and_is_exact():
    a, b = _params(), _params()
    opt_a = PrecisionAwareAdamW(_groups(a), lr=1e-2, betas=(0.9, 0.95), state_dtype=torch.bfloat16)
    _drive([(opt_a, a)], 3)
    with torch.no_grad():
        for pa, pb in zip(a, b):
            pb.copy_(pa)
    opt_b = PrecisionAwareAdamW(_groups(b), lr=1e-2, betas=(0.9, 0.95), state_dtype=torch.bfloat16)
    # a copy, as a save and load make (torch would share the step tensors); it casts the moments to fp32
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in opt_b.state.values())
    _drive([(opt_a, a), (opt_b, b)], 3, seed=5)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a, b))


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 16))


def _train(model, opt, steps, gen):
    for _ in range(steps):
        ids = torch.randint(0, 16, (4, 6), generator=gen)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_dcp_checkpoint_resume_is_bit_exact(tmp_path):
    cfg = OptimizerConfig(lr=1e-2, state_dtype="bf16")
    straight = _model(0)
    straight_opt = cfg.build(straight)
    assert isinstance(straight_opt, PrecisionAwareAdamW)
    _train(straight, straight_opt, 6, torch.Generator().manual_seed(3))

    first = _model(0)
    first_opt = cfg.build(first)
    gen = torch.Generator().manual_seed(3)
    _train(first, first_opt, 3, gen)
    cp = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    cp.save(3, first, first_opt, {}, {})
    resumed = _model(7)
    resumed_opt = cfg.build(resumed)  # fresh: DCP initialises its state before loading into it
    cp.load(cp.latest(), resumed, resumed_opt, {})
    _train(resumed, resumed_opt, 3, gen)

    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            want, got = straight_opt.state[p][key], resumed_opt.state[q][key]
            assert got.dtype == want.dtype and torch.equal(got, want), (name, key)
    assert straight_opt.state[next(straight.parameters())]["exp_avg"].dtype == torch.bfloat16


def test_config_choices_and_errors():
    model = _model(0)
    assert type(OptimizerConfig().build(model)) is torch.optim.AdamW  # the default is unchanged
    opt = OptimizerConfig(state_dtype="bf16", weight_decay=0.1).build(model)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # the same groups
    with pytest.raises(ConfigError, match="optimizer.beta2 <= 0.9961"):
        OptimizerConfig(state_dtype="bf16", beta2=0.999).build(model)
    with pytest.raises(ConfigError, match="leave optimizer.fused unset"):
        OptimizerConfig(state_dtype="bf16", fused=True).build(model)
    with pytest.raises(ConfigError, match=r"fp32 master weights, but some are \['torch.bfloat16'\]"):
        OptimizerConfig(state_dtype="bf16").build(_model(0).to(torch.bfloat16))
    with pytest.raises(ConfigError, match="state_dtype"):
        OptimizerConfig().apply_overrides(["state_dtype=fp16"])


# ---- through the trainer -----------------------------------------------------------------


TRAIN = ["--trainer.steps=30", "--scheduler.warmup_steps=3", "--trainer.log_interval=1",
         "--trainer.micro_batch_size=4"]


def _run(rank, world, args, out, ckpt_dir, data_dir, resume):
    """tools/pretrain.py's build and the trainer's loop on the tiny MoE (a checkpoint at the last step);
    saves the per-step losses, full parameters and the optimizer's state dtypes."""
    os.environ["MOETRON_DATA_DIR"] = data_dir
    import pretrain

    from moetron.core.grad import DTensor
    from tests.parallel.test_equivalence import TINY

    torch.set_default_dtype(torch.float64 if world > 1 or "--fp64" in args else torch.float32)
    args = [a for a in args if a != "--fp64"]
    cfg, _ = pretrain.parse_args(["--preset", "tiny-moe", *TINY, f"--trainer.run_dir={out}/run",
                                  f"--checkpoint.dir={ckpt_dir}", *args])
    checkpointer = Checkpointer(cfg.checkpoint)
    trainer, state = pretrain.build(cfg, torch.device("cpu"), world, checkpointer)
    if resume:
        trainer.load(checkpointer.latest())
    losses = [record["loss"] for record in trainer.fit()]  # trainer.log_interval=1: every step
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in trainer.model.named_parameters()}
    dtypes = {str(v.dtype) for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"}
    if rank == 0:
        torch.save({"losses": losses, "params": params, "dtypes": dtypes, "applied": state.applied,
                    "optimizer": type(trainer.optimizer).__name__}, os.path.join(out, "result.pt"))


def _result(tmp_path, name, data_dir, args, world=1, resume=False):
    """The run's result; runs under one tmp_path share their checkpoint directory."""
    out = tmp_path / name
    out.mkdir(parents=True, exist_ok=True)
    run_distributed(_run, world, args, str(out), str(tmp_path / "ckpt"), data_dir, resume, timeout_s=300)
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))


# the state dtypes each optimizer.state_dtype leaves (q8: 8-bit matrices' codes and fp32 scales, fp32 for 1-D;
# fp8: E4M3 codes and uint8 E8M0 scales, fp32 for 1-D)
STATE_DTYPES = {"bf16": {"torch.bfloat16"}, "q8": {"torch.uint8", "torch.float32"},
                "fp8": {"torch.float8_e4m3fn", "torch.uint8", "torch.float32"}}


def test_tiny_moe_trains_with_low_precision_state_as_with_fp32(tmp_path, data_dir):
    """fp32 runs (fp32 parameters): 30 steps at lr 1e-2; the loss falls by well over 1 nat either way
    and the bf16-state and 8-bit-state (q8, fp8: core/moments_q8.py) curves stay within 2% of the fp32 one at
    every step (bf16 measured: about 0.1%); each 8-bit curve differs from fp32's (its moments really are 8-bit)."""
    fp32 = _result(tmp_path / "fp32", "run", data_dir, TRAIN)
    assert fp32["optimizer"] == "AdamW" and fp32["dtypes"] == {"torch.float32"}
    assert fp32["losses"][0] - fp32["losses"][-1] > 1.0
    for state, dtypes in STATE_DTYPES.items():
        low = _result(tmp_path / state, "run", data_dir, [*TRAIN, f"--optimizer.state_dtype={state}"])
        assert low["optimizer"] == "PrecisionAwareAdamW" and low["dtypes"] == dtypes, state
        assert low["losses"] == pytest.approx(fp32["losses"], rel=0.02), state
        if state in ("q8", "fp8"):
            assert low["losses"] != fp32["losses"], state


@pytest.mark.parametrize("state", sorted(STATE_DTYPES))
def test_fsdp2_low_precision_state_matches_one_process_and_resumes(tmp_path, data_dir, state):
    """bf16 and 8-bit moments under FSDP2 and expert parallel (gloo, float64 parameters) step the single
    process's numbers (rel 1e-9): 8-bit blocks run along the last dim, so dim-0 shards hold whole blocks with
    their scales (and fp8's random bits hash values, not positions); a DCP checkpoint saved under FSDP2 resumes
    exactly."""
    FSDP = [*TRAIN, "--trainer.steps=3", f"--optimizer.state_dtype={state}", "--trainer.micro_batch_size=2"]
    single = _result(tmp_path, "single", data_dir, [*FSDP, "--fp64"])
    assert single["dtypes"] == STATE_DTYPES[state], single["dtypes"]
    runs = {}
    for name, extra in {"dp_shard=2": ["--parallel.dp_shard=2"],
                        "ep=2": ["--parallel.dp_shard=2", "--parallel.ep=2"],
                        "offload": ["--parallel.dp_shard=2", "--parallel.fsdp_offload=true"]}.items():
        got = runs[name] = _result(tmp_path / name, "run", data_dir, [*FSDP, *extra], world=2)
        assert "data" in got["applied"] and got["dtypes"] == STATE_DTYPES[state], name
        assert got["losses"] == pytest.approx(single["losses"], rel=1e-9), name
        for n, p in single["params"].items():
            torch.testing.assert_close(got["params"][n], p, rtol=1e-9, atol=1e-12, msg=f"{name}: {n}")
    # FSDP2 saves after 2 steps; a fresh FSDP2 run loads it and its step 3 is the straight run's
    # (the dp_shard=2 run above: these very settings, uninterrupted)
    dp2 = [*FSDP, "--parallel.dp_shard=2"]
    first = _result(tmp_path / "resume", "a", data_dir, [*dp2, "--trainer.stop_at_step=2"], world=2)
    resumed = _result(tmp_path / "resume", "b", data_dir, dp2, world=2, resume=True)
    assert len(first["losses"]) == 2 and len(resumed["losses"]) == 1
    assert resumed["losses"] == pytest.approx(single["losses"][2:], rel=1e-9)
    for n, p in runs["dp_shard=2"]["params"].items():
        assert torch.equal(resumed["params"][n], p), n


def test_fsdp_offload_needs_fsdp():
    from moetron.parallel import ParallelConfig

    with pytest.raises(ConfigError, match="parallel.fsdp_offload=true .* has no FSDP2"):
        ParallelConfig(fsdp_offload=True).resolve(1)
    ParallelConfig(fsdp_offload=True, strategies=["data"]).resolve(1)
    ParallelConfig(fsdp_offload=True).resolve(2)


def test_the_optimizers_default_moments_are_the_configs():
    """One default for the moments' dtype: PrecisionAwareAdamW built directly keeps fp32 moments, as
    OptimizerConfig (fp32 unless --optimizer.state_dtype=bf16) and torch.optim.AdamW do."""
    p = nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3)
    direct = PrecisionAwareAdamW([p], lr=1e-2)
    direct.step()
    configured = {"fp32": torch.float32, "bf16": torch.bfloat16}[OptimizerConfig().state_dtype.value]
    assert direct.state_dtype == configured == torch.float32
    assert direct.state[p]["exp_avg"].dtype == direct.state[p]["exp_avg_sq"].dtype == torch.float32
