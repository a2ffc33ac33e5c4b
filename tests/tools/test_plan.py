"""tools/plan.py: memory terms by hand on a tiny config, FLOPs through ModelConfig, layout errors, --search, JSON."""

import dataclasses
import json

import pytest
import torch

import plan as planner  # tools/plan.py
from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig
from moetron.core.precision import PrecisionConfig
from moetron.models import ModelConfig, Transformer
from moetron.parallel.config import ParallelConfig
from moetron.run.planner.hardware import DETERMINISTIC_ATTN

GiB = 2**30


COPIES_OFF = dict(expert_weight_copies="none", expert_grads_bf16=False, dense_weight_copies=False, head_weight_copy=False)
"""The optimizer's weight copies off, as every precision switch's term is measured against (their ``auto``
turns them on for one GPU and one micro-batch: test_auto_copies_resolve_as_the_run_would)."""


def _plan(num_gpus=1, **parallel):
    """tiny-moe on H200s with the weight copies off and optimizer.split_master off (given, though the default: a
    test that turns some copies on measures them alone)."""
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig

    return planner.Plan(model=ModelConfig.tiny_moe(), parallel=ParallelConfig(**parallel), memory=MemoryConfig(),
                        seq_len=256, global_batch=8, gpu="h200", num_gpus=num_gpus,
                        precision=PrecisionConfig(recipe="bf16", **COPIES_OFF),
                        optimizer=OptimizerConfig(split_master=False))


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
    assert r["stages"][0]["act_bytes_per_token"] == 2 * cfg.d_model * cfg.n_layers  # the bf16 stream (bf16_residual auto)
    p.precision = PrecisionConfig(bf16_residual=False)
    assert planner.plan(p)["stages"][0]["act_bytes_per_token"] == 4 * cfg.d_model * cfg.n_layers  # the fp32 stream


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


# ---- this session's switches: each term from its definition --------------------------------------

def _olmoe8(**kw):
    model = ModelConfig.preset("olmoe-1b-7b")
    model.n_layers, model.vocab_size = 8, 100352
    for k, v in kw.pop("model", {}).items():
        setattr(model, k, v)
    return planner.Plan(model=model, parallel=kw.pop("parallel", ParallelConfig()), memory=MemoryConfig(),
                        seq_len=4096, global_batch=4, **kw)


def test_bf16_state_halves_the_moments():
    from moetron.core.optim import OptimizerConfig

    n = ModelConfig.tiny_moe().num_params()
    p = _plan()
    p.optimizer = OptimizerConfig(state_dtype="bf16")
    r = planner.plan(p)
    assert r["stages"][0]["optimizer_gib"] * GiB == 4 * n and r["state_dtype"] == "bf16"
    # The Triton kernel moves fewer bytes with bf16 moments; the foreach ops (impl=torch) more.
    assert r["optimizer_s"] < planner.plan(_plan())["optimizer_s"]
    p.optimizer = OptimizerConfig(state_dtype="bf16", impl="torch")
    assert planner.plan(p)["optimizer_s"] > planner.plan(_plan())["optimizer_s"]
    p.optimizer = OptimizerConfig(state_dtype="bf16", fused=True)
    with pytest.raises(ConfigError, match="fused"):
        planner.plan(p)


def test_8bit_state_quarters_the_moments():
    """optimizer.state_dtype=q8: a byte a moment and an fp32 scale a block of 256 (core/moments_q8.py); its
    Triton kernel, though it moves 4 bytes an element fewer than bf16's, takes 1.5x bf16's time (measured on an
    H100, session 59: bound by its instructions), and the plan's optimizer time says so. fp8: byte scales, its
    pass at its bytes (assumed)."""
    from moetron.core.optim import OptimizerConfig

    n = ModelConfig.tiny_moe().num_params()
    p = _plan()
    p.optimizer = OptimizerConfig(state_dtype="bf16")
    bf16 = planner.plan(p)
    p.optimizer = OptimizerConfig(state_dtype="q8")
    r = planner.plan(p)
    assert r["stages"][0]["optimizer_gib"] * GiB == pytest.approx((2 + 8 / 256) * n) and r["state_dtype"] == "q8"
    assert r["optimizer_s"] > bf16["optimizer_s"]  # fewer bytes, more time: the measurement, not the count
    assert r["optimizer_s"] == pytest.approx(bf16["optimizer_s"] * (20 * 1.5 + 4) / 24)
    assert r["stages"][0]["peak_gib"] < bf16["stages"][0]["peak_gib"]
    # fp8's code: the same bytes of moments with byte scales, its pass counted at its bytes (assumed HBM-bound)
    p.optimizer = OptimizerConfig(state_dtype="fp8")
    f = planner.plan(p)
    assert f["stages"][0]["optimizer_gib"] * GiB == pytest.approx((2 + 2 / 256) * n) and f["state_dtype"] == "fp8"
    assert f["optimizer_s"] == pytest.approx(bf16["optimizer_s"] * (16 + 4) / 24)


def test_fsdp_offload_moves_params_grads_state_to_the_host_and_adds_copies():
    n = ModelConfig.tiny_moe().num_params()
    on = planner.plan(_plan(num_gpus=2, dp_shard=2, fsdp_offload=True))
    off = planner.plan(_plan(num_gpus=2, dp_shard=2))
    s = on["stages"][0]
    assert s["params_gib"] == s["grads_gib"] == s["optimizer_gib"] == 0
    assert s["host_gib"] * GiB == pytest.approx(16 * n / 2)
    assert on["peak_gib"] < off["peak_gib"] and on["step_s"] > off["step_s"] and on["offload_s"] > 0
    assert on["bytes_per_step"]["offload_host_device"] == pytest.approx(4 * n / 2 * 3)  # 2 gathers + 1 grad copy
    with pytest.raises(ConfigError, match="fsdp_offload"):
        planner.plan(_plan(fsdp_offload=True))  # one rank, no FSDP2: pretrain's error


def test_grad_sync_step_holds_unsharded_grads_and_reduces_once():
    """trainer.grad_sync=step, 4 micro-batches over dp_shard=4: every rank holds its units' unsharded
    fp32 gradients through the accumulation (4 B x the gathered parameters, in place of the sharded
    4 B / 4 held meanwhile), reduce-scatters once instead of 4 times, all-gathers as often; one
    micro-batch, or one rank, is unchanged."""
    import dataclasses

    n = ModelConfig.tiny_moe().num_params()
    base = dataclasses.replace(_plan(num_gpus=4, dp_shard=4), micro_batch=1, global_batch=16)  # 4 per rank
    per_mb = planner.plan(base)
    step = planner.plan(dataclasses.replace(base, grad_sync="step"))
    assert per_mb["grad_sync"] == "micro_batch" and step["grad_sync"] == "step" and step["grad_accum"] == 4
    assert step["bytes_per_step"]["fsdp_reduce_scatter"] == pytest.approx(per_mb["bytes_per_step"]["fsdp_reduce_scatter"] / 4)
    assert step["bytes_per_step"]["fsdp_all_gather"] == per_mb["bytes_per_step"]["fsdp_all_gather"]
    held = step["stages"][0]["peak_candidates_gib"]["last block's backward"] - \
        per_mb["stages"][0]["peak_candidates_gib"]["last block's backward"]
    assert held * GiB == pytest.approx(4 * n - 4 * n / 4)
    one_mb = dataclasses.replace(base, micro_batch=4)
    assert planner.plan(dataclasses.replace(one_mb, grad_sync="step"))["peak_gib"] == planner.plan(one_mb)["peak_gib"]
    with pytest.raises(ConfigError, match="grad_sync"):
        planner.plan(dataclasses.replace(base, grad_sync="never"))


def test_loss_terms_fused_vs_plain():
    T, D, V = 16384, 2048, 100352
    fused = planner.plan(_olmoe8())["stages"][0]
    plain = planner.plan(_olmoe8(model={"fused_loss": False}))
    # fused keeps the final norm's input and grad_h [T, D] in the stream's dtype (bf16: bf16_residual auto)
    # and grad_W [V, D] fp32
    assert fused["loss_saved_gib"] * GiB == 2 * T * D + 2 * T * D + 4 * V * D
    fp32_stream = planner.plan(_olmoe8(precision=PrecisionConfig(bf16_residual=False)))["stages"][0]
    assert fp32_stream["loss_saved_gib"] * GiB == 4 * T * D + 4 * T * D + 4 * V * D
    # plain keeps the fp32 log-softmax and the head's bf16 input; its peak is inside its backward
    s = plain["stages"][0]
    assert s["loss_saved_gib"] * GiB == 2 * T * D + 2 * T * D + 4 * T * V
    assert plain["peak_at"].startswith("loss backward") and s["loss_gib"] * GiB == s["loss_saved_gib"] * GiB + 10 * T * V
    assert plain["peak_gib"] - planner.plan(_olmoe8())["peak_gib"] > 14  # the [T, V] buffers gone


def test_bf16_experts_save_no_product_low_precision_saves_fp8_inputs():
    cfg = ModelConfig.preset("olmoe-1b-7b")
    K, D, F = 8, 2048, 1024
    for compiled in (True, False):
        bf16 = planner.activation_terms(cfg, 0, planner.Switches(compiled=compiled))
        assert "expert_swiglu" not in bf16
        low = planner.Switches(compiled=compiled, recipe="mxfp8", backend="emulated",
                               low_modules=frozenset({"experts", "attention", "mlp"}))
        terms = planner.activation_terms(cfg, 0, low)
        assert terms["expert_swiglu"][1] == pytest.approx(K * (0 if compiled else 2 * F) + K * (1 + 1 / 32) * F)
        assert terms["o_proj_input"][1] == pytest.approx((1 + 1 / 32) * D)
    # the compiled table reproduces the measured OLMoE block: 96 KiB of rows, 36 of attention, 11 rest - 2 of copies
    total = sum(b for _, b in planner.activation_terms(cfg, 0, planner.Switches()).values())
    assert total == pytest.approx((96 + 36 + 9.25) * 1024)


def test_precision_recipes_resolve_per_gpu_and_change_the_step():
    from moetron.core.precision import PrecisionConfig

    bf16 = planner.plan(_olmoe8())
    emu = planner.plan(_olmoe8(precision=PrecisionConfig(recipe="mxfp8")))  # auto on Hopper: emulated
    assert emu["precision_backend"] == "emulated" and emu["step_s"] > bf16["step_s"]
    assert emu["microbatch_parts_s"]["gemm"] == pytest.approx(bf16["microbatch_parts_s"]["gemm"])  # bf16 GEMMs
    assert emu["stages"][0]["activations_gib"] < bf16["stages"][0]["activations_gib"]
    fp8 = planner.plan(_olmoe8(precision=PrecisionConfig(recipe="fp8_blockwise")))
    # Native fp8 GEMMs at their own measured rates: dense faster than bf16, the grouped Triton kernel
    # (441 TFLOP/s measured) slower than bf16's grouped GEMM today, so the sum moves but not far.
    assert fp8["precision_backend"] == "native"
    assert fp8["microbatch_parts_s"]["gemm"] != pytest.approx(bf16["microbatch_parts_s"]["gemm"], rel=1e-3)
    with pytest.raises(ConfigError, match="SM100"):
        planner.plan(_olmoe8(precision=PrecisionConfig(recipe="mxfp8", backend="native")))
    assert planner.plan(_olmoe8(precision=PrecisionConfig(recipe="mxfp8"), gpu="b300"))["precision_backend"] == "native"


def test_cli_reads_pretrains_switch_flags(tmp_path):
    out = tmp_path / "plan.json"
    assert planner.main(["--preset", "tiny-moe", "--seq-len", "256", "--global-batch", "8", "--num-gpus", "2",
                         "--parallel.fsdp_offload=true", "--optimizer.state_dtype=bf16", "--model.fused_loss=false",
                         "--precision.recipe=fp8_blockwise", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["rows"][0]
    assert r["fsdp_offload"] and r["state_dtype"] == "bf16" and not r["fused_loss"] and r["precision"] == "fp8_blockwise"
    with pytest.raises(ConfigError, match="unrecognized"):
        planner.main(["--preset", "tiny-moe", "--trainer.steps=3"])


# ---- --validate --------------------------------------------------------------------------------

def _bench_files(tmp_path):
    """A bench_train and a bench_memory report, each with a row planned to within the targets and one far off."""
    base = ["--preset", "tiny-moe", "--seq-len", "256", "--batch", "8", "--model.n_layers=2"]
    full = ["--memory.recompute=full"]
    model = ModelConfig.tiny_moe()
    model.n_layers = 2
    plans = {}
    for name, ovr, compiled in (("none", [], True), ("full", full, True), ("eager", [], False)):
        p = planner.Plan(model=model, parallel=ParallelConfig(), memory=MemoryConfig(recompute="full" if ovr else "none"),
                         seq_len=256, global_batch=8, compiled=compiled)
        plans[name] = planner.plan(p)
    # dated after the last default change (tools/plan.py CHANGED_AUTO): replayed with today's defaults
    train = {"env": {"command": "python tools/bench_train.py " + " ".join(base + ["--compile"]), "preset": "tiny-moe",
                     "seq_len": 256, "batch": 8, "date": "2026-12-08 00:00:00"},
             "rows": [{"variant": "none", "overrides": [], "peak_mem_gib": plans["none"]["peak_gib"] * 1.05,
                       "step_s": plans["none"]["step_s"] * 1.1},
                      {"variant": "full", "overrides": full, "peak_mem_gib": plans["full"]["peak_gib"] * 2,
                       "step_s": plans["full"]["step_s"]}]}
    memory = {"env": {"command": "python tools/bench_memory.py " + " ".join(base), "preset": "tiny-moe", "seq_len": 256,
                      "batch": 8, "compile": False, "base_overrides": {"model": ["n_layers=2"]}, "date": "2026-12-08 00:00:00"},
              "rows": [{"variant": "eager", "overrides": [], "peak_bytes": plans["eager"]["peak_gib"] * GiB,
                        "step_s": plans["eager"]["step_s"] * 0.5}]}
    paths = []
    for name, report in (("train", train), ("memory", memory)):
        path = tmp_path / f"bench_{name}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    return paths


def test_validate_rebuilds_each_rows_config_and_scores_it(tmp_path, capsys):
    paths = _bench_files(tmp_path)
    out = tmp_path / "validate.json"
    assert planner.main(["--validate", *paths, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["none", "full", "eager"]
    none, full, eager = rows
    assert none["peak_error"] == pytest.approx(1 / 1.05 - 1) and none["step_error"] == pytest.approx(1 / 1.1 - 1)
    assert none["peak_met"] and none["step_met"] and none["compiled"]
    assert not full["peak_met"] and full["step_met"]  # the row's override reached the plan: planned = full's
    assert not eager["compiled"] and eager["peak_met"] and not eager["step_met"]  # bench_memory: peak_bytes, eager
    text = capsys.readouterr().out
    assert "met / met" in text and "missed / met" in text and "1 of 3 rows meet both targets" in text


def test_validate_plans_each_report_on_the_gpu_it_ran_on(tmp_path):
    """A report's ``device`` (torch.cuda.get_device_name(), as the benchmarks record it) picks the planned GPU:
    an H100 report is planned for the H100 (slower HBM: a longer step than the H200's plan), a report without a
    device, or on one the table lacks, for the H200."""
    assert planner.gpu_of("NVIDIA H100 80GB HBM3") == "h100" and planner.gpu_of("NVIDIA H200") == "h200"
    assert planner.gpu_of("NVIDIA B200") == "b200" and planner.gpu_of("cpu") is None and planner.gpu_of(None) is None
    base = ["--preset", "tiny-moe", "--seq-len", "256", "--batch", "8", "--model.n_layers=2", "--compile"]
    paths = []
    for name, device in (("h100", "NVIDIA H100 80GB HBM3"), ("none", None), ("other", "NVIDIA A100-SXM4-80GB")):
        env = {"command": "python tools/bench_train.py " + " ".join(base), "preset": "tiny-moe", "seq_len": 256, "batch": 8,
               "date": "2026-12-08 00:00:00"}  # after the last default change (CHANGED_AUTO): today's defaults
        if device:
            env["device"] = device
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"env": env, "rows": [{"variant": name, "overrides": [], "peak_mem_gib": 1.0,
                                                          "step_s": 0.1}]}))
        paths.append(str(path))
    rows = planner.validate(paths)
    assert [r["gpu"] for r in rows] == ["h100", "h200", "h200"]
    model = ModelConfig.tiny_moe()
    model.n_layers = 2
    for r in rows:
        p = planner.Plan(model=model, parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=256, global_batch=8,
                         compiled=True, gpu=r["gpu"])
        assert r["planned_step_ms"] == pytest.approx(1e3 * planner.plan(p)["step_s"])
    assert rows[0]["planned_step_ms"] > rows[1]["planned_step_ms"]


def test_validate_reports_a_row_it_cannot_replay_and_goes_on(tmp_path, capsys):
    """A row whose override no longer parses (a switch since removed) is listed as not replayed with the
    ConfigError's message; the report's other rows, and the other reports, are still planned and scored."""
    base = ["--preset", "tiny-moe", "--seq-len", "256", "--batch", "8", "--model.n_layers=2"]
    env = {"command": "python tools/bench_train.py " + " ".join(base), "preset": "tiny-moe", "seq_len": 256, "batch": 8}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"env": env, "rows": [
        {"variant": "gone", "overrides": ["--precision.emulated_save_w_dgrad=true"], "step_s": 0.1},
        {"variant": "kept", "overrides": [], "peak_mem_gib": 1.0, "step_s": 0.1}]}))
    rows = planner.validate([str(path)])
    assert [r["variant"] for r in rows] == ["gone", "kept"]
    assert "emulated_save_w_dgrad" in rows[0]["not_replayed"] and "planned_step_ms" not in rows[0]
    assert rows[1]["planned_step_ms"] > 0 and "not_replayed" not in rows[1]
    planner.print_validation(rows)
    out = capsys.readouterr().out
    assert "gone" in out and "not replayed" in out and "1 rows not replayed" in out
    assert "0 of 1 rows meet both targets" in out or "1 of 1 rows meet both targets" in out
    assert "over 1 rows" in out
    # a JSON that is not a report (a list, as some tools write): listed as not replayed, the others still planned
    other = tmp_path / "list.json"
    other.write_text(json.dumps([{"step": 1}]))
    rows = planner.validate([str(other), str(path)])
    assert rows[0]["file"] == str(other) and "not a bench_train" in rows[0]["not_replayed"]
    assert [r["variant"] for r in rows[1:]] == ["gone", "kept"] and rows[2]["planned_step_ms"] > 0


# ---- --slice: what tools/bench_slice.py runs ------------------------------------------------------

def _moe_1t_slice(compiled: bool, recompute: str = "none"):
    cfg = ModelConfig.moe_1t()
    cfg.triton_rmsnorm = cfg.triton_rope = False  # the pinned rows (2026-12-01) ran torch's eager norm and RoPE
    layers, local = planner.slice_layers(cfg, ep=8, pp=8, layers=2, name="moe-1t")
    r = planner.plan_slice(cfg, layers, ep=8, seq_len=8192, memory=MemoryConfig(recompute=recompute),
                           compiled=compiled, gpu="h200")
    return cfg, layers, local, r


def test_slice_params_are_the_blocks_bench_slice_builds_on_meta():
    import torch

    from moetron.core.moe import MoESpec
    from moetron.core.moe.experts import GroupedExperts
    from moetron.models.transformer import Block

    cfg, layers, local, r = _moe_1t_slice(compiled=True)
    assert layers == [2, 3] and local == 128 // 8  # the first two MoE blocks (0 and 1 are dense), E / ep
    # counted from the config: attention (q, k, v, o, qk-norms), two block norms, the router over all E,
    # the shared expert, and E/ep routed SwiGLU experts at full width
    D, att, moe = cfg.d_model, cfg.attention, cfg.moe
    per_block = (att.num_params(D) + 2 * D + moe.num_experts * D + 3 * D * moe.shared_width()
                 + local * 3 * D * moe.expert_hidden)
    assert r["params"] == 2 * per_block
    spec = MoESpec.from_config(moe)
    spec = MoESpec(router=spec.router, dispatcher=spec.dispatcher,
                   experts=lambda E, d, F, backend, dev: GroupedExperts(local, d, F, backend, dev))
    built = sum(p.numel() for i in layers for p in Block(cfg, i, device=torch.device("meta"), moe_spec=spec).parameters())
    assert built == r["params"]
    # bf16 weights and bf16 grads (bench_slice's parameters all require grad and are never zeroed)
    assert r["weights_gib"] * GiB == 2 * r["params"] and r["grads_gib"] * GiB == 2 * r["params"]
    assert r["io_gib"] * GiB == 4 * 2 * 8192 * D  # x, x.grad, y, dy
    assert r["flops"] == sum(cfg.block_flops_per_token(i, 8192) for i in layers) * 8192  # bench_slice's count
    assert r["tflops_per_gpu"] == pytest.approx(r["flops"] / r["step_s"] / 1e12)
    assert r["parts_s"]["ep_a2a"] == 0.0 and r["rows"] == 8192 * moe.router.top_k
    assert r["peak_gib"] == pytest.approx(r["weights_gib"] + r["grads_gib"] + r["io_gib"] + r["held_at_peak_gib"]
                                          + r["backward_transient_gib"])


def test_slice_pinned_figures_and_ordering():
    """The planner's figures for the three rows measured on one H200 (docs/performance.md,
    2026-12-01: eager none 202.0 ms / 32.8 GiB, eager full 266.3 / 27.3, compiled none 174.2 / 30.7).
    Since session 41's in-step GEMM rates the steps plan 8-10% short of them (they were 7-11% long); since
    session 46 the slice's bf16 stream takes precision.bf16_residual's terms (0.5-0.7 ms, 0.19 GiB compiled)."""
    eager = _moe_1t_slice(compiled=False)[3]
    full = _moe_1t_slice(compiled=False, recompute="full")[3]
    compiled = _moe_1t_slice(compiled=True)[3]
    pinned = {"eager": (eager, 183.6, 33.98), "full": (full, 244.3, 29.45), "compiled": (compiled, 156.5, 31.09)}
    for name, (r, ms, gib) in pinned.items():
        assert 1e3 * r["step_s"] == pytest.approx(ms, abs=0.1), name
        assert r["peak_gib"] == pytest.approx(gib, abs=0.01), name
    for r, measured_ms, measured_gib in ((eager, 202.0, 32.8), (full, 266.3, 27.3), (compiled, 174.2, 30.7)):
        assert abs(r["peak_gib"] / measured_gib - 1) <= planner.PEAK_TARGET
        assert abs(r["step_s"] * 1e3 / measured_ms - 1) <= planner.STEP_TARGET
    assert full["step_s"] > eager["step_s"] > compiled["step_s"]
    assert full["tflops_per_gpu"] < eager["tflops_per_gpu"] < compiled["tflops_per_gpu"]
    assert eager["peak_gib"] > compiled["peak_gib"] > full["peak_gib"]
    assert full["activations_gib"] * GiB == 2 * 2 * 8192 * ModelConfig.moe_1t().d_model  # bf16 block inputs only
    assert eager["weights_gib"] == full["weights_gib"] == compiled["weights_gib"]


def test_slice_cli_and_bad_slices(tmp_path, capsys):
    out = tmp_path / "slice.json"
    assert planner.main(["--slice", "--layers", "2", "--preset", "moe-1t", "--parallel.ep=8", "--parallel.pp=8",
                         "--seq-len", "8192", "--gpu", "h200", "--eager", "--memory.recompute=full",
                         "--model.triton_rmsnorm=false", "--model.triton_rope=false", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["layers"] == [2, 3] and row["recompute"] == "full" and not row["compiled"]
    direct = _moe_1t_slice(compiled=False, recompute="full")[3]
    assert row["peak_gib"] == pytest.approx(direct["peak_gib"]) and row["step_s"] == pytest.approx(direct["step_s"])
    assert planner.main(["--slice", "--layers", "2", "--preset", "moe-1t", "--parallel.ep=8", "--parallel.pp=8",
                         "--seq-len", "8192", "--gpu", "h200", "--eager", "--json", str(out)]) == 0
    (kernels,) = json.loads(out.read_text())["rows"]  # today's defaults: the eager Triton norm and RoPE
    assert kernels["step_s"] < _moe_1t_slice(compiled=False)[3]["step_s"]
    assert "no all-to-all, no optimizer, no bubble" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="must divide the 128 experts"):
        planner.main(["--slice", "--preset", "moe-1t", "--parallel.ep=3", "--json", ""])
    with pytest.raises(ConfigError, match="exceeds one stage"):
        planner.main(["--slice", "--preset", "moe-1t", "--parallel.pp=8", "--layers", "9", "--json", ""])
    with pytest.raises(ConfigError, match="is dense"):
        planner.main(["--slice", "--preset", "tiny", "--json", ""])


def test_expert_grads_bf16_and_triton_swiglu_terms():
    """precision.expert_grads_bf16: 2 B less per expert gradient at the end of backward and a faster
    step (no wgrad cast, 2 B less read by AdamW); refused under a sharded layout. precision.triton_swiglu
    (default): the fused SwiGLU backward holds two [T*K, F] bf16 row tensors fewer than the torch
    path's, counted from core/precision/bf16_grouped.py."""
    from moetron.core.precision import PrecisionConfig

    cfg = ModelConfig.tiny_moe()
    base, g16 = _plan(), _plan()
    base.precision = PrecisionConfig(recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=False)
    g16.precision = PrecisionConfig(recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True)
    rb, rg = planner.plan(base), planner.plan(g16)
    n_expert = sum(cfg.moe.num_experts * 3 * cfg.moe.expert_hidden * cfg.d_model
                   for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    assert (rb["stages"][0]["grads_gib"] - rg["stages"][0]["grads_gib"]) * GiB == 2 * n_expert
    assert rg["step_s"] < rb["step_s"]
    sharded = _plan(num_gpus=2, dp_shard=2)
    sharded.precision = g16.precision
    with pytest.raises(ConfigError, match="one unsharded GPU"):
        planner.plan(sharded)
    torch_path = _plan()
    torch_path.precision = PrecisionConfig(recipe="bf16", triton_swiglu=False)
    fused = _plan()
    fused.precision = PrecisionConfig(recipe="bf16")
    top = max(i for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    rows = 256 * 8 * cfg.moe.router.top_k  # the whole batch in one micro-batch
    key = "last block's backward"
    t, f = planner.plan(torch_path)["stages"][0], planner.plan(fused)["stages"][0]
    assert top == cfg.n_layers - 1
    assert (t["peak_candidates_gib"][key] - f["peak_candidates_gib"][key]) * GiB == pytest.approx(
        2 * 2 * rows * cfg.moe.expert_hidden)


def test_fused_loss_prescale_terms():
    """model.fused_loss_prescale (default on): the loss' backward neither makes nor holds scaled copies
    of grad_h [T, D] and grad_W [V, D] (fp32 both: 4 B each less at its peak, which is then its
    forward's last chunk) and skips their scaling pass (read and write, 8 B per element, each
    micro-batch); on under a pipeline schedule too (it declares each micro-batch's weight)."""
    from moetron.run.planner.hardware import GPUS

    T, D, V = 16384, 2048, 100352
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner.memory import loss_memory
    from moetron.run.planner.switches import Switches, switches

    on = planner.plan(_olmoe8())
    off = planner.plan(_olmoe8(model={"fused_loss_prescale": False}))
    assert off["step_s"] - on["step_s"] == pytest.approx(8.0 * D * (V + T) / GPUS["h200"].stream_bps)
    # olmoe3's D 4096: there the scaled copies make the loss' backward its peak
    olmoe3 = ModelConfig.preset("olmo3-moe-8e")
    olmoe3.n_layers, olmoe3.vocab_size, D = 4, V, 4096
    m_on, m_off = (loss_memory(olmoe3, Switches(fused_loss_prescale=p), T) for p in (True, False))
    assert m_on["saved"] == m_off["saved"]
    assert m_off["where"] == "loss backward" and m_off["peak"] - m_off["saved"] == 4 * T * D + 4 * V * D
    assert m_on["where"] == "loss forward (last chunk)" and m_on["peak"] < m_off["peak"]

    args = (PrecisionConfig(recipe="bf16"), OptimizerConfig(), GPUS["h200"], True)
    cfg = ModelConfig.tiny_moe()
    assert switches(cfg, ParallelConfig(), *args).fused_loss_prescale
    assert switches(cfg, ParallelConfig(pp=2), *args).fused_loss_prescale
    cfg.fused_loss = False  # nothing to prescale
    assert not switches(cfg, ParallelConfig(), *args).fused_loss_prescale


def test_save_swiglu_product_terms():
    """precision.save_swiglu_product: 2 B x top-k x F more saved per token and MoE layer, and as many
    bytes less written by the backward (the product's recompute), on OLMoE-8L (every layer MoE);
    refused outside the bf16 recipe."""
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner.hardware import GPUS

    T = 16384
    base, saving = _olmoe8(), _olmoe8()
    base.precision = PrecisionConfig(recipe="bf16")
    saving.precision = PrecisionConfig(recipe="bf16", save_swiglu_product=True)
    rb, rs = planner.plan(base), planner.plan(saving)
    moe = base.model.moe
    product = 2.0 * moe.router.top_k * moe.expert_hidden * T * 8  # eight MoE layers
    assert (rs["stages"][0]["activations_gib"] - rb["stages"][0]["activations_gib"]) * GiB == pytest.approx(product)
    assert rb["step_s"] - rs["step_s"] == pytest.approx(product / GPUS[base.gpu].stream_bps)
    bad = _olmoe8()
    bad.precision = PrecisionConfig(recipe="fp8_rowwise", save_swiglu_product=True)
    with pytest.raises(ConfigError, match="save_swiglu_product"):
        planner.plan(bad)


def test_bf16_residual_terms():
    """precision.bf16_residual (auto: on with bf16): the compiled norms' saved [T, D] and the loss' final
    norm input and grad_h at 2 B an element instead of 4, and RESIDUAL_SAVED_BYTES of traffic less per
    stream element (D x blocks x tokens), on OLMoE-8L; off, the fp32 stream's plan."""
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner.hardware import GPUS, RESIDUAL_SAVED_BYTES

    T, D, L = 16384, 2048, 8
    off, on = _olmoe8(), _olmoe8()
    off.precision = PrecisionConfig(recipe="bf16", bf16_residual=False)
    on.precision = PrecisionConfig(recipe="bf16")  # auto
    ro, rn = planner.plan(off), planner.plan(on)
    assert (ro["stages"][0]["activations_gib"] - rn["stages"][0]["activations_gib"]) * GiB == pytest.approx(2.0 * D * T * L)
    assert ro["peak_gib"] > rn["peak_gib"]
    assert ro["step_s"] - rn["step_s"] == pytest.approx(RESIDUAL_SAVED_BYTES * D * L * T / GPUS[off.gpu].stream_bps)
    fp8 = _olmoe8(precision=PrecisionConfig(recipe="fp8_blockwise"))  # auto: off outside bf16
    fp8_on = _olmoe8(precision=PrecisionConfig(recipe="fp8_blockwise", bf16_residual=True))
    assert planner.plan(fp8)["step_s"] > planner.plan(fp8_on)["step_s"]


def test_eager_triton_norm_and_rope_terms(tmp_path):
    """model.triton_rmsnorm in an eager step: each norm keeps its input as it came (OLMoE-8L is pre_norm: the
    fp32 stream; its q / k norms read bf16) and one fp32 scale a row, instead of torch's 8 B an element; the
    step moves EAGER_NORM_SAVED_BYTES less per normed element and, with model.triton_rope,
    EAGER_ROPE_SAVED_BYTES less per roped one (q and k). Compiled steps trace torch's: no change. A report
    dated before the defaults changed replays without them (tools/plan.py CHANGED_MODEL_DEFAULTS)."""
    from moetron.run.planner.hardware import EAGER_NORM_SAVED_BYTES, EAGER_ROPE_SAVED_BYTES, GPUS

    T, D, L = 16384, 2048, 8  # OLMoE-8L: A = G = D, QK-norm
    fp32_stream = PrecisionConfig(bf16_residual=False)

    def plan(norm: bool, rope: bool, compiled: bool = False) -> dict:
        return planner.plan(_olmoe8(model={"triton_rmsnorm": norm, "triton_rope": rope}, precision=fp32_stream,
                                    compiled=compiled))

    torch_path, norm, both = plan(False, False), plan(True, False), plan(True, True)
    per_block = (8 * D + 8 * D + 8 * 2 * D) - ((4 * D + 4) + (4 * D + 4) + 2 * (2 * D + 4))
    assert (torch_path["stages"][0]["activations_gib"] - norm["stages"][0]["activations_gib"]) * GiB == \
        pytest.approx(per_block * T * L)
    bps = GPUS["h200"].stream_bps
    assert torch_path["step_s"] - norm["step_s"] == pytest.approx(EAGER_NORM_SAVED_BYTES * 4 * D * L * T / bps)
    assert norm["step_s"] - both["step_s"] == pytest.approx(EAGER_ROPE_SAVED_BYTES * 2 * D * L * T / bps)
    assert plan(False, False, True)["step_s"] == plan(True, True, True)["step_s"]
    paths = []
    for date in ("2026-12-06 12:00:00", "2026-12-07 12:00:00"):  # before session 44's default change, after 45's
        env = {"command": "python tools/bench_train.py --preset tiny-moe --seq-len 256 --batch 8", "preset": "tiny-moe",
               "seq_len": 256, "batch": 8, "date": date}
        path = tmp_path / f"{date[:10]}.json"
        path.write_text(json.dumps({"env": env, "rows": [{"variant": "eager", "overrides": [], "step_s": 0.1}]}))
        paths.append(str(path))
    before, after = planner.validate(paths)
    tiny = ModelConfig.tiny_moe()
    tiny.triton_rmsnorm = tiny.triton_rope = False
    old = planner.plan(planner.Plan(model=tiny, parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=256,
                                    global_batch=8, compiled=False,  # that day's defaults: the copies off too
                                    precision=PrecisionConfig(bf16_residual=False, **COPIES_OFF)))
    assert before["planned_step_ms"] == pytest.approx(1e3 * old["step_s"]) and after["planned_step_ms"] < before["planned_step_ms"]


def test_dense_weight_copies_terms():
    """precision.dense_weight_copies: 2 B less per dense linear gradient (attention, dense and shared
    SwiGLUs; not the head), 12 B of HBM traffic less per such element in the step (the forward's weight
    cast and the backward's gradient cast gone, the optimizer's copy write against its 2 B less read),
    the peak no higher; refused outside the bf16 recipe and under a sharded layout."""
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner.hardware import GPUS
    from moetron.run.planner.memory import _linear_params

    cfg = ModelConfig.tiny_moe()
    base, dense = _plan(), _plan()
    base.precision = PrecisionConfig(recipe="bf16", **COPIES_OFF)
    dense.precision = PrecisionConfig(recipe="bf16", **{**COPIES_OFF, "dense_weight_copies": True})
    rb, rd = planner.plan(base), planner.plan(dense)
    n_dense = sum(_linear_params(cfg, i)["attention"] + _linear_params(cfg, i)["mlp"] for i in range(cfg.n_layers))
    assert n_dense == sum(p.numel() for n, p in Transformer(cfg, device="meta").named_parameters()
                          if n.endswith("_proj.weight"))  # q/k/v/o and the SwiGLUs' gate/up/down
    assert (rb["stages"][0]["grads_gib"] - rd["stages"][0]["grads_gib"]) * GiB == 2 * n_dense
    assert rb["step_s"] - rd["step_s"] == pytest.approx(12.0 * n_dense / GPUS[base.gpu].stream_bps)
    assert rd["stages"][0]["peak_gib"] <= rb["stages"][0]["peak_gib"]
    for recipe, layout in (("fp8_rowwise", {}), ("bf16", {"num_gpus": 2, "dp_shard": 2})):
        bad = _plan(**layout)
        bad.precision = PrecisionConfig(recipe=recipe, dense_weight_copies=True)
        with pytest.raises(ConfigError, match="dense_weight_copies"):
            planner.plan(bad)


def test_fp8_cublas_experts_at_the_gpu_rate_or_the_cpu_floor():
    """precision.fp8_experts=cublas: with 8 experts of 8192 rows the experts' GEMMs run at the
    measured cuBLAS rate, faster than the Triton kernels'; with OLMoE-8L's 64 experts a layer's 6 x 64
    calls at 55 us each are the floor, slower than the Triton kernels (as measured: 0.19x)."""
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw

    def step(plan_fn, experts, **kw):
        precision = PrecisionConfig(recipe="fp8_blockwise", backend="native", fp8_experts=experts)
        return planner.plan(plan_fn(precision=precision, **kw))["microbatch_parts_s"]

    olmoe3 = lambda **kw: planner.Plan(model=_olmoe3(), parallel=ParallelConfig(), memory=MemoryConfig(),  # noqa: E731
                                      seq_len=4096, global_batch=4, **kw)
    tri, cub = step(olmoe3, "triton"), step(olmoe3, "cublas")
    moe = ModelConfig.preset("olmo3-moe-8e").moe
    flops = 3 * 6.0 * 4 * 3 * 4096 * moe.expert_hidden * 16384  # 3 MoE layers, top-4, fwd + bwd
    assert tri["gemm"] - cub["gemm"] == pytest.approx(flops / 1979e12 * (1 / hw.EFF_FP8_EXPERT - 1 / hw.EFF_FP8_CUBLAS_EXPERT))
    tri8, cub8 = step(_olmoe8, "triton"), step(_olmoe8, "cublas")
    floor = 8 * 6 * 64 * hw.CUBLAS_CALL_S
    flops8 = 8 * 6.0 * 8 * 3 * 2048 * 1024 * 16384
    assert cub8["gemm"] - tri8["gemm"] == pytest.approx(floor - flops8 / (1979e12 * hw.EFF_FP8_EXPERT))


def test_bf16_cublas_experts_measured_ratio_or_the_cpu_floor():
    """precision.bf16_experts=cublas, fitted to session 9's H200 runs: olmoe3-4l-8e's 8 experts of 8192
    rows run at the grouped rate x the measured 1.05 (GPU-bound), a step about as long as the grouped
    kernel's (measured 304.0 against 303.3 ms); OLMoE-8L's 64 experts x 6 calls x 8 layers are bound by
    the CPU time per call, well over twice as slow (measured 453.5 against 184.7 ms)."""
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw
    from moetron.run.planner.timing import cublas_bf16_speedup, expert_gemm_share

    def grouped_rate(rows, d, f):  # the bf16 grouped experts' in-step rate on the H200 the plans run on
        return 989e12 * hw.GPUS["h200"].gemm_eff * expert_gemm_share(rows, d, f)

    def run(plan_fn, experts):  # bench_train's b16 / b16c switches
        precision = PrecisionConfig(recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True,
                                    bf16_experts=experts)
        return planner.plan(plan_fn(precision=precision, optimizer=OptimizerConfig(state_dtype="bf16")))

    olmoe3 = lambda **kw: planner.Plan(model=_olmoe3(), parallel=ParallelConfig(), memory=MemoryConfig(),  # noqa: E731
                                      seq_len=4096, global_batch=4, **kw)
    gemm = lambda r: r["microbatch_parts_s"]["gemm"]  # noqa: E731
    grouped, cublas = run(olmoe3, "grouped_mm"), run(olmoe3, "cublas")
    moe = ModelConfig.preset("olmo3-moe-8e").moe
    flops = 3 * 6.0 * 4 * 3 * 4096 * moe.expert_hidden * 16384  # 3 MoE layers, top-4, fwd + bwd
    speedup = 31.371 / 29.906  # call1_gemm.json, olmo3-moe-8e
    assert cublas_bf16_speedup(8192, 4096, moe.expert_hidden) == pytest.approx(speedup)
    rate = grouped_rate(8192, 4096, moe.expert_hidden)
    assert gemm(grouped) - gemm(cublas) == pytest.approx(flops / rate * (1 - 1 / speedup))
    assert 0.97 < cublas["step_s"] / grouped["step_s"] < 1.0
    grouped8, cublas8 = run(_olmoe8, "grouped_mm"), run(_olmoe8, "cublas")
    floor = 8 * 6 * 64 * hw.BF16_CUBLAS_CALL_S
    flops8 = 8 * 6.0 * 8 * 3 * 2048 * 1024 * 16384
    assert flops8 / (grouped_rate(2048, 2048, 1024) * cublas_bf16_speedup(2048, 2048, 1024)) < floor
    assert gemm(cublas8) - gemm(grouped8) == pytest.approx(floor - flops8 / grouped_rate(2048, 2048, 1024))
    assert 2.2 < cublas8["step_s"] / grouped8["step_s"] < 2.7  # measured 2.46x
    # the ratio grows with the GEMM's size, not its rows: 2048-row olmoe experts lose, 1024-row olmo3-moe-3.2b ones do not
    assert cublas_bf16_speedup(2048, 2048, 1024) == pytest.approx(7.570 / 11.057)
    assert cublas_bf16_speedup(1024, 4096, 4096) == pytest.approx(33.496 / 32.951)
    assert cublas_bf16_speedup(1024, 4096, 4096) < cublas_bf16_speedup(4096, 4096, 4096) < speedup
    assert cublas_bf16_speedup(64, 2048, 1024) == cublas_bf16_speedup(2048, 2048, 1024)
    assert cublas_bf16_speedup(65536, 4096, 4096) == cublas_bf16_speedup(8192, 4096, 4096)


def test_fp8_wgrad_false_moves_a_third_of_the_flops_to_bf16_and_saves_inputs_in_bf16():
    """precision.fp8_wgrad=false: the wgrad third of every fp8 module's GEMM FLOPs runs at the bf16
    rates, the cuBLAS loop makes 4 calls per expert and layer instead of 6, quantization counts the
    rows output only, and the low-precision inputs are saved in bf16 (the forward's peak grows)."""
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw

    def run(wgrad, experts="triton", olmoe8=False):
        precision = PrecisionConfig(recipe="fp8_blockwise", backend="native", fp8_wgrad=wgrad, fp8_experts=experts)
        if olmoe8:
            return planner.plan(_olmoe8(precision=precision))
        return planner.plan(planner.Plan(model=_olmoe3(), parallel=ParallelConfig(), memory=MemoryConfig(),
                                         seq_len=4096, global_batch=4, precision=precision))

    fp8, bf16 = run(True), run(False)
    moe = ModelConfig.preset("olmo3-moe-8e").moe
    flops = 3 * 6.0 * 4 * 3 * 4096 * moe.expert_hidden * 16384 / 3  # the experts' wgrad third
    from moetron.run.planner.timing import expert_gemm_share

    bf16_grouped = 989e12 * hw.GPUS["h200"].gemm_eff * expert_gemm_share(8192, 4096, moe.expert_hidden)
    expert_delta = flops / bf16_grouped - flops / (1979e12 * hw.EFF_FP8_EXPERT)
    gemm = lambda r: r["microbatch_parts_s"]["gemm"]  # noqa: E731
    # at the in-step bf16 grouped rate (683 TFLOP/s here) the experts' wgrad third runs faster in bf16
    # than in the Triton FP8 kernels (562): expert_delta < 0, as the FP8 wgrad measured slower than bf16
    assert expert_delta < 0
    assert gemm(bf16) - gemm(fp8) > expert_delta  # + the dense modules' wgrad thirds, slower in bf16
    # precision.fp8_wgrad=dense: the experts' wgrad third alone at the bf16 rate
    assert gemm(run("dense")) - gemm(fp8) == pytest.approx(expert_delta, rel=1e-6)
    # and the experts' gate|up wgrad holds no FP8 token operand and writes its bf16 gradient directly
    from moetron.run.planner.memory import gate_up_wgrad_transient
    from moetron.run.planner.switches import Switches

    cfg, held = ModelConfig.preset("olmo3-moe-8e"), {}
    for wgrad in ("all", "none", "dense"):
        sw = Switches(compiled=True, recipe="fp8_blockwise", backend="native",
                      low_modules=frozenset({"experts", "attention", "mlp"}), fp8_wgrad=wgrad)
        held[wgrad] = gate_up_wgrad_transient(cfg, 1, sw, 16384, 8)
    F, D = cfg.moe.expert_hidden, cfg.d_model
    assert held["dense"] == held["none"] and held["none"]["dh_tokens"] == 0 < held["all"]["dh_tokens"]
    # both bf16 gradients written by their kernels (the FP8 wgrad stores the weight's dtype since session 37)
    assert held["none"]["wgrad"] == 2.0 * 8 * 2 * F * D == held["all"]["wgrad"]
    quant = lambda r: r["microbatch_parts_s"]["recast_quant"]  # noqa: E731
    from moetron.run.planner.timing import _gemm_operands

    # q, k, v (gate, up) share one quantized input: precision.quantize_input_once is on (auto) since session 38
    elements = sum(x + y for i in range(4) for x, y in _gemm_operands(_olmoe3(), i, True).values()) * 16384
    assert quant(fp8) - quant(bf16) == pytest.approx(
        (hw.QUANT_BYTES["native"] - hw.QUANT_ROWS_BYTES) * elements / (hw.GPUS["h200"].hbm_tbps * 1e12))
    assert fp8["stages"][0]["peak_gib"] < bf16["stages"][0]["peak_gib"]
    # OLMoE-8L's cuBLAS loop is CPU-bound: 4 fp8 passes per expert and layer instead of 6 save more
    # than the bf16 wgrad costs (8 layers x 2 x 64 calls)
    saved = 8 * 2 * 64 * hw.CUBLAS_CALL_S
    assert gemm(run(True, "cublas", olmoe8=True)) - gemm(run(False, "cublas", olmoe8=True)) > saved / 2


def _olmoe3():
    model = ModelConfig.preset("olmo3-moe-8e")
    model.n_layers, model.vocab_size = 4, 100352
    return model


def test_quantize_weights_once_quantizes_the_experts_once_and_holds_the_cache():
    """precision.quantize_weights_once, compiled, one micro-batch: the experts' weight quantization
    is counted once per step instead of in forward and backward, and the WeightCache holds their
    quantized copies through the step (FP8_WEIGHT_CACHED bytes per element); dense modules and eager
    runs are unchanged."""
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw

    def run(once, compiled=True):
        precision = PrecisionConfig(recipe="fp8_blockwise", backend="native", quantize_weights_once=once)
        return planner.plan(planner.Plan(model=_olmoe3(), parallel=ParallelConfig(), memory=MemoryConfig(),
                                         seq_len=4096, global_batch=4, precision=precision, compiled=compiled))

    off, on = run(False), run(True)
    from moetron.run.planner.model import _expert_params

    experts = sum(_expert_params(_olmoe3(), i) for i in range(4))
    # compiled: w (forward) and w^T (backward) each from the fp32 master, 4 + 1 B; once: both together, 4 + 2 B
    saved = (2 * (4.0 + 1.0) - (4.0 + 2.0)) * experts / (hw.GPUS["h200"].hbm_tbps * 1e12)
    quant = lambda r: r["microbatch_parts_s"]["recast_quant"]  # noqa: E731
    assert quant(off) - quant(on) == pytest.approx(saved)
    assert (on["stages"][0]["compute_copies_gib"] - off["stages"][0]["compute_copies_gib"]) * GiB == \
        pytest.approx(hw.FP8_WEIGHT_CACHED * experts)
    assert quant(run(False, compiled=False)) == quant(run(True, compiled=False))


def test_mxfp8_emulated_quantization_counted_from_its_kernels_fits_session9():
    """mxfp8 emulated, compiled (session 9 on the H200, docs/planner.md): the quantization is the
    kernels' bytes by hand (x: rows + columns' payload from one read, 2 + 2 + 1 + 1/32 B, or two
    reads, + 2; its payload dequantized, 1 + 1/32 + 2; dy: rows + columns in bf16, 6 or 8; weights
    fp32 -> bf16 along I and along O, 12) at the measured rates; the OLMoE-8L step lands within 5%
    of the measured 218.7 ms (fused, the default) and 227.8 ms (MOETRON_MX_FUSED=0), fused the
    faster by the 9.1 ms measured, and quantize_weights_once saves nothing with one micro-batch
    (measured 339.5 / 339.3 ms on olmoe3-4l-8e)."""
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw

    def run(model, fused, once=False):
        precision = PrecisionConfig(recipe="mxfp8", backend="emulated", quantize_weights_once=once,
                                    quantize_input_once=False)  # as session 9 ran (before auto)
        return planner.plan(planner.Plan(model=model, parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=4096,
                                         global_batch=4, precision=precision,
                                         optimizer=OptimizerConfig(state_dtype="bf16"), mx_fused=fused))

    olmoe8 = _olmoe8().model
    fused, two_pass = run(olmoe8, True), run(olmoe8, False)
    assert "fused" in fused["precision_note"] and "two passes" in two_pass["precision_note"]
    T, D, F, K, E = 16384, 2048, 1024, 8, 64
    x = 8 * T * (4 * D + K * (D + F))  # q, k, v, o inputs; gate|up and down inputs (routed rows)
    dy = 8 * T * (4 * D + K * (2 * F + D))
    w = 8 * (4 * D * D + E * 3 * D * F)
    hbm = 4.8e12
    quant = lambda r: r["microbatch_parts_s"]["recast_quant"]  # noqa: E731
    separate = ((1 + 1 / 32 + 2) * x + 12 * w) / (hbm * hw.EFF_MX_QUANT)
    assert quant(fused) == pytest.approx(((5 + 1 / 32) * x + 6 * dy) / (hbm * hw.EFF_MX_FUSED) + separate)
    assert quant(two_pass) == pytest.approx(((7 + 1 / 32) * x + 8 * dy) / (hbm * hw.EFF_MX_QUANT) + separate)
    assert fused["step_s"] == pytest.approx(0.2187, rel=0.05)
    assert two_pass["step_s"] == pytest.approx(0.2278, rel=0.05)
    assert two_pass["step_s"] - fused["step_s"] == pytest.approx(0.2278 - 0.2187, abs=5e-4)
    olmoe3 = _olmoe3()
    assert run(olmoe3, False)["step_s"] == pytest.approx(0.3276, rel=0.05)
    assert run(olmoe3, False, once=True)["step_s"] == pytest.approx(run(olmoe3, False)["step_s"])
    # fused, the weight cache (quantize_weights_once) makes both orientations of an expert weight
    # from one fp32 read: 4 + 2 + 2 B at the fused rate instead of two passes of 4 + 2 at the other
    moe_layers = sum(olmoe3.is_moe_layer(i) for i in range(olmoe3.n_layers))
    we = moe_layers * olmoe3.moe.num_experts * 3 * olmoe3.d_model * olmoe3.moe.expert_hidden
    saved = quant(run(olmoe3, True)) - quant(run(olmoe3, True, once=True))
    assert saved == pytest.approx(12 * we / (hbm * hw.EFF_MX_QUANT) - 8 * we / (hbm * hw.EFF_MX_FUSED), rel=1e-6)
    # a report that recorded MOETRON_MX_FUSED is planned as it ran; without it, as this process has it
    row = {"overrides": ["--precision.recipe=mxfp8", "--precision.backend=emulated"]}
    assert planner.bench_plan({"preset": "tiny-moe", "env_vars": {"MOETRON_MX_FUSED": "0"}}, row).mx_fused is False
    assert planner.bench_plan({"preset": "tiny-moe"}, row).mx_fused is None


def test_bench_reports_record_the_mx_kernel_switches(monkeypatch):
    """The MX kernel switches are read at import, so a report keeps them (tools/plan.py --validate
    plans a row as it ran), and so are inductor's; unrelated variables stay out."""
    from moetron.core.metrics import run_environment

    monkeypatch.setenv("MOETRON_MX_FUSED", "0")
    monkeypatch.setenv("MOETRON_MX_LEAN", "1")
    monkeypatch.setenv("MOETRON_MX_GRID", "rows-first")
    monkeypatch.setenv("MOETRON_SOMETHING_ELSE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", "1")  # inductor's switches change the kernels
    env = run_environment(torch.device("cpu"), 1, "tools/bench_train.py", [])["env_vars"]
    assert env["MOETRON_MX_FUSED"] == "0" and env["MOETRON_MX_LEAN"] == "1" and env["MOETRON_MX_GRID"] == "rows-first"
    assert env["TORCHINDUCTOR_MAX_AUTOTUNE_GEMM"] == "1"
    assert "MOETRON_SOMETHING_ELSE" not in env
    row = {"overrides": ["--precision.recipe=mxfp8", "--precision.backend=emulated"]}
    assert planner.bench_plan({"preset": "tiny-moe", "env_vars": env}, row).mx_fused is False


def test_fp8_rowwise_native_rates_and_quantization_by_hand():
    """fp8_rowwise native on the H200 (docs/planner.md): the experts at the bf16 grouped rate x session 11's
    measured ratio over bf16 (the table's at its shapes, between them in between, fast accumulation
    faster), dense linears at session 15's in-step rate, and the quantization the kernels' bytes by
    hand at session 15's kernel rates (every operand's rows, 3 B an element; with FP8 wgrads its
    columns, 3 B, and olmoe3's 8192-column gate|up gradient's column maxima in a read of their own, 2 B;
    each weight along I and along O from its master: fp32 4 + 1 B, the experts' bf16 copies 2 + 1). The
    recipe the throughput rows run (RWC) lands within 5% of session 17's olmoe3-4l-8e step (241.1 ms)
    and within 10% of its OLMoE-8L one with bf16 weight gradients (175.0 ms), within 6% / 5% of the
    measured peak (39.05 / 56.37 GiB), and bf16 weight gradients save the columns' passes."""
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw
    from moetron.run.planner.timing import fp8_rowwise_speedup

    for rows, d, f, promoted, fast in hw.FP8_ROWWISE_MEASURED.values():
        assert fp8_rowwise_speedup(rows, d, f, False) == pytest.approx(promoted)
        assert fp8_rowwise_speedup(rows, d, f, True) == pytest.approx(fast) and fast > promoted
    between = fp8_rowwise_speedup(4096, 4096, 4096, True)  # between olmo3-moe-3.2b's size and olmo3-moe-8e's
    assert hw.FP8_ROWWISE_MEASURED["olmo3-moe-3.2b"][4] < between < hw.FP8_ROWWISE_MEASURED["olmo3-moe-8e"][4]

    def run(model, **kw):
        kw = {"fp8_fast_accum": True, **kw}
        precision = PrecisionConfig(recipe="fp8_rowwise", expert_weight_copies="optimizer", expert_grads_bf16=True,
                                    quantize_input_once=False, **kw)  # as session 11 ran (before auto)
        return planner.plan(planner.Plan(model=model, parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=4096,
                                         global_batch=4, precision=precision,
                                         optimizer=OptimizerConfig(state_dtype="bf16")))

    olmoe3 = _olmoe3()
    r = run(olmoe3)
    assert r["precision"] == "fp8_rowwise" and "fp8_rowwise" in r["precision_note"]
    T, D, F, K, E, S, H = 16384, 4096, 4096, 4, 8, 4096, 5 * 4096
    A, G = 4096, 1024
    attn = 4 * (3 * D + A + A + 2 * G + D)  # q, k, v, o: x and dy
    dense = 3 * (2 * D + S + 2 * S + D) + (2 * D + H + 2 * H + D)  # shared experts of layers 1-3, layer 0's MLP
    experts = 3 * K * (D + F + 2 * F + D)
    n = T * (attn + dense + experts)
    chunks = 2 * T * 3 * K * 2 * F  # the 8192-column gate|up gradient: column maxima read apart
    w_dense = 4 * (2 * D * A + 2 * D * G) + 3 * 3 * D * S + 3 * D * H
    w_exp = 3 * E * 3 * D * F
    wq = 5 * w_dense + 3 * w_exp
    hbm = 4.8e12
    want = (3 * n + chunks + wq) / (hbm * hw.EFF_ROWWISE_ROWS) + (3 * n + wq) / (hbm * hw.EFF_ROWWISE_COLS)
    assert r["microbatch_parts_s"]["recast_quant"] == pytest.approx(want, rel=1e-9)
    assert r["step_s"] == pytest.approx(0.2411, rel=0.05)
    # 6%: since session 38 the plan counts q, k and v's (gate and up's) saved operands one each with the
    # input quantized per linear, as this row ran (+0.75 GiB; the native fp8_blockwise A/B measured that
    # term exactly), on top of the olmoe3-4l-8e peaks' +2-4% (tools/plan.py --validate, sessions 37-38)
    assert r["peak_gib"] == pytest.approx(39.05, rel=0.06)
    # bf16 weight gradients: no columns' passes (rows alone), a third of the GEMM FLOPs in bf16
    none = run(olmoe3, fp8_wgrad="none")
    assert none["microbatch_parts_s"]["recast_quant"] == pytest.approx(
        (3 * n + wq) / (hbm * hw.EFF_ROWWISE_ROWS) + wq / (hbm * hw.EFF_ROWWISE_COLS), rel=1e-9)
    olmoe8 = run(_olmoe8().model, fp8_wgrad="none")
    assert olmoe8["step_s"] == pytest.approx(0.1750, rel=0.10)
    assert olmoe8["peak_gib"] == pytest.approx(56.37, rel=0.05)
    # fp32 promotion: slower GEMMs (the dense rate assumed at fp8_blockwise's)
    assert run(olmoe3, fp8_fast_accum=False)["step_s"] > r["step_s"]


def test_fp8_rowwise_eager_cache_holds_the_backward_orientation_only_after_it_ran():
    """Eager fp8_rowwise caches each weight orientation as its own entry (fp8_rowwise._weight): 1 B an
    element (the forward's rows) until the weight's backward, 2 B after; fp8_blockwise makes both in
    one entry. In the plan the end of backward holds the difference for every weight, the last
    block's backward for its own weights only (session 17's eager rows: +9.4% peak before, +5-7% now)."""
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner.hardware import FP8_WEIGHT_CACHED
    from moetron.run.planner.switches import Switches

    rw = Switches(compiled=False, recipe="fp8_rowwise", low_modules=frozenset({"experts", "attention", "mlp"}))
    assert rw.weight_cache("experts", forward_only=True) == 1.0 and rw.weight_cache("experts") == 2.0
    bw = Switches(compiled=False, recipe="fp8_blockwise", low_modules=frozenset({"experts"}))
    assert bw.weight_cache("experts", forward_only=True) == bw.weight_cache("experts") == FP8_WEIGHT_CACHED
    p = _plan()
    p.compiled, p.precision = False, PrecisionConfig(recipe="fp8_rowwise")
    s = planner.plan(p)["stages"][0]
    cfg = ModelConfig.tiny_moe()
    from moetron.run.planner.memory import stage_linear

    linear = stage_linear(cfg, list(range(cfg.n_layers)), 1)
    assert s["compute_copies_gib"] * GiB == pytest.approx(sum(linear.values()))  # the rows entries, 1 B each


def test_fp8_rowwise_plan_without_triton_is_one_clear_error(monkeypatch):
    """Planning fp8_rowwise reads the fused kernel's tile rule beside the kernel; where triton cannot
    be imported that is one ConfigError naming what to install."""
    import sys

    from moetron.core.precision import PrecisionConfig

    monkeypatch.setitem(sys.modules, "moetron.core.precision.fp8_rowwise_triton", None)  # import -> ImportError
    p = _plan()
    p.precision = PrecisionConfig(recipe="fp8_rowwise")
    with pytest.raises(ConfigError, match="pip install triton"):
        planner.plan(p)


def test_emulated_recipes_on_the_optimizers_bf16_copies():
    """mxfp8 emulated with precision.expert_weight_copies=optimizer and expert_grads_bf16 (session 22):
    the plan holds the experts' bf16 copies (2 B per expert parameter) and bf16 gradients, reads 2 B
    less of each expert weight in every weight quantization (two orientations a micro-batch,
    compiled: 2 x 2 B per element at the separate passes' rate), and drops the gradients' cast. Native
    fp8_blockwise takes them too (session 37): the same copies and gradients, and each compiled weight
    quantization reads 2 B less of each expert element (timing.weight_quant_bytes); native
    mxfp8 (a Blackwell) refuses them as the run does (core.precision.config.check_expert_copies)."""
    from moetron.core.config import ConfigError
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw

    def run(copies: bool, recipe="mxfp8", backend="emulated"):
        p = _olmoe8(gpu="h200", compiled=True, optimizer=OptimizerConfig(state_dtype="bf16"))
        p.precision = PrecisionConfig(recipe=recipe, backend=backend,
                                      expert_weight_copies="optimizer" if copies else "none", expert_grads_bf16=copies)
        return planner.plan(p)

    off, on = run(False), run(True)
    cfg = _olmoe8().model
    experts = sum(cfg.moe.num_params(cfg.d_model) - cfg.moe.num_experts * cfg.d_model
                  for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    assert on["stages"][0]["compute_copies_gib"] * GiB == pytest.approx(
        off["stages"][0]["compute_copies_gib"] * GiB + 2 * experts)
    assert on["stages"][0]["grads_gib"] * GiB == pytest.approx(off["stages"][0]["grads_gib"] * GiB - 2 * experts)
    hbm = 4.8e12
    lighter = 2 * 2.0 * experts / (hbm * hw.EFF_MX_QUANT)  # two orientations, 2 B less read each
    assert off["microbatch_parts_s"]["recast_quant"] - on["microbatch_parts_s"]["recast_quant"] == pytest.approx(
        lighter, rel=1e-9)
    assert on["step_s"] < off["step_s"]
    # measured (session 22, docs/bench/session22/call2/olmoe8l_mx.json): 213.7 -> 206.9 ms, 48.55 -> 54.55 GiB
    assert on["step_s"] == pytest.approx(0.2069, rel=0.2) and on["peak_gib"] == pytest.approx(54.55, rel=0.1)
    with pytest.raises(ConfigError, match="native mxfp8 GEMMs do not take.*backend=emulated"):
        run(True, recipe="mxfp8", backend="native")
    off8, on8 = run(False, recipe="fp8_blockwise", backend="auto"), run(True, recipe="fp8_blockwise", backend="auto")
    assert on8["stages"][0]["compute_copies_gib"] * GiB == pytest.approx(
        off8["stages"][0]["compute_copies_gib"] * GiB + 2 * experts)
    assert on8["stages"][0]["grads_gib"] * GiB == pytest.approx(off8["stages"][0]["grads_gib"] * GiB - 2 * experts)
    # compiled: w in the forward, w^T in the backward, each from the bf16 copy (2 B read, not 4)
    assert off8["microbatch_parts_s"]["recast_quant"] - on8["microbatch_parts_s"]["recast_quant"] == pytest.approx(
        2 * 2.0 * experts / hbm, rel=1e-9)


def test_emulated_save_x_bf16_trades_the_dequantize_for_bf16_saved_inputs():
    """precision.emulated_save_x_bf16 (session 23), mxfp8 emulated, compiled: every low-precision GEMM
    input's wgrad operand is held in bf16 (2 B per element instead of 1 + 1/32), its forward kernel
    writes bf16 columns as dy's does (2 + 2 + 2 B instead of 2 + 2 + 1 + 1/32), and the backward's
    dequantize (1 + 1/32 + 2 B at the separate passes' rate) is gone; fp8_blockwise resolving to its
    native GEMMs on the H200 is refused as the run refuses it (check_emulated_saves)."""
    from moetron.core.config import ConfigError
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw

    def run(on: bool, recipe="mxfp8", backend="emulated", copies=True):
        p = _olmoe8(gpu="h200", compiled=True, optimizer=OptimizerConfig(state_dtype="bf16"))
        p.precision = PrecisionConfig(recipe=recipe, backend=backend, expert_weight_copies="optimizer" if copies else "none",
                                      expert_grads_bf16=copies, emulated_save_x_bf16=on,
                                      quantize_input_once=False)  # as session 23 ran (before auto)
        return planner.plan(p)

    off, on = run(False), run(True)
    T, D, F, K = 16384, 2048, 1024, 8
    x = 8 * T * (4 * D + K * (D + F))  # q, k, v, o inputs; gate|up and down inputs (routed rows)
    hbm = 4.8e12
    quant = lambda r: r["microbatch_parts_s"]["recast_quant"]  # noqa: E731
    fused_saved = ((5 + 1 / 32) - 6) * x / (hbm * hw.EFF_MX_FUSED)  # negative: bf16 columns write more
    assert quant(off) - quant(on) == pytest.approx(fused_saved + (3 + 1 / 32) * x / (hbm * hw.EFF_MX_QUANT), rel=1e-9)
    saved = 8 * T * (4 * D + K * (D + F))  # compiled, q, k and v each save their input (input once off: memory.py)
    assert (on["stages"][0]["activations_gib"] - off["stages"][0]["activations_gib"]) * GiB == \
        pytest.approx((2 - (1 + 1 / 32)) * saved, rel=1e-9)
    # measured (docs/bench/session23/call4/olmoe8l.json): 210.0 -> 205.7 ms, 54.55 -> 58.5 GiB
    assert on["step_s"] - off["step_s"] == pytest.approx(-0.0043, abs=0.002)
    assert on["peak_gib"] - off["peak_gib"] == pytest.approx(58.5 - 54.55, abs=0.6)
    with pytest.raises(ConfigError, match="emulated_save_x_bf16: an option of mxfp8 / fp8_blockwise on the emulated"):
        run(True, recipe="fp8_blockwise", backend="auto", copies=False)


def test_quantize_input_once_counts_one_quantization_of_the_qkv_input():
    """precision.quantize_input_once (session 24), mxfp8 emulated on OLMoE-8L: q, k and v quantize
    their one input once, so the forward's fused kernel runs on D elements per token per layer
    instead of 3 D, and the backward dequantizes one payload instead of three; eager, one saved
    payload instead of three, eager and compiled (memory.activation_terms);
    the bf16 recipe is refused as the run refuses it (check_input_once)."""
    from moetron.core.config import ConfigError
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw

    def run(on: bool, compiled=True, recipe="mxfp8"):
        p = _olmoe8(gpu="h200", compiled=compiled, optimizer=OptimizerConfig(state_dtype="bf16"))
        p.precision = PrecisionConfig(recipe=recipe, backend="emulated" if recipe != "bf16" else "auto",
                                      quantize_input_once=on)
        return planner.plan(p)

    off, on = run(False), run(True)
    T, D, hbm = 16384, 2048, 4.8e12
    x = 8 * T * 2 * D  # the two quantizations of the qkv input no longer made, per layer
    b = hw.MX_EMULATED_BYTES
    quant = lambda r: r["microbatch_parts_s"]["recast_quant"]  # noqa: E731
    want = b["input_fused"] * x / (hbm * hw.EFF_MX_FUSED) + b["input_dequant"] * x / (hbm * hw.EFF_MX_QUANT)
    assert quant(off) - quant(on) == pytest.approx(want, rel=1e-9)
    # compiled too, one saved payload instead of three (measured on every low-precision recipe: mxfp8 emulated
    # -1.0 GiB here, session 26; native fp8_blockwise -0.5 GiB, the planner's delta exactly, session 38)
    assert (off["stages"][0]["activations_gib"] - on["stages"][0]["activations_gib"]) * GiB == \
        pytest.approx((1 + 1 / 32) * x, rel=1e-9)
    eager_off, eager_on = run(False, compiled=False), run(True, compiled=False)
    assert (eager_off["stages"][0]["activations_gib"] - eager_on["stages"][0]["activations_gib"]) * GiB == \
        pytest.approx((1 + 1 / 32) * x, rel=1e-9)
    with pytest.raises(ConfigError, match="quantize_input_once: an option of fp8_rowwise"):
        run(True, recipe="bf16")
    # auto: the plan of on where the recipe takes it, of off for bf16 (as the run resolves it: input_once_on)
    assert run("auto")["microbatch_parts_s"] == on["microbatch_parts_s"]
    assert run("auto", recipe="bf16")["step_s"] == run(False, recipe="bf16")["step_s"]


def test_validate_replays_a_report_with_the_defaults_of_its_day():
    """precision.quantize_input_once became auto (on for mxfp8 emulated) in session 29: an mxfp8
    emulated row of a report written before that ran with it off, and is planned so (CHANGED_DEFAULTS);
    the same row in a report dated after it is planned with it on, and a row that sets it is planned
    as it says whatever the date. A row that recorded its precision section (bench_train since session
    29) is planned with that section, whatever its date or today's defaults."""
    cmd = ("python tools/bench_train.py --preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 "
           "--seq-len 4096 --batch 4 --compile")
    mx = ["--optimizer.state_dtype=bf16", "--precision.recipe=mxfp8", "--precision.backend=emulated"]

    def planned(date, extra=(), recorded=None):
        env = {"command": cmd, "preset": "olmoe-1b-7b", "seq_len": 4096, "batch": 4, "compile": True, "date": date}
        row = {"overrides": mx + list(extra)}
        if recorded is not None:
            row["precision"] = recorded
        return planner.bench_plan(env, row)

    since, old = planner.CHANGED_DEFAULTS[0][0], "2026-12-04 10:00:00"
    step = lambda date, *extra: planner.plan(planned(date, extra))["step_s"]  # noqa: E731
    assert step(old) == step(since, "--precision.quantize_input_once=false")  # the old default
    assert step(since) < step(old)  # auto: one quantization of the qkv input, not three
    assert step(old, "--precision.quantize_input_once=true") == step(since)  # a row's own setting wins
    from moetron.core.precision import PrecisionConfig

    off = PrecisionConfig.from_dict({"recipe": "mxfp8", "backend": "emulated", "quantize_input_once": False}).to_dict()
    assert planned(since, recorded=off).precision.to_dict() == off
    assert planner.plan(planned(since, recorded=off))["step_s"] == step(old)  # as the run had it, not today's auto
    # what auto means changed for native fp8_blockwise in session 38 (CHANGED_AUTO): a recorded auto before
    # then is replayed off, after it on; the emulated backend's auto was on all along
    f8 = PrecisionConfig.from_dict({"recipe": "fp8_blockwise"}).to_dict()
    then = {field: since for since, _, field, _ in planner.CHANGED_AUTO}
    now = "2026-12-06 09:00:00"
    assert str(planned("2026-12-06 07:30:00", recorded=f8).precision.quantize_input_once) == "false"
    assert str(planned(now, recorded=f8).precision.quantize_input_once) == "auto" and then["quantize_input_once"] < now
    emulated = dict(f8, backend="emulated")
    assert str(planned("2026-12-06 07:30:00", recorded=emulated).precision.quantize_input_once) == "auto"
    # and its experts became the Gluon kernels on SM90 in session 37: an auto before then ran the Triton ones
    assert str(planned("2026-12-06 06:00:00", recorded=f8).precision.fp8_experts) == "triton"
    assert str(planned("2026-12-06 07:30:00", recorded=f8).precision.fp8_experts) == "auto"
    assert then["fp8_experts"] < "2026-12-06 07:30:00"


def test_validate_replays_split_master_as_its_run_had_it():
    """bench_train records each row's optimizer section (since session 51): a row is replayed with it, so session
    51's rows that ran optimizer.split_master at auto (call 5) plan it on and its rows at false (then the default)
    plan it off, whatever today's default (auto since session 52); a row without one ran before split_master had an
    auto and plans it off unless its overrides set the switch."""
    from moetron.core.optim import OptimizerConfig

    cmd = ("python tools/bench_train.py --preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 "
           "--seq-len 4096 --batch 4 --compile")

    def planned(extra=(), recorded=None):
        env = {"command": cmd, "preset": "olmoe-1b-7b", "seq_len": 4096, "batch": 4, "compile": True,
               "date": "2026-12-07 10:46:02"}
        row = {"overrides": list(extra)}
        if recorded is not None:
            row["optimizer"] = recorded
        return planner.plan(planner.bench_plan(env, row))

    auto = planned(recorded=OptimizerConfig(split_master=None).to_dict())
    assert auto["split_master"] and not planned()["split_master"]
    assert planned(["--optimizer.split_master=true"])["split_master"]
    assert planned()["peak_gib"] - auto["peak_gib"] > 6  # OLMoE-8L: 6.6 GiB measured
    assert not planned(recorded=OptimizerConfig(split_master=False).to_dict())["split_master"]


def test_quantized_expert_copies_move_the_weight_quantization_into_the_optimizer():
    """precision.quantized_expert_copies (session 25, not measured yet), mxfp8 emulated on OLMoE-8L's
    optimizer copies, compiled: no GEMM quantizes an expert weight (the forward's and the backward's
    pass over each bf16 copy gone: recast_quant), the optimizer writes 2 B more per expert weight
    element, and the second copy is held (2 B each); refused without the copies, as the run refuses it."""
    from moetron.core.config import ConfigError
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner import hardware as hw

    def run(on: bool, copies=True):
        p = _olmoe8(gpu="h200", compiled=True, optimizer=OptimizerConfig(state_dtype="bf16"))
        p.precision = PrecisionConfig(recipe="mxfp8", backend="emulated", expert_weight_copies="optimizer" if copies
                                      else "none", expert_grads_bf16=copies, quantized_expert_copies=on)
        return planner.plan(p)

    off, on = run(False), run(True)
    experts, hbm = 8 * 64 * 3 * 2048 * 1024, 4.8e12  # expert weight elements: 8 layers x 64 x (gate|up + down)
    quant = lambda r: r["microbatch_parts_s"]["recast_quant"]  # noqa: E731
    assert quant(off) - quant(on) == pytest.approx((hw.MX_EMULATED_BYTES["weight"] - 2) * experts * 2
                                                   / (hbm * hw.EFF_MX_QUANT), rel=1e-9)
    assert on["optimizer_s"] - off["optimizer_s"] == pytest.approx(2 * experts / hw.GPUS["h200"].stream_bps, rel=1e-9)
    assert (on["peak_gib"] - off["peak_gib"]) * GiB == pytest.approx(2 * experts, rel=1e-6)
    assert on["step_s"] < off["step_s"]
    with pytest.raises(ConfigError, match="needs --precision.expert_weight_copies=optimizer"):
        run(True, copies=False)


def test_optimizer_overlap_is_named_as_not_modelled():
    """optimizer.overlap (session 24, not measured yet): the plan says it keeps the step unoverlapped."""
    from moetron.core.optim import OptimizerConfig

    from moetron.core.precision import PrecisionConfig

    copies_off = PrecisionConfig(recipe="bf16", **COPIES_OFF)  # auto would turn them on without the overlap only
    off = planner.plan(_olmoe8(gpu="h200", compiled=True, optimizer=OptimizerConfig(state_dtype="bf16"), precision=copies_off))
    on = planner.plan(_olmoe8(gpu="h200", compiled=True, optimizer=OptimizerConfig(state_dtype="bf16", overlap=True),
                              precision=copies_off))
    assert on["step_s"] == off["step_s"] and "optimizer.overlap=true is not modelled" in on["overlap"]
    assert "not modelled" not in off["overlap"] and off["step_overlap_best_s"] is None
    # the bound: the embedding's (100352 x 2048) and the first block's updates stay exposed
    cfg = _olmoe8(gpu="h200").model
    first = 100352 * 2048 + cfg.num_block_params(0)
    total = on["stages"][0]["params_local"]
    assert on["step_overlap_best_s"] == pytest.approx(on["step_s"] - on["optimizer_s"] * (1 - first / total), rel=1e-9)
    assert 0.15 < first / total < 0.2 and "at best" in on["overlap"]


def test_validate_plans_the_step_trainer_switches_as_the_step_without_them():
    """A bench_train row with --trainer.cuda_graph / grad_clip (tools/step_builder.py STEP_TRAINER_FIELDS)
    plans as the same row without them (the graph replays the eager step's kernels in memory allocated
    as its: +0.0-0.1 GiB measured, session 39); --trainer.deterministic as the same row with only its
    attention time scaled by DETERMINISTIC_ATTN (the same bytes); another --trainer.* field is still refused."""
    env = {"preset": "tiny-moe", "seq_len": 64, "batch": 2, "compile": True}
    plain = planner.bench_plan(env, {"overrides": ["--model.n_layers=2"]})
    graph = planner.bench_plan(env, {"overrides": ["--model.n_layers=2", "--trainer.cuda_graph=true",
                                                   "--trainer.grad_clip=0.5"]})
    assert plain.model.n_layers == graph.model.n_layers == 2 and not plain.deterministic
    planned, planned_plain = planner.plan(graph), planner.plan(plain)
    assert planned["stages"] == planned_plain["stages"] and planned["step_s"] == planned_plain["step_s"]
    det = planner.bench_plan(env, {"overrides": ["--model.n_layers=2", "--trainer.deterministic=true"]})
    assert det.deterministic and det.model.n_layers == 2
    planned_det = planner.plan(det)
    assert planned_det["peak_gib"] == planned_plain["peak_gib"]
    attn, attn_det = (r["microbatch_parts_s"]["attention"] for r in (planned_plain, planned_det))
    assert attn > 0 and attn_det == pytest.approx(attn * DETERMINISTIC_ATTN)
    assert planned_det["step_s"] == pytest.approx(planned_plain["step_s"] + attn_det - attn)
    with pytest.raises(ConfigError, match="unrecognized arguments.*--trainer.steps=3"):
        planner.bench_plan(env, {"overrides": ["--trainer.steps=3"]})


def test_cli_and_run_yaml_plan_trainer_deterministic(tmp_path):
    """tools/plan.py --trainer.deterministic=true, or a run YAML whose trainer section sets it, plans the
    deterministic step (its figure, DETERMINISTIC_ATTN, measured in session 53: OLMoE-8L's attention
    16.1 -> 38.1 ms a step on the H100); the flag given overrides the YAML."""
    base = ["--preset", "tiny-moe", "--seq-len", "256", "--global-batch", "8"]
    steps = {}
    for name, extra in (("plain", []), ("det", ["--trainer.deterministic=true"])):
        out = tmp_path / f"{name}.json"
        assert planner.main(base + extra + ["--json", str(out)]) == 0
        steps[name] = json.loads(out.read_text())["rows"][0]
    assert steps["det"]["deterministic"] and not steps["plain"]["deterministic"]
    assert steps["det"]["step_s"] > steps["plain"]["step_s"]
    yml = tmp_path / "run.yaml"
    yml.write_text("trainer:\n  deterministic: true\n")
    for extra, want in (([], True), (["--trainer.deterministic=false"], False)):
        out = tmp_path / "yaml.json"
        assert planner.main(["--config", str(yml)] + base + extra + ["--json", str(out)]) == 0
        assert json.loads(out.read_text())["rows"][0]["deterministic"] is want


def test_in_step_rates_plan_the_profiled_terms():
    """Session 41's calibration against tools/profile_step.py's profiles of the bf16 best rows on the H100
    (docs/bench/session40/call4/profile_S2_best_top40.json, docs/bench/session41/call2/profile_S1_best_top40.json):
    each term of the plan near the kernel time it stands for. GEMMs 222.6 / 106.8 ms a step (olmoe3-4l-8e /
    OLMoE-8L), attention 17.4 / 16.1, the optimizer with its grad norm 20.5 / 28.5, the step 290.8 / 189.9."""
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.run.planner.hardware import EXPERT_GEMM_MEASURED
    from moetron.run.planner.timing import expert_gemm_share

    best = dict(precision=PrecisionConfig(recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True,
                                          dense_weight_copies=True, head_weight_copy=True, save_swiglu_product=True),
                optimizer=OptimizerConfig(state_dtype="bf16", triton_grad_norm=True, split_master=False), gpu="h100",
                compiled=True)
    olmoe3 = planner.Plan(model=_olmoe3(), parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=4096,
                          global_batch=4, **best)
    olmoe3.model.loss_chunk_tokens, olmoe3.model.triton_embedding_grad = 16384, True
    olmoe8 = _olmoe8(model={"loss_chunk_tokens": 16384, "triton_embedding_grad": True}, **best)
    for plan_, gemm, attn, opt, step in ((olmoe3, 222.6, 17.4, 20.5, 290.8), (olmoe8, 106.8, 16.1, 28.5, 189.9)):
        r = planner.plan(plan_)
        parts = {k: 1e3 * v for k, v in r["microbatch_parts_s"].items()}
        assert parts["gemm"] == pytest.approx(gemm, rel=0.04)
        assert parts["attention"] == pytest.approx(attn, rel=0.08)
        assert 1e3 * r["optimizer_s"] == pytest.approx(opt, rel=0.03)
        assert 1e3 * r["step_s"] == pytest.approx(step, rel=0.03)
    # the experts' share of the dense rate: the measured ends, log-linear between, flat outside
    (r1, d1, f1, s1), (r2, d2, f2, s2) = EXPERT_GEMM_MEASURED.values()
    assert expert_gemm_share(r1, d1, f1) == pytest.approx(s1) and expert_gemm_share(r2, d2, f2) == pytest.approx(s2)
    assert s1 < expert_gemm_share(4096, 4096, 2048) < s2
    assert expert_gemm_share(64, d1, f1) == pytest.approx(s1) and expert_gemm_share(65536, d2, f2) == pytest.approx(s2)


def test_split_master_plans_two_bytes_less_an_element_held_and_moved():
    """optimizer.split_master on olmoe3-4l-8e's best row: the split weights are the dense linears, the
    experts and the head (every parameter but the embedding, the norms and the routers' bias-free
    vectors), counted by hand from the model: 2 B an element less held (params) and moved by the
    optimizer; refused without copies, as the trainer refuses it."""
    from moetron.core.optim import OptimizerConfig

    def plan(split: bool, **precision):
        precision = dict(dict(recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True,
                              dense_weight_copies=True, head_weight_copy=True), **precision)
        p = planner.Plan(model=_olmoe3(), parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=4096,
                         global_batch=4, precision=PrecisionConfig(**precision),
                         optimizer=OptimizerConfig(state_dtype="bf16", split_master=split), gpu="h100", compiled=True)
        return planner.plan(p)

    model = _olmoe3().build(device="meta")
    split = sum(p.numel() for n, p in model.named_parameters()
                if n.endswith(("_proj.weight", "w_gate_up", "w_down", "lm_head.weight")))
    assert 2.0e9 < split < 2.3e9
    off, on = plan(False), plan(True)
    (s_off,), (s_on,) = off["stages"], on["stages"]
    assert (s_off["params_gib"] - s_on["params_gib"]) * 2**30 == pytest.approx(2.0 * split, rel=1e-6)
    assert (s_off["peak_gib"] - s_on["peak_gib"]) * 2**30 == pytest.approx(2.0 * split, rel=1e-6)
    saved_s = off["optimizer_s"] - on["optimizer_s"]
    assert saved_s > 0 and off["step_s"] - on["step_s"] == pytest.approx(saved_s, rel=1e-6)
    assert saved_s * planner.GPUS["h100"].stream_bps == pytest.approx(2.0 * split, rel=1e-6)
    with pytest.raises(ConfigError, match="this run has none"):
        plan(True, expert_weight_copies="none", expert_grads_bf16=False, dense_weight_copies=False,
             head_weight_copy=False)


def test_head_grads_bf16_plans_the_heads_gradient_in_two_bytes():
    """precision.head_grads_bf16 on olmoe3-4l-8e's best row (the loss in one chunk of 16384 tokens): the
    head's gradient 2 B x V x D less at the peak and 4 B x V x D less moved (the optimizer's read, the
    loss' write); in several chunks the loss keeps its fp32 accumulator (only the optimizer's read)."""
    from moetron.core.optim import OptimizerConfig

    def plan(grads: bool, chunk: int = 16384):
        p = planner.Plan(model=_olmoe3(), parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=4096,
                         global_batch=4, precision=PrecisionConfig(
                             recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True,
                             dense_weight_copies=True, head_weight_copy=True, head_grads_bf16=grads),
                         optimizer=OptimizerConfig(state_dtype="bf16"), gpu="h100", compiled=True)
        p.model.loss_chunk_tokens = chunk
        return planner.plan(p)

    VD = 100352 * 4096
    rate = planner.GPUS["h100"].stream_bps
    off, on = plan(False), plan(True)
    assert (off["stages"][0]["peak_gib"] - on["stages"][0]["peak_gib"]) * 2**30 == pytest.approx(2.0 * VD, rel=1e-6)
    assert (off["step_s"] - on["step_s"]) * rate == pytest.approx(4.0 * VD, rel=1e-6)
    off, on = plan(False, 4096), plan(True, 4096)
    assert (off["step_s"] - on["step_s"]) * rate == pytest.approx(2.0 * VD, rel=1e-6)
    assert on["stages"][0]["peak_gib"] == pytest.approx(off["stages"][0]["peak_gib"])


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_embedding_copy_plans_its_gradient_in_two_bytes(split):
    """precision.embedding_weight_copy on olmoe3-4l-8e's best row: the copy held (2 B x V x D) for the
    gradient's 2 B less (params + grads + copies: even, and with optimizer.split_master 2 B x V x D less
    params); moved: 2 B x V x D less (the kernel's write; the optimizer reads 2 B less and writes the copy)
    and 10 B x T x D (the rows), with split_master 2 B x V x D more; refused on the fp32 stream and
    sharded, as the run refuses it."""
    from moetron.core.optim import OptimizerConfig

    def plan(on: bool, parallel=None, **precision):
        precision = dict(dict(recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True,
                              dense_weight_copies=True, head_weight_copy=True, embedding_weight_copy=on), **precision)
        p = planner.Plan(model=_olmoe3(), parallel=parallel or ParallelConfig(), memory=MemoryConfig(),
                         num_gpus=2 if parallel else 1,
                         seq_len=4096, global_batch=4, precision=PrecisionConfig(**precision),
                         optimizer=OptimizerConfig(state_dtype="bf16", split_master=split), gpu="h100",
                         compiled=True)
        return planner.plan(p)

    VD, TD = 100352 * 4096, 16384 * 4096
    off, on = plan(False), plan(True)
    (s_off,), (s_on,) = off["stages"], on["stages"]
    held = sum(s_off[k] - s_on[k] for k in ("params_gib", "grads_gib", "compute_copies_gib")) * 2**30
    assert held == pytest.approx(2.0 * VD if split else 0.0, abs=1e6)
    assert (s_off["grads_gib"] - s_on["grads_gib"]) * 2**30 == pytest.approx(2.0 * VD, rel=1e-6)
    moved = (off["step_s"] - on["step_s"]) * planner.GPUS["h100"].stream_bps
    assert moved == pytest.approx((4.0 if split else 2.0) * VD + 10.0 * TD, rel=1e-6)
    with pytest.raises(ConfigError, match="bf16_residual=auto"):
        plan(True, bf16_residual=False)
    with pytest.raises(ConfigError, match="one unsharded GPU"):
        plan(True, parallel=ParallelConfig(dp_shard=2), dense_weight_copies=False, head_weight_copy=False,
             expert_weight_copies="none", expert_grads_bf16=False)


def test_auto_copies_resolve_as_the_run_would():
    """precision's weight copies left at auto plan as the run resolves them (core.precision.config.copies_auto_on):
    on one GPU with one micro-batch a step as all four switches on, with two micro-batches or on a sharded layout
    as all four off."""
    from moetron.core.precision import PrecisionConfig

    on_given = PrecisionConfig(recipe="bf16", expert_weight_copies="optimizer", expert_grads_bf16=True,
                               dense_weight_copies=True, head_weight_copy=True)
    off_given = PrecisionConfig(recipe="bf16", **COPIES_OFF)

    def figures(precision, micro_batch=None, num_gpus=1, **parallel):
        p = _plan(num_gpus, **parallel)
        p.precision, p.micro_batch = precision, micro_batch
        r = planner.plan(p)
        return r["step_s"], r["stages"][0]["peak_gib"], r["stages"][0]["grads_gib"]

    auto = PrecisionConfig(recipe="bf16")
    assert figures(auto) == figures(on_given) != figures(off_given)
    assert figures(auto, micro_batch=4) == figures(off_given, micro_batch=4)
    assert figures(auto, num_gpus=2, dp_shard=2) == figures(off_given, num_gpus=2, dp_shard=2)


def test_a_plan_over_memory_names_the_auto_copies_it_holds():
    """A one-GPU plan that does not fit because auto turned the weight copies on (optimizer.split_master off, the
    default) gives the peak without them (the plan with them off); a plan whose copies are given, or that fits,
    gives none. With split_master auto (on with the copies) the same layout fits, below the copies-off peak: the
    split masters hold 2 B an element less than the fp32 masters."""
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig

    def run(precision=None, n_layers=10, split=False):
        model = ModelConfig.preset("olmoe-1b-7b")
        model.n_layers, model.vocab_size = n_layers, 100352
        return planner.plan(planner.Plan(model=model, parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=3072,
                                         global_batch=4, gpu="h100", precision=precision or PrecisionConfig(),
                                         optimizer=OptimizerConfig(split_master=None if split else False)))

    r, off = run(), run(PrecisionConfig(**COPIES_OFF))
    assert not r["fits"] and off["fits"] and r["peak_without_auto_copies_gib"] == off["peak_gib"] < r["peak_gib"]
    given = run(PrecisionConfig(expert_weight_copies="optimizer", expert_grads_bf16=True, dense_weight_copies=True,
                                head_weight_copy=True))
    assert given["peak_gib"] == r["peak_gib"] and given["peak_without_auto_copies_gib"] is None
    assert run(n_layers=8)["fits"] and run(n_layers=8)["peak_without_auto_copies_gib"] is None
    default = run(split=True)
    assert default["split_master"] and not r["split_master"] and not run(PrecisionConfig(**COPIES_OFF), split=True)["split_master"]
    assert default["fits"] and default["peak_gib"] < off["peak_gib"] and default["peak_without_auto_copies_gib"] is None
    assert default["step_s"] < r["step_s"] < off["step_s"]


def test_search_plans_a_layout_over_memory_with_auto_copies_off():
    """--search: a one-GPU layout that fits only without the weight copies auto turns on (optimizer.split_master
    off) is planned with them off (OLMoE-1B-7B cut to 10 layers at 4 x 3072 tokens on an H100: one micro-batch
    without recompute), and ranks above the slower layouts that fit with them (full recompute). With the defaults
    ``--optimizer.split_master=auto`` that layout fits with the copies and their split masters."""
    from moetron.core.optim import OptimizerConfig
    from moetron.core.precision import PrecisionConfig

    model = ModelConfig.preset("olmoe-1b-7b")
    model.n_layers, model.vocab_size = 10, 100352
    base = planner.Plan(model=model, parallel=ParallelConfig(), memory=MemoryConfig(), seq_len=3072, global_batch=4,
                        gpu="h100", precision=PrecisionConfig(), optimizer=OptimizerConfig(split_master=False))
    default = planner.search(dataclasses.replace(base, optimizer=OptimizerConfig(split_master=None)))[0]  # auto: fits
    assert default["micro_batch"] == 4 and default["recompute"] == "none" and default["weight_copies"] and default["split_master"]
    rows = planner.search(base)
    best = rows[0]
    assert best["micro_batch"] == 4 and best["recompute"] == "none" and not best["weight_copies"]
    assert any(r["weight_copies"] and r["recompute"] == "full" and r["step_s"] > best["step_s"] for r in rows)
    off = planner.plan(dataclasses.replace(base, micro_batch=4, precision=PrecisionConfig(**COPIES_OFF)))
    assert best["step_s"] == off["step_s"] and best["peak_gib"] == off["peak_gib"]
