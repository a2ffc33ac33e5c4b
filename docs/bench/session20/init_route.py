"""Routing of the freshly built GPU proxy (preset moe-1t-proxy, 4 layers, seed 0) on one batch of
the embedded corpus (or random tokens with ``random``): per MoE layer, how much of the router's
input is one shared direction (|mean| / rms over tokens, and the mean cosine to the mean), the max
violation of the top-4 load and the experts under 0.1 x the fair share. CPU, about a minute.

    python docs/bench/session20/init_route.py [random] [model overrides, e.g. moe.router.top_k=8]
"""
import sys

import numpy as np
import torch

from moetron.data.corpus import ensure_default_corpus
from moetron.data.preprocess import open_token_file
from moetron.models.config import ModelConfig
from moetron.models.transformer import Transformer

cfg = ModelConfig.moe_1t_proxy()
cfg.n_layers = 4
cfg.apply_overrides([a for a in sys.argv[1:] if "=" in a])
torch.manual_seed(0)
model = Transformer(cfg).train()
B, S = 4, 2048
if "random" in sys.argv:
    x = torch.randint(0, cfg.vocab_size, (B, S))
else:
    tokens, _ = open_token_file(ensure_default_corpus("data_cache", cfg.vocab_size)["train"])
    x = torch.from_numpy(np.asarray(tokens[: B * S]).astype(np.int64)).view(B, S)
inputs = {}
for i, layer in model.moe_layers().items():
    layer.register_forward_hook(lambda mod, inp, out: inputs.__setitem__(mod.layer_index, inp[0].detach()))
with torch.no_grad():
    model(x[:, :-1], x[:, 1:])
for i, h in inputs.items():
    h = h.reshape(-1, h.shape[-1]).float()
    mean = h.mean(0)
    share = mean.norm() / h.pow(2).sum(-1).mean().sqrt()
    cos = torch.nn.functional.cosine_similarity(h, mean[None], dim=-1).mean()
    layer = model.moe_layers()[i]
    ids = (h @ layer.router.weight.float().t()).topk(layer.cfg.router.top_k, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=layer.num_experts).float()
    print(f"layer {i}: shared direction {share:.3f} of the rms (mean cosine {cos:.3f}), max violation "
          f"{(counts.max() / counts.mean() - 1).item():.2f}, {(counts < 0.1 * counts.mean()).sum().item()} of "
          f"{layer.num_experts} experts under 0.1 x the fair share")
