"""Tiny random Hugging Face checkpoints saved by transformers itself (the oracle in interop tests)."""

import torch


def save_tiny_olmo3(path: str, vocab_size: int = 512):
    """A 2-layer Olmo3ForCausalLM (one sliding, one full layer) saved with save_pretrained; returns it in eval mode."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Olmo3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=16, rope_theta=10_000.0,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=1, eos_token_id=2, bos_token_id=None,
    )
    model = transformers.Olmo3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model
