"""core/layers/embedding.py: the token embedding with the Triton weight gradient (model.triton_embedding_grad),
under TRITON_INTERPRET=1 on the CPU (a subprocess: the variable must be set before triton is imported)
and on the GPU.

Oracles: a sequential fp32 loop over the tokens in order (the kernel's own summation order, its
unrolled loads included: the same bits), float64 sums, and torch's own embedding backward (fp32 rounding apart); ids absent from the
batch, repeated ones, a D that no block divides, bf16 gradients; the module's forward equals
nn.Embedding's and its parameters keep their names.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetron.core.layers.embedding import Embedding
from tests.interpreted import run_interpreted, tiny_model_step


def _loop_reference(ids: torch.Tensor, grad: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Row by row, token after token, in fp32: what the kernel sums, in the order it does."""
    ids_T, grad_TD = ids.reshape(-1).cpu(), grad.reshape(ids.numel(), -1).cpu().float()
    out = torch.zeros(vocab, grad_TD.shape[1])
    for t in range(ids_T.numel()):
        out[ids_T[t]] += grad_TD[t]
    return out.to(dtype)


def check(device: str) -> None:
    from moetron.core.layers import embedding as E

    g = torch.Generator().manual_seed(0)
    for vocab, D, grad_dtype in ((50, 40, torch.float32), (37, 1500, torch.float32), (50, 96, torch.bfloat16)):
        ids = torch.randint(0, vocab // 2, (3, 21), generator=g)  # half the vocabulary absent, ids repeated
        ids[0, :5] = vocab - 1  # the last row, five times
        ids[1, 3:] = 3  # a run of 18 and more: past two of the kernel's unrolled loads of 8
        grad = torch.randn(3, 21, D, generator=g).to(grad_dtype)
        got = E.embedding_grad(ids.to(device), grad.to(device), vocab, torch.float32)
        assert got.shape == (vocab, D) and got.dtype == torch.float32
        assert torch.equal(got.cpu(), _loop_reference(ids, grad, vocab, torch.float32)), (vocab, D, grad_dtype)
        exact = torch.zeros(vocab, D, dtype=torch.float64).index_add_(0, ids.reshape(-1), grad.reshape(-1, D).double())
        torch.testing.assert_close(got.cpu().double(), exact, rtol=1e-6, atol=1e-6)
        assert not got[vocab // 2:-1].any()  # absent ids: zeros, written (the output starts uninitialized)
    # bf16 weights (FSDP2's gathered ones): the sums in fp32, rounded once.
    got = E.embedding_grad(ids.to(device), grad.to(device), 50, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.cpu(), _loop_reference(ids, grad, 50, torch.bfloat16))
    # The module: nn.Embedding's forward, the Triton weight gradient, repeatable to the bit.
    E.KERNEL = "triton"
    try:
        torch.manual_seed(0)
        emb = Embedding(50, 96, device=device, triton_grad=True)
        plain = torch.nn.Embedding(50, 96, device=device)
        plain.load_state_dict(emb.state_dict())
        ids = ids.to(device)
        grads = []
        for _ in range(2):
            emb.weight.grad = None
            out = emb(ids)
            assert torch.equal(out, plain(ids))
            (out * torch.arange(96, device=device)).sum().backward()
            grads.append(emb.weight.grad.clone())
        assert torch.equal(grads[0], grads[1])
        (plain(ids) * torch.arange(96, device=device)).sum().backward()
        torch.testing.assert_close(grads[0], plain.weight.grad, rtol=1e-6, atol=1e-5)
        # precision.embedding_weight_copy: rows gathered from the bf16 copy are the fp32 rows cast (the bf16
        # stream's), and the copy's gradient is the kernel's fp32 sums rounded once.
        check_copy(emb, ids, device)
        # A whole tiny model with model.triton_embedding_grad: every other gradient the same bits,
        # the embedding's to fp32 rounding.
        grads = {on: tiny_model_step(device, f"triton_embedding_grad={str(on).lower()}")[2] for on in (False, True)}
        assert grads[True].keys() == grads[False].keys()
        for n, g in grads[False].items():
            if n == "embed.weight":
                torch.testing.assert_close(grads[True][n], g, rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(grads[True][n], g), n
    finally:
        E.KERNEL = "auto"


def check_copy(emb: Embedding, ids: torch.Tensor, device: str) -> None:
    """``emb`` given a bf16 copy of its weight (Embedding.weight_copy) and the bf16 stream: its rows the
    bits of the fp32 rows cast, the copy's gradient the loop reference rounded to bf16, none on the weight;
    without grad the rows come from the copy too."""
    emb.weight.grad = None
    emb.weight_copy = emb.weight.detach().to(torch.bfloat16).requires_grad_(True)
    emb.out_dtype = torch.bfloat16
    try:
        out = emb(ids)
        assert out.dtype == torch.bfloat16 and torch.equal(out, F.embedding(ids, emb.weight).to(torch.bfloat16))
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
        out.backward(grad)
        assert emb.weight.grad is None and emb.weight_copy.grad.dtype == torch.bfloat16
        want = _loop_reference(ids, grad, emb.num_embeddings, torch.bfloat16)
        assert torch.equal(emb.weight_copy.grad.cpu(), want)
        with torch.no_grad():
            assert torch.equal(emb(ids), out.detach())
    finally:
        emb.weight_copy, emb.out_dtype = None, None


def test_embedding_copy_on_the_cpu():
    """The copy's gradient off Triton (torch's fp32 embedding backward, rounded once): against the loop
    reference rounded (their fp32 sums may differ in order: equal here, where each row sums at most a
    few exact bf16 values)."""
    torch.manual_seed(0)
    emb = Embedding(30, 16)
    ids = torch.randint(0, 10, (4, 7))
    check_copy(emb, ids, "cpu")


def test_embedding_grad_interpreted():
    run_interpreted("tests.core.test_embedding", "check('cpu')")


@pytest.mark.gpu
def test_embedding_grad_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check("cuda")
    # At the step's size: against torch's backward, and the same bits run to run.
    V, D, T = 100352, 4096, 16384
    ids = torch.randint(0, V, (T,), device="cuda")
    grad = torch.randn(T, D, device="cuda")
    from moetron.core.layers.embedding import embedding_grad

    a, b = embedding_grad(ids, grad, V, torch.float32), embedding_grad(ids, grad, V, torch.float32)
    assert torch.equal(a, b)
    w = torch.zeros(V, D, device="cuda", requires_grad=True)
    F.embedding(ids, w).backward(grad)
    torch.testing.assert_close(a, w.grad, rtol=1e-6, atol=1e-5)


def test_module_on_the_cpu_is_nn_embedding():
    """Off CUDA (no interpreter) the module is nn.Embedding throughout, gradient included; its
    parameter is ``weight``, and it is an nn.Embedding for the code that looks for one (no weight decay)."""
    torch.manual_seed(0)
    emb = Embedding(20, 8, triton_grad=True)
    plain = torch.nn.Embedding(20, 8)
    plain.load_state_dict(emb.state_dict())
    ids = torch.randint(0, 20, (4, 5))
    emb(ids).square().sum().backward()
    plain(ids).square().sum().backward()
    assert isinstance(emb, torch.nn.Embedding) and [n for n, _ in emb.named_parameters()] == ["weight"]
    assert torch.equal(emb.weight.grad, plain.weight.grad)
    assert "triton_grad=True" in repr(emb)
