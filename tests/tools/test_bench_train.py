"""tools/bench_train.py on the CPU: every variant is measured and written, memory.* and optimizer.* overrides reach
the run as variants, bad overrides fail with one error."""

import dataclasses
import json

import torch

import pytest

import bench_train
from moetron.core.config import ConfigError
from moetron.core.precision import PrecisionConfig


def test_variants_with_memory_overrides(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_train.main(["--preset", "tiny-moe", "--model.n_layers=2", "--seq-len", "32", "--batch", "2",
                      "--steps", "1", "--warmup", "0", "--json", str(out),
                      "--variant", "none:memory.recompute=none",
                      "--variant", "sel:memory.recompute=selective,memory.recompute_modules=[norm,swiglu]"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["none", "sel"]
    assert rows[1]["overrides"] == ["--memory.recompute=selective", "--memory.recompute_modules=[norm,swiglu]"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["tokens_per_s_vs_first"] == 1.0
    assert rows[1]["tokens_per_s_vs_first"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    out = capsys.readouterr().out
    assert "sel" in out and "x 1st" in out


def test_bad_override_is_one_error():
    with pytest.raises(ConfigError, match="--trainer.steps=3"):
        bench_train.main(["--preset", "tiny", "--trainer.steps=3"])
    with pytest.raises(ConfigError, match="recompute_modules"):
        bench_train.main(["--preset", "tiny", "--memory.recompute=selective", "--steps", "1"])


def test_optimizer_overrides_are_variants(tmp_path):
    out = tmp_path / "bench.json"
    bench_train.main(["--preset", "tiny", "--model.n_layers=1", "--seq-len", "16", "--batch", "1", "--steps", "1",
                      "--warmup", "0", "--json", str(out), "--optimizer.weight_decay=0.0",
                      "--variant", "a:optimizer.lr=1e-3", "--variant", "b:optimizer.lr=2e-3,optimizer.beta2=0.99"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["overrides"] for r in rows] == [["--optimizer.lr=1e-3"], ["--optimizer.lr=2e-3", "--optimizer.beta2=0.99"]]
    # each row records its precision section, every field as it ran (tools/plan.py --validate replays it)
    assert rows[0]["precision"]["recipe"] == "auto" and rows[0]["precision"]["quantize_input_once"] == "auto"
    assert set(rows[0]["precision"]) == {f.name for f in dataclasses.fields(PrecisionConfig)}
    with pytest.raises(ConfigError, match="optimizer.lr"):
        bench_train.main(["--preset", "tiny", "--steps", "1", "--variant", "bad:optimizer.lr=-1"])


def test_fused_loss_on_and_off_are_variants(tmp_path):
    out = tmp_path / "bench.json"
    bench_train.main(["--preset", "tiny", "--model.n_layers=1", "--seq-len", "16", "--batch", "2", "--steps", "1",
                      "--warmup", "0", "--json", str(out), "--model.loss_chunk_tokens=7",
                      "--variant", "fused:model.fused_loss=true", "--variant", "plain:model.fused_loss=false"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fused", "plain"]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_losses_are_recorded_and_a_diverging_variant_is_flagged(tmp_path, capsys):
    """Variants train the same seeded model on the same batches: equal numerics give equal losses
    (recompute changes no value), a variant whose training diverges (a learning rate of 10) is
    named on stderr, so a numerics bug cannot pass as a timing."""
    out = tmp_path / "bench.json"
    bench_train.main(["--preset", "tiny", "--model.n_layers=1", "--seq-len", "16", "--batch", "2", "--steps", "3",
                      "--warmup", "2", "--json", str(out), "--variant", "a:optimizer.lr=1e-3",
                      "--variant", "same:optimizer.lr=1e-3,memory.recompute=full", "--variant", "wild:optimizer.lr=10"])
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["loss_first"] == rows[1]["loss_first"] == rows[2]["loss_first"]  # the same first step
    assert rows[0]["loss_last"] == pytest.approx(rows[1]["loss_last"], rel=1e-5)
    err = capsys.readouterr().err
    assert "variant wild's last loss" in err and "variant same's" not in err
    assert bench_train.loss_outliers([{"variant": "x", "error": "boom"}]) == (None, [])


def test_each_timed_step_is_recorded_and_a_slow_one_is_named(tmp_path, capsys, monkeypatch):
    """The report keeps every timed step's time beside the window's mean: they add up to the window,
    and a step far over the median (a one-off stall the mean would carry) is named on stderr."""
    out = tmp_path / "bench.json"
    bench_train.main(["--preset", "tiny", "--model.n_layers=1", "--seq-len", "16", "--batch", "2", "--steps", "4",
                      "--warmup", "1", "--json", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    times = row["step_times_s"]
    assert len(times) == 4 and all(t > 0 for t in times)
    assert sum(times) <= 4 * row["step_s"] <= sum(times) + 0.5  # the window adds only the last loss's read
    assert row["step_median_s"] == pytest.approx(sorted(times)[1] / 2 + sorted(times)[2] / 2)
    assert bench_train.slow_steps({"step_median_s": 1.0, "step_times_s": [1.0, 0.9, 1.1, 2.0]}) == [(3, 2.0)]
    assert bench_train.slow_steps({"step_median_s": 1.0, "step_times_s": [1.0, 1.19]}) == []
    # a stall inside the timed window: step boundaries on a synthetic clock, the second step 10x the others
    clock = iter([0.0, 1.0, 11.0, 12.0, 13.0])
    monkeypatch.setattr(bench_train, "_mark", lambda device: next(clock))
    bench_train.main(["--preset", "tiny", "--model.n_layers=1", "--seq-len", "16", "--batch", "2", "--steps", "4",
                      "--warmup", "0", "--json", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["step_times_s"] == [1.0, 10.0, 1.0, 1.0] and row["step_median_s"] == 1.0 and row["step_max_s"] == 10.0
    err = capsys.readouterr().err
    assert "variant base: timed step(s) 2 (10.00x) took over 1.2x its median step (1000.0 ms)" in err


def test_routing_over_the_timed_steps_is_reported(tmp_path, capsys):
    """MoE rows carry the routing of their timed steps, computed as the trainer's load log does
    (the trainer's own summary of the same counts is the reference), and a collapsed router is named."""
    out = tmp_path / "bench.json"
    bench_train.main(["--preset", "tiny-moe", "--model.n_layers=2", "--seq-len", "32", "--batch", "2", "--steps", "2",
                      "--warmup", "1", "--json", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["moe_experts"] == 16 and 0 <= row["moe_starved_experts"] <= 16 and row["moe_max_violation"] >= 0
    # the reference: a trainer stepped the same way, its layers' raw counts of the two timed steps
    # reduced by hand (max load / mean - 1; a share under 0.1 / E is starved), not by core/moe/metrics.py
    from step_builder import build_trainer, step_configs, token_stream
    cfg, memory, optim, precision, _, _ = step_configs("tiny-moe", "auto", ["--model.n_layers=2"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # bench_train's own choice
    data = token_stream(cfg, 2, 32, device)
    trainer = build_trainer(cfg, memory, data, device, seq_len=32, precision=precision, optimizer=optim)
    trainer.train_step(data.next_batch())
    before = [layer.log_tokens_E.clone() for layer in trainer.moe_layers.values()]
    for _ in range(2):
        trainer.train_step(data.next_batch())
    counts = [(layer.log_tokens_E - b).double().cpu() for layer, b in zip(trainer.moe_layers.values(), before)]
    assert row["moe_max_violation"] == pytest.approx(max(float(c.max() / c.mean() - 1) for c in counts))
    assert row["moe_starved_experts"] == max(int((c / c.sum() < 0.1 / 16).sum()) for c in counts)
    assert bench_train.routing_state({}) == {}  # a dense model has no routing columns
    # a router that starved 12 of 16 experts is named; the row above (a fresh tiny model) is not
    collapsed = dict(row, variant="c", moe_starved_experts=12, step_times_s=[row["step_median_s"]] * 2)
    assert any("variant c: routing collapsed" in line and "12 of 16" in line for line in bench_train.row_warnings(collapsed))
    assert any("8 of 16" in line for line in bench_train.row_warnings(dict(row, moe_starved_experts=8)))  # half
    assert not any("collapsed" in line for line in bench_train.row_warnings(dict(row, moe_starved_experts=7)))
