"""Load diagnostics: summarize() and LoadLog against hand-computed values."""

import numpy as np
import pytest
import torch

from moetron.core.moe.metrics import LoadLog, summarize


def _stats(tokens, dropped, entropy, bias=None):
    s = {"tokens_per_expert": torch.tensor(tokens), "dropped": torch.tensor(dropped), "entropy": torch.tensor(entropy)}
    if bias is not None:
        s["expert_bias"] = torch.tensor(bias)
    return s


def test_summarize_hand_values():
    # Layer 3 listed first: the output follows layer order, not insertion order.
    stats = {
        3: _stats([0.0, 0.0, 0.0, 0.0], 0.0, 0.0, [0.0, 0.0, 0.0, 0.0]),
        1: _stats([6.0, 2.0, 0.0, 0.0], 1.0, 0.5, [-0.1, 0.0, 0.1, 0.2]),
    }
    out = summarize(stats)
    np.testing.assert_array_equal(out["layers"], [1, 3])
    np.testing.assert_array_equal(out["tokens_per_expert"], [[6, 2, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["dropped"], [1, 0])
    np.testing.assert_allclose(out["entropy"], [0.5, 0.0])
    # layer 1: mean 2, max 6 -> 6 / 2 - 1 = 2; an idle layer has no violation
    np.testing.assert_allclose(out["max_violation"], [2.0, 0.0])
    np.testing.assert_allclose(out["expert_bias"], [[-0.1, 0.0, 0.1, 0.2], [0, 0, 0, 0]])
    assert "expert_bias" not in summarize({0: _stats([1.0, 1.0], 0.0, 0.7)})


def test_load_log_writes_every_record(tmp_path):
    path = str(tmp_path / "moe_load.npz")
    log = LoadLog(path)
    log.add(10, summarize({0: _stats([3.0, 1.0], 0.0, 0.6), 2: _stats([2.0, 2.0], 0.0, 0.7)}))
    line = log.add(20, summarize({0: _stats([4.0, 0.0], 2.0, 0.2), 2: _stats([1.0, 3.0], 0.0, 0.4)}))
    # step 20: violations 4/2 - 1 = 1 (layer 0) and 3/2 - 1 = 0.5 (layer 2); 2 of 8 slots dropped
    assert line == pytest.approx({
        "moe_max_violation": 1.0, "moe_max_violation_layer": 0, "moe_mean_violation": 0.75,
        "moe_entropy": 0.3, "moe_dropped_frac": 0.25,
    })
    saved = np.load(path)
    np.testing.assert_array_equal(saved["step"], [10, 20])
    np.testing.assert_array_equal(saved["layers"], [0, 2])
    assert saved["tokens_per_expert"].shape == (2, 2, 2)
    np.testing.assert_allclose(saved["max_violation"], [[0.5, 0.0], [1.0, 0.5]])
