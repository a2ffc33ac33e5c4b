"""tools/bench_parallel.py under torchrun on two gloo ranks: both dispatch variants measured in one
launch, with the expert all-to-all's time and share of the step."""

import json
import os
import sys

from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench_parallel.py")

SMALL = [
    "--preset", "tiny-moe", "--model.d_model=64", "--model.n_layers=2", "--model.vocab_size=512",
    "--data.corpus_vocab_size=512", "--data.corpus_max_bytes=300000", "--seq-len", "32", "--tokens-per-gpu", "128",
    "--steps", "2", "--warmup", "1", "--parallel.ep=2", "--trainer.device=cpu",
]


def test_two_variants_report_all_to_all_share(tmp_path):
    out = str(tmp_path / "bench.json")
    env = dict(os.environ, MOETRON_DATA_DIR=str(tmp_path / "corpus"), OMP_NUM_THREADS="1")
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", BENCH, *SMALL,
           "--json", out, "--variants", "synced:parallel.ep_dispatch=synced", "sync_free:parallel.ep_dispatch=sync_free"]
    proc = run_python(cmd, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.load(open(out))
    rows = {r["variant"]: r for r in result["rows"]}
    assert sorted(rows) == ["sync_free", "synced"]
    for name, r in rows.items():
        assert r["layout"]["ep"] == 2 and r["layout"]["ep_dispatch"] == name and r["gpus"] == 2
        assert r["global_batch_size"] == 8  # 128 tokens x 2 data-parallel ranks / 32
        assert r["tokens_per_s_per_gpu"] > 0 and r["step_ms"] > 0
        assert r["a2a_ms"] > 0 and 0 < r["a2a_share"] < 1, r
        assert r["a2a_calls_per_step"] == 4  # one MoE layer: dispatch + combine, forward + backward
        assert r["mfu"] is None and r["peak_mem_gib"] is None  # no peak, no CUDA memory on the CPU
    assert "synced" in proc.stdout and "a2a %" in proc.stdout
    assert result["env"]["env_vars"]["NCCL_NVLS_ENABLE"] == "0"
    assert result["env"]["command"].startswith("torchrun --nproc-per-node 2 tools/bench_parallel.py")


def test_variant_specs_split_on_keys_only():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_parallel

    assert bench_parallel.split_variant("a:parallel.ep=2,data.train_paths=[x,y]") == (
        "a", ["--parallel.ep=2", "--data.train_paths=[x,y]"])
    assert bench_parallel.split_variant("b:--parallel.ep_dispatch=sync_free") == (
        "b", ["--parallel.ep_dispatch=sync_free"])


def test_pipeline_bubble_theory_and_measured(tmp_path):
    """Theory against hand-computed values; measured against a pp=1 baseline in a real two-rank run."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_parallel

    from moetron.parallel.config import ParallelConfig

    def layout(**kw):
        return ParallelConfig(**kw).resolve(4)

    assert bench_parallel.bubble_theory(layout()) is None
    assert bench_parallel.bubble_theory(layout(pp=4, pp_microbatches=8)) == 3 / 11  # (p-1)/(m+p-1)
    assert bench_parallel.bubble_theory(layout(pp=2, pp_schedule="gpipe", pp_microbatches=2)) == 1 / 3
    assert bench_parallel.bubble_theory(layout(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2,
                                               pp_microbatches=4)) == 1 / 9  # (p-1)/(v m+p-1)
    assert bench_parallel.bubble_theory(layout(pp=2)) == 1 / 5  # default m = 2 x stages = 4

    out = str(tmp_path / "bench.json")
    env = dict(os.environ, MOETRON_DATA_DIR=str(tmp_path / "corpus"), OMP_NUM_THREADS="1")
    small = [a for a in SMALL if a != "--parallel.ep=2"]
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", BENCH, *small,
           "--json", out, "--data.global_batch_size=8", "--bubble-baseline", "dp",
           "--variants", "dp:parallel.dp_shard=2", "1f1b:parallel.pp=2,parallel.dp_shard=1,parallel.pp_microbatches=4"]
    proc = run_python(cmd, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["variant"]: r for r in json.load(open(out))["rows"]}
    assert rows["dp"]["bubble_measured"] is None and rows["dp"]["bubble_theory"] is None
    assert rows["1f1b"]["bubble_theory"] == 1 / 5
    assert rows["1f1b"]["bubble_measured"] == 1 - rows["dp"]["step_ms"] / rows["1f1b"]["step_ms"]
    assert "bubble %" in proc.stdout

    # a baseline from an earlier launch's JSON, scaled to the row's tokens per GPU: one GPU doing
    # the whole step ideally takes twice as long as each of two pipeline ranks
    base = {"variant": "one", "layout": {"pp": 1}, "step_ms": 10.0, "gpus": 1, "tokens_per_step": 256}
    path = tmp_path / "one_gpu.json"
    path.write_text(json.dumps({"rows": [base]}))
    pipe = {"variant": "p", "layout": {"pp": 2}, "step_ms": 6.0, "gpus": 2, "tokens_per_step": 256}
    bench_parallel.add_measured_bubbles([pipe], bench_parallel.baseline_row(f"{path}:one", []))
    assert pipe["bubble_measured"] == 1 - 5.0 / 6.0

    bad = run_python(cmd[:cmd.index("--bubble-baseline") + 1] + ["nope"] + cmd[cmd.index("--variants"):],
                     env=env, cwd=ROOT, timeout=300)
    assert bad.returncode != 0 and "--bubble-baseline 'nope' names no variant" in bad.stderr
