#!/usr/bin/env python
"""Benchmark one MoE layer, forward + backward, on a GPU: where the time goes and how fast the
expert GEMMs run against a dense GEMM of the same total shape.

For each layer shape and each routing source it reports:
- the whole layer's time and TFLOP/s (router + routed experts + shared expert FLOPs);
- the expert GEMMs' TFLOP/s (grouped GEMMs, fwd + bwd = 18 x rows x D x F FLOPs) beside a dense
  bf16 GEMM doing the same FLOPs on the same rows ([T*K, D] x [D, 2F] and [T*K, F] x [F, D]);
- the time split router / permute (routing plan + scatter) / expert GEMMs / combine, each timed
  forward + backward on its own, both eagerly and as GPU kernel time (the profiler's device time:
  no Python or launch gaps, which in a real step hide behind the expert GEMMs);
- host syncs: the layer's forward and backward run under torch.cuda.set_sync_debug_mode("error").

Routing sources: ``uniform`` (each token's k experts drawn uniformly at random) and ``real``
(the routing a briefly trained MoE model makes on held-out text of the embedded corpus: the
layer's top-k ids are replaced by those recorded ids, so the data's imbalance is what is timed).

    python tools/bench_moe.py                       # both published shapes, both routings
    python tools/bench_moe.py --shapes olmoe --routing uniform --json runs/bench/moe.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from moetron.core.metrics import run_environment
from moetron.core.moe import MoEConfig, MoELayer, RouterConfig
from moetron.core.moe.kernels.ops import combine_rows, route, scatter_rows

from cli import median_ms, write_report  # tools/cli.py

SHAPES = {
    # name: (D, E, K, F, shared experts)
    "olmoe": dict(d_model=2048, num_experts=64, top_k=8, hidden=1024, shared=0),
    "olmo3-moe-3.2b": dict(d_model=4096, num_experts=64, top_k=4, hidden=4096, shared=1),
}


def bench(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds of fn() over iters runs, timed with CUDA events."""
    return median_ms(fn, "cuda", warmup, iters)


def gpu_busy_ms(fn, iters: int = 10) -> float:
    """Milliseconds of GPU kernel time per call of fn (the profiler's sum of device time): the GPU
    work alone, without the Python and launch gaps that eager timing of a small piece adds (in a
    real step those hide behind the expert GEMMs, or go away under CUDA graphs / compile)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / iters / 1e3


def real_routing(num_experts: int, top_k: int, tokens: int, steps: int, cache: str) -> np.ndarray:
    """Top-k ids [tokens, K] of a middle MoE layer of a small model briefly trained on the corpus."""
    if os.path.exists(cache):
        return np.load(cache)
    from moetron.core.optim import OptimizerConfig, SchedulerConfig
    from moetron.data.loader import DataConfig
    from moetron.models import ModelConfig, cross_entropy_loss

    cfg = ModelConfig.tiny_moe()
    cfg.d_model, cfg.n_layers, cfg.sliding_window = 512, 4, None
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 8, 8
    cfg.moe = MoEConfig(num_experts=num_experts, expert_hidden=256, router=RouterConfig(top_k=top_k),
                        num_shared_experts=0, dense_layers=[0])
    data = DataConfig(seq_len=512, global_batch_size=32).build(cfg.vocab_size)
    torch.manual_seed(0)
    model = cfg.build(device="cuda")
    opt = OptimizerConfig(lr=2e-3).build(model)
    sched = SchedulerConfig(warmup_steps=20).build(opt, steps)
    t0 = time.time()
    for _ in range(steps):
        batch = data.next_batch().cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()  # the MoE layers' aux losses ride on their outputs
        opt.step()
        opt.zero_grad()
        sched.step()
        for m in model.moe_layers().values():
            m.update_expert_bias()
    print(f"[real routing] trained {cfg.describe()} for {steps} steps in {time.time() - t0:.0f}s, "
          f"loss {loss.item():.3f}", flush=True)
    layer = model.blocks["2"].mlp
    captured = []
    hook = layer.router.register_forward_hook(lambda m, i, out: captured.append(out.topk_ids_TK))
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for batch in data.val_batches(16):
            model(batch[:, :-1].cuda())
            if sum(c.shape[0] for c in captured) >= tokens:
                break
    hook.remove()
    ids = torch.cat(captured)
    reps = -(-tokens // ids.shape[0])  # repeat the held-out routing if it is shorter than `tokens`
    ids = ids.repeat(reps, 1)[:tokens].cpu().numpy()
    os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
    np.save(cache, ids)
    return ids


def measure(shape: dict, ids_TK: torch.Tensor, tokens: int) -> dict:
    D, E, K, F = shape["d_model"], shape["num_experts"], shape["top_k"], shape["hidden"]
    cfg = MoEConfig(num_experts=E, expert_hidden=F, router=RouterConfig(top_k=K, lb_loss_weight=0.01),
                    num_shared_experts=shape["shared"], shared_expert_hidden=F)
    torch.manual_seed(0)
    layer = MoELayer(D, cfg, device="cuda")
    layer.init_weights(0.02)
    # Expert weights in bf16, as FSDP2's bf16 param_dtype hands them to the layer: the timed GEMMs
    # then read bf16 weights like the dense reference does, with no per-step fp32 -> bf16 cast.
    layer.experts.to(torch.bfloat16)
    # Replace the router's choice by the given ids (its logits/softmax/top-k still run and count).
    real_forward = layer.router.forward

    def forced(x_TD):
        out = real_forward(x_TD)
        return out._replace(topk_ids_TK=ids_TK, topk_weights_TK=out.probs_TE.gather(1, ids_TK))

    layer.router.forward = forced
    x = torch.randn(1, tokens, D, device="cuda", requires_grad=True)
    dy = torch.randn(1, tokens, D, device="cuda", dtype=torch.bfloat16)

    def whole():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
            loss = (y * dy).sum()  # + the layer's aux losses, attached to y
        loss.backward()

    whole()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        whole()  # raises on any host-device sync in forward or backward
        syncs = 0
    except RuntimeError as e:
        syncs = 1
        print(f"host sync detected: {e}", file=sys.stderr)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    t_layer = bench(whole)

    # ---- components, each forward + backward on its own ------------------------------------
    x_TD = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x32 = x_TD.detach().float().requires_grad_()

    def router_part():
        out = layer.router(x32)
        (out.topk_weights_TK.sum() + out.probs_TE.sum()).backward()

    plan = route(ids_TK, E, None)

    def permute_part():
        p = route(ids_TK, E, None)
        scatter_rows(x_TD, p.dest_row_TK, p.num_rows).backward(x_rows_grad)

    x_rows_grad = torch.randn(plan.num_rows, D, device="cuda", dtype=torch.bfloat16)
    x_RD = scatter_rows(x_TD.detach(), plan.dest_row_TK, plan.num_rows).requires_grad_()

    def experts_part():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer.experts(x_RD, plan.offsets_E)
        y.backward(x_rows_grad)

    y_RD = torch.randn(plan.num_rows, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_TK = torch.rand(tokens, K, device="cuda", requires_grad=True)
    dy_TD = dy.view(tokens, D)

    def combine_part():
        combine_rows(y_RD, plan.dest_row_TK, w_TK).backward(dy_TD)

    fns = {"router": router_part, "permute": permute_part, "experts": experts_part, "combine": combine_part}
    parts = {k: bench(f) for k, f in fns.items()}
    parts_graph = {k: gpu_busy_ms(f) for k, f in fns.items()}
    t_layer_graph = gpu_busy_ms(whole)

    # ---- dense GEMM reference: same rows, same FLOPs, one weight -----------------------------
    R = tokens * K
    a = torch.randn(R, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.randn(D, 2 * F, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(F, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(R, D, device="cuda", dtype=torch.bfloat16)

    def dense_part():
        h = a @ w1
        gate, up = h.chunk(2, dim=-1)
        (torch.nn.functional.silu(gate) * up @ w2).backward(g)

    t_dense = bench(dense_part)
    expert_flops = 18 * R * D * F
    shared_flops = 18 * tokens * D * cfg.shared_width()
    router_flops = 6 * tokens * D * E
    counts = np.bincount(ids_TK.cpu().numpy().ravel(), minlength=E)
    return {
        "layer_ms": t_layer,
        "layer_tflops": (expert_flops + shared_flops + router_flops) / t_layer / 1e9,
        "experts_ms": parts["experts"],
        "experts_tflops": expert_flops / parts["experts"] / 1e9,
        "dense_same_shape_tflops": expert_flops / t_dense / 1e9,
        "experts_vs_dense": t_dense / parts["experts"],
        "parts_ms": parts,
        "routing_share_of_layer": (parts["router"] + parts["permute"] + parts["combine"]) / t_layer,
        "layer_graph_ms": t_layer_graph,
        "parts_graph_ms": parts_graph,
        "routing_share_of_layer_graph": (
            (parts_graph["router"] + parts_graph["permute"] + parts_graph["combine"]) / t_layer_graph
            if t_layer_graph and all(parts_graph.values()) else None),
        "host_syncs": syncs,
        "max_violation": float(counts.max() / counts.mean() - 1),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--routing", nargs="+", default=["uniform", "real"], choices=["uniform", "real"])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--train-steps", type=int, default=300, help="steps of the model that makes the real routing")
    p.add_argument("--cache-dir", default="runs/bench/routing")
    p.add_argument("--json", default="runs/bench/bench_moe.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_moe needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        E, K = shape["num_experts"], shape["top_k"]
        for routing in args.routing:
            if routing == "uniform":
                g = torch.Generator(device="cuda").manual_seed(0)
                ids = torch.rand(args.tokens, E, device="cuda", generator=g).topk(K, dim=-1).indices
            else:
                cache = os.path.join(args.cache_dir, f"real_E{E}_K{K}_T{args.tokens}.npy")
                ids = torch.from_numpy(real_routing(E, K, args.tokens, args.train_steps, cache)).cuda().long()
            rows.append({"shape": name, "routing": routing, **shape, "tokens": args.tokens,
                         **measure(shape, ids, args.tokens)})
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    print(f"{dev} | torch {torch.__version__} | {args.tokens} tokens/GPU | fwd+bwd, bf16")
    head = (f"{'shape':<15} {'routing':<8} {'maxvio':>6} {'layer ms':>8} {'layer TF/s':>10} {'exp TF/s':>8} "
            f"{'dense TF/s':>10} {'exp/dense':>9} {'router':>7} {'permute':>7} {'experts':>7} {'combine':>7} "
            f"{'route%':>6} {'syncs':>5}")
    print("eager timing (each piece launched from Python):")
    print(head)
    for r in rows:
        pm = r["parts_ms"]
        print(f"{r['shape']:<15} {r['routing']:<8} {r['max_violation']:>6.2f} {r['layer_ms']:>8.2f} "
              f"{r['layer_tflops']:>10.1f} {r['experts_tflops']:>8.1f} {r['dense_same_shape_tflops']:>10.1f} "
              f"{100 * r['experts_vs_dense']:>8.1f}% {pm['router']:>7.2f} {pm['permute']:>7.2f} {pm['experts']:>7.2f} "
              f"{pm['combine']:>7.2f} {100 * r['routing_share_of_layer']:>5.1f}% {r['host_syncs']:>5}")
    print("GPU kernel time (profiler):")
    print(f"{'shape':<15} {'routing':<8} {'layer ms':>8} {'router':>7} {'permute':>7} {'experts':>7} {'combine':>7} {'route%':>6}")
    for r in rows:
        pg = r["parts_graph_ms"]
        fmt = lambda v: f"{v:>7.2f}" if v is not None else f"{'-':>7}"
        share = r["routing_share_of_layer_graph"]
        print(f"{r['shape']:<15} {r['routing']:<8} {fmt(r['layer_graph_ms']):>8} {fmt(pg['router'])} {fmt(pg['permute'])} "
              f"{fmt(pg['experts'])} {fmt(pg['combine'])} {(100 * share if share is not None else float('nan')):>5.1f}%")
    write_report(args.json, run_environment(torch.device("cuda"), 1, "tools/bench_moe.py", argv), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
