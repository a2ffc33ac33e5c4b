"""tools/pretrain.py with TensorBoard / W&B on: the trackers hold what metrics.jsonl holds, and
tools/plot.py draws the run."""

import glob
import json
import os

import pytest

from test_pretrain import MOE, run  # tests/tools/test_pretrain.py: the tiny CPU run in a fresh process


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))


def jsonl_scalars(run_dir):
    """(name, step) -> value of every number in metrics.jsonl (nulls, i.e. NaN/inf, left out)."""
    out = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key, row["step"]] = float(value)
    return out


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory, data_dir):
    """A tiny MoE run (3 steps, held-out loss at steps 2 and 3) with TensorBoard on."""
    d = str(tmp_path_factory.mktemp("tb") / "run")
    run([*MOE, "--trainer.steps=3", "--trainer.eval_interval=2", "--checkpoint.dir=null", "--logging.tensorboard=true",
         f"--trainer.run_dir={d}"], data_dir)
    return d


def test_tensorboard_events_hold_the_metrics_jsonl_scalars(tb_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = tb_run
    assert glob.glob(f"{d}/tb/events.out.tfevents.*")
    events = EventAccumulator(f"{d}/tb", size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    tb = {(tag, e.step): e.value for tag in tags for e in events.Scalars(tag)}
    expected = jsonl_scalars(d)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "eval_loss", "moe_max_violation"} <= {k for k, _ in expected}
    assert {(k, s): pytest.approx(v, rel=1e-6) for (k, s), v in expected.items()} == \
        {key: v for key, v in tb.items() if not key[0].startswith("moe/")}  # same names, steps, values
    # plus every MoE layer's load: max violation, entropy, each expert's share, and a histogram
    layers = sorted({int(t.split("/")[1][len("layer"):]) for t in tags if t.startswith("moe/layer")})
    assert layers and max(layers) == 1  # 2 blocks, the first dense
    for name in ("max_violation", "entropy", "dropped_frac", "expert_share/e0", "expert_share/e3"):
        assert [e.step for e in events.Scalars(f"moe/layer1/{name}")] == [1, 2, 3]
    shares = [events.Scalars(f"moe/layer1/expert_share/e{e}")[-1].value for e in range(4)]
    assert sum(shares) == pytest.approx(1.0, rel=1e-5)
    assert "moe/layer1/expert_share" in events.Tags()["histograms"]


def test_wandb_offline_writes_its_run_directory(tmp_path, data_dir):
    pytest.importorskip("wandb")
    d = str(tmp_path / "run")
    run([*MOE, "--trainer.steps=2", "--checkpoint.dir=null", "--logging.wandb=offline", "--logging.wandb_name=t",
         "--logging.wandb_tags=[ci,tiny]", f"--trainer.run_dir={d}"], data_dir,
        env_extra={"WANDB_SILENT": "true", "WANDB_MODE": "offline", "WANDB_DISABLE_GIT": "true"})
    runs = glob.glob(f"{d}/wandb/offline-run-*")
    assert len(runs) == 1 and glob.glob(f"{runs[0]}/run-*.wandb"), os.listdir(f"{d}/wandb")


def test_plots_of_the_tiny_moe_run(tb_run, tmp_path):
    pytest.importorskip("matplotlib")
    import plot  # tools/plot.py

    from test_plot import is_png

    assert plot.main([tb_run, "--out", str(tmp_path)]) == 0
    expected = ["loss.png", "lr.png", "grad_norm.png", "throughput.png", "expert_load_step3.png",
                "expert_load_evolution.png"]
    assert sorted(os.listdir(tmp_path)) == sorted(expected)
    assert all(is_png(os.path.join(tmp_path, name)) for name in expected)
