"""Sparse upcycling: a dense Olmo 3 checkpoint becomes an MoE that starts where the dense model was.

Legend: D model dim, H dense MLP hidden, g granularity, F = H / g expert hidden, E experts,
C = E / g copies of the dense MLP, K experts per token.

Each upcycled layer's dense SwiGLU ``down(silu(gate x) * up x)`` is cut along its hidden dim into
g shards; shard j takes rows j*F:(j+1)*F of gate AND of up (kept paired: SwiGLU multiplies them
element-wise) and the matching columns of down. The shards sum to the dense MLP exactly:
``dense(x) = sum_j shard_j(x)``. The E experts are the g shards tiled C times: expert e holds shard
e % g of copy e // g. The layers left dense are copied unchanged, as are attention, norms,
embedding and LM head.

Weight scaling (why the upcycled model starts at the dense one). A token's MoE output is
``sum_k w_k * s * shard_{e_k}(x)`` (s scales every expert's down projection). Write P for the sum
of a token's top-K weights.

- g = 1: every expert is a full copy, so the output is ``s * P * dense(x)``; with
  renormalization P = 1 and s = 1 gives the dense output exactly (softmax or sigmoid, any router).
- g > 1: the output equals the dense one only when the token picks whole copies (all g shards of
  each chosen copy) with equal weight within each copy. ``router_init=virtual_groups`` gives the g
  experts of one copy the same router row, hence the same logit and score, so top-K with K a
  multiple of g takes whole copies (ties inside a group, generic gaps between groups). A chosen
  copy c with weight w_c on each of its shards adds w_c * s * sum_j shard_j = w_c * s * dense(x);
  the copies' weights sum to P / g, so the output is s * (P / g) * dense(x),
  so s = g / P. With renormalization P = 1 and s = g: exact up to float rounding (the logits of
  equal rows may differ in the last bit inside a GEMM, so weights are equal to ~1e-7 relative;
  tests hold the logits to 1e-4 absolute in fp32). If K is not a multiple of g, or the router rows
  are independent (``random``), the start is only approximate (a part of some copies is missing).
- Without renormalization P is not fixed; s uses its value at a uniform router, P ~ K / E for
  softmax and K / 2 for sigmoid (the router starts with small logits), so the start is close, not
  exact: for g = 1 the error goes to 0 with router_std.
- shared_expert: the dense MLP also becomes one shared expert (hidden H). With routed_fraction f
  the shared expert's down projection is scaled by (1 - f) and the routed experts' by f * s, so
  shared + routed = dense at the start (exactly, under the conditions above). f = 0 starts the
  routed experts silent (down projections zero: only they get gradients at step 1, the router and
  the experts' gate/up start learning from step 2); the default f = 0.5 lets every part learn from
  step 1.
- noise_std > 0 adds N(0, noise_std^2) to every expert's gate/up/down (before scaling) so copies
  differ from step 0; the start then moves by about that much.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Callable

import torch

from moetron.core.config import Config, ConfigError, StrEnum
from moetron.core.moe.config import MoEConfig, RouterConfig, RouterScore

from .config import ModelConfig, native_config

__all__ = ["RouterInit", "UpcycleConfig", "upcycle_config", "upcycle_specs", "native_source", "Source"]

# A source of tensors by native name: ({name: (shape, dtype)}, produce(name) -> tensor).
Source = tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable[[str], torch.Tensor]]


class RouterInit(StrEnum):
    virtual_groups = "virtual_groups"
    """One random row per copy of the dense MLP, repeated for its g shard experts, so routing picks
    whole copies at the start (with g = 1 this is the same as random)."""
    random = "random"
    """An independent random row per expert."""


class LayerChoice(StrEnum):
    all = "all"
    """Every layer becomes MoE."""
    every_other = "every_other"
    """Layers 1, 3, 5 ... become MoE; the even layers (the first included) stay dense."""


@dataclasses.dataclass
class UpcycleConfig(Config):
    num_experts: int = 8
    """Routed experts per upcycled layer (a multiple of granularity)."""
    top_k: int = 2
    """Experts per token (a multiple of granularity for an exact start)."""
    score: RouterScore = RouterScore.softmax
    """Router score function (softmax or sigmoid)."""
    renormalize: bool = True
    """Rescale each token's top-k weights to sum to 1 (needed for an exact start)."""
    granularity: int = 1
    """Split each dense MLP of hidden H into this many experts of hidden H / granularity."""
    router_init: RouterInit = RouterInit.virtual_groups
    """How the new router rows are drawn (see RouterInit)."""
    router_std: float = 0.02
    """Std of the truncated-normal (+-3 std) router rows."""
    noise_std: float = 0.0
    """Std of Gaussian noise added to each expert copy's weights (0: exact copies)."""
    shared_expert: bool = False
    """Also keep the dense MLP as one shared expert (hidden H)."""
    routed_fraction: float = 0.5
    """With shared_expert: the share of the dense output the routed experts carry at the start."""
    layers: list[int] | str = "all"
    """Which layers become MoE: "all", "every_other" (odd layers) or a list of layer indices."""

    def validate(self) -> None:
        super().validate()
        for name in ("num_experts", "top_k", "granularity"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"upcycle.{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"upcycle.top_k={self.top_k} exceeds upcycle.num_experts={self.num_experts}: "
                              f"pick top_k <= num_experts")
        if self.num_experts % self.granularity:
            raise ConfigError(f"upcycle.num_experts={self.num_experts} is not a multiple of granularity="
                              f"{self.granularity}: experts are whole copies of the g shards")
        if self.router_std < 0 or self.noise_std < 0:
            raise ConfigError("upcycle.router_std and upcycle.noise_std must be >= 0")
        if not 0.0 <= self.routed_fraction <= 1.0:
            raise ConfigError(f"upcycle.routed_fraction must be in [0, 1], got {self.routed_fraction}")
        if isinstance(self.layers, str) and self.layers not in set(LayerChoice):
            raise ConfigError(f"upcycle.layers={self.layers!r}: use 'all', 'every_other' or a list of layers")

    def validate_for(self, dense: ModelConfig) -> None:
        """Checks that need the dense model: its MLP width and layer count."""
        self.validate()
        if dense.moe is not None:
            raise ConfigError("the input model is already an MoE: upcycle a dense checkpoint")
        if dense.mlp_hidden % self.granularity:
            raise ConfigError(f"upcycle.granularity={self.granularity} does not divide the dense MLP hidden "
                              f"{dense.mlp_hidden}: choose a divisor of {dense.mlp_hidden}")
        layers = self.moe_layers(dense.n_layers)
        if not layers:
            raise ConfigError("upcycle.layers selects no layer")

    def moe_layers(self, n_layers: int) -> list[int]:
        """The layer indices that become MoE (ConfigError for indices out of range or repeated)."""
        if self.layers == LayerChoice.all:
            return list(range(n_layers))
        if self.layers == LayerChoice.every_other:
            return list(range(1, n_layers, 2))
        bad = [i for i in self.layers if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(f"upcycle.layers {bad} are not layers of a {n_layers}-layer model")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"upcycle.layers {self.layers} repeats a layer")
        return sorted(self.layers)

    def expected_topk_sum(self) -> float:
        """P, the sum of a token's top-k weights at the start (exact with renormalization)."""
        if self.renormalize:
            return 1.0
        if self.score == RouterScore.softmax:
            return self.top_k / self.num_experts
        return self.top_k / 2.0

    def routed_scale(self) -> float:
        """s x (routed share): the factor on every routed expert's down projection."""
        share = self.routed_fraction if self.shared_expert else 1.0
        return share * self.granularity / self.expected_topk_sum()

    def exact_start(self) -> tuple[bool, str]:
        """Whether the upcycled model's output equals the dense one at step 0 (up to rounding), and why not."""
        if self.noise_std > 0:
            return False, f"noise_std={self.noise_std} perturbs the copies"
        if not self.renormalize:
            return False, "without renormalization the top-k weights do not sum to 1 (scaled for a uniform router)"
        if self.granularity > 1 and self.top_k % self.granularity:
            return False, f"top_k={self.top_k} is not a multiple of granularity={self.granularity}: no whole copies"
        if self.granularity > 1 and self.router_init != RouterInit.virtual_groups:
            return False, "granularity > 1 needs router_init=virtual_groups to route whole copies"
        return True, "exact up to float rounding"


def upcycle_config(dense: ModelConfig, up: UpcycleConfig) -> ModelConfig:
    """The MoE model config: the dense one with MoE MLPs in up's layers (dense_layers = the rest)."""
    up.validate_for(dense)
    moe_layers = up.moe_layers(dense.n_layers)
    moe = MoEConfig(
        num_experts=up.num_experts,
        expert_hidden=dense.mlp_hidden // up.granularity,
        router=RouterConfig(score=up.score, top_k=up.top_k, renormalize=up.renormalize),
        num_shared_experts=1 if up.shared_expert else 0,
        shared_expert_hidden=dense.mlp_hidden if up.shared_expert else None,
        dense_layers=[i for i in range(dense.n_layers) if i not in moe_layers],
    )
    cfg = ModelConfig.from_dict(dict(dense.to_dict(), moe=moe.to_dict()))
    cfg.validate()
    return cfg


def native_source(path: str) -> tuple[ModelConfig, Source]:
    """A native checkpoint (trainer's step_N or save_weights output) as (model config, source).

    The source reads one tensor per call. Raises CheckpointError.
    """
    from moetron.core.checkpoint import CheckpointConfig, Checkpointer
    from moetron.core.weights import iter_weights, read_weight_specs

    Checkpointer(CheckpointConfig()).verify(path)  # every file against the manifest's sha256
    cfg = native_config(path)
    specs = read_weight_specs(path)

    def produce(name: str) -> torch.Tensor:
        return next(iter_weights(path, [name]))[1]

    return cfg, (specs, produce)


def _mlp_names(layer: int) -> tuple[str, str, str]:
    p = f"blocks.{layer}.mlp."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def _generator(seed: int, name: str) -> torch.Generator:
    # A stream per tensor: the result does not depend on the order DCP asks for tensors.
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def upcycle_specs(dense_source: Source, dense_cfg: ModelConfig, moe_cfg: ModelConfig, up: UpcycleConfig,
                  seed: int = 0) -> Source:
    """Stream the upcycled weights: ({name: (shape, dtype)}, produce(name)) for save_weights.

    ``dense_source`` = (specs, produce) of the dense model by native name (``native_source`` or the
    HF converter's ``hf_native_specs``). ``produce`` makes one tensor per call and keeps at most one
    layer's dense MLP (3 tensors) cached, so peak memory is one layer's experts.
    """
    up.validate_for(dense_cfg)
    dense_specs, dense_produce = dense_source
    meta_model = moe_cfg.build(device="meta")
    moe_layers = set(up.moe_layers(dense_cfg.n_layers))
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, t in meta_model.state_dict().items():
        if name in dense_specs:
            specs[name] = (tuple(t.shape), dense_specs[name][1])
            if tuple(dense_specs[name][0]) != tuple(t.shape):
                raise ConfigError(f"dense tensor {name} is {tuple(dense_specs[name][0])}, the model wants "
                                  f"{tuple(t.shape)}: the checkpoint does not match its config")
        else:
            layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
            if layer not in moe_layers:
                raise ConfigError(f"the dense checkpoint has no tensor {name}")
            ref = dense_specs[_mlp_names(layer)[0]][1]
            # Router rows and expert bias stay fp32 (routing is done in fp32).
            dtype = torch.float32 if ".router." in name else ref
            specs[name] = (tuple(t.shape), dtype)
    del meta_model

    E, g = up.num_experts, up.granularity
    C, F = E // g, dense_cfg.mlp_hidden // g
    routed_scale, shared_scale = up.routed_scale(), 1.0 - up.routed_fraction
    cache: dict[str, torch.Tensor] = {}

    def dense_mlp(layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        names = _mlp_names(layer)
        if names[0] not in cache:
            cache.clear()
            for n in names:
                cache[n] = dense_produce(n)
        return tuple(cache[n] for n in names)

    def noisy(t: torch.Tensor, name: str) -> torch.Tensor:
        if up.noise_std == 0:
            return t
        gen = _generator(seed + 1, name)
        return t + up.noise_std * torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)

    def produce(name: str) -> torch.Tensor:
        shape, dtype = specs[name]
        if name in dense_specs:
            return dense_produce(name).to(dtype)
        layer = int(name.split(".")[1])
        suffix = name.split(".mlp.", 1)[1]
        if suffix == "router.weight":
            std = up.router_std
            rows = E if up.router_init == RouterInit.random else C
            w = torch.empty(rows, dense_cfg.d_model)
            if std > 0:
                torch.nn.init.trunc_normal_(w, 0.0, std, -3 * std, 3 * std, generator=_generator(seed, name))
            else:
                w.zero_()
            # virtual_groups: row c repeated for experts c*g .. c*g+g-1 (expert e is shard e % g of copy e // g)
            return (w.repeat_interleave(g, dim=0) if rows == C else w).to(dtype)
        if suffix == "router.expert_bias":
            return torch.zeros(shape, dtype=dtype)
        gate_FD, up_FD, down_DF = dense_mlp(layer)
        if suffix == "experts.w_gate_up":
            gate_gFD, up_gFD = gate_FD.float().view(g, F, -1), up_FD.float().view(g, F, -1)
            shards_g2FD = torch.cat([gate_gFD, up_gFD], dim=1)  # gate rows then up rows, per shard
            w_E2FD = shards_g2FD.repeat(C, 1, 1)
            return noisy(w_E2FD, name).to(dtype)
        if suffix == "experts.w_down":
            D = down_DF.shape[0]
            shards_gDF = down_DF.float().view(D, g, F).permute(1, 0, 2)
            w_EDF = noisy(shards_gDF.repeat(C, 1, 1), name)
            return (w_EDF * routed_scale).to(dtype)
        if suffix == "shared.gate_proj.weight":
            return gate_FD.to(dtype)
        if suffix == "shared.up_proj.weight":
            return up_FD.to(dtype)
        if suffix == "shared.down_proj.weight":
            return (down_DF.float() * shared_scale).to(dtype)
        raise ConfigError(f"upcycling does not know how to make {name}")

    return specs, produce


def pretrain_yaml(moe_cfg: ModelConfig, checkpoint: str, name: str = "upcycled") -> str:
    """A partial PretrainConfig (model + checkpoint.init_from) for ``tools/pretrain.py --config``."""
    import yaml

    data = {"name": name, "model": moe_cfg.to_dict(),
            "checkpoint": {"init_from": os.path.abspath(checkpoint)}}
    return yaml.safe_dump(json.loads(json.dumps(data)), sort_keys=False)
