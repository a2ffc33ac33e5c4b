"""The Olmo 3 family as one configurable model config, with named presets.

Counts are computed from the config alone, before anything is built, so a run can say
"7.30B params" in its name and log, and a test can pin each preset on the meta device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable

from moetron.core.config import Config, ConfigError, StrEnum
from moetron.core.layers.attention import AttentionConfig
from moetron.core.moe.config import MoEConfig, RouterConfig, RouterScore


class BlockType(StrEnum):
    reordered_norm = "reordered_norm"
    """Olmo 2/3: norm on each sublayer's output before the residual add, h = x + norm(f(x))."""
    pre_norm = "pre_norm"
    """Classic pre-norm (OLMoE, Llama): h = x + f(norm(x))."""


class LayerType(StrEnum):
    full = "full"
    """Causal attention over the whole sequence."""
    sliding = "sliding"
    """Causal attention over the last `sliding_window` tokens (the token itself included)."""


def _ultra_router() -> RouterConfig:
    """The router of moe-1t, moe-2.4t and their proxies: top-4 softmax, the Switch loss at its default
    weight, and the aux-loss-free expert bias (our choice: the source does not publish its balancing)."""
    return RouterConfig(top_k=4, expert_bias=True)


@dataclasses.dataclass
class HFMetadata(Config):
    """Fields of a Hugging Face config.json that the model does not compute with, kept from an import
    so that an export writes them back (None: unknown, see docs/checkpoints.md)."""

    max_position_embeddings: int | None = None
    """Context length the checkpoint declares."""
    bos_token_id: int | list[int] | None = None
    """Beginning-of-sequence token id(s) of its tokenizer."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id(s) of its tokenizer (generation stops at any of them)."""
    pad_token_id: int | None = None
    """Padding token id of its tokenizer."""

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))


@dataclasses.dataclass
class ModelConfig(Config):
    d_model: int = 256
    """Residual stream width."""
    n_layers: int = 4
    """Transformer blocks."""
    vocab_size: int = 4096
    """Embedding rows; pad the tokenizer's vocab up to a multiple of 128 for fast GEMMs."""
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    """Heads, KV heads, head dim, QK-norm, RoPE theta."""
    mlp_hidden: int = 768
    """SwiGLU hidden width of the dense layers."""
    moe: MoEConfig | None = None
    """Mixture-of-experts MLPs (None = a dense model); moe.dense_layers keep the dense MLP."""
    block_type: BlockType = BlockType.reordered_norm
    """Where the norms sit (see BlockType)."""
    sliding_window: int | None = 4096
    """Window of the sliding layers; None makes every layer full attention."""
    full_attention_every: int = 4
    """Olmo 3 pattern: layer i is full when (i + 1) % this == 0, the last layer always full."""
    layer_types: list[LayerType] | None = None
    """Explicit per-layer types (as HF config.json lists them); overrides the pattern above."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Std of the truncated-normal (+-3 std) init of every weight matrix and the embedding."""
    init_on_cpu: bool = False
    """Initialize on the CPU with the CPU generator, then move to the device: the same weights for a
    seed on any device (for comparing GPU with CPU runs), at the cost of CPU time for big models."""
    fused_loss: bool = True
    """The LM head's loss fused with its GEMM and chunked over tokens (core.layers.loss.linear_cross_entropy):
    no [tokens, vocab] logits in bf16 or fp32 are ever held, only one chunk's. Off: logits, then
    fp32 cross entropy (the reference). Default on: the same GEMMs with 10 bytes x tokens x vocab
    less memory at the start of the backward; the step-time measurement on GPUs is tools/bench_loss.py.
    Forward without labels (scoring, HF comparisons) gives logits either way."""
    triton_embedding_grad: bool = False
    """The token embedding's weight gradient from one deterministic Triton pass over the vocabulary
    (core/layers/embedding.py) on CUDA, instead of torch's zero-fill and sort-and-segment kernels
    (about 2 ms a step on olmoe3-4l-8e on the H100, session 31's profile; the pass's floor is writing
    the [V, D] fp32 gradient once, about 0.55 ms). Each row is summed in increasing token order in
    fp32: the same bits run to run, fp32 rounding apart from torch's order. Elsewhere (the CPU) torch's
    backward either way. Alone on olmoe3-4l-8e (H100, session 34): 0.8% faster, at the edge of that
    run's 0.4% noise; not measured on real text (a frequent token's long run of rows is its worst
    case): off by default."""
    triton_rmsnorm: bool = True
    """Eager steps on CUDA run every RMSNorm (the blocks' two, the QK-norms, the final norm) as one
    Triton pass forward and one backward (core/layers/norm_triton.py) instead of torch's separate fp32
    kernels, and autograd keeps x and one fp32 scale a row instead of fp32 copies of the rows. The
    same quantities in fp32 (the backward in closed form), the row sums in another order: outputs
    agree to fp32 rounding (a bf16 output to one rounding; tests/core/test_norm_triton.py). Compiled modules trace the torch path
    either way (inductor fuses it with the residual adds), and the CPU runs the torch path. Eager on
    the H100 (session 43, best rows): olmoe3-4l-8e +12.6% tokens/s and OLMoE-8L +19.6%, 5.1 GiB less
    peak on both; the GPU proxy about +28%. On by default since session 45: on the GPU proxy's 200-step
    runs at three initial-weight seeds (sessions 44-45), the norm's five runs are within 1% of the six
    without it by tools/compare_runs.py (+0.93% train, +0.45% held-out; one pair per seed +0.31% / +0.11%,
    the seeds' own spread 1.5%), seed 2's run below its pair; on the proxy's real inputs the kernel's
    outputs are the torch path's to one rounding on the GPU too (docs/performance.md, sessions 44-45)."""
    triton_rope: bool = True
    """Eager steps on CUDA rotate q and k by RoPE in one Triton pass each way (core/layers/rope_triton.py)
    instead of torch's separate fp32 kernels (cast, slice, negation, concatenation, two products, a
    sum, the cast back), with nothing but the tables kept for the backward: the same fp32 operations
    in the same order, so the same bits both ways (tests/core/test_rope_triton.py, on the CPU under the
    interpreter and on the GPU). Compiled modules and the CPU take the torch path. Eager on the H100
    (session 44, best rows with the Triton norm): olmoe3-4l-8e +5.3% tokens/s, OLMoE-8L +11.4%, the
    same peak; the GPU proxy +10% with the norm, about +8% without (on by default since session 44)."""
    fused_loss_prescale: bool = True
    """The fused loss takes the gradient its backward will receive where the training loop declares
    it (the micro-batch's weight; core.layers.loss.loss_weight) and computes its gradients already
    at that weight, handing them on as they are: no scaling pass over the [V, D] fp32 head gradient
    in the backward (3.3 GB of HBM traffic at V 100352 x D 4096) and no second copy of it held during
    that pass. At weight 1 (one micro-batch) or any power of two, the same bits as off; otherwise the
    weight is folded in before the bf16 rounding of the logits' gradient (a few ulps apart). The
    built-in loop and the pipeline schedules declare; a ``step_fn`` of one's own does not (its
    loss is scaled in the backward, as off does)."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the fused loss; None: about 1 GiB of transient logits (5120 tokens at vocab 100352 on CUDA's Triton path, 1536 on the torch path; core/layers/loss.default_chunk_tokens)."""
    hf_metadata: HFMetadata | None = None
    """config.json fields of an imported HF checkpoint that only matter to HF tools (context length,
    special token ids); carried through to export. None for models that never came from HF."""

    # ---- derived ----------------------------------------------------------------------------
    def resolved_layer_types(self) -> list[LayerType]:
        if self.layer_types is not None:
            return list(self.layer_types)
        if self.sliding_window is None:
            return [LayerType.full] * self.n_layers
        types = [
            LayerType.full if (i + 1) % self.full_attention_every == 0 else LayerType.sliding
            for i in range(self.n_layers)
        ]
        if types:
            types[-1] = LayerType.full
        return types

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.resolved_layer_types()[layer] == LayerType.sliding else None

    def validate(self) -> None:
        super().validate()
        for name in ("d_model", "n_layers", "vocab_size", "mlp_hidden", "full_attention_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if not math.isfinite(self.norm_eps) or self.norm_eps <= 0:
            raise ConfigError(
                f"model.norm_eps must be a positive finite number (RMSNorm divides by sqrt(mean(x^2) + eps)), "
                f"got {self.norm_eps}: e.g. --model.norm_eps=1e-6"
            )
        self.attention.validate_for(self.d_model, "model.attention")
        if self.moe is not None:
            self.moe.validate_for(self.n_layers)
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens <= 0:
            raise ConfigError(f"model.loss_chunk_tokens must be positive (tokens per chunk of the fused loss) or "
                              f"null (about 1 GiB of transient logits), got {self.loss_chunk_tokens}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"model.sliding_window must be positive or null, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                raise ConfigError(
                    f"model.layer_types lists {len(self.layer_types)} layers but model.n_layers is "
                    f"{self.n_layers}: give one type per layer"
                )
            if LayerType.sliding in self.layer_types and self.sliding_window is None:
                raise ConfigError("model.layer_types has sliding layers but model.sliding_window is null")

    def gemm_widths(self) -> dict[str, dict[str, int]]:
        """The widths of the GEMM weights a low-precision recipe may take, by precision.modules kind
        ("attention", "mlp", "experts") -> {field that sets it: width}; each is a reduction dim of
        some pass (forward, dgrad), so a block-scaled recipe needs it a multiple of its block."""
        d, att = self.d_model, self.attention
        hd = att.head_width(d)
        widths = {
            "attention": {"model.d_model": d, "model.attention.n_heads x head_dim": att.n_heads * hd,
                          "model.attention.n_kv_heads x head_dim": att.kv_heads() * hd},
            "mlp": {"model.d_model": d},
        }
        if self.moe is None or any(not self.is_moe_layer(i) for i in range(self.n_layers)):
            widths["mlp"]["model.mlp_hidden"] = self.mlp_hidden
        if self.moe is not None:
            if self.moe.num_shared_experts:
                widths["mlp"]["model.moe.shared_expert_hidden (x num_shared_experts)"] = self.moe.shared_width()
            widths["experts"] = {"model.d_model": d, "model.moe.expert_hidden": self.moe.expert_hidden}
        return widths

    # ---- counts -----------------------------------------------------------------------------
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    def num_block_params(self, layer: int, active: bool = False) -> int:
        attn = self.attention.num_params(self.d_model)
        if self.is_moe_layer(layer):
            mlp = self.moe.num_active_params(self.d_model) if active else self.moe.num_params(self.d_model)
        else:
            mlp = 3 * self.d_model * self.mlp_hidden
        return attn + mlp + 2 * self.d_model

    def num_params(self) -> int:
        """All parameters: embedding, blocks, final norm, untied LM head."""
        blocks = sum(self.num_block_params(i) for i in range(self.n_layers))
        return self.num_embedding_params() * 2 + blocks + self.d_model

    def num_active_params(self) -> int:
        """Parameters used per token: top-k routed experts, shared experts, router, the rest."""
        blocks = sum(self.num_block_params(i, active=True) for i in range(self.n_layers))
        return self.num_embedding_params() * 2 + blocks + self.d_model

    def num_flops_params(self) -> int:
        """Active parameters that do matmul work: all but the input embedding (a lookup)."""
        return self.num_active_params() - self.num_embedding_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active non-embedding params + attention scores.

        Attention is 12 * layers * attention width * context (PaLM's convention: QK^T and AV,
        forward and backward, no causal halving); a sliding layer's context is its window.
        """
        blocks = sum(self.block_flops_per_token(i, seq_len) for i in range(self.n_layers))
        return blocks + 6.0 * (self.num_embedding_params() + self.d_model)  # + LM head and final norm

    def block_flops_per_token(self, layer: int, seq_len: int) -> float:
        """One block's share of flops_per_token: 6 x its active params + attention over its context
        (the layer's window, or seq_len); the rest is the LM head and the final norm."""
        width = self.attention.n_heads * self.attention.head_width(self.d_model)
        context = min(seq_len, self.window_of(layer) or seq_len)
        return 6.0 * self.num_block_params(layer, active=True) + 12.0 * width * context

    def describe(self) -> str:
        kind = f"MoE {self.moe.num_experts}E top-{self.moe.router.top_k}" if self.moe else "dense"
        return f"{kind}, {_fmt(self.num_active_params())} active, {_fmt(self.num_params())} total params"

    def build(self, device=None):
        import torch

        from .transformer import Transformer

        self.validate()
        if self.init_on_cpu and device is not None and torch.device(device).type not in ("cpu", "meta"):
            return Transformer(self, device="cpu").to(device)
        return Transformer(self, device=device)

    # ---- presets ----------------------------------------------------------------------------
    @classmethod
    def tiny(cls) -> "ModelConfig":
        """Trains on 2 CPU cores in minutes; same block design as Olmo 3 (GQA, QK-norm, windows)."""
        return cls(
            d_model=256,
            n_layers=4,
            vocab_size=4096,
            attention=AttentionConfig(n_heads=4, n_kv_heads=2, rope_theta=10_000.0),
            mlp_hidden=768,
            sliding_window=64,
        )

    @classmethod
    def olmo3_7b(cls) -> "ModelConfig":
        return cls(
            d_model=4096,
            n_layers=32,
            vocab_size=100352,
            attention=AttentionConfig(n_heads=32, n_kv_heads=32, rope_theta=500_000.0),
            mlp_hidden=11008,
            sliding_window=4096,
        )

    @classmethod
    def olmo3_32b(cls) -> "ModelConfig":
        return cls(
            d_model=5120,
            n_layers=64,
            vocab_size=100352,
            attention=AttentionConfig(n_heads=40, n_kv_heads=8, rope_theta=500_000.0),
            mlp_hidden=27648,
            sliding_window=4096,
        )

    @classmethod
    def tiny_moe(cls) -> "ModelConfig":
        """The 3.2B family's block design at CPU size: top-4 of 16 experts + 1 shared, first layer dense."""
        return cls(
            d_model=256,
            n_layers=4,
            vocab_size=4096,
            attention=AttentionConfig(n_heads=4, n_kv_heads=2, rope_theta=10_000.0),
            mlp_hidden=5 * 128,
            sliding_window=64,
            moe=MoEConfig(num_experts=16, expert_hidden=128, router=RouterConfig(top_k=4), num_shared_experts=1,
                          dense_layers=[0]),
        )

    @classmethod
    def moe_1t_proxy(cls) -> "ModelConfig":
        """moe-1t's block design at one-GPU-per-2-MoE-layers size (examples/pretrain_moe_1t.sh on GPUs):
        128 routed experts + 1 shared, top-4, the first two layers dense with MLPs as wide as the active
        experts, expert hidden / d_model = 4/3 as in the recipe, 128-wide heads with 2:1 GQA, sliding
        windows; vocabulary of the local corpus. 6 layers here; the example sets 2 + 2 x GPUs.
        The router balances as moe-1t's does (aux-loss-free expert bias beside the Switch loss)."""
        return cls(
            d_model=768,
            n_layers=6,
            vocab_size=4096,
            attention=AttentionConfig(n_heads=6, n_kv_heads=3, head_dim=128, rope_theta=500_000.0),
            mlp_hidden=5 * 1024,
            sliding_window=1024,
            moe=MoEConfig(num_experts=128, expert_hidden=1024, router=_ultra_router(),
                          num_shared_experts=1, dense_layers=[0, 1]),
        )

    @classmethod
    def olmo3_moe(cls, num_experts: int) -> "ModelConfig":
        """The OLMo-core 3 MoE family at about 3.2B active: 8 layers x 4096, 32 heads x 128 (8 KV),
        top-4 of num_experts experts of hidden 4096 + 1 shared expert of 4096, the first layer dense
        (its MLP as wide as the active experts: 5 x 4096), seq 8192."""
        return cls(
            d_model=4096,
            n_layers=8,
            vocab_size=100352,
            attention=AttentionConfig(n_heads=32, n_kv_heads=8, head_dim=128, rope_theta=500_000.0),
            mlp_hidden=5 * 4096,
            sliding_window=4096,
            moe=MoEConfig(num_experts=num_experts, expert_hidden=4096, router=RouterConfig(top_k=4),
                          num_shared_experts=1, dense_layers=[0]),
        )

    @classmethod
    def olmoe_1b_7b(cls) -> "ModelConfig":
        """OLMoE-1B-7B's shape: 16 x 2048, 16 heads MHA, 64 experts top-8 of hidden 1024, pre-norm,
        QK-norm, RoPE 10k, softmax routing without top-k renormalization, vocab 50304."""
        return cls(
            d_model=2048,
            n_layers=16,
            vocab_size=50304,
            attention=AttentionConfig(n_heads=16, rope_theta=10_000.0),
            mlp_hidden=1024,
            block_type=BlockType.pre_norm,
            sliding_window=None,
            norm_eps=1e-5,
            moe=MoEConfig(num_experts=64, expert_hidden=1024,
                          router=RouterConfig(top_k=8, renormalize=False, score=RouterScore.softmax)),
        )

    @classmethod
    def moe_1t(cls, num_experts: int = 128) -> "ModelConfig":
        """OLMo-core 3 "Ultra-128E": 63 x 6144, attention 64 heads x 128 (32 KV), 128 routed experts of
        hidden 8192 + 1 shared of 8192, top-4: 58.4B active, 1.2T total (256 experts: 2.38T).
        The published totals pin two dense layers (MLP as wide as the active experts); we take the
        first two, as the 3.2B family keeps its first layer dense. The source does not publish its
        load balancing; ours is the Switch loss (0.01) plus the aux-loss-free expert bias
        (``_ultra_router``; why, with the measurements: docs/moe.md, "Balancing in the recipes")."""
        return cls(
            d_model=6144,
            n_layers=63,
            vocab_size=100352,
            attention=AttentionConfig(n_heads=64, n_kv_heads=32, head_dim=128, rope_theta=500_000.0),
            mlp_hidden=5 * 8192,
            sliding_window=4096,
            moe=MoEConfig(num_experts=num_experts, expert_hidden=8192, router=_ultra_router(),
                          num_shared_experts=1, dense_layers=[0, 1]),
        )

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        key = name.replace("_", "-").lower()
        if key not in PRESETS:
            import difflib

            close = difflib.get_close_matches(key, PRESETS, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"choose one of {', '.join(PRESETS)}"
            raise ConfigError(f"unknown model preset {name!r}: {hint}")
        return PRESETS[key]()


def native_config(path: str) -> ModelConfig:
    """The validated ModelConfig in a native checkpoint's meta.json (config.model), as the trainer,
    save_weights, tools/convert_hf.py and tools/upcycle.py write it; CheckpointError if it is missing,
    unreadable or invalid."""
    from moetron.core.checkpoint import META, CheckpointError

    where = os.path.join(path, META)
    try:
        with open(where, encoding="utf-8") as f:
            model = json.load(f)["config"]["model"]
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where} cannot be read ({e}): not a moetron checkpoint") from None
    except (KeyError, TypeError):
        raise CheckpointError(f"{where} has no config.model: not a moetron model checkpoint") from None
    try:
        cfg = ModelConfig.from_dict(model, prefix="model")
        cfg.validate()
    except ConfigError as e:
        raise CheckpointError(f"{where}: invalid model config: {e}") from None
    return cfg


def _fmt(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": ModelConfig.tiny,
    "olmo3-7b": ModelConfig.olmo3_7b,
    "olmo3-32b": ModelConfig.olmo3_32b,
    "tiny-moe": ModelConfig.tiny_moe,
    **{f"olmo3-moe-{e}e": (lambda e=e: ModelConfig.olmo3_moe(e)) for e in (8, 16, 32, 48, 64, 128)},
    "olmoe-1b-7b": ModelConfig.olmoe_1b_7b,
    "moe-1t": ModelConfig.moe_1t,
    "moe-1t-proxy": ModelConfig.moe_1t_proxy,
    "moe-2.4t": lambda: ModelConfig.moe_1t(256),
}
