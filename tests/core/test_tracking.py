"""Experiment tracking and the starved-expert alert: the starved set, the alert on a planted load
(unit and through the Trainer's loop), the per-layer scalars, and the one error for a missing package."""

import sys

import numpy as np
import pytest
import torch

from moetron.core.config import ConfigError
from moetron.core.moe.metrics import StarvedExpertWatch, starved_experts
from moetron.core.tracking import LoggingConfig, WandbMode, layer_scalars

TINY_MOE = [
    "--preset", "tiny-moe", "--model.d_model=32", "--model.n_layers=3", "--model.vocab_size=512",
    "--model.mlp_hidden=64", "--model.attention.n_heads=4", "--model.attention.n_kv_heads=2",
    "--model.sliding_window=8", "--model.moe.num_experts=4", "--model.moe.expert_hidden=16",
    "--model.moe.router.top_k=2", "--data.seq_len=16", "--data.global_batch_size=4",
    "--data.corpus_vocab_size=512", "--data.corpus_max_bytes=300000", "--scheduler.warmup_steps=1",
    "--precision.recipe=fp32", "--trainer.device=cpu", "--trainer.eval_batches=0", "--trainer.log_interval=1",
]


def planted_summary(layers=(1, 3)):
    """Layer 3 (second row): expert 0 dead, expert 5 at 1% of the fair share; layer 1 balanced."""
    tokens_LE = np.full((len(layers), 8), 100.0)
    tokens_LE[1, 0], tokens_LE[1, 5] = 0.0, 1.0
    return {"layers": np.array(layers), "tokens_per_expert": tokens_LE, "dropped": np.zeros(len(layers)),
            "entropy": np.full(len(layers), 1.5), "max_violation": np.array([0.0, 0.14]),
            "lb_loss": np.array([0.01, 0.02])}


def test_starved_set_is_under_the_share_of_fair():
    tokens_LE = planted_summary()["tokens_per_expert"]
    starved_LE = starved_experts(tokens_LE, 0.1)
    assert starved_LE.tolist() == [[False] * 8, [True, False, False, False, False, True, False, False]]
    assert not starved_experts(np.zeros((1, 4)), 0.1).any()  # a layer that routed nothing starves none
    assert starved_experts(np.array([[9.0, 1.0]]), 0.25).tolist() == [[False, True]]  # 0.1 < 0.25 x 0.5


def test_alert_after_n_consecutive_log_steps_names_layer_and_experts():
    watch = StarvedExpertWatch(0.1, 3)
    lines = [watch.update(step, planted_summary()) for step in (10, 20, 30, 40, 50, 60)]
    assert lines[0] == lines[1] == [] and lines[3] == lines[4] == []
    assert len(lines[2]) == 1 and lines[2][0].startswith("alert: step 30: layer 3: expert(s) 0, 5 got under 0.1 x")
    assert "for 3+ consecutive log steps" in lines[2][0]
    assert len(lines[5]) == 1 and "step 60" in lines[5][0]  # repeated every N log steps while it lasts
    balanced = planted_summary()
    balanced["tokens_per_expert"] = np.full((2, 8), 100.0)
    watch.update(70, balanced)  # the streak breaks
    assert [watch.update(s, planted_summary()) for s in (80, 90)] == [[], []]
    assert StarvedExpertWatch(0.0, 1).update(1, planted_summary()) == []  # 0 turns it off


def test_alert_for_many_starved_experts_stays_one_bounded_line():
    """128 experts of which 100 starve: the line names the count and the first 16 (not all 100)."""
    from moetron.core.moe.metrics import ALERT_LISTED_EXPERTS

    tokens_LE = np.full((1, 128), 1000.0)
    tokens_LE[0, 28:] = 0.0
    summary = {"layers": np.array([2]), "tokens_per_expert": tokens_LE}
    (line,) = StarvedExpertWatch(0.1, 1).update(5, summary)
    listed = ", ".join(str(e) for e in range(28, 28 + ALERT_LISTED_EXPERTS))
    assert line.startswith(f"alert: step 5: layer 2: expert(s) 100 of 128 ({listed}, ...; every one in the run's moe_load.npz)")
    assert line.count("0.0000") == ALERT_LISTED_EXPERTS and len(line) < 600


def test_trainer_prints_the_alert_for_a_planted_load(tmp_path, monkeypatch, capsys):
    import pretrain  # tools/pretrain.py

    monkeypatch.setenv("MOETRON_DATA_DIR", str(tmp_path / "corpus"))
    cfg, _ = pretrain.parse_args([*TINY_MOE, "--trainer.steps=4", "--checkpoint.dir=null",
                                  f"--trainer.run_dir={tmp_path}/run", "--trainer.starved_expert_log_steps=2"])
    trainer, _ = pretrain.build(cfg, torch.device("cpu"), 1)
    assert trainer.moe_layers
    for layer in trainer.moe_layers.values():
        real = layer.pop_load_stats

        def planted(real=real):
            stats = real()  # resets the layer's counters as usual; then expert 2 gets almost nothing
            tokens_E = torch.full_like(stats["tokens_per_expert"], 50.0)
            tokens_E[2] = 1.0
            return dict(stats, tokens_per_expert=tokens_E)

        layer.pop_load_stats = planted
    trainer.fit()
    out = capsys.readouterr().out
    alerts = [line for line in out.splitlines() if line.startswith("alert:")]
    first = min(trainer.moe_layers)
    assert any(line.startswith(f"alert: step 2: layer {first}: expert(s) 2 got under 0.1 x") for line in alerts), out
    assert len(alerts) == 2 * len(trainer.moe_layers)  # steps 2 and 4, one line per layer


def test_wandb_modes_parse_from_overrides():
    import pretrain

    for text, mode in (("off", WandbMode.off), ("offline", WandbMode.offline), ("online", WandbMode.online)):
        cfg, _ = pretrain.parse_args([f"--logging.wandb={text}", "--logging.wandb_tags=[a,b]"])
        assert cfg.logging.wandb == mode and cfg.logging.wandb_tags == ["a", "b"]
    with pytest.raises(ConfigError, match="logging.wandb: 'sometimes' is not one of 'off', 'online', 'offline'"):
        pretrain.parse_args(["--logging.wandb=sometimes"])


def test_layer_scalars_name_every_layer_and_expert():
    scalars = layer_scalars(planted_summary())
    assert scalars["moe/layer3/max_violation"] == pytest.approx(0.14)
    assert scalars["moe/layer3/expert_share/e0"] == 0.0
    assert scalars["moe/layer1/expert_share/e7"] == pytest.approx(1 / 8)
    assert scalars["moe/layer3/lb_loss"] == pytest.approx(0.02) and "moe/layer1/entropy" in scalars
    assert not any("expert_share" in k for k in layer_scalars(planted_summary(), expert_scalars=False))


@pytest.mark.parametrize("cfg,package", [(LoggingConfig(tensorboard=True), "tensorboard"),
                                         (LoggingConfig(wandb=WandbMode.offline), "wandb")])
def test_missing_package_is_one_clear_error(monkeypatch, tmp_path, cfg, package):
    monkeypatch.setitem(sys.modules, package, None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=f"needs the {package} package, which is not installed: pip install {package}"):
        cfg.build(str(tmp_path), "run")
    assert not (tmp_path / "tb").exists()
    LoggingConfig().build(str(tmp_path), "run").log({"step": 1, "loss": 1.0})  # off: needs nothing, writes nothing


def test_pretrain_fails_at_start_without_the_package(monkeypatch, tmp_path):
    import pretrain

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match="logging.tensorboard=true needs the tensorboard package"):
        pretrain.main(["--trainer.device=cpu", f"--trainer.run_dir={tmp_path}/run", "--logging.tensorboard=true"])
    assert not (tmp_path / "run").exists()  # nothing built, nothing written
