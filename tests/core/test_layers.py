"""Layers against naive references written independently of the code under test."""

import math

import pytest
import torch

from moetron.core.layers import Attention, AttentionConfig, RMSNorm, RotaryEmbedding, apply_rotary

torch.set_default_dtype(torch.float32)


def naive_rope(x, theta):
    """Rotate pairs (j, j + d/2) of x [B, H, S, d] by angle pos * theta^(-2j/d), in float64."""
    B, H, S, d = x.shape
    out = torch.empty_like(x, dtype=torch.float64)
    for s in range(S):
        for j in range(d // 2):
            angle = s * theta ** (-2.0 * j / d)
            c, si = math.cos(angle), math.sin(angle)
            a, b = x[..., s, j].double(), x[..., s, j + d // 2].double()
            out[..., s, j] = a * c - b * si
            out[..., s, j + d // 2] = a * si + b * c
    return out


def naive_rms(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def naive_attention(x, attn: Attention, window):
    """Loop over heads and query positions; keys allowed: 0 <= i - j < window (or all j <= i)."""
    B, S, D = x.shape
    H, G, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = x.double() @ attn.q_proj.weight.double().T
    k = x.double() @ attn.k_proj.weight.double().T
    v = x.double() @ attn.v_proj.weight.double().T
    if attn.q_norm is not None:
        q = naive_rms(q, attn.q_norm.weight, attn.q_norm.eps)
        k = naive_rms(k, attn.k_norm.weight, attn.k_norm.eps)
    q = naive_rope(q.view(B, S, H, d).transpose(1, 2), attn.rope.theta)
    k = naive_rope(k.view(B, S, G, d).transpose(1, 2), attn.rope.theta)
    v = v.view(B, S, G, d).transpose(1, 2)
    out = torch.zeros(B, H, S, d, dtype=torch.float64)
    for h in range(H):
        g = h // (H // G)  # query head h reads kv head g
        for i in range(S):
            keys = [j for j in range(S) if j <= i and (window is None or i - j < window)]
            scores = torch.stack([(q[:, h, i] * k[:, g, j]).sum(-1) / math.sqrt(d) for j in keys], -1)
            p = torch.softmax(scores, -1)
            out[:, h, i] = sum(p[:, n : n + 1] * v[:, g, j] for n, j in enumerate(keys))
    out = out.transpose(1, 2).reshape(B, S, H * d)
    return out @ attn.o_proj.weight.double().T


def test_rmsnorm_matches_naive():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(norm(x).double(), naive_rms(x, norm.weight, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("theta", [10_000.0, 500_000.0])
def test_rope_matches_naive(theta):
    x = torch.randn(2, 3, 7, 8)
    cos, sin = RotaryEmbedding(8, theta)(7, x.device)
    torch.testing.assert_close(apply_rotary(x, cos, sin).double(), naive_rope(x, theta), rtol=1e-5, atol=1e-5)


def test_rope_relative_position():
    """q.k after RoPE depends only on the distance between positions."""
    rope = RotaryEmbedding(16, 10_000.0)
    cos, sin = rope(12, torch.device("cpu"))
    q, k = torch.randn(16), torch.randn(16)
    x = torch.stack([q] * 12)[None, None]
    y = torch.stack([k] * 12)[None, None]
    rq, rk = apply_rotary(x, cos, sin)[0, 0], apply_rotary(y, cos, sin)[0, 0]
    assert torch.allclose(rq[5] @ rk[2], rq[9] @ rk[6], atol=1e-4)
    assert not torch.allclose(rq[5] @ rk[2], rq[5] @ rk[4], atol=1e-4)


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,window,qk_norm",
    [(4, 4, None, True), (4, 2, None, True), (4, 1, 3, True), (6, 2, 4, False), (2, 2, 1, True), (4, 2, 50, True)],
)
def test_attention_matches_naive(n_heads, n_kv_heads, window, qk_norm):
    torch.manual_seed(0)
    cfg = AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=8, qk_norm=qk_norm, rope_theta=10_000.0)
    attn = Attention(24, cfg, sliding_window=window)
    if qk_norm:
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 11, 24)
    expected = naive_attention(x, attn, window if window is not None and window < 11 else None)
    torch.testing.assert_close(attn(x).double(), expected, rtol=1e-4, atol=1e-5)


def test_sliding_window_limits_receptive_field():
    """Changing a token outside every later query's window leaves those outputs unchanged."""
    torch.manual_seed(0)
    attn = Attention(16, AttentionConfig(n_heads=2, head_dim=8), sliding_window=3)
    x = torch.randn(1, 10, 16)
    y = x.clone()
    y[0, 2] += 1.0
    ox, oy = attn(x), attn(y)
    assert torch.allclose(ox[0, 5:], oy[0, 5:], atol=1e-6)  # queries >= 5 do not see position 2
    assert not torch.allclose(ox[0, 2:5], oy[0, 2:5], atol=1e-4)


def test_causality():
    torch.manual_seed(0)
    attn = Attention(16, AttentionConfig(n_heads=2, n_kv_heads=1, head_dim=8))
    x = torch.randn(1, 9, 16)
    y = x.clone()
    y[0, 6:] = torch.randn(3, 16)
    assert torch.allclose(attn(x)[0, :6], attn(y)[0, :6], atol=1e-6)


def test_flex_backend_matches_sdpa():
    torch.manual_seed(0)
    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16)
    sdpa = Attention(64, cfg, sliding_window=5)
    flex = Attention(64, AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, backend="flex"), sliding_window=5)
    flex.load_state_dict(sdpa.state_dict())
    x = torch.randn(2, 40, 64)
    with torch.no_grad():  # flex_attention has no CPU backward; the GPU test covers training
        torch.testing.assert_close(flex(x), sdpa(x), rtol=1e-4, atol=1e-5)


def test_auto_attention_takes_flex_only_where_its_gpu_kernel_exists():
    from moetron.core.layers.attention import AttentionBackend, use_flex

    def q(head_dim, dtype=torch.float32, device="meta"):
        return torch.empty(1, 2, 8, head_dim, dtype=dtype, device=device)

    # meta stands in for a GPU tensor: only the device type is read
    cuda_like = lambda t: type("T", (), {"device": torch.device("cuda"), "shape": t.shape, "dtype": t.dtype})()  # noqa: E731
    assert use_flex(AttentionBackend.auto, cuda_like(q(64)))
    assert use_flex(AttentionBackend.auto, cuda_like(q(16, torch.bfloat16)))
    assert not use_flex(AttentionBackend.auto, cuda_like(q(8)))  # Triton's tl.dot needs >= 16
    assert not use_flex(AttentionBackend.auto, cuda_like(q(64, torch.float64)))
    assert not use_flex(AttentionBackend.auto, q(64, device="cpu"))
    assert not use_flex(AttentionBackend.sdpa, cuda_like(q(64)))
    assert use_flex(AttentionBackend.flex, q(8, device="cpu"))  # asked for: the caller's choice
