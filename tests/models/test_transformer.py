"""Our forward pass against transformers' own: logits, and the RoPE frequencies."""

import pytest
import torch
import torch.nn.functional as F

from lazyrag.kernels.rope import rope_table
from lazyrag.models import rotate
from lazyrag.models.loading import transformer_from_hf


def causal_attention(positions):
    """Plain dense causal attention over one sequence, rotating q like the keys."""

    def attend(layer, q, k, v, model=None):
        q = rotate(q, rope_table(positions, attend.inv_freq))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return o.transpose(0, 1)

    return attend


def our_logits(model, ids):
    positions = torch.arange(len(ids))
    attend = causal_attention(positions)
    attend.inv_freq = model.inv_freq
    return model.logits(model(torch.tensor(ids), positions, attend))


@pytest.mark.slow
def test_smollm_logits_match_transformers(smollm):
    from transformers import AutoModelForCausalLM

    from lazyrag.models.loading import smollm2_dir

    ids = smollm.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = our_logits(smollm.model, ids)
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4
    assert ours[-1].argmax() == ref[-1].argmax()


def test_qwen3_style_logits_match_transformers():
    """q/k RMSNorm before RoPE, q/k/v bias off, tied embeddings, GQA 2:1."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hf = Qwen3ForCausalLM(cfg).eval()
    for name, p in hf.named_parameters():  # norms are ones at init: randomise them so they matter
        if "norm" in name:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    model = transformer_from_hf(cfg, hf.state_dict(), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 300, (23,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = our_logits(model, ids)
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4


def test_llama3_rope_scaling_frequencies_match_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from lazyrag.models.presets import preset_config
    from lazyrag.models.transformer import rope_frequencies

    cfg = preset_config("llama3-8b")
    ours, scale = rope_frequencies(cfg)
    ref = LlamaRotaryEmbedding(cfg).inv_freq
    assert torch.equal(ours, ref.float())
    assert scale == 1.0
