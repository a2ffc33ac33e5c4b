"""tools/score.py: its mean loss equals the loss of the model run directly on the same windows; one
log-prob per predicted token; HF directories score as transformers does; bad input fails clearly."""

import math
import os
import re

import numpy as np
import pytest
import torch

import score as score_tool
from moetron.core.checkpoint import CheckpointError
from moetron.core.weights import save_weights
from moetron.data.tokenizer import DataError
from moetron.data.preprocess import tokenize_documents
from moetron.core.moe.config import MoEConfig, RouterConfig
from moetron.models import ModelConfig
from tests.hf_models import save_tiny_olmo3
from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCORE = os.path.join(ROOT, "tools", "score.py")
VOCAB = 300


class ToyTokenizer:
    """Bytes shifted past the specials; enough for tokenize_documents."""

    eos_id = 2
    vocab_size = VOCAB

    def encode(self, text):
        return [3 + b for b in text.encode()]


def small_cfg(moe: bool = False) -> ModelConfig:
    cfg = ModelConfig(d_model=64, n_layers=2, vocab_size=320, mlp_hidden=128, sliding_window=16)
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 4, 2
    if moe:
        cfg.moe = MoEConfig(num_experts=4, expert_hidden=32, router=RouterConfig(top_k=2), dense_layers=[0])
    return cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("score")
    torch.manual_seed(0)
    cfg = small_cfg(moe=True)
    model = cfg.build().eval()
    sd = model.state_dict()
    ckpt = str(tmp / "ckpt")
    save_weights(ckpt, {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}, lambda n: sd[n],
                 {"config": {"model": cfg.to_dict()}})
    docs = ["The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x + 1\n" * 4]
    prefix = str(tmp / "val")
    tokenize_documents(docs, prefix, ToyTokenizer(), progress=False)
    return cfg, model, ckpt, prefix, tmp


def direct_logprobs(model, tokens, seq_len):
    """Independent oracle: loop over windows one at a time, cross entropy per token."""
    out = []
    for start in range(0, len(tokens) - 1, seq_len):
        w = torch.as_tensor(np.asarray(tokens[start:start + seq_len + 1], dtype=np.int64))[None]
        with torch.no_grad():
            logits = model(w[:, :-1])[0]
        out.append(-torch.nn.functional.cross_entropy(logits, w[0, 1:], reduction="none"))
    return torch.cat(out).numpy()


@pytest.mark.parametrize("seq_len,batch,max_tokens", [(16, 3, None), (32, 2, 100), (7, 8, 57)])
def test_mean_loss_matches_direct(setup, capsys, seq_len, batch, max_tokens):
    cfg, model, ckpt, prefix, tmp = setup
    from moetron.data.preprocess import open_token_file

    tokens = np.asarray(open_token_file(prefix)[0], dtype=np.int64)[:max_tokens]
    out = str(tmp / f"lp_{seq_len}.npy")
    args = [ckpt, prefix + ".bin", "--seq-len", str(seq_len), "--batch-size", str(batch), "--output", out,
            "--device", "cpu"]
    if max_tokens:
        args += ["--max-tokens", str(max_tokens)]
    assert score_tool.main(args) == 0
    printed = capsys.readouterr().out
    lp = np.load(out)
    assert lp.dtype == np.float32 and lp.shape == (len(tokens) - 1,)
    want = direct_logprobs(model, tokens, seq_len)
    np.testing.assert_allclose(lp, want, rtol=0, atol=1e-5)
    loss = -want.astype(np.float64).mean()
    # The printed figures, parsed: the tool's float32 mean may round the last printed digit the
    # other way from this float64 one.
    printed_loss = float(re.search(r"mean loss: ([\d.]+)", printed).group(1))
    printed_ppl = float(re.search(r"perplexity: ([\d.]+)", printed).group(1))
    assert printed_loss == pytest.approx(loss, abs=2e-6)
    assert printed_ppl == pytest.approx(math.exp(loss), rel=1e-6)
    assert f"tokens: {len(tokens) - 1} predicted" in printed


def test_text_file_with_tokenizer(setup, capsys):
    cfg, model, ckpt, prefix, tmp = setup
    from moetron.data.tokenizer import SentencePieceTokenizer

    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of some text about foxes and dogs {i * 7}" for i in range(300)))
    tok = SentencePieceTokenizer.train([str(corpus)], str(tmp / "tok"), vocab_size=300)
    text = tmp / "doc.txt"
    text.write_text("some text about dogs and foxes, line 12")
    out = str(tmp / "text.npy")
    assert score_tool.main([ckpt, str(text), "--tokenizer", tok.path, "--seq-len", "8", "--output", out,
                            "--device", "cpu"]) == 0
    ids = tok.encode(text.read_text()) + [tok.eos_id]
    lp = np.load(out)
    assert lp.shape == (len(ids) - 1,)
    np.testing.assert_allclose(lp, direct_logprobs(model, ids, 8), rtol=0, atol=1e-5)


def test_text_file_with_hf_tokenizer(setup):
    """A tokenizer.json (tokenizers' own encode + EOS) scores like a sentencepiece model does."""
    tokenizers = pytest.importorskip("tokenizers")
    cfg, model, ckpt, prefix, tmp = setup
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"line {i} of some text about foxes and dogs" for i in range(300)], trainer)
    os.makedirs(tmp / "hf_tok", exist_ok=True)
    tok.save(str(tmp / "hf_tok" / "tokenizer.json"))
    text = tmp / "doc_hf.txt"
    text.write_text("some text about dogs and foxes, line 12")
    out = str(tmp / "text_hf.npy")
    assert score_tool.main([ckpt, str(text), "--tokenizer", str(tmp / "hf_tok"), "--seq-len", "8", "--output", out,
                            "--device", "cpu"]) == 0
    ids = tok.encode(text.read_text(), add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]
    np.testing.assert_allclose(np.load(out), direct_logprobs(model, ids, 8), rtol=0, atol=1e-5)


def run_cli(args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return run_python([SCORE, *args], env=env, cwd=ROOT)


def test_errors(setup, tmp_path):
    cfg, model, ckpt, prefix, tmp = setup
    # A token file whose ids exceed the model's vocab (320).
    class Wide(ToyTokenizer):
        vocab_size = 1000

        def encode(self, text):
            return [900] + super().encode(text)

    big = str(tmp_path / "big")
    tokenize_documents(["hello"], big, Wide(), progress=False)
    out = str(tmp_path / "x.npy")
    # One-line error and exit 2 from the script ...
    proc = run_cli([ckpt, big, "--output", out])
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
    assert "token id 900 but the model's vocab is 320" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    # ... which prints the message of these exceptions (checked in-process: faster).
    (tmp_path / "words.txt").write_text("hello")
    cases = [
        ([ckpt, str(tmp_path / "missing.bin")], "not found"),
        ([str(tmp_path / "nockpt"), prefix], "does not exist"),
        ([ckpt, str(tmp_path / "plain.txt")], "does not exist"),
        ([ckpt, str(tmp_path / "words.txt")], "--tokenizer"),
    ]
    for args, message in cases:
        with pytest.raises((CheckpointError, DataError), match=re.escape(message)):
            score_tool.main(args + ["--device", "cpu"])
    assert not os.path.exists(out)


def test_hf_dir_matches_transformers(tmp_path, capsys):
    pytest.importorskip("transformers")
    hf_dir = str(tmp_path / "hf")
    hf = save_tiny_olmo3(hf_dir, vocab_size=320)
    S, windows = 16, 5
    tokens = torch.randint(3, 320, (S * windows + 1,), generator=torch.Generator().manual_seed(1))
    prefix = str(tmp_path / "tok")

    class Fixed(ToyTokenizer):
        vocab_size = 320

        def encode(self, text):
            return tokens[:-1].tolist()

    tokenize_documents(["x"], prefix, Fixed(), progress=False)
    tokens[-1] = Fixed.eos_id
    assert score_tool.main([hf_dir, prefix, "--seq-len", str(S), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    with torch.no_grad():
        losses = [hf(input_ids=tokens[i * S:(i + 1) * S + 1][None], labels=tokens[i * S:(i + 1) * S + 1][None]).loss
                  for i in range(windows)]
    want = float(torch.stack(losses).mean())
    got = float(printed.split("mean loss: ")[1].split()[0])
    assert abs(got - want) < 1e-4, (got, want)
