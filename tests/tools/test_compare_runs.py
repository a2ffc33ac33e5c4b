"""tools/compare_runs.py: relative final losses against a reference run from hand-written
metrics.jsonl files (values chosen so the expected differences are exact), the tolerance verdict,
the plot, and the errors."""

import json
import math
import os

import pytest

import compare_runs
from moetron.core.config import ConfigError


def _run(tmp_path, name, losses, evals=None):
    d = tmp_path / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for step, loss in losses:
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        for step, loss in (evals or []):
            f.write(json.dumps({"step": step, "eval_loss": loss}) + "\n")
        f.write('{"step": 9')  # a torn last line (a killed run) is skipped
    return str(d)


def test_relative_losses_and_verdict(tmp_path, capsys):
    ref = _run(tmp_path, "bf16", [(10, 5.0), (20, 4.0), (30, 2.0)], [(30, 2.5)])
    close = _run(tmp_path, "fp8", [(10, 5.1), (20, 4.02), (30, 2.01)], [(30, 2.5125)])
    far = _run(tmp_path, "mx", [(10, 5.0), (20, 4.4), (30, 2.2), (40, 1.0)], [(30, 2.6)])  # step 40: not shared
    rows = {r["run"]: r for r in compare_runs.compare([ref, close, far], last=2)}
    assert rows[ref]["reference"] and rows[ref]["train_vs_reference"] == 0
    # mean of the last two shared steps: (4.02 + 2.01) / 2 vs (4 + 2) / 2 -> +0.5%
    assert rows[close]["train_vs_reference"] == pytest.approx(0.005)
    assert rows[close]["eval_vs_reference"] == pytest.approx(0.005) and rows[close]["within_tolerance"]
    assert rows[far]["train_vs_reference"] == pytest.approx(0.1) and not rows[far]["within_tolerance"]
    assert rows[far]["final_step"] == 30 and rows[far]["compared_steps"] == 3
    out = tmp_path / "cmp.json"
    assert compare_runs.main([ref, close, far, "--last", "2", "--json", str(out), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0
    text = capsys.readouterr().out
    assert "NO" in text and "(reference)" in text
    assert len(json.loads(out.read_text())["rows"]) == 3


def test_no_held_out_and_errors(tmp_path):
    a = _run(tmp_path, "a", [(1, 3.0)])
    b = _run(tmp_path, "b", [(1, 3.02)])
    rows = compare_runs.compare([a, b])
    assert math.isnan(rows[1]["eval_vs_reference"]) and rows[1]["within_tolerance"]
    with pytest.raises(ConfigError, match="at least two"):
        compare_runs.compare([a])
    c = _run(tmp_path, "c", [(2, 3.0)])
    with pytest.raises(ConfigError, match="share no logged train step"):
        compare_runs.compare([a, c])
    with pytest.raises(ConfigError, match="does not exist"):
        compare_runs.compare([a, str(tmp_path / "missing")])
    # A run given by its metrics.jsonl (a copy kept beside a benchmark's output) reads as its directory
    by_file = compare_runs.compare([a, os.path.join(b, "metrics.jsonl")])
    assert by_file[1]["train_vs_reference"] == pytest.approx(0.02 / 3.0) == rows[1]["train_vs_reference"]


def test_groups_compare_means_over_seeds(tmp_path, capsys):
    """--group: a row's losses are the means over its runs (seeds), their spread beside them; one
    seed of a group may stray past the tolerance while the group's mean is within it."""
    r0 = _run(tmp_path, "bf16_s0", [(10, 4.0)], [(10, 4.0)])
    r1 = _run(tmp_path, "bf16_s1", [(10, 4.2)], [(10, 4.2)])
    m0 = _run(tmp_path, "mx_s0", [(10, 3.98)], [(10, 4.0)])  # -2.9% from the bf16 mean on its own
    m1 = _run(tmp_path, "mx_s1", [(10, 4.2)], [(10, 4.2)])
    rows = {r["run"]: r for r in compare_runs.compare_groups({"bf16": [r0, r1], "mx": [m0, m1]}, last=1)}
    assert rows["bf16"]["train_loss"] == pytest.approx(4.1) and rows["bf16"]["train_spread"] == pytest.approx(0.2 / 4.1)
    assert rows["mx"]["train_vs_reference"] == pytest.approx(4.09 / 4.1 - 1) and rows["mx"]["within_tolerance"]
    assert rows["mx"]["runs"] == [m0, m1] and rows["bf16"]["reference"]
    single = {r["run"]: r for r in compare_runs.compare([r1, m0], last=1)}
    assert not single[m0]["within_tolerance"]  # one seed against one seed: outside 1%
    # noise: 2 standard errors of the difference of the means, relative to the reference's mean (sample variances
    # by hand: bf16 (4.0, 4.2) 0.02, mx (3.98, 4.2) 0.0242), so mx's -0.24% is inside it; a group far off is beyond
    assert rows["mx"]["train_noise"] == pytest.approx(2 * (0.02 / 2 + 0.0242 / 2) ** 0.5 / 4.1)
    assert rows["mx"]["beyond_noise"] is False and rows["bf16"]["beyond_noise"] is None
    assert single[m0]["beyond_noise"] is None  # one run a side: no noise estimate
    f0, f1 = _run(tmp_path, "far_s0", [(10, 4.5)], [(10, 4.2)]), _run(tmp_path, "far_s1", [(10, 4.5)], [(10, 4.2)])
    far = {r["run"]: r for r in compare_runs.compare_groups({"bf16": [r0, r1], "far": [f0, f1]}, last=1)}["far"]
    assert far["train_noise"] == pytest.approx(2 * (0.02 / 2) ** 0.5 / 4.1) and far["beyond_noise"] is True
    out = tmp_path / "g.json"
    assert compare_runs.main(["--group", f"bf16={r0},{r1}", "--group", f"mx={m0},{m1}", "--last", "1",
                              "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mx" in printed and "inside" in printed.splitlines()[2]
    long = "bf16 + bias (session 20, H200, seeds 0-2), the reference"  # over 40 characters: printed whole
    assert compare_runs.main(["--group", f"{long}={r0},{r1}", "--group", f"mx={m0},{m1}", "--last", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(long + " ") and lines[2].startswith("mx ")
    assert lines[1].index(" 10 ") == lines[2].index(" 10 ")  # the columns line up
    with pytest.raises(ConfigError, match="NAME=DIR"):
        compare_runs.main(["--group", "bf16"])
    with pytest.raises(ConfigError, match="given twice"):
        compare_runs.main(["--group", f"a={r0}", "--group", f"a={r1}"])
    with pytest.raises(ConfigError, match="none of the runs or groups"):
        compare_runs.compare_groups({"a": [r0], "b": [r1]}, reference="c")


def test_group_curves_are_the_plotted_means_and_differences(tmp_path):
    """What the plot draws: per group, the mean over its runs at the steps every run logged, the
    runs' min and max, and the mean's relative difference to the reference group's mean at each
    step (train) and at the held-out steps both logged; then the PNG is written."""
    r0 = _run(tmp_path, "bf16_s0", [(10, 4.0), (20, 3.0), (30, 2.0)], [(20, 3.5)])
    r1 = _run(tmp_path, "bf16_s1", [(10, 4.4), (20, 3.2), (30, 2.2)], [(20, 3.7)])
    m0 = _run(tmp_path, "mx_s0", [(10, 4.2), (20, 3.3), (30, 2.1), (40, 1.0)], [(20, 3.6), (40, 1.2)])
    curves = compare_runs.group_curves({"bf16": [r0, r1], "mx": [m0]})
    b, m = curves["bf16"], curves["mx"]
    assert b["steps"] == m["steps"] == [10, 20, 30]  # step 40: not logged by every run
    assert b["mean"] == pytest.approx([4.2, 3.1, 2.1]) and b["lo"] == [4.0, 3.0, 2.0] and b["hi"] == [4.4, 3.2, 2.2]
    assert b["rel"] == pytest.approx([0.0, 0.0, 0.0])
    assert m["rel"] == pytest.approx([0.0, 3.3 / 3.1 - 1, 0.0])
    assert b["held_steps"] == [20] and b["held_mean"] == pytest.approx([3.6])
    assert m["held_steps"] == [20, 40] and m["held_rel"] == pytest.approx({20: 0.0})  # 40: no reference there
    assert compare_runs.group_curves({"bf16": [r0, r1], "mx": [m0]}, reference="mx")["bf16"]["rel"][1] == \
        pytest.approx(3.1 / 3.3 - 1)
    pytest.importorskip("matplotlib")
    path = compare_runs.plot({"bf16": [r0, r1], "mx": [m0]}, str(tmp_path / "p.png"), tolerance=0.02)
    assert (tmp_path / "p.png").stat().st_size > 0 and path.endswith("p.png")


def test_main_reads_each_run_once_for_the_table_and_the_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    r0 = _run(tmp_path, "a", [(10, 4.0), (20, 3.0)], [(20, 3.5)])
    r1 = _run(tmp_path, "b", [(10, 4.1), (20, 3.1)], [(20, 3.6)])
    reads = []
    real = compare_runs.read_metrics
    monkeypatch.setattr(compare_runs, "read_metrics", lambda d: reads.append(d) or real(d))
    assert compare_runs.main([r0, r1, "--json", str(tmp_path / "c.json"), "--out", str(tmp_path / "c.png")]) == 0
    assert sorted(reads) == sorted([r0, r1]) and (tmp_path / "c.png").stat().st_size > 0
