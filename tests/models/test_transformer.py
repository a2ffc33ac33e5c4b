"""The model's blocks against a naive composition of its parts, and basic training behaviour."""

import torch

from moetron.models import BlockType, ModelConfig, cross_entropy_loss


def _tiny(**kw):
    torch.manual_seed(0)
    base = dict(d_model=32, n_layers=2, vocab_size=64, mlp_hidden=48, sliding_window=4)
    base.update(kw)
    cfg = ModelConfig.from_dict({**base, "attention": {"n_heads": 4, "n_kv_heads": 2}})
    return cfg, cfg.build()


def test_reordered_norm_block_is_olmo3():
    """h = x + norm(attn(x)); out = h + norm(mlp(h))."""
    cfg, model = _tiny()
    block = model.blocks["0"]
    x = torch.randn(2, 6, 32)
    h = x + block.attention_norm(block.attention(x))
    expected = h + block.mlp_norm(block.mlp(h))
    torch.testing.assert_close(block(x), expected)


def test_pre_norm_block():
    cfg, model = _tiny(block_type="pre_norm")
    block = model.blocks["1"]
    x = torch.randn(2, 6, 32)
    h = x + block.attention(block.attention_norm(x))
    torch.testing.assert_close(block(x), h + block.mlp(block.mlp_norm(h)))
    assert cfg.block_type == BlockType.pre_norm


def test_windows_follow_the_layer_pattern():
    cfg, model = _tiny(n_layers=5)
    assert [model.blocks[str(i)].attention.sliding_window for i in range(5)] == [4, 4, 4, None, None]


def test_loss_and_memorization():
    """A fixed batch can be memorised: the loss drops far below log(V)."""
    cfg, model = _tiny()
    batch = torch.randint(0, 64, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = cross_entropy_loss(model(batch[:, :-1]), batch[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert abs(first - torch.log(torch.tensor(64.0)).item()) < 0.3
    assert loss.item() < 0.5


def test_compile_modules_compiles_every_block_and_the_final_norm(monkeypatch):
    """trainer.compile's one path (run/build.py, tools/step_builder.py): each block and the final norm
    (left eager, the norm ran as ~10 unfused fp32 kernels: 1.8 ms a step on olmoe3-4l-8e)."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    _, model = _tiny(n_layers=3)
    model.compile_modules()
    assert compiled == [*model.blocks.values(), model.norm]
