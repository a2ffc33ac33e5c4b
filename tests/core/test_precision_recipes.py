"""The precision section's low-precision recipes: config resolution and errors, which modules get the
low-precision backend, and a tiny MoE trained with mxfp8 emulated through the trainer."""

import numpy as np
import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.moe.experts import GroupedExperts
from moetron.core.precision import PrecisionConfig, TorchGemm
from moetron.core.precision.emulated import EmulatedGemm


def cfg(**kw):
    return PrecisionConfig.from_dict(kw)


def test_backend_resolution_and_errors(capsys):
    mx = cfg(recipe="mxfp8")
    assert mx.resolved_backend("cuda", 10) == "native"
    assert mx.resolved_backend("cuda", 9, verbose=True) == "emulated"
    assert "emulated" in capsys.readouterr().out  # auto on Hopper says so
    assert mx.resolved_backend("cpu") == "emulated"
    assert cfg(recipe="fp8_blockwise").resolved_backend("cuda", 9) == "native"
    assert cfg(recipe="fp8_blockwise").resolved_backend("cpu") == "emulated"
    with pytest.raises(ConfigError, match="SM100.*fp8_blockwise"):
        cfg(recipe="mxfp8", backend="native").resolved_backend("cuda", 9)
    with pytest.raises(ConfigError, match="SM100.*the CPU.*backend=emulated"):
        cfg(recipe="mxfp8", backend="native").build("cpu")
    with pytest.raises(ConfigError, match="SM90.*the CPU"):
        cfg(recipe="fp8_blockwise", backend="native").build("cpu")
    with pytest.raises(ConfigError, match="'expert' is not one of 'experts', 'attention', 'mlp'"):
        cfg(recipe="mxfp8", modules=["expert"])
    with pytest.raises(ConfigError, match="mx_scale"):
        cfg(recipe="mxfp8", mx_scale="ceil").build("cpu")
    with pytest.raises(ConfigError, match="fp8_experts=cublas.*needs --precision.recipe=fp8_blockwise"):
        cfg(recipe="mxfp8", fp8_experts="cublas").validate()
    with pytest.raises(ConfigError, match="fp8_experts=cublas needs the native.*backend=emulated"):
        cfg(recipe="fp8_blockwise", fp8_experts="cublas").build("cpu")  # auto resolves emulated on the CPU
    with pytest.raises(ConfigError, match="fp8_experts=gluon.*SM90.*precision.backend=emulated.*fp8_experts=triton"):
        cfg(recipe="fp8_blockwise", fp8_experts="gluon").build("cpu")
    with pytest.raises(ConfigError, match="fp8_experts=gluon.*needs --precision.recipe=fp8_blockwise"):
        cfg(recipe="mxfp8", fp8_experts="gluon").validate()
    with pytest.raises(ConfigError, match="'cuBLAS' is not one of"):
        cfg(recipe="fp8_blockwise", fp8_experts="cuBLAS")
    with pytest.raises(ConfigError, match="quantize_weights_once.*needs --precision.recipe=mxfp8, fp8_blockwise or fp8_rowwise"):
        cfg(recipe="bf16", quantize_weights_once=True).validate()
    assert cfg(recipe="mxfp8", backend="emulated", quantize_weights_once=True).build("cpu").gemm.quantize_weights_once
    for bad in (dict(recipe="bf16"), dict(recipe="fp8_rowwise"), dict(recipe="fp8_blockwise", backend="native")):
        with pytest.raises(ConfigError, match="emulated_save_x_bf16: an option of mxfp8 / fp8_blockwise on the "
                                              "emulated backend.*--precision.backend=emulated"):
            cfg(emulated_save_x_bf16=True, **bad).validate()
    for recipe in ("mxfp8", "fp8_blockwise"):  # auto resolves emulated on the CPU
        assert cfg(recipe=recipe, emulated_save_x_bf16=True).build("cpu", verbose=False).gemm.save_x_bf16
    assert not cfg(recipe="mxfp8").build("cpu", verbose=False).gemm.save_x_bf16
    from moetron.core.precision.config import low_precision_gemm

    assert low_precision_gemm("fp8_blockwise", "native", fp8_experts="cublas").experts == "cublas"
    with pytest.raises(ConfigError, match="fp8_wgrad=none.*needs --precision.recipe=fp8_blockwise or fp8_rowwise"):
        cfg(recipe="mxfp8", fp8_wgrad=False).validate()
    with pytest.raises(ConfigError, match="fp8_wgrad=none is an option of the native.*backend=emulated"):
        cfg(recipe="fp8_blockwise", fp8_wgrad=False).build("cpu")
    assert not low_precision_gemm("fp8_blockwise", "native", fp8_wgrad=False).fp8_wgrad
    split = low_precision_gemm("fp8_blockwise", "native", fp8_wgrad="dense")
    assert (split.fp8_wgrad, split.fp8_wgrad_experts) == (True, False)
    # the emulated backends' bf16 GEMMs take it (and then leave the compiled graph); the native ones refuse it
    assert cfg(recipe="mxfp8", backend="emulated", bf16_experts="cublas").build("cpu", verbose=False).gemm.per_expert
    assert not cfg(recipe="mxfp8", backend="emulated").build("cpu", verbose=False).gemm.per_expert
    with pytest.raises(ConfigError, match="'per_expert' is not one of 'grouped_mm', 'cublas'"):
        cfg(bf16_experts="per_expert")
    assert cfg(recipe="bf16", bf16_experts="cublas").build("cuda", verbose=False).gemm.per_expert
    assert not cfg(recipe="bf16").build("cuda", verbose=False).gemm.per_expert
    assert low_precision_gemm("fp8_blockwise", "native").fp8_wgrad


def test_bf16_experts_cublas_refused_by_the_native_backends(monkeypatch):
    import moetron.core.precision.config as config

    monkeypatch.setattr(config, "_capability_major", lambda device_type: 9)  # as on a Hopper GPU
    with pytest.raises(ConfigError, match="bf16_experts=cublas.*resolved precision.backend=native.*fp8_experts=cublas"):
        cfg(recipe="fp8_blockwise", bf16_experts="cublas").build("cuda", verbose=False)
    assert cfg(recipe="fp8_blockwise", fp8_experts="cublas").build("cuda", verbose=False).gemm.experts == "cublas"


def test_fp8_fused_swiglu_is_the_native_triton_or_gluon_experts_option(monkeypatch):
    import moetron.core.precision.config as config

    with pytest.raises(ConfigError, match="fp8_fused_swiglu=true.*needs --precision.recipe=fp8_blockwise"):
        cfg(recipe="mxfp8", fp8_fused_swiglu=True).validate()
    with pytest.raises(ConfigError, match="fp8_fused_swiglu=true is an option of the native.*backend=emulated"):
        cfg(recipe="fp8_blockwise", fp8_fused_swiglu=True).build("cpu", verbose=False)
    monkeypatch.setattr(config, "_capability_major", lambda device_type: 9)  # as on a Hopper GPU
    for bad in (dict(fp8_experts="cublas"), dict(fp8_wgrad="dense")):
        with pytest.raises(ConfigError, match="fp8_fused_swiglu=true fuses.*use fp8_experts=triton or gluon with "
                                              "fp8_wgrad=all"):
            cfg(recipe="fp8_blockwise", fp8_fused_swiglu=True, **bad).build("cuda", verbose=False)
    gemm = cfg(recipe="fp8_blockwise", fp8_fused_swiglu=True, fp8_experts="triton").build("cuda", verbose=False).gemm
    assert gemm.fused_swiglu and not cfg(recipe="fp8_blockwise").build("cuda", verbose=False).gemm.fused_swiglu


def test_fp8_quantize_warps_sets_the_native_blockwise_quantization_kernel(monkeypatch):
    """precision.fp8_quantize_warps: 4 or 8, fp8_blockwise native only; the backend built with it runs
    the 1x128 kernel on that many warps (the last one built sets the one kernel object)."""
    import moetron.core.precision.config as config
    from moetron.core.precision import blockwise_triton as bt

    def kernel_warps():
        return [c.num_warps for c in bt._fp8_quantize_1x128_kernel.configs]

    with pytest.raises(ConfigError, match="fp8_quantize_warps must be 4 or 8.*got 6"):
        cfg(recipe="fp8_blockwise", fp8_quantize_warps=6).validate()
    with pytest.raises(ConfigError, match="fp8_quantize_warps sets the fp8_blockwise.*recipe is mxfp8"):
        cfg(recipe="mxfp8", fp8_quantize_warps=8).validate()
    with pytest.raises(ConfigError, match="fp8_quantize_warps sets the native.*backend=emulated"):
        cfg(recipe="fp8_blockwise", fp8_quantize_warps=8).build("cpu", verbose=False)
    monkeypatch.setattr(config, "_capability_major", lambda device_type: 9)  # as on a Hopper GPU
    try:
        assert cfg(recipe="fp8_blockwise", fp8_quantize_warps=8).build("cuda", verbose=False).gemm.quantize_warps == 8
        assert kernel_warps() == [8]
        cfg(recipe="fp8_blockwise").build("cuda", verbose=False)
        assert kernel_warps() == [4] == [bt.QUANTIZE_WARPS]
    finally:
        bt.use_quantize_configs(bt.QUANTIZE_CONFIGS)


def tiny_moe():
    from moetron.models.config import ModelConfig

    m = ModelConfig.tiny_moe()
    m.d_model, m.vocab_size, m.mlp_hidden, m.n_layers = 64, 256, 128, 2
    m.attention.n_heads, m.attention.n_kv_heads = 2, 1
    m.moe.num_experts, m.moe.expert_hidden = 4, 32
    return m.build(device="cpu")


@pytest.mark.parametrize("modules", [["experts", "attention", "mlp"], ["experts"], ["attention", "mlp"]])
def test_modules_choose_who_gets_the_low_precision_backend(modules):
    model = tiny_moe()
    policy = cfg(recipe="mxfp8", backend="emulated", modules=modules).build("cpu", verbose=False)
    policy.apply(model)
    kinds = {}
    for name, module in model.named_modules():
        if hasattr(module, "gemm"):
            low = isinstance(module.gemm, EmulatedGemm)
            assert low or isinstance(module.gemm, TorchGemm)
            kind = ("experts" if isinstance(module, GroupedExperts) else "attention" if ".attn" in name or "attention" in name
                    else "lm_head" if "lm_head" in name else "mlp")
            kinds.setdefault(kind, set()).add(low)
    assert kinds["lm_head"] == {False}  # the LM head stays bf16
    for kind in ("experts", "attention", "mlp"):
        assert kinds[kind] == {kind in modules}, (kind, kinds)


def train(recipe_args, tmp_path, monkeypatch, steps=12):
    import pretrain

    from tests.data.token_writers import write_dolma_npy

    tmp_path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 64, size=rng.integers(20, 60)) % 64 * 4 % 256) for _ in range(200)]
    path = write_dolma_npy(tmp_path / "tokens.npy", docs)
    monkeypatch.setenv("MOETRON_DATA_DIR", str(tmp_path / "unused"))
    cfg_, _ = pretrain.parse_args([
        "--preset", "tiny-moe", "--model.d_model=64", "--model.n_layers=2", "--model.vocab_size=256",
        "--model.mlp_hidden=128", "--model.attention.n_heads=2", "--model.attention.n_kv_heads=1",
        "--model.sliding_window=16", "--model.moe.num_experts=4", "--model.moe.expert_hidden=32",
        "--model.moe.router.top_k=2", "--model.moe.shared_expert_hidden=32", "--data.seq_len=32",
        "--data.global_batch_size=8", f"--trainer.steps={steps}", "--scheduler.warmup_steps=1",
        "--trainer.device=cpu", "--trainer.eval_batches=0", "--trainer.log_interval=1", "--optimizer.lr=1e-2",
        f"--trainer.run_dir={tmp_path}/run", f"--checkpoint.dir={tmp_path}/ckpt", "--data.source=files",
        f"--data.train_paths=[{path}]", *recipe_args])
    trainer, _ = pretrain.build(cfg_, torch.device("cpu"), 1, None)
    losses = []
    for _ in range(steps):
        losses.append(trainer.train_step(trainer.data.next_batch())[0].item())
        trainer.precision.after_optimizer_step(trainer.model_parts)
        trainer.step += 1
    return trainer, losses


def assert_trains_close_to_fp32(recipe_args, gemm_class: str, tmp_path, monkeypatch) -> None:
    """A tiny MoE trained with ``recipe_args``: the low-precision backend ``gemm_class`` on every
    module but the LM head, finite losses that fall, the last three within 1% of an fp32 run's."""
    _, fp32 = train(["--precision.recipe=fp32"], tmp_path / "fp32", monkeypatch)
    trainer, low = train(recipe_args, tmp_path / "low", monkeypatch)
    gemms = {type(m.gemm).__name__ for m in trainer.model_parts[0].modules() if hasattr(m, "gemm")}
    assert gemms == {gemm_class, "TorchGemm"}  # TorchGemm: the LM head
    print("fp32", np.round(fp32, 3), gemm_class, np.round(low, 3))
    assert all(np.isfinite(low))
    assert np.mean(low[-3:]) < low[0] - 0.5  # it learns
    assert abs(np.mean(low[-3:]) - np.mean(fp32[-3:])) < 0.01 * np.mean(fp32[-3:]), (low, fp32)


# the loop run also shares the q, k, v (and the dense / shared SwiGLUs' gate, up) input quantization
@pytest.mark.parametrize("experts_backend, extra", [("grouped_mm", []), ("loop", ["--precision.quantize_input_once=true"])])
def test_tiny_moe_trains_in_mxfp8_emulated_close_to_fp32(tmp_path, monkeypatch, experts_backend, extra):
    assert_trains_close_to_fp32(["--precision.recipe=mxfp8", "--precision.backend=emulated",
                                 f"--model.moe.experts_backend={experts_backend}", *extra], "EmulatedGemm", tmp_path,
                                monkeypatch)


def test_swizzled_mx_scales_match_torchao_to_blocked():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.utils import to_blocked

    from moetron.core.precision.mx import swizzle_mx_scales

    g = torch.Generator().manual_seed(0)
    for rows, blocks in [(128, 4), (300, 7), (1, 1), (256, 64), (129, 5)]:
        scale = torch.randint(0, 256, (rows, blocks), dtype=torch.uint8, generator=g)
        assert torch.equal(swizzle_mx_scales(scale), to_blocked(scale).flatten()), (rows, blocks)


def test_native_mx_for_experts_builds():
    # the grouped GEMM is built (not run: tests/core/test_native_mx.py checks it on the CPU)
    from moetron.core.precision.native_mx import NativeMXGemm

    c = cfg(recipe="mxfp8", backend="native")
    c.resolved_backend = lambda *a, **k: "native"  # as on an SM100 GPU
    assert isinstance(c.build("cuda").gemm, NativeMXGemm)


@pytest.mark.parametrize("recipe, block", [("mxfp8", 32), ("fp8_blockwise", 128)])
def test_gemm_widths_checked_at_start(recipe, block):
    """A width the recipe's scale blocks do not divide is one ConfigError from the config, naming the
    field and the fix, before anything is built (it was a ValueError at the first GEMM of step 1);
    leaving that module in bf16 (precision.modules) is accepted, and so is fp8_rowwise (per-row scales)."""
    from moetron.models.config import ModelConfig
    from moetron.run.config import PretrainConfig

    def run(**model):
        c = PretrainConfig.from_dict({"model": ModelConfig.preset("tiny-moe").to_dict() | model,
                                      "precision": {"recipe": recipe, "backend": "emulated"}})
        return c

    ok = run(d_model=256, mlp_hidden=256, moe={**ModelConfig.preset("tiny-moe").to_dict()["moe"], "expert_hidden": 128},
             attention={**ModelConfig.preset("tiny-moe").to_dict()["attention"], "n_heads": 4, "n_kv_heads": 2})
    ok.validate()
    widths = ok.model.gemm_widths()
    assert widths["experts"] == {"model.d_model": 256, "model.moe.expert_hidden": 128}
    assert widths["attention"]["model.attention.n_kv_heads x head_dim"] == 128
    assert ok.model.moe.num_shared_experts  # the shared expert's width is its own (an mlp GEMM)
    bad = run(d_model=256, mlp_hidden=256, moe={**ok.model.moe.to_dict(), "expert_hidden": block + block // 2,
                                                 "shared_expert_hidden": 128},
              attention=ok.model.attention.to_dict())
    with pytest.raises(ConfigError, match=rf"model.moe.expert_hidden is {block + block // 2} .*multiple of {block}"):
        bad.validate()
    bad.precision.modules = ["attention", "mlp"]  # the experts in bf16: nothing to divide
    bad.validate()
    bad.precision.recipe = "fp8_rowwise"
    bad.precision.modules = ["experts", "attention", "mlp"]
    bad.validate()


def test_fp8_experts_auto_picks_gluon_on_hopper_only(monkeypatch):
    """precision.fp8_experts=auto (the default): the Gluon kernels for the native fp8_blockwise backend on
    an SM90 GPU, the Triton ones on any other GPU, on the emulated backend and for other recipes; an
    explicit choice stays; the planner resolves it by the same rule for its GPU."""
    pytest.importorskip("triton")
    import moetron.core.precision.config as config_module
    from moetron.core.precision import fp8_gluon
    from moetron.core.precision.config import Fp8Experts

    def cfg(**kw):
        return PrecisionConfig.from_dict(kw)

    assert cfg().fp8_experts == Fp8Experts.auto
    hopper = Fp8Experts.gluon if fp8_gluon.AVAILABLE else Fp8Experts.triton
    assert cfg(recipe="fp8_blockwise").resolved_fp8_experts("cuda", "native", capability_major=9) == hopper
    assert cfg(recipe="fp8_blockwise").resolved_fp8_experts("cuda", "native", capability_major=10) == Fp8Experts.triton
    assert cfg(recipe="fp8_blockwise").resolved_fp8_experts("cuda", "emulated", capability_major=9) == Fp8Experts.triton
    assert cfg(recipe="mxfp8").resolved_fp8_experts("cuda", "native", capability_major=9) == Fp8Experts.triton
    assert cfg(recipe="fp8_blockwise", fp8_experts="triton").resolved_fp8_experts(
        "cuda", "native", capability_major=9) == Fp8Experts.triton
    cfg(recipe="mxfp8").validate()  # auto is no error for another recipe (an explicit gluon is)
    for major, want in ((9, str(hopper)), (10, "triton")):
        monkeypatch.setattr(config_module, "_capability_major", lambda device_type, m=major: m)
        assert cfg(recipe="fp8_blockwise").build("cuda", verbose=False).gemm.experts == want
    monkeypatch.undo()
    assert isinstance(cfg(recipe="fp8_blockwise").build("cpu", verbose=False).gemm, EmulatedGemm)  # emulated on the CPU
    from moetron.core.optim import OptimizerConfig
    from moetron.models import ModelConfig
    from moetron.parallel.config import ParallelConfig
    from moetron.run.planner.hardware import GPUS
    from moetron.run.planner.switches import switches

    sw = switches(ModelConfig.preset("olmoe-1b-7b"), ParallelConfig(), cfg(recipe="fp8_blockwise"), OptimizerConfig(),
                  GPUS["h200"], True)
    assert sw.fp8_experts == str(hopper)


def test_fp8_gluon_group_sets_the_gluon_rows_kernels_raster(monkeypatch):
    """precision.fp8_gluon_group: 1 to 64, fp8_blockwise with the Gluon experts only; the backend built
    with it runs the Gluon rows kernel in raster groups of that many row tiles (the last one built sets
    the module's CONFIG), its ring, launch and epilogue unchanged."""
    import moetron.core.precision.config as config
    from moetron.core.precision import fp8_gluon

    with pytest.raises(ConfigError, match="fp8_gluon_group must be 1 to 64.*got 0"):
        cfg(recipe="fp8_blockwise", fp8_gluon_group=0).validate()
    with pytest.raises(ConfigError, match="fp8_gluon_group sets the fp8_blockwise.*recipe is mxfp8"):
        cfg(recipe="mxfp8", fp8_gluon_group=8).validate()
    with pytest.raises(ConfigError, match="fp8_gluon_group orders the Gluon.*fp8_experts=triton"):
        cfg(recipe="fp8_blockwise", fp8_gluon_group=8).build("cpu", verbose=False)
    monkeypatch.setattr(config, "_capability_major", lambda device_type: 9)  # as on a Hopper GPU
    with pytest.raises(ConfigError, match="fp8_gluon_group orders the Gluon.*fp8_experts=cublas"):
        cfg(recipe="fp8_blockwise", fp8_gluon_group=8, fp8_experts="cublas").build("cuda", verbose=False)
    before = fp8_gluon.CONFIG
    try:
        assert cfg(recipe="fp8_blockwise", fp8_gluon_group=8).build("cuda", verbose=False).gemm.gluon_group == 8
        assert fp8_gluon.CONFIG == fp8_gluon.GluonConfig(*before[:3], 8)
        assert fp8_gluon.CONFIG.name.endswith(" g8 gluon")
        cfg(recipe="fp8_blockwise").build("cuda", verbose=False)
        assert fp8_gluon.CONFIG == before and fp8_gluon.CONFIG[3] == 1
    finally:
        fp8_gluon.CONFIG = before
