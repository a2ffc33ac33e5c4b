"""The Olmo 3 transformer: embedding -> blocks -> final norm -> untied LM head.

Legend: B batch, S sequence, D model dim, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from moetron.core.layers import Attention, Embedding, LMHead, RMSNorm, SwiGLU
from moetron.core.layers.loss import cross_entropy
from moetron.core.layers.rope import RotaryEmbedding, prefill_ropes, rope_modules
from moetron.core.moe import MoELayer, moe_layers

from .config import BlockType, ModelConfig


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, device=None, moe_spec=None):
        """Block ``layer`` of ``cfg``; ``moe_spec`` (core.moe.MoESpec) builds its MoE layer's parts
        (default: from cfg.moe)."""
        super().__init__()
        self.block_type = cfg.block_type
        self.attention = Attention(cfg.d_model, cfg.attention, cfg.window_of(layer), cfg.norm_eps, device)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoELayer(cfg.d_model, cfg.moe, device, layer_index=layer, spec=moe_spec) if self.is_moe else SwiGLU(cfg.d_model, cfg.mlp_hidden, device)
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, device)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.block_type == BlockType.reordered_norm:
            h_BSD = x_BSD + self.attention_norm(self.attention(x_BSD))
            return h_BSD + self.mlp_norm(self.mlp(h_BSD))
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD))
        return h_BSD + self.mlp(self.mlp_norm(h_BSD))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, device=device, triton_grad=cfg.triton_embedding_grad)
        # A ModuleDict keyed by layer index keeps parameter names stable when pipeline stages
        # hold only some of the blocks.
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, device) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, device, fused=cfg.fused_loss,
                              chunk_tokens=cfg.loss_chunk_tokens, prescale=cfg.fused_loss_prescale)
        for m in self.modules():  # the eager Triton kernels asked for, on every module they serve
            if isinstance(m, RMSNorm):  # the blocks' norms, the QK-norms, the final one
                m.triton = cfg.triton_rmsnorm
            elif isinstance(m, RotaryEmbedding):
                m.triton = cfg.triton_rope
        if device is None or torch.device(device).type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Truncated normal (std init_std, cut at 3 std) for every matrix and the embedding."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, MoELayer):
                module.init_weights(std)

    def forward(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, S] -> logits [B, S, V]; with labels [B, S], the mean next-token loss over
        the labels != -100 instead (the LM head's: fused and chunked when cfg.fused_loss, so no
        [B, S, V] tensor is made)."""
        h_BSD = self.embed(input_ids_BS)
        prefill_ropes(self._ropes(), input_ids_BS.shape[1], input_ids_BS.device)
        for block in self.blocks.values():
            h_BSD = block(h_BSD)
        return self.lm_head(self.norm(h_BSD), labels_BS)

    def compile_modules(self) -> None:
        """torch.compile (in place) each block and the final norm: the trainer's and the benchmarks'
        one compile path. The final norm left eager runs as about ten unfused fp32 kernels forward and
        backward (1.8 ms a step at 16,384 tokens x 4096 on an H200, session 11's profile); compiled it
        is two or three. The LM head's loss stays eager (its chunk loop and Triton kernel)."""
        for block in self.blocks.values():
            block.compile()
        self.norm.compile()

    def overlap_units(self) -> list[nn.Module]:
        """The modules the forward uses in turn (embedding, blocks, final norm, LM head): the units
        whose updates an overlapped optimizer step (core/overlap.py) finishes in this order."""
        return [self.embed, *self.blocks.values(), self.norm, self.lm_head]

    def _ropes(self) -> list[RotaryEmbedding]:
        """The blocks' RoPE modules (looked up once: the module tree is fixed after build)."""
        if getattr(self, "_rope_modules", None) is None:
            self._rope_modules = rope_modules(self.blocks)
        return self._rope_modules

    def moe_layers(self) -> dict[int, MoELayer]:
        """MoE layers by block index (core.moe.moe_layers over this model)."""
        return moe_layers(self)


cross_entropy_loss = cross_entropy
"""loss(logits [B, S, V], labels [B, S]) -> mean next-token cross entropy in fp32 (core.layers.loss)."""
