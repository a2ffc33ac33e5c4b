"""tools/peer_ratio.py: moetron's rows against peer runs from hand-written reports (figures chosen so every ratio
is exact), a report tools/bench_train.py itself wrote on the CPU, the verdicts, the GB -> GiB conversion, and
one error for each thing that makes a ratio meaningless."""

import json

import pytest

import bench_train
import peer_ratio
from moetron.core.config import ConfigError

TOKENS = 16384


def _moetron(tmp_path, rows, device="GPU X", name="moetron.json"):
    """A bench_train-shaped report: rows of (variant, tok/s, median tok/s, peak GiB, params)."""
    out = []
    for variant, tps, median_tps, gib, params in rows:
        out.append({"variant": variant, "params": params, "tokens_per_s": tps, "step_s": TOKENS / tps,
                    "step_median_s": TOKENS / median_tps, "peak_mem_gib": gib})
    path = tmp_path / name
    path.write_text(json.dumps({"env": {"device": device}, "rows": out}))
    return str(path)


def _peer(tmp_path, name, tps, median_s, params=1_000_000, tokens=TOKENS, device="GPU X", gb=55.63, events=None):
    path = tmp_path / name
    lines = [{"event": "config", "config": "shape", "framework": "torchtitan", "device": device},
             {"event": "step", "step": 1, "time_s": 9.0}]
    lines += events if events is not None else [
        {"event": "result", "config": "shape", "framework": "torchtitan", "total_params": params,
         "tokens_per_step": tokens, "median_step_s": median_s, "tokens_per_s": tps, "peak_mem_gb": gb}]
    path.write_text("\n".join(json.dumps(e) for e in lines) + '\n{"event": "res')  # a torn last line is skipped
    return str(path)


def test_ratios_over_peer_runs_and_verdicts(tmp_path, capsys):
    m = _moetron(tmp_path, [("best", 60000.0, 61440.0, 38.0, 1_000_500), ("base", 48000.0, 49152.0, 42.9, 1_000_000)])
    p1 = _peer(tmp_path, "before.jsonl", 50000.0, 0.3)   # 60000 / 50000 = 1.2; 0.3 / (16384 / 61440) = 1.125
    p2 = _peer(tmp_path, "after.jsonl", 40000.0, 0.32)   # 1.5; 0.32 / (16384 / 61440) = 1.2
    out = tmp_path / "ratio.json"
    assert peer_ratio.main([m, "--peer", p1, "--peer", p2, "--target", "1.25", "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    best, base = rows["best"], rows["base"]
    assert best["ratio_min"] == pytest.approx(1.2) and best["ratio_max"] == pytest.approx(1.5)
    assert best["median_ratio_min"] == pytest.approx(1.125) and best["median_ratio_max"] == pytest.approx(1.2)
    assert best["verdict"] == "mixed"                      # 1.2 < 1.25 <= 1.5
    assert base["ratio_min"] == pytest.approx(0.96) and base["ratio_max"] == pytest.approx(1.2)
    assert base["verdict"] == "missed"
    assert best["tokens_per_step"] == TOKENS and best["step_ms"] == pytest.approx(1e3 * TOKENS / 60000)
    text = capsys.readouterr().out
    assert "55.63 GB (51.8 GiB)" in text                    # 55.63e9 / 2**30 = 51.81
    assert "1.200-1.500x" in text and "mixed (1.25x)" in text
    rows = peer_ratio.compare([(m, *peer_ratio.read_moetron(m))], [peer_ratio.read_peer(p1)], target=1.2)
    assert [r["verdict"] for r in rows] == ["met", "missed"]  # a single run: its one ratio decides


def test_a_bench_train_report_against_a_peer(tmp_path, capsys):
    """The report bench_train writes (CPU, tiny-moe) is read as it is: its tokens per step from tok/s x the mean step."""
    report = tmp_path / "bench.json"
    bench_train.main(["--preset", "tiny-moe", "--model.n_layers=2", "--seq-len", "32", "--batch", "2",
                      "--steps", "2", "--warmup", "0", "--json", str(report), "--variant", "a:memory.recompute=none"])
    row = json.loads(report.read_text())["rows"][0]
    env = json.loads(report.read_text())["env"]
    peer = _peer(tmp_path, "p.jsonl", row["tokens_per_s"] / 2, 2 * row["step_median_s"], params=row["params"],
                 tokens=64, device=env.get("device", "GPU X"))
    assert peer_ratio.main([str(report), "--peer", peer, "--json", ""]) == 0
    rows = peer_ratio.compare([(str(report), *peer_ratio.read_moetron(str(report)))], [peer_ratio.read_peer(peer)])
    assert rows[0]["tokens_per_step"] == 64
    assert rows[0]["ratio_min"] == pytest.approx(2.0) and rows[0]["median_ratio_min"] == pytest.approx(2.0)


@pytest.mark.parametrize("peer_kw, message", [
    ({"tokens": 8192}, "16,384 tokens a step"),
    ({"params": 1_100_000}, "another shape"),
    ({"device": "GPU Y"}, "same device call"),
    ({"events": [{"event": "error", "error": "OOM", "detail": "CUDA out of memory"}]}, r"failed \(OOM: CUDA out of memory"),
    ({"events": []}, "no \"result\" event"),
])
def test_runs_that_cannot_be_compared_are_refused(tmp_path, peer_kw, message):
    m = _moetron(tmp_path, [("best", 60000.0, 60000.0, 38.0, 1_000_000)])
    p = _peer(tmp_path, "p.jsonl", 50000.0, 0.3, **peer_kw)
    with pytest.raises(ConfigError, match=message):
        peer_ratio.main([m, "--peer", p, "--json", ""])


def test_bad_inputs(tmp_path):
    m = _moetron(tmp_path, [("best", 60000.0, 60000.0, 38.0, 1_000_000)])
    with pytest.raises(ConfigError, match="at least one --peer"):
        peer_ratio.main([m, "--json", ""])
    (tmp_path / "x.json").write_text('{"rows": [{"tokens_per_s": 1.0, "step_s": 1.0}]}')  # no variant
    with pytest.raises(ConfigError, match="not a tools/bench_train.py --json report"):
        peer_ratio.main([str(tmp_path / "x.json"), "--peer", _peer(tmp_path, "p.jsonl", 1.0, 1.0)])
    with pytest.raises(ConfigError, match="cannot read it"):
        peer_ratio.main([m, "--peer", str(tmp_path / "missing.jsonl")])
