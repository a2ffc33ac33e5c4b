"""tools/bench_memory.py on the CPU: the breakdown's parts against what they must be (parameter and
optimizer-state bytes from the model's own counts, the saved activations a recompute must drop),
and that every variant is measured and written."""

import json

import pytest

import bench_memory
from moetron.models import ModelConfig


def test_breakdown_against_counts_and_switches(tmp_path, capsys):
    out = tmp_path / "mem.json"
    bench_memory.main(["--preset", "tiny-moe", "--model.n_layers=2", "--seq-len", "32", "--batch", "2",
                       "--steps", "1", "--warmup", "1", "--json", str(out),
                       "--variant", "base:", "--variant", "full:memory.recompute=full",
                       "--variant", "bf16:optimizer.state_dtype=bf16"])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2"])
    n = cfg.num_params()
    base = rows["base"]
    assert base["param_bytes"] == 4 * n  # fp32 master weights
    assert base["optimizer_state_bytes"] == 8 * n  # two fp32 Adam moments
    assert rows["bf16"]["optimizer_state_bytes"] == 4 * n
    # Full recompute keeps only each block's input: far less than all the blocks' activations.
    def blocks(row):
        return sum(v for k, v in row["saved_by_layer"].items() if k.startswith("blocks."))

    assert 0 < blocks(rows["full"]) < blocks(base) / 3
    layers = base["saved_by_layer"]
    assert layers["blocks.0"] > 0 and layers["blocks.1"] > 0
    assert sum(base["saved_by_kind"].values()) == base["saved_activation_bytes"]
    assert "saved for backward" in capsys.readouterr().out


def test_a_replayed_step_is_refused(capsys):
    """trainer.cuda_graph's replays run no saved-tensor hook and allocate nothing: the breakdown would
    read empty, so the variant is refused, naming bench_train."""
    with pytest.raises(SystemExit):
        bench_memory.main(["--preset", "tiny-moe", "--model.n_layers=2", "--seq-len", "32", "--batch", "2",
                           "--variant", "base:", "--variant", "cg:trainer.cuda_graph=true"])
    assert "variant cg: trainer.cuda_graph replays" in capsys.readouterr().err
