"""dimattn.transformers against the real Hugging Face transformers (pinned by
scripts/bootstrap): tiny models built from configs (no weights downloaded) of Llama
(GQA), Mistral (sliding window), Qwen2 (a window on some layers), Gemma 2 (soft-capping,
alternating windows), Gemma 3 and GPT-OSS (sinks, set to non-zero values): their logits
equal to transformers' eager attention with left and right padding and without, greedy
generate() tokens equal with a DynamicCache and a StaticCache, a training step's
gradients equal, and every call ran dimattn's fused kernel (none fell back)."""
import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig,
                          GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

import dimattn.transformers as dt

dt.register(track_kernels=True)

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def gpt_oss():
    m = GptOssForCausalLM(GptOssConfig(**{**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2,
                                          "head_dim": 16, "sliding_window": 4,
                                          "layer_types": ["sliding_attention", "full_attention"]}))
    with torch.no_grad():
        for layer in m.model.layers:  # sinks start at 0: make them act
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return m


MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=4)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4,
                                                   max_window_layers=1)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**SMALL, head_dim=16, sliding_window=4,
                                                     attn_logit_softcapping=3.0, query_pre_attn_scalar=16)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=4,
                                                         layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": gpt_oss,
}
B, T = 2, 11


def model(name):
    torch.manual_seed(0)
    return MODELS[name]().float()


def inputs(padding):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if padding == "left":
        mask[1, :4] = 0
    if padding == "right":
        mask[1, -4:] = 0
    return ids, mask


def with_impl(m, impl):
    m.set_attn_implementation(impl)
    return m


def routed_all_fused():
    s = dt.stats()
    assert s["fallback"] == 0 and s["routed"] > 0 and set(s["kernels"]) == {"cpu_flash"}, s


@pytest.fixture(autouse=True)
def _stats():
    dt.reset_stats()
    yield


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_eager(name, padding):
    m = model(name).eval()
    ids, mask = inputs(padding)
    with torch.no_grad():
        want = with_impl(m, "eager")(ids, attention_mask=mask).logits
        got = with_impl(m, dt.NAME)(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert torch.isfinite(got).all()
    assert (got - want)[valid].abs().max() <= 1e-4
    routed_all_fused()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_equals_eager(name, cache):
    m = model(name).eval()
    ids, mask = inputs("left")
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = with_impl(m, "eager").generate(ids, **kw)
    got = with_impl(m, dt.NAME).generate(ids, **kw)
    assert torch.equal(got, want)
    routed_all_fused()


@pytest.mark.parametrize("name", MODELS)
def test_training_step_gradients_equal_eager(name):
    m = model(name).train()
    ids, mask = inputs("left")
    # A padded row's output is undefined (eager: the mean over every key; dimattn: 0):
    # no label is predicted from one (the first real token's label neither).
    labels = ids.masked_fill((mask == 0) | (mask.roll(1, dims=1) == 0), -100)
    grads = {}
    for impl in ("eager", dt.NAME):
        m.zero_grad()
        with_impl(m, impl)(ids, attention_mask=mask, labels=labels).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads[dt.NAME].keys()
    for n, g in grads["eager"].items():
        assert (grads[dt.NAME][n] - g).abs().max() <= 1e-4 * max(1.0, float(g.abs().max())), n
    routed_all_fused()


def test_output_attentions_gives_the_reference_weights():
    m = with_impl(model("llama").eval(), dt.NAME)
    ids, mask = inputs("left")
    with torch.no_grad():
        out = m(ids, attention_mask=mask, output_attentions=True)
        eager = with_impl(m, "eager")(ids, attention_mask=mask, output_attentions=True)
    for a, b in zip(out.attentions, eager.attentions):
        assert a.shape == b.shape == (B, 4, T, T)
        rows = mask.bool()[:, None, :, None].expand_as(a)
        assert (a - b)[rows].abs().max() <= 1e-5
    assert set(dt.stats()["kernels"]) == {"reference"}
