"""optimizer.split_master: the fp32 master of each weight the model computes on through the
optimizer's bf16 copy held as that copy plus an int16 rest (core.adamw.split_fp32 / join_fp32, the
Triton kernel's store_split / join_split), the parameter's fp32 storage freed between steps.

Oracles: torch's own bf16 rounding (Tensor.to(torch.bfloat16)) for the copy; the fp32 bits for the
rest (exact but at a tie, where the master moves one ulp toward the copy); the unsplit optimizer
(adamw_update_ with its bf16 out, the foreach path) for every update; the same run without the switch
for the losses and weights; an uninterrupted run for resume.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from moetron.core.adamw import PrecisionAwareAdamW, join_fp32, split_fp32
from moetron.core.config import ConfigError
from moetron.core.optim import OptimizerConfig
from tests.interpreted import run_interpreted


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).to(torch.int64)


def _split(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi, lo = torch.empty_like(p, dtype=torch.bfloat16), torch.empty_like(p, dtype=torch.int16)
    split_fp32(p, hi, lo)
    return hi, lo


def _tricky(n: int = 1 << 16, seed: int = 0) -> torch.Tensor:
    """fp32 values over the whole range: normal draws at every scale, random bit patterns (NaNs
    dropped), exact bf16 ties of both parities and signs, zeros, infinities, the largest finite
    (which rounds to inf in bf16), subnormals."""
    g = torch.Generator().manual_seed(seed)
    scaled = torch.randn(n, generator=g) * torch.logspace(-38, 38, n)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45,
                            1e-40, 1.0, -1.0, 1.00390625])  # the last: 1 + 2^-8, a tie rounding down to 1
    x = torch.cat([scaled, bits.view(torch.float32), ties.view(torch.float32), special])
    return x[~torch.isnan(x)].contiguous()


def test_split_is_torchs_rounding_plus_an_exact_rest():
    p = _tricky()
    hi, lo = _split(p)
    assert torch.equal(hi.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))  # round to nearest even
    joined = join_fp32(hi, lo, torch.empty_like(p))
    tie = (_bits(p) & 0xFFFF) == 0x8000
    assert 60000 < int(tie.sum()) < 70000  # the injected ties, both ways
    assert torch.equal(joined[~tie].view(torch.int32), p[~tie].view(torch.int32))  # exact off the ties
    moved = _bits(joined[tie]) - _bits(p[tie])
    assert set(moved.tolist()) == {-1, 1}  # one ulp, toward the rounding the copy holds:
    assert torch.equal(joined.to(torch.bfloat16).view(torch.int16), hi.view(torch.int16))
    assert torch.equal(_split(joined)[1], lo) and int(lo.abs().max()) == 32767
    # |p - hi| <= half a bf16 ulp: the rest is what the fp32 master has below the copy
    assert (lo.to(torch.int64).abs() <= 2**15).all()


def check_kernel(device: str) -> None:
    """adamw_update_split_ against adamw_update_ on the joined master with its bf16 out, then split:
    the same bits (hi, lo, both moments) over sizes off BLOCK multiples, fp32 and bf16 moments and
    gradients, weight decay on and off, a deferred clip scale, several steps; the first at lr 0, so
    the masters it writes are its input, which holds ties (lo -32768) the kernel must move."""
    from moetron.core.adamw_triton import adamw_update_, adamw_update_split_

    g = torch.Generator().manual_seed(7)
    for n in (1, 1000, 3 * 1024 + 7):
        for state_dtype in (torch.float32, torch.bfloat16):
            for grad_dtype in (torch.float32, torch.bfloat16):
                p = torch.randn(n, generator=g)
                hi, lo = _split(p)
                lo[::5] = -32768  # a tie in five, both parities: no split makes one, the update must
                ref_p = join_fp32(hi, lo, torch.empty_like(p)).to(device)
                hi, lo = hi.to(device), lo.to(device)
                m = torch.zeros(n, dtype=state_dtype, device=device)
                v = torch.zeros(n, dtype=state_dtype, device=device)
                ref_m, ref_v, ref_copy = m.clone(), v.clone(), torch.empty(n, dtype=torch.bfloat16, device=device)
                for step in range(1, 4):
                    grad = (torch.randn(n, generator=g) * 10.0 ** (step - 3)).to(device, grad_dtype)
                    scale = torch.tensor(0.5, device=device) if step == 2 else None
                    hyper = dict(step=step, lr=1e-2 if step > 1 else 0.0, beta1=0.9, beta2=0.95, eps=1e-8,
                                 weight_decay=0.1 if step != 3 else 0.0, grad_scale=scale)
                    adamw_update_split_(hi, lo, grad, m, v, **hyper)
                    adamw_update_(ref_p, grad, ref_m, ref_v, out_bf16=ref_copy, **hyper)
                    ref_hi, ref_lo = _split(ref_p.cpu())
                    what = f"n {n}, {state_dtype} moments, {grad_dtype} grad, step {step}"
                    assert torch.equal(hi.cpu().view(torch.int16), ref_hi.view(torch.int16)), what
                    assert torch.equal(hi.cpu().view(torch.int16), ref_copy.cpu().view(torch.int16)), what
                    assert torch.equal(lo.cpu(), ref_lo), what
                    assert torch.equal(m, ref_m) and torch.equal(v, ref_v), what
                    ref_p = join_fp32(ref_hi, ref_lo, torch.empty_like(p)).to(device)  # the kept master


def _optimizers(kernel: str, device: str):
    """Two PrecisionAwareAdamW over the same weights (two decay groups, one weight without a copy,
    one that skips steps), plain copies and split masters."""
    runs = []
    for split in (False, True):
        gen = torch.Generator().manual_seed(4)
        ps = [nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((64, 96), (3001,), (7, 5), (33,))]
        opt = PrecisionAwareAdamW([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), kernel=kernel, split_master=split,
                                  state_dtype=torch.bfloat16)
        copies = {p: p.detach().to(torch.bfloat16) for p in ps[:3]}
        opt.add_compute_copies(copies, replaces=True)
        runs.append((ps, copies, opt))
    return runs


def check_optimizer(kernel: str, device: str) -> None:
    """Through the optimizer: split masters against plain copies, 6 steps of the same gradients (a
    deferred clip scale on some): the masters equal but at the few elements that met a tie
    (_assert_within_ties), the copies the masters' rounding, the uncopied weight and the moments as the plain run's."""
    (ps0, copies0, opt0), (ps1, copies1, opt1) = _optimizers(kernel, device)
    assert [id(p) for p in opt1.split_parameters()] == [id(p) for p in ps1[:3]]
    assert all(p.untyped_storage().nbytes() == 0 for p in ps1[:3]) and ps1[3].untyped_storage().nbytes()
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        for i, (p0, p1) in enumerate(zip(ps0, ps1)):
            g = None if (i == 1 and step % 3 == 2) else torch.randn(p0.shape, generator=gen).to(device)
            p0.grad, p1.grad = g, None if g is None else g.clone()
        for opt in (opt0, opt1):
            if step % 2:
                opt.defer_grad_scale(torch.tensor(0.25, device=device))
            opt.step()
    assert all(p.untyped_storage().nbytes() == 0 for p in ps1[:3])
    with opt1.masters_materialized():
        masters = [p.detach().clone() for p in ps1]
    for i, (p0, m1) in enumerate(zip(ps0, masters)):
        assert_within_ties(p0, m1, f"param {i}")
        if i < 3:
            assert torch.equal(copies1[ps1[i]], m1.to(torch.bfloat16)), f"param {i}"
        else:
            assert torch.equal(p0, ps1[i])
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = opt0.state[p0][key].float(), opt1.state[ps1[i]][key].float()
            assert (a - b).abs().max() <= 2**-7 * a.abs().max(), f"{key} {i}"


def check_interpreted() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_kernel("cpu")
    check_optimizer("triton", "cpu")


def test_split_kernel_interpreted():
    run_interpreted("tests.core.test_split_master", "check_interpreted()")


def test_split_optimizer_foreach():
    check_optimizer("foreach", "cpu")


@pytest.mark.gpu
def test_split_master_on_gpu():
    check_kernel("cuda")
    check_optimizer("triton", "cuda")


def test_materialized_masters_hold_what_is_set_there():
    """masters_materialized: inside, the parameters hold the masters (and nest); a value set there
    (a load) is split again on leaving, its copy rewritten; refresh_compute_copies outside refuses."""
    (_, _, _), (ps, copies, opt) = _optimizers("foreach", "cpu")
    before = [join_fp32(copies[p], opt._lo[id(p)], torch.empty_like(p)) for p in ps[:3]]
    with opt.masters_materialized():
        with opt.masters_materialized():
            assert all(torch.equal(p, b) for p, b in zip(ps, before))
        assert ps[0].untyped_storage().nbytes() == 4 * ps[0].numel()
        with torch.no_grad():
            ps[0].fill_(1.0 + 2**-9)  # a tie: the master kept moves one ulp toward 1.0
            ps[1].mul_(3.0)
        opt.refresh_compute_copies()
    assert ps[0].untyped_storage().nbytes() == 0
    assert torch.equal(copies[ps[0]], torch.full_like(copies[ps[0]], 1.0))
    assert torch.equal(copies[ps[1]], (before[1] * 3.0).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="inside that block"):
        opt.refresh_compute_copies()
    with pytest.raises(ValueError, match="plain contiguous fp32"):
        q = nn.Parameter(torch.randn(4, 6).t())
        PrecisionAwareAdamW([q], split_master=True, state_dtype=torch.bfloat16).add_compute_copies(
            {q: torch.empty(q.shape, dtype=torch.bfloat16)}, replaces=True)


# ---- in training ------------------------------------------------------------------------------

def _trainer(split: bool, experts: bool = True, compile: bool = False, kernel: str = "torch"):
    """tests/core/test_dense_copies.py's tiny MoE with every copy on (the dense linears', the head's,
    the experts' with their bf16 gradients), optimizer.split_master on or off."""
    from step_builder import RandomTokens, build_trainer  # tools/ (tests/conftest.py puts it on the path)

    from moetron.core.memory import MemoryConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.models import ModelConfig

    cfg = ModelConfig.preset("tiny-moe")
    cfg.apply_overrides(["n_layers=2", "moe.experts_backend=grouped_mm"])
    data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
    precision = PrecisionConfig(recipe="bf16", dense_weight_copies=True, head_weight_copy=True,
                                **(dict(expert_weight_copies="optimizer", expert_grads_bf16=True) if experts else {}))
    trainer = build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32, compile=compile,
                            precision=precision,
                            optimizer=OptimizerConfig(state_dtype="bf16", impl=kernel, split_master=split))
    return trainer, data


def _weights(trainer) -> dict[str, torch.Tensor]:
    with trainer.masters_materialized():
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_within_ties(a: dict, b: dict) -> None:
    """The weights of a split and an unsplit run: equal but at the few elements a tie moved (at most
    one in 1,000; by an ulp there, a few where a later update cancels most of the weight: within 2^-20
    of the tensor's largest)."""
    assert a.keys() == b.keys()
    for k in a:
        assert_within_ties(a[k], b[k], k)


def assert_within_ties(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != torch.float32:
        assert torch.equal(a, b), what
        return
    assert ((a - b).abs() <= 2**-20 * a.abs().max()).all(), what
    assert float((a != b).float().mean()) < 1e-3, what


def test_split_master_trains_as_the_fp32_masters():
    """Three steps with and without the switch: the same losses and gradient norms (the copies the
    model computes with are the same bf16 roundings), the weights equal but at ties; between steps the
    split weights hold no fp32 storage (4 bytes an element freed, 2 of rest kept)."""
    runs = {}
    for split in (False, True):
        trainer, data = _trainer(split)
        history = [tuple(t.item() for t in trainer.train_step(data.next_batch())) for _ in range(3)]
        runs[split] = history, _weights(trainer)
    from moetron.core.layers.linear import Linear
    from moetron.core.moe.experts import GroupedExperts

    split_params = trainer.optimizer.split_parameters()
    copies = trainer.optimizer.compute_copies
    modules = list(trainer.model.modules())
    assert {id(p) for p in split_params} == {id(m.weight) for m in modules if isinstance(m, Linear)} | {
        id(w) for m in modules if isinstance(m, GroupedExperts) for w in (m.w_gate_up, m.w_down)}
    assert all(p.untyped_storage().nbytes() == 0 for p in split_params)
    assert sum(p.numel() for p in split_params) > 0.75 * sum(p.numel() for p in trainer.model.parameters())
    assert runs[True][0] == runs[False][0] and runs[False][0][2][0] != runs[False][0][0][0]
    _assert_within_ties(runs[True][1], runs[False][1])
    masters = runs[True][1]
    by_id = {id(p): n for n, p in trainer.model.named_parameters()}
    assert all(torch.equal(copies[p], masters[by_id[id(p)]].to(torch.bfloat16)) for p in split_params)


def test_split_master_compiled():
    """Under torch.compile (inductor on the CPU) the freed parameters are never read: two steps on
    one batch give the unsplit compiled run's losses, through the same graphs (their guarded stand-in
    class, core.split_param, costs no graph break and no recompile)."""
    from torch._dynamo.utils import counters

    runs, stats = {}, {}
    for split in (False, True):
        torch._dynamo.reset()
        counters.clear()
        trainer, data = _trainer(split, experts=False, compile=True)
        batch = data.next_batch()
        runs[split] = [trainer.train_step(batch)[0].item() for _ in range(3)]
        stats[split] = dict(counters["stats"]), dict(counters["graph_break"])
    assert runs[True] == runs[False] and runs[False][1] < runs[False][0]
    assert stats[True] == stats[False] and not stats[True][1] and stats[True][0]["unique_graphs"] > 0


def test_a_split_parameter_refuses_reads_between_steps():
    """Between steps a split parameter holds no storage: what would read its values (a clone, arithmetic, the
    model's state_dict, .data, a deepcopy, a save) raises one error naming masters_materialized instead of reading
    freed memory (a segfault on the CPU before); what reads its metadata (shape, dtype, device, its gradient,
    isinstance, a dict keyed on it) works. Inside masters_materialized it is a plain Parameter holding the master
    (its copy's rounding); after the block it refuses again, and training goes on."""
    import copy
    import io

    from moetron.core.split_param import SplitMasterError

    trainer, data = _trainer(True)
    for _ in range(2):
        trainer.train_step(data.next_batch())
    p = trainer.optimizer.split_parameters()[0]
    c = trainer.optimizer.compute_copies[p]
    assert isinstance(p, nn.Parameter) and p.requires_grad and p.grad is None
    assert (p.shape, p.dtype, p.device, p.numel(), p.dim()) == (c.shape, torch.float32, c.device, c.numel(), c.dim())
    assert trainer.optimizer.state[p]["exp_avg"].shape == p.shape and {p: 1}[p] == 1
    assert "masters_materialized" in repr(p)
    reads = {"clone": lambda: p.detach().clone(), "add": lambda: p + 1, "equal": lambda: torch.equal(p, p),
             "data": lambda: p.data, "state_dict": lambda: trainer.model.state_dict(),
             "deepcopy": lambda: copy.deepcopy(trainer.model), "save": lambda: torch.save(p, io.BytesIO()),
             "to": lambda: p.to(torch.bfloat16), "foreach": lambda: torch._foreach_add([p], 1.0)}
    for what, read in reads.items():
        with pytest.raises(SplitMasterError, match=r"masters_materialized\(\)"):
            read()
    with trainer.masters_materialized():
        assert type(p) is nn.Parameter
        master = p.detach().clone()
        assert torch.isfinite(master).all() and torch.equal(master.to(torch.bfloat16), c)
        assert torch.equal(trainer.model.state_dict()[next(n for n, q in trainer.model.named_parameters()
                                                           if q is p)], master)
    with pytest.raises(SplitMasterError):
        p.sum()
    loss = trainer.train_step(data.next_batch())[0]
    assert torch.isfinite(loss)


def test_split_master_saves_the_masters_and_resumes_exactly(tmp_path):
    """A split run saves its fp32 masters (the checkpoint is the unsplit format: an unsplit run loads
    it, its weights those masters); resumed split, its next steps equal the uninterrupted run's bit for
    bit; the checkpoint's finiteness check and save leave the masters split again."""
    from moetron.core.checkpoint import CheckpointConfig, Checkpointer

    first, data = _trainer(True)
    first.checkpointer = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    for _ in range(2):
        first.train_step(data.next_batch())
    first.step = 2
    with first.masters_materialized():
        first._check_finite(before_save=True)
        path = first.save()
    assert all(p.untyped_storage().nbytes() == 0 for p in first.optimizer.split_parameters())
    saved = _weights(first)
    batches = [data.next_batch() for _ in range(2)]
    resumed = {}
    for split in (False, True):
        resumed[split], _ = _trainer(split)
        resumed[split].checkpointer = first.checkpointer
        resumed[split].load(path)
        assert all(torch.equal(saved[k], v) for k, v in _weights(resumed[split]).items())
    losses = [resumed[True].train_step(b)[0].item() for b in batches]
    assert losses == [first.train_step(b)[0].item() for b in batches]
    after = _weights(first)
    assert all(torch.equal(after[k], v) for k, v in _weights(resumed[True]).items())


def test_init_weights_rewrites_the_copies(tmp_path):
    """checkpoint.init_from (Trainer.init_weights): the copies, split or not, hold the loaded weights,
    so the first step computes with them: it equals the first step of a run resumed from the same
    checkpoint."""
    from moetron.core.checkpoint import CheckpointConfig, Checkpointer

    source, data = _trainer(False)
    source.checkpointer = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ckpt")))
    for _ in range(2):
        source.train_step(data.next_batch())
    source.step = 2
    path = source.save()
    batch = data.next_batch()

    def loss(trainer) -> float:
        with trainer.precision.autocast(), torch.no_grad():
            return trainer.model(batch[:, :-1], batch[:, 1:]).item()

    want = loss(source)
    for split in (False, True):
        fresh, _ = _trainer(split)
        fresh.checkpointer = source.checkpointer
        assert loss(fresh) != want  # its own initial weights
        fresh.init_weights(path)
        copies = fresh.optimizer.compute_copies
        with fresh.masters_materialized():
            assert all(torch.equal(c, p.detach().to(torch.bfloat16)) for p, c in copies.items())
        assert loss(fresh) == want


def test_split_master_refusals():
    with pytest.raises(ConfigError, match="this run has none"):
        _no_copies_trainer()
    with pytest.raises(ConfigError, match="split_master=true is held by this package's AdamW"):
        OptimizerConfig(split_master=True).build(nn.Linear(4, 4))  # fp32 state on the CPU: torch's AdamW
    trainer, _ = _trainer(True, experts=False)
    (head,) = [m for m in trainer.model.modules() if type(m).__name__ == "LMHead"]
    with pytest.raises(RuntimeError, match="masters_materialized"):
        head(torch.zeros(1, 2, head.weight.shape[1]))
    with trainer.masters_materialized():
        assert head(torch.zeros(1, 2, head.weight.shape[1])).shape == (1, 2, head.weight.shape[0])


def _no_copies_trainer():
    from step_builder import RandomTokens, build_trainer

    from moetron.core.memory import MemoryConfig
    from moetron.core.precision import PrecisionConfig
    from moetron.models import ModelConfig

    cfg = ModelConfig.preset("tiny-moe")
    data = RandomTokens(cfg.vocab_size, 2, 32, torch.device("cpu"))
    return build_trainer(cfg, MemoryConfig(), data, torch.device("cpu"), seq_len=32,
                         precision=PrecisionConfig(recipe="bf16"),
                         optimizer=OptimizerConfig(state_dtype="bf16", impl="torch", split_master=True))


def test_step_parts_steps_split_masters_as_step():
    """optimizer.overlap's step_parts with split masters: the same copies, rests and moments as step(),
    bit for bit, the parts in reverse order."""
    results = []
    for parts in (False, True):
        (_, _, _), (ps, copies, opt) = _optimizers("foreach", "cpu")
        first = copies[ps[0]].clone()
        gen = torch.Generator().manual_seed(6)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.defer_grad_scale(torch.tensor(0.5))
            if parts:
                opt.step_parts([[p] for p in ps][::-1], lambda i: None)
            else:
                opt.step()
        results.append([copies[p].clone() for p in ps[:3]] + [opt._lo[id(p)].clone() for p in ps[:3]]
                       + [opt.state[p][k].clone() for p in ps for k in ("exp_avg", "exp_avg_sq")] + [ps[3].detach().clone()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], first)  # the steps moved the weights


def test_split_master_auto_follows_the_copies(capsys):
    """optimizer.split_master's auto (the default since session 52, its freed parameters guarded: core.split_param):
    on where the weight copies' auto is on (bf16 on one CUDA GPU, one micro-batch a step, this package's AdamW) and
    the run holds a copy it splits; off on the CPU, with several micro-batches or ranks, with every copy turned
    off, or with only the head's copy and the loss not fused; a value given is kept; the command line spells it
    auto. The planner resolves it by the same two rules."""
    from moetron.core.precision import PrecisionConfig
    from moetron.core.precision.config import copies_off_overrides
    from moetron.models import ModelConfig
    from moetron.parallel.config import ParallelConfig
    from moetron.run.build import resolve_auto
    from moetron.run.planner.hardware import GPUS
    from moetron.run.planner.switches import switches

    assert OptimizerConfig().split_master is None  # auto
    assert OptimizerConfig().apply_overrides(["--split_master=true", "--split_master=auto"]).split_master is None
    copies_off = PrecisionConfig().apply_overrides([o.replace("--precision.", "--") for o in copies_off_overrides()])
    head_only = PrecisionConfig(expert_weight_copies="none", dense_weight_copies=False)

    def split(device="cuda", micro=None, precision=None, fused_loss=True, one_rank=True, **optimizer):
        optimizer = {"split_master": None, **optimizer}  # auto
        return resolve_auto(precision or PrecisionConfig(), OptimizerConfig(**optimizer), device, one_rank=one_rank,
                            local_batch=4, micro_batch=micro, fused_loss=fused_loss)[1].split_master

    assert split() is True and split(precision=head_only) is True
    assert resolve_auto(PrecisionConfig(), OptimizerConfig(), "cuda", one_rank=True, local_batch=4, micro_batch=None,
                        fused_loss=True)[1].split_master is True  # the default: auto
    for case in (dict(device="cpu"), dict(micro=2), dict(one_rank=False), dict(impl="torch"), dict(overlap=True),
                 dict(precision=copies_off), dict(precision=head_only, fused_loss=False), dict(split_master=False)):
        assert split(**case) is False, case
    assert split(device="cpu", split_master=True) is True  # given: kept (the trainer refuses it without copies)
    # the build's start-up line names what auto turned on, and how to undo each
    lines = {}
    for name, case in (("both", {}), ("copies", dict(split_master=False)),
                       ("split", dict(precision=PrecisionConfig(dense_weight_copies=True, expert_weight_copies="none",
                                                                expert_grads_bf16=False, head_weight_copy=False))),
                       ("none", dict(precision=copies_off)), ("cpu", dict(device="cpu"))):
        capsys.readouterr()
        split(**case)
        lines[name] = capsys.readouterr().out
    assert "weight copies" in lines["both"] and "split_master" in lines["both"]
    assert "--precision.dense_weight_copies=false" in lines["both"] and "--optimizer.split_master=false" in lines["both"]
    assert "weight copies" in lines["copies"] and "split_master" not in lines["copies"]
    assert "weight copies" not in lines["split"] and "--optimizer.split_master=false" in lines["split"]
    assert lines["none"] == lines["cpu"] == ""

    model = ModelConfig.preset("tiny-moe")
    for layout, ranks, precision, on in ((ParallelConfig(), 1, PrecisionConfig(), True),
                                         (ParallelConfig(dp_shard=2), 2, PrecisionConfig(), False),
                                         (ParallelConfig(), 1, copies_off, False)):
        sw = switches(model, layout, precision, OptimizerConfig(split_master=None), GPUS["h100"], compiled=False,
                      ranks=ranks)
        assert sw.split_master is on, (layout, ranks)
    assert switches(model, ParallelConfig(), PrecisionConfig(), OptimizerConfig(), GPUS["h100"], compiled=False).split_master
    assert not switches(model, ParallelConfig(), PrecisionConfig(), OptimizerConfig(split_master=False), GPUS["h100"],
                        compiled=False).split_master


def test_fit_returns_the_fp32_masters_and_trains_on():
    """After fit() the split parameters hold their fp32 masters again, readable without masters_materialized (a
    model used after training: an export, an evaluation), equal to an uninterrupted run's; the next fit() splits
    them again (their storage freed) and trains on bit for bit as that run; a value set in a parameter after fit()
    is what the next step trains from (its copy rewritten)."""
    runs = {}
    for name, stops in (("twice", (2, 4)), ("once", (4,))):
        trainer, _ = _trainer(True)
        trainer.cfg.eval_batches, trainer.cfg.log_interval = 0, 1  # random tokens: no held-out set
        for stop in stops:
            trainer.cfg.steps = stop
            trainer.fit()
            split = trainer.optimizer.split_parameters()
            assert split and all(p.untyped_storage().nbytes() == 4 * p.numel() for p in split)
            if stop == 2:
                after_two = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}  # no block needed
        runs[name] = trainer
    reference, _ = _trainer(True)
    data = reference.data
    for _ in range(2):
        reference.train_step(data.next_batch())
    assert all(torch.equal(after_two[k], v) for k, v in _weights(reference).items())
    losses = [[(r["step"], r["loss"]) for r in runs[name].history if "loss" in r] for name in ("twice", "once")]
    assert losses[0] == losses[1] and [step for step, _ in losses[0]] == [1, 2, 3, 4]
    once = {k: v.detach().clone() for k, v in runs["once"].model.state_dict().items()}
    assert all(torch.equal(once[k], v) for k, v in runs["twice"].model.state_dict().items())

    trainer = runs["twice"]
    p = trainer.optimizer.split_parameters()[0]
    with torch.no_grad():
        p.zero_()
    trainer._release_masters()  # what the next step does first
    assert p.untyped_storage().nbytes() == 0 and not trainer.optimizer.compute_copies[p].any()


def test_masters_that_cannot_be_joined_stay_split(monkeypatch, capsys):
    """Joining the masters after fit() running out of memory part way (the first joined, the second not) leaves
    every master split and none held twice (the joined one's storage freed again), says how to read them, and
    the next step trains as a trainer that never tried: the same loss bit for bit."""
    import moetron.core.adamw as adamw

    trainer, data = _trainer(True)
    reference, ref_data = _trainer(True)
    for _ in range(2):
        trainer.train_step(data.next_batch())
        reference.train_step(ref_data.next_batch())
    real, calls = adamw.join_fp32, []

    def join(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args)

    monkeypatch.setattr(adamw, "join_fp32", join)
    trainer._hold_masters()
    monkeypatch.setattr(adamw, "join_fp32", real)
    assert len(calls) == 2 and trainer._masters_held is None
    assert all(p.untyped_storage().nbytes() == 0 for p in trainer.optimizer.split_parameters())
    assert "masters_materialized" in capsys.readouterr().out
    assert trainer.train_step(data.next_batch())[0].item() == reference.train_step(ref_data.next_batch())[0].item()
