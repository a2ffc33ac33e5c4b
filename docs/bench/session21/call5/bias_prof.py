"""The proxy step with the expert bias on/off: per-step GPU time beside the worst layer's max violation,
and the kernels whose time differs (torch.profiler over the timed steps)."""
import sys, json, os, collections, torch
sys.path.insert(0, "tools")
from step_builder import step_configs, build_trainer, token_stream
from moetron.core.moe.layer import MoELayer

rec = []
orig = MoELayer.update_expert_bias
def patched(self):
    c = self.step_tokens_E.float()
    rec.append(torch.stack([c.max() / c.mean() - 1, (c == 0).sum().float()]))
    orig(self)
MoELayer.update_expert_bias = patched
dev = torch.device("cuda")
real = "--real-text" in sys.argv
out = {}
for bias in ("false", "true", "false", "true"):
    ov = ["--model.n_layers=4", f"--model.moe.router.expert_bias={bias}"]
    cfg, mem, opt, prec, dov = step_configs("moe-1t-proxy", "bf16", ov, real)
    data = token_stream(cfg, 8, 2048, dev, real)
    tr = build_trainer(cfg, mem, data, dev, seq_len=2048, precision=prec, compile=True, optimizer=opt)
    for _ in range(10):
        tr.train_step(data.next_batch())
    torch.cuda.synchronize()
    rec.clear()
    ev = [torch.cuda.Event(enable_timing=True)]; ev[0].record()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            tr.train_step(data.next_batch())
            e = torch.cuda.Event(enable_timing=True); e.record(); ev.append(e)
        torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in zip(ev, ev[1:])]
    nl = len(rec) // 30
    mv = torch.stack(rec).view(30, nl, 2).cpu()
    worst = mv[:, :, 0].max(1).values.tolist(); empty = mv[:, :, 1].max(1).values.tolist()
    k = collections.Counter()
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k[e.key[:90]] += e.self_device_time_total / 1e3 / 30
    key = f"bias={bias}#{len([x for x in out if x.startswith('bias=' + bias)])}"
    out[key] = {"times": times, "worst": worst, "empty": empty, "kernels": dict(k.most_common(40))}
    print(key, "median ms %.2f" % sorted(times)[15])
    print("  step ms:", " ".join(f"{t:.1f}" for t in times))
    print("  maxvio :", " ".join(f"{t:.1f}" for t in worst))
    print("  empty  :", " ".join(f"{t:.0f}" for t in empty))
    del tr; torch._dynamo.reset(); torch.cuda.empty_cache()
json.dump(out, open(os.environ.get("OUT", ".") + f"/bias_prof{'_real' if real else ''}.json", "w"))
a, b = out["bias=false#0"]["kernels"], out["bias=true#0"]["kernels"]
print("kernel ms/step: nobias#0, bias#0, diff (largest differences)")
for name in sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, 0) - a.get(n, 0)))[:15]:
    print(f"  {a.get(name, 0):7.2f} {b.get(name, 0):7.2f} {b.get(name, 0) - a.get(name, 0):+7.2f}  {name}")
