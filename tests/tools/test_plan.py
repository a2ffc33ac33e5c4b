"""tools/plan.py: memory terms by hand on a tiny config, FLOPs through ModelConfig, layout errors, --search, JSON."""

import json

import pytest

import plan as planner  # tools/plan.py
from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig
from moetron.models import ModelConfig
from moetron.parallel.config import ParallelConfig

GiB = 2**30


def _plan(num_gpus=1, **parallel):
    return planner.Plan(model=ModelConfig.tiny_moe(), parallel=ParallelConfig(**parallel), memory=MemoryConfig(),
                        seq_len=256, global_batch=8, gpu="h200", num_gpus=num_gpus)


def test_parameter_grad_optimizer_bytes_exact_and_sharded():
    cfg = ModelConfig.tiny_moe()
    n = cfg.num_params()
    r = planner.plan(_plan())
    s = r["stages"][0]
    assert s["params_local"] == n
    assert s["params_gib"] * GiB == 4 * n and s["grads_gib"] * GiB == 4 * n and s["optimizer_gib"] * GiB == 8 * n
    sharded = planner.plan(_plan(num_gpus=4, dp_shard=4, ep=2))["stages"][0]
    assert sharded["params_local"] == pytest.approx(n / 4)  # dense over dp_shard, experts over ep x efsdp
    assert sharded["optimizer_gib"] * GiB == pytest.approx(8 * n / 4)


def test_flops_are_model_config_flops_times_tokens():
    r = planner.plan(_plan())
    cfg = ModelConfig.tiny_moe()
    assert r["flops_per_token"] == cfg.flops_per_token(256)
    assert r["flops_per_step"] == cfg.flops_per_token(256) * 8 * 256


def test_recompute_full_keeps_block_inputs_only():
    p = _plan()
    p.memory = MemoryConfig(recompute="full")
    r = planner.plan(p)
    cfg = ModelConfig.tiny_moe()
    assert r["stages"][0]["act_bytes_per_token"] == 4 * cfg.d_model * cfg.n_layers


def test_non_dividing_layout_is_a_config_error():
    with pytest.raises(ConfigError, match="ep=3 must divide dp_shard=4"):
        planner.plan(_plan(num_gpus=4, ep=3))
    with pytest.raises(ConfigError, match="do not match the world size"):
        planner.plan(_plan(num_gpus=4, dp_shard=3))


def test_search_returns_only_layouts_that_fit():
    base = _plan(num_gpus=8)
    rows = planner.search(base, top=50)
    assert rows and all(r["fits"] for r in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    big = planner.Plan(model=ModelConfig.moe_1t(), parallel=ParallelConfig(), memory=MemoryConfig(),
                       seq_len=8192, global_batch=64, gpu="h100", num_gpus=8)
    assert planner.search(big) == []  # 1.2T parameters cannot fit 8 x 80 GB


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert planner.main(["--preset", "tiny-moe", "--seq-len", "256", "--global-batch", "8", "--gpu", "h100",
                         "--json", str(out), "--memory.recompute=full"]) == 0
    data = json.loads(out.read_text())
    assert data["rows"][0]["recompute"] == "full" and data["rows"][0]["fits"]
    assert "tightest resource" in capsys.readouterr().out
