"""tools/convert_hf.py: import/export through the CLI, one-line errors with nothing written, and
streaming (peak RSS far below the checkpoint size)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

tf = pytest.importorskip("transformers")

import convert_hf
from moetron.core.weights import checkpoint_exists, iter_weights

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def olmo3_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = tf.Olmo3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, sliding_window=8, pad_token_id=None,
                         eos_token_id=None)
    path = str(tmp_path_factory.mktemp("hf") / "olmo3")
    tf.Olmo3ForCausalLM(cfg).save_pretrained(path, max_shard_size="60KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    return path


def _copy(src, tmp_path, name="bad"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(changes)
    json.dump(cfg, open(cfg_path, "w"))


def _fails(argv, capsys, *needles):
    """Runs the CLI, expects exit 2, one 'error:' line naming every needle, nothing at the output."""
    out = argv[2]
    parent = os.path.dirname(os.path.abspath(out))
    before = set(os.listdir(parent)) if os.path.isdir(parent) else set()
    assert convert_hf.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for needle in needles:
        assert needle in err[0], err[0]
    assert not os.path.exists(out)
    assert (set(os.listdir(parent)) if os.path.isdir(parent) else set()) == before  # no temp dirs left
    return err[0]


def test_import_export_roundtrip(olmo3_dir, tmp_path, capsys):
    native, hf = str(tmp_path / "native"), str(tmp_path / "hf")
    assert convert_hf.main(["import", olmo3_dir, native]) == 0
    assert "Olmo3ForCausalLM: dense" in capsys.readouterr().out
    assert checkpoint_exists(native)
    meta = json.load(open(os.path.join(native, "meta.json")))
    assert meta["config"]["model"]["d_model"] == 64
    assert convert_hf.main(["export", native, hf, "--shard-size", "50KB"]) == 0
    reloaded = tf.AutoModelForCausalLM.from_pretrained(hf).eval()
    original = tf.AutoModelForCausalLM.from_pretrained(olmo3_dir).eval()
    ids = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)


def test_import_bf16(olmo3_dir, tmp_path):
    native = str(tmp_path / "native")
    assert convert_hf.main(["import", olmo3_dir, native, "--dtype", "bf16"]) == 0
    assert all(t.dtype == torch.bfloat16 for _, t in iter_weights(native))


def test_existing_output_needs_overwrite(olmo3_dir, tmp_path, capsys):
    native, hf = str(tmp_path / "native"), str(tmp_path / "hf")
    assert convert_hf.main(["import", olmo3_dir, native]) == 0
    assert convert_hf.main(["export", native, hf]) == 0
    capsys.readouterr()
    for argv in (["import", olmo3_dir, native], ["export", native, hf]):
        stamp = {f: os.path.getmtime(os.path.join(argv[2], f)) for f in os.listdir(argv[2])}
        assert convert_hf.main(argv) == 2
        err = capsys.readouterr().err
        assert "already holds a checkpoint" in err and "--overwrite" in err
        assert stamp == {f: os.path.getmtime(os.path.join(argv[2], f)) for f in os.listdir(argv[2])}
        assert convert_hf.main(argv + ["--overwrite"]) == 0


def test_unsupported_architecture(olmo3_dir, tmp_path, capsys):
    bad = _copy(olmo3_dir, tmp_path)
    _edit_config(bad, architectures=["LlamaForCausalLM"])
    _fails(["import", bad, str(tmp_path / "out")], capsys, "unsupported architecture LlamaForCausalLM",
           "config.json", "Olmo3ForCausalLM and OlmoeForCausalLM")


def test_tied_embeddings(olmo3_dir, tmp_path, capsys):
    bad = _copy(olmo3_dir, tmp_path)
    _edit_config(bad, tie_word_embeddings=True)
    _fails(["import", bad, str(tmp_path / "out")], capsys, "tie_word_embeddings")


def test_unsupported_rope_type(olmo3_dir, tmp_path, capsys):
    bad = _copy(olmo3_dir, tmp_path)
    _edit_config(bad, rope_parameters={"full_attention": {"rope_type": "llama3", "rope_theta": 1e4},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    _fails(["import", bad, str(tmp_path / "out")], capsys, "llama3")


def test_missing_shard(olmo3_dir, tmp_path, capsys):
    bad = _copy(olmo3_dir, tmp_path)
    os.remove(os.path.join(bad, "model-00002-of-" + sorted(os.listdir(bad))[-2].split("-of-")[1]))
    _fails(["import", bad, str(tmp_path / "out")], capsys, "model-00002-of-", "missing")


def test_shape_mismatch(olmo3_dir, tmp_path, capsys):
    bad = _copy(olmo3_dir, tmp_path)
    _edit_config(bad, intermediate_size=80)
    _fails(["import", bad, str(tmp_path / "out")], capsys, "model.layers.0.mlp.gate_proj.weight", "[96, 64]",
           "[80, 64]")


def test_dtype_mismatch(olmo3_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = _copy(olmo3_dir, tmp_path)
    index = json.load(open(os.path.join(bad, "model.safetensors.index.json")))
    shard = index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    tensors = load_file(os.path.join(bad, shard))
    tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"].half()
    save_file(tensors, os.path.join(bad, shard), metadata={"format": "pt"})
    _fails(["import", bad, str(tmp_path / "out")], capsys, "model.layers.1.self_attn.q_proj.weight", "float16")


def test_export_of_a_non_checkpoint(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    _fails(["export", str(tmp_path / "empty"), str(tmp_path / "out")], capsys, "meta.json")


# ---- streaming -------------------------------------------------------------------------------

_MEASURE = textwrap.dedent("""
    import sys

    def hwm():  # VmHWM is this process's own peak (ru_maxrss keeps the forking parent's peak across exec)
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

    import torch, safetensors, moetron.models.hf, moetron.core.weights  # baseline: everything imported
    sys.path.insert(0, sys.argv[1])
    import convert_hf
    base = hwm()
    rc = convert_hf.main(sys.argv[2:])
    print("RSS", base, hwm(), rc)
""")


def _measure(argv) -> tuple[int, int]:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _MEASURE, os.path.join(ROOT, "tools"), *argv],
                          capture_output=True, text=True, env=env, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RSS")]
    assert proc.returncode == 0 and line, proc.stdout + proc.stderr
    _, base, peak, rc = line[0].split()
    assert rc == "0", proc.stderr
    return int(base), int(peak)


def _synthetic_olmo3(path, n_layers=24, d=1024, hidden=4096, vocab=16384) -> int:
    """An Olmo 3 HF checkpoint of constant fp32 tensors (no RNG: fast) written shard by shard,
    without building a model; returns its size in bytes."""
    from safetensors.torch import save_file

    os.makedirs(path)
    hf = {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": d,
          "num_hidden_layers": n_layers, "num_attention_heads": 8, "num_key_value_heads": 8,
          "intermediate_size": hidden, "vocab_size": vocab, "rms_norm_eps": 1e-6, "sliding_window": 4096,
          "dtype": "float32", "tie_word_embeddings": False,
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}}
    json.dump(hf, open(os.path.join(path, "config.json"), "w"))
    shards = [{"model.embed_tokens.weight": (vocab, d)}]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shards.append({p + f"self_attn.{n}.weight": (d, d) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
                      | {p + f"self_attn.{n}.weight": (d,) for n in ("q_norm", "k_norm")}
                      | {p + "mlp.gate_proj.weight": (hidden, d), p + "mlp.up_proj.weight": (hidden, d),
                         p + "mlp.down_proj.weight": (d, hidden),
                         p + "post_attention_layernorm.weight": (d,), p + "post_feedforward_layernorm.weight": (d,)})
    shards.append({"model.norm.weight": (d,), "lm_head.weight": (vocab, d)})
    n, weight_map, total = len(shards), {}, 0
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors = {key: torch.full(shape, 0.01 * (k + 1)) for key, shape in shard.items()}
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update({key: name for key in shard})
        del tensors
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(path, "model.safetensors.index.json"), "w"))
    return total


def test_streaming_peak_rss_is_far_below_checkpoint_size(tmp_path):
    hf = str(tmp_path / "big_hf")
    size = _synthetic_olmo3(hf, n_layers=12)  # 0.9 GB: loading it whole would be 3x the growth allowed
    assert size > 0.85e9
    native, back = str(tmp_path / "big_native"), str(tmp_path / "big_back")
    base, peak = _measure(["import", hf, native])
    growth_import = peak - base
    base, peak = _measure(["export", native, back, "--shard-size", "250MB"])
    growth_export = peak - base
    print(f"checkpoint {size / 1e9:.2f} GB; peak RSS growth import {growth_import / 1e6:.0f} MB, "
          f"export {growth_export / 1e6:.0f} MB")
    assert growth_import < 0.3 * size and growth_export < 0.3 * size
    assert len([f for f in os.listdir(back) if f.endswith(".safetensors")]) >= 4
