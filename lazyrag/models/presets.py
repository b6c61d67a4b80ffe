"""`random:<preset>` models: real geometries with seeded random weights, so GPU speed
can be measured where real weights cannot travel, and a byte-level tokenizer that
needs no download."""

from __future__ import annotations

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    # small enough for CPU tests; head_dim 64 so the Triton kernels take it
    "tiny": dict(model_type="llama", vocab_size=384, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        rope_parameters={**LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
                       rms_norm_eps=1e-6),
}


def preset_config(name: str):
    from transformers import AutoConfig

    spec = dict(PRESETS[name])
    model_type = spec.pop("model_type")
    spec.setdefault("rms_norm_eps", 1e-5)
    spec.setdefault("max_position_embeddings", 131072)
    spec.setdefault("bos_token_id", 256)
    spec.setdefault("eos_token_id", 257)
    return AutoConfig.for_model(model_type, **spec)


def byte_tokenizer():
    """A byte-level tokenizer (ids 0-255 are bytes, 256 <s>, 257 </s>) with offsets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # byte-level BPE spells byte b as a printable character: itself when printable,
    # else chr(256 + n) for the n-th unprintable byte; token id = byte value
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    spelled, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    vocab = {ch: b for b, ch in spelled.items()}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
