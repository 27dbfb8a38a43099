#!/usr/bin/env python3
"""Hugging Face transformers models with attn_implementation="dimattn" against the
implementation a user has today: "sdpa", or "eager" where transformers refuses sdpa
(Gemma 2's soft-capping, GPT-OSS's sinks); whole model and the attention function
alone, in one process, interleaved.

    PYTHONPATH=python DIMATTN_TORCH_OPS=build/python/libdimattn_torch_ops.so \\
        ~/.cache/dimattn/venv/bin/python bench/transformers_models.py

Models: random tiny configs (no weights downloaded) of Llama (GQA), Gemma 2 and GPT-OSS:
--layers layers, hidden --hidden, 16 query / 4 kv heads (head dim hidden / 16),
sliding windows of 4096 on every other layer (Gemma 2, GPT-OSS). Per model, dtype and
T: prefill (one forward over B 1 x T tokens, no grad), a training step (forward with
labels, backward) and, at --generate-after, greedy generate of --new-tokens tokens;
medians of interleaved rounds. The attention function alone: one call on the layer's
shapes (q [1, 16, T, D], k, v [1, 4, T, D], causal), dimattn's against sdpa's or eager's
function, forward only. Own cost: dimattn.transformers' function against calling
dimattn.dot_attention directly on the same tensors at T = --own-cost-at. Every row's
outputs are checked against the baseline's first.
"""
import argparse
import os
import time

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaConfig,
                          LlamaForCausalLM)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

import dimattn as da
import dimattn.transformers as dt
from bench_timing import cpu_info, interleaved

dt.register()


def configs(args):
    common = dict(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=args.hidden // 16, max_position_embeddings=16384)
    windows = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)]
    return {
        "llama": (lambda: LlamaForCausalLM(LlamaConfig(**common)), "sdpa", sdpa_attention_forward),
        "gemma2": (lambda: Gemma2ForCausalLM(Gemma2Config(**common, sliding_window=4096, attn_logit_softcapping=50.0,
                                                          query_pre_attn_scalar=args.hidden // 16)),
                   "eager", gemma2_eager),
        "gpt_oss": (lambda: GptOssForCausalLM(GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                           sliding_window=4096, layer_types=windows)),
                    "eager", gpt_oss_eager),
    }


def model_rows(name, make, baseline, dtype, T, args):
    torch.manual_seed(0)
    m = make().to(dtype)
    if name == "gpt_oss":
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.normal_()
    ids = torch.randint(0, 1024, (1, T))

    def prefill(impl):
        def run():
            m.set_attn_implementation(impl)
            with torch.no_grad():
                return m(ids).logits
        return run

    def train(impl):
        def run():
            m.set_attn_implementation(impl)
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()
        return run

    ref, ours = prefill(baseline)(), prefill(dt.NAME)()
    # Per position: GPT-OSS routes each token to its top experts, and a difference of
    # 1e-6 in the attention can flip a choice (one position at T = 8192 in float32,
    # then the positions attending it); the other models agree at every position.
    err = (ref.float() - ours.float()).abs().amax(-1)[0]
    close = float((err < (0.5 if dtype == torch.bfloat16 else 1e-2)).float().mean())
    assert close >= (0.9 if name == "gpt_oss" else 1.0), f"{name}: logits differ at {1 - close:.1%} of the positions"
    rounds = 1 if T >= 8192 else args.rounds
    base_p, ours_p = interleaved([prefill(baseline), prefill(dt.NAME)], rounds)
    base_t, ours_t = interleaved([train(baseline), train(dt.NAME)], rounds) if T <= args.train_up_to else (None, None)
    return base_p, ours_p, base_t, ours_t


def generate_row(name, make, baseline, dtype, args):
    torch.manual_seed(0)
    m = make().to(dtype).eval()
    ids = torch.randint(0, 1024, (1, args.generate_after))

    def gen(impl):
        def run():
            m.set_attn_implementation(impl)
            return m.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, min_new_tokens=args.new_tokens)
        return run

    a, b = gen(baseline)(), gen(dt.NAME)()
    same = bool(torch.equal(a, b))
    base, ours = interleaved([gen(baseline), gen(dt.NAME)], max(1, args.rounds // 2))
    return base, ours, same


def attention_alone(baseline_fn, softcap, sinks, dtype, T, D, args):
    class Module(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True
        training = False
        head_dim = D

    mod = Module()
    if sinks is not None:
        mod.sinks = sinks.to(dtype)  # GPT-OSS's eager function reads the module's
    q = torch.randn(1, 16, T, D, dtype=dtype)
    k, v = torch.randn(1, 4, T, D, dtype=dtype), torch.randn(1, 4, T, D, dtype=dtype)
    mask = None if baseline_fn is sdpa_attention_forward else \
        torch.triu(torch.full((T, T), torch.finfo(dtype).min, dtype=dtype), 1)[None, None]
    kw = {}
    if softcap:
        kw["softcap"] = softcap
    if sinks is not None:
        kw["s_aux"] = sinks.to(dtype)
    with torch.no_grad():
        a = baseline_fn(mod, q, k, v, mask, scaling=D ** -0.5, **kw)[0]
        b = dt.attention_forward(mod, q, k, v, None, scaling=D ** -0.5, **kw)[0]
        err = float((a.float() - b.float()).abs().max())
        assert err < (5e-2 if dtype == torch.bfloat16 else 1e-4), f"attention alone differs by {err}"
        return interleaved([lambda: baseline_fn(mod, q, k, v, mask, scaling=D ** -0.5, **kw),
                            lambda: dt.attention_forward(mod, q, k, v, None, scaling=D ** -0.5, **kw)],
                           args.rounds)


def own_cost(T, args):
    class Module(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True
        training = False

    mod = Module()
    D = args.hidden // 16
    q, k, v = torch.randn(1, 16, T, D), torch.randn(1, 4, T, D), torch.randn(1, 4, T, D)
    b, h, g, t, s, f = (da.Dim("b", 1), da.Dim("h", 4), da.Dim("g", 4), da.Dim("t", T), da.Dim("s", T),
                        da.Dim("f", D))
    qn = da.Tensor(q.unflatten(1, (4, 4)), [b, h, g, t, f])
    kn, vn = da.Tensor(k, [b, h, s, f]), da.Tensor(v, [b, h, s, f])

    def direct():  # with the output in transformers' [B, T, Hq, D] layout, as the function returns it
        out = da.dot_attention(qn, kn, vn, key_dim=f, axis=s, causal_query_spatial_dim=t, causal_offset=0)
        return out.raw_in([b, t, h, g, f]).flatten(2, 3)

    def through():
        return dt.attention_forward(mod, q, k, v, None)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return interleaved([direct, through], args.own_cost_rounds, clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama", "gemma2", "gpt_oss"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--train-up-to", type=int, default=2048, help="training steps up to this T")
    ap.add_argument("--generate-after", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--own-cost-at", type=int, default=128)
    ap.add_argument("--own-cost-rounds", type=int, default=41)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("CPU: %s; flags: %s" % cpu_info())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}; {args.layers} "
          f"layers, hidden {args.hidden}, 16/4 heads, batch 1, wall clock, medians of {args.rounds} interleaved rounds "
          f"(1 at T >= 8192)")
    models = configs(args)
    print("\n| model | dtype | T | baseline | prefill base (s) | prefill dimattn (s) | speed-up | train base (s) | "
          "train dimattn (s) | speed-up |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        make, baseline, _ = models[name]
        for dtype in args.dtypes:
            dt_ = getattr(torch, dtype)
            for T in args.lengths:
                bp, op, bt, ot = model_rows(name, make, baseline, dt_, T, args)
                train = f"{bt:.3f} | {ot:.3f} | {bt / ot:.2f}x" if bt else "– | – | –"
                print(f"| {name} | {dtype} | {T} | {baseline} | {bp:.3f} | {op:.3f} | {bp / op:.2f}x | {train} |",
                      flush=True)
    if not args.skip_generate:
        print(f"\n| model | dtype | generate {args.new_tokens} after {args.generate_after} | base (s) | dimattn (s) | "
              f"speed-up | tokens equal |")
        print("|---|---|---|---:|---:|---:|---|")
        for name in args.models:
            make, baseline, _ = models[name]
            for dtype in args.dtypes:
                b, o, same = generate_row(name, make, baseline, getattr(torch, dtype), args)
                print(f"| {name} | {dtype} | {baseline} | {b:.3f} | {o:.3f} | {b / o:.2f}x | {same} |", flush=True)
    print("\n| attention function alone | dtype | T | base (ms) | dimattn (ms) | speed-up |")
    print("|---|---|---:|---:|---:|---:|")
    D = args.hidden // 16
    for name in args.models:
        _, baseline, fn = models[name]
        softcap = 50.0 if name == "gemma2" else None
        sinks = torch.randn(16) if name == "gpt_oss" else None
        for dtype in args.dtypes:
            for T in [x for x in args.lengths if x <= 2048]:
                b, o = attention_alone(fn, softcap, sinks, getattr(torch, dtype), T, D, args)
                print(f"| {name} ({baseline}) | {dtype} | {T} | {b * 1e3:.1f} | {o * 1e3:.1f} | {b / o:.2f}x |",
                      flush=True)
    direct, through = own_cost(args.own_cost_at, args)
    print(f"\nown cost at T={args.own_cost_at} (float32, forward, 1 thread, its CPU time): dimattn.dot_attention "
          f"{direct * 1e3:.3f} ms, dimattn.transformers' function {through * 1e3:.3f} ms, ratio {through / direct:.3f}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
