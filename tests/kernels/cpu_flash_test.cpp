// The CPU flash attention kernel against the float64 oracle
// (tests/support/kernel_case.h): forward (out, lse) and backward (dq, dk, dv,
// d(sinks), d(bias)) over shapes, lengths and offsets, GQA, head dims,
// dropout, strided and packed views, the variants and dtypes. Masks, code
// paths, parameters and the decode path have files of their own
// (cpu_flash_*_test.cpp). Needs only the kernel sources.
#include <gtest/gtest.h>

#include "cpu_flash_check.h"

namespace dimattn::kernels {
namespace {

// ---------------------------------------------------------------------------

TEST(CpuFlash, SelfAttention) {
  for (ElementType t : kAllTypes) {
    Case c = base("self", t);
    c.B = 2, c.H = 3, c.Hkv = 3, c.Tq = c.Tk = 37, c.D = c.Dv = 16;
    check_case(c);
  }
}

TEST(CpuFlash, CrossAttention) {
  for (ElementType t : kAllTypes) {
    Case c = base("cross", t);
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = 19, c.Tk = 147, c.D = 24, c.Dv = 40;
    check_case(c);
  }
}

TEST(CpuFlash, CausalSelfAcrossTiles) {
  for (int64_t d : {64, 128}) {
    Case c = base("causal D=" + std::to_string(d));  // several kv tiles at every width (fwd_block_k)
    c.B = 1, c.H = 2, c.Hkv = 2, c.Tq = c.Tk = 300, c.D = c.Dv = d, c.causal = true;
    check_case(c);
  }
}

TEST(CpuFlash, CausalWithOffsets) {
  for (ElementType t : kAllTypes) {
    // Chunks appended to a kv history of 70, 5 and -3 positions: the negative
    // offset leaves the first three rows with nothing to attend.
    Case c = base("causal offsets", t);
    c.B = 3, c.H = 2, c.Hkv = 1, c.Tq = 20, c.Tk = 90, c.D = c.Dv = 8, c.causal = true;
    c.offsets = {70, 5, -3};
    check_case(c);
  }
}

TEST(CpuFlash, CausalOffsetsEmptyRowsAndHugeOffsets) {
  Case c = base("causal offsets empty rows");
  c.B = 4, c.H = 1, c.Tq = 70, c.Tk = 70, c.D = c.Dv = 8, c.causal = true;
  c.offsets = {-10, -1000, 1000, std::numeric_limits<int64_t>::min() / 2};
  check_case(c);
}

TEST(CpuFlash, KvLengthsIncludingZeroAndOne) {
  for (bool causal : {false, true}) {
    Case c = base(std::string("kv lengths") + (causal ? " causal" : ""));
    c.B = 4, c.H = 2, c.Hkv = 2, c.Tq = 33, c.Tk = 200, c.D = c.Dv = 16, c.causal = causal;
    c.kv_lens = {0, 1, 50, 200};
    if (causal) c.offsets = {0, 0, 30, 167};
    check_case(c);
  }
}

TEST(CpuFlash, PerRowKvLengths) {
  // Each query row of each head its own kv length, rows of length 0 among
  // them (out 0, lse -inf): across kv tiles, with GQA, causal offsets,
  // dropout, query padding, and the few-rows path that reads kv in place.
  for (ElementType t : kAllTypes)
    for (bool causal : {false, true}) {
      Case c = base(std::string("per-row kv lengths") + (causal ? " causal" : ""), t);
      c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 70, c.Tk = 150, c.D = c.Dv = 16, c.causal = causal;
      if (causal) c.offsets = {80, 10};
      with_row_lengths(c, true);
      check_case(c);
    }
  for (int64_t d : {64, 128}) {
    Case c = base("per-row kv lengths causal D=" + std::to_string(d));
    c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = c.Tk = 300, c.D = c.Dv = d, c.causal = true;
    with_row_lengths(c, true);
    check_case(c);
  }
  {
    Case c = base("per-row kv lengths, shared by the heads, dropout, q lengths");
    c.B = 3, c.H = 3, c.Hkv = 3, c.Tq = 37, c.Tk = 150, c.D = c.Dv = 16, c.p = 0.3, c.q_lens = {37, 20, 0};
    with_row_lengths(c, true, true);
    check_case(c);
  }
  for (int64_t tq : {1, 3}) {
    Case c = base("per-row kv lengths, few rows Tq=" + std::to_string(tq));
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = tq, c.Tk = 301, c.D = 12, c.Dv = 16;
    with_row_lengths(c, true);
    check_case(c);
  }
}

TEST(CpuFlash, PerHeadKvLengths) {
  // One kv length per (b, h) plane (row stride 0): beams or GQA heads with
  // histories of their own.
  for (ElementType t : {ElementType::float32, ElementType::bfloat16}) {
    Case c = base("per-head kv lengths", t);
    c.B = 2, c.H = 6, c.Hkv = 2, c.Tq = 40, c.Tk = 133, c.D = c.Dv = 16, c.causal = true, c.offsets = {93, 20};
    with_row_lengths(c, false);
    check_case(c);
  }
}

TEST(CpuFlash, QueryLengths) {
  Case c = base("q lengths");
  c.B = 3, c.H = 2, c.Tq = 40, c.Tk = 40, c.D = c.Dv = 8, c.causal = true;
  c.q_lens = {3, 0, 40};
  c.kv_lens = {40, 10, 25};
  check_case(c);
}

TEST(CpuFlash, GroupedQueryAttention) {
  for (ElementType t : kAllTypes) {
    Case c = base("gqa", t);
    c.B = 2, c.H = 8, c.Hkv = 2, c.Tq = c.Tk = 45, c.D = c.Dv = 16, c.causal = true;
    check_case(c);
  }
}

TEST(CpuFlash, MultiQueryAttention) {
  Case c = base("mqa");
  c.B = 2, c.H = 4, c.Hkv = 1, c.Tq = 30, c.Tk = 70, c.D = 32, c.Dv = 16;
  c.kv_lens = {70, 33};
  check_case(c);
}

TEST(CpuFlash, OddHeadDims) {
  for (ElementType t : kAllTypes) {
    Case c = base("D=5 Dv=3", t);
    c.B = 2, c.H = 2, c.Hkv = 1, c.Tq = 13, c.Tk = 29, c.D = 5, c.Dv = 3, c.causal = true, c.offsets = {16, 2};
    check_case(c);
  }
}

TEST(CpuFlash, HeadDims64And128) {
  for (ElementType t : kAllTypes)
    for (int64_t d : {64, 128}) {
      Case c = base("D=" + std::to_string(d), t);
      c.B = 1, c.H = 2, c.Hkv = 2, c.Tq = 70, c.Tk = 150, c.D = c.Dv = d;
      check_case(c);
    }
}

TEST(CpuFlash, SingleStep) {
  for (ElementType t : kAllTypes) {
    Case c = base("T=1", t);
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = 1, c.Tk = 1, c.D = c.Dv = 8;
    check_case(c);
    c.name = "decode";  // one query against a long history
    c.Tk = 300, c.causal = true, c.offsets = {299, 150};
    check_case(c);
  }
}

TEST(CpuFlash, FewQueryRowsReadKvInPlace) {
  // <= 4 float32 query rows take the path that reads k and v rows in place
  // (no packing); a head dim that is not a whole number of vectors exercises
  // its scalar tail.
  for (int64_t tq : {1, 3, 4, 5}) {
    Case c = base("few rows Tq=" + std::to_string(tq));
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = tq, c.Tk = 301, c.D = 12, c.Dv = 16, c.causal = true;
    c.offsets = {290, 100};
    c.kv_lens = {301, 77};
    c.p = 0.2;
    check_case(c);
  }
}

TEST(CpuFlash, Dropout) {
  // float64 at 1e-10: a single mask bit differing from the naive reference's
  // (same Philox function) would be off by a whole weight.
  for (ElementType t : kAllTypes) {
    Case c = base("dropout", t);
    c.B = 2, c.H = 3, c.Hkv = 1, c.Tq = 37, c.Tk = 150, c.D = c.Dv = 16, c.causal = true, c.offsets = {113, 50};
    c.p = 0.3;
    check_case(c);
  }
}

// The variants at kernel level in every dtype, forward and backward: a
// window on both sides with offsets and kv lengths, soft-capping with ALiBi
// and dropout, sinks with an entry of no kv position, a bias plane per head
// shared by the batch, and all of them with a mask and segments over GQA.
TEST(CpuFlash, Variants) {
  int ran = 0;
  for (ElementType t : kAllTypes) {
    std::vector<Case> cases;
    Case w = base("window_two_sided", t);
    w.B = 2, w.H = 2, w.Tq = 37, w.Tk = 70, w.D = w.Dv = 16, w.offsets = {20, -3}, w.kv_lens = {70, 41};
    w.window_left = 9, w.window_right = 4;
    cases.push_back(w);
    Case s = base("softcap_alibi_dropout", t);
    s.B = 2, s.H = 4, s.Hkv = 2, s.Tq = s.Tk = 67, s.D = s.Dv = 32, s.causal = true, s.softcap = 2.5, s.p = 0.2;
    with_alibi(s);
    cases.push_back(s);
    Case k = base("sinks_empty_entry", t);
    k.B = 2, k.H = 2, k.Hkv = 2, k.Tq = 20, k.Tk = 33, k.D = k.Dv = 8, k.kv_lens = {33, 0};
    with_sinks(k);
    cases.push_back(k);
    Case b = base("bias_shared_by_batch", t);
    b.B = 3, b.H = 2, b.Tq = 19, b.Tk = 45, b.D = b.Dv = 8;
    with_bias(b);
    cases.push_back(b);
    Case a = base("all_variants_gqa_dropout", t);
    a.B = 2, a.H = 4, a.Hkv = 2, a.Tq = a.Tk = 90, a.D = a.Dv = 16, a.causal = true, a.offsets = {0, -9};
    a.kv_lens = {90, 70}, a.p = 0.2, a.window_left = 30, a.softcap = 3.0;
    with_alibi(a), with_sinks(a), with_bias(a), with_random_mask(a), with_segments(a);
    cases.push_back(a);
    for (const Case& c : cases) {
      check_case(c);
      ++ran;
    }
  }
  EXPECT_EQ(ran, 20);
}

TEST(CpuFlash, BroadcastDropout) {
  for (ElementType t : {ElementType::float32, ElementType::float64}) {
    Case c = base("broadcast dropout", t);
    c.B = 2, c.H = 2, c.Hkv = 2, c.Tq = 21, c.Tk = 133, c.D = c.Dv = 8, c.p = 0.4, c.broadcast = true;
    c.kv_lens = {133, 90};
    check_case(c);
  }
}

TEST(CpuFlash, DropoutOneDropsEverything) {
  Case c = base("p=1", ElementType::float64);
  c.B = 1, c.H = 2, c.Tq = 9, c.Tk = 17, c.D = c.Dv = 4, c.p = 1.0;
  check_case(c);
}

TEST(CpuFlash, DropoutMaskIsPhiloxContract) {
  // The kept fraction matches p, and the kernel's output equals the naive
  // reference built from dropout_uniform element by element (check_case).
  Case c = base("dropout contract", ElementType::float64);
  c.B = 1, c.H = 1, c.Tq = 64, c.Tk = 256, c.D = c.Dv = 4, c.p = 0.25;
  int64_t kept = 0;
  for (int64_t i = 0; i < c.Tq; ++i)
    for (int64_t j = 0; j < c.Tk; ++j) kept += c.keep_scale(0, 0, i, j) != 0;
  EXPECT_NEAR(static_cast<double>(kept) / (c.Tq * c.Tk), 0.75, 0.02);
  check_case(c);
}

TEST(CpuFlash, StridedViews) {
  for (Layout layout : {Layout::bthd, Layout::padded, Layout::packed}) {
    for (ElementType t : kAllTypes) {
      Case c = base("layout " + std::to_string(static_cast<int>(layout)), t);
      c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = c.Tk = 41, c.D = c.Dv = 16, c.causal = true;
      c.layout = layout;
      check_case(c);
    }
  }
}

TEST(CpuFlash, PackedQkvIsZeroCopy) {
  // q, k and v point into one buffer: the kernel reads them in place.
  Case c = base("packed");
  c.B = 2, c.H = 8, c.Hkv = 2, c.Tq = c.Tk = 20, c.D = c.Dv = 8, c.layout = Layout::packed;
  const Inputs in = make_inputs(c);
  KernelRun r = prepare(c, in);
  EXPECT_EQ(r.q.buf, r.k.buf);
  EXPECT_EQ(static_cast<const unsigned char*>(r.p.k) - static_cast<const unsigned char*>(r.p.q),
            static_cast<ptrdiff_t>(c.H * c.D * 4));
  check_case(c);
}

TEST(CpuFlash, MultiChunkBackward) {
  // Few (batch, kv head) groups and a long kv axis: the backward pass splits
  // the kv axis into chunks and sums their dQ shares in a second pass.
  for (bool causal : {false, true}) {
    Case c = base(std::string("kv chunks") + (causal ? " causal" : ""));
    c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = 90, c.Tk = 700, c.D = c.Dv = 16, c.causal = causal, c.offsets = {610};
    c.p = 0.1;
    check_case(c);
  }
}

TEST(CpuFlash, ExplicitScale) {
  Case c = base("scale", ElementType::float64);
  c.B = 1, c.H = 1, c.Tq = 10, c.Tk = 12, c.D = c.Dv = 6, c.scale = 0.77;
  check_case(c);
}

TEST(CpuFlash, EmptySizes) {
  {
    Case c = base("B=0");
    c.B = 0, c.Tq = c.Tk = 5;
    check_case(c);
  }
  {
    Case c = base("Tq=0");
    c.B = 2, c.Tq = 0, c.Tk = 5;
    check_case(c);
  }
  {
    // No kv positions: every row attends nothing.
    Case c = base("Tk=0");
    c.B = 2, c.H = 2, c.Tq = 5, c.Tk = 0;
    check_case(c);
  }
}

TEST(CpuFlash, NanInputPropagatesToItsRowOnly) {
  // A NaN score must not be mistaken for a masked one (0 weight): the row's
  // output is NaN, as the reference path's softmax gives; other rows are intact.
  for (ElementType t : {ElementType::float32, ElementType::bfloat16, ElementType::float16}) {
    Case c = base("nan", t);
    c.B = 1, c.H = 1, c.Tq = 4, c.Tk = 20, c.D = c.Dv = 8;
    const Inputs in = make_inputs(c);
    for (CpuIsa isa : isas()) {
      SCOPED_TRACE(cpu_isa_name(isa));
      KernelRun r = prepare(c, in);
      r.q.buf->set(r.q.at(0, 0, 2, 3), std::numeric_limits<double>::quiet_NaN());
      flash_attention_forward_cpu(r.p, serial_parallel_for(), isa);
      for (int64_t i = 0; i < c.Tq; ++i)
        for (int64_t e = 0; e < c.Dv; ++e)
          EXPECT_EQ(std::isnan(r.out.buf->get(r.out.at(0, 0, i, e))), i == 2) << "row " << i << " col " << e;
    }
  }
}

// The avx512_bf16 path packs bfloat16 as pairs along each product's k (head
// dim, kv positions, query rows) and starts backward blocks at even rows:
// odd head dims, lengths and row counts, every layout, GQA, causal offsets,
// dropout and the multi-chunk backward reach its pair boundaries. Run on
// every path this CPU has, like every case here.
TEST(CpuFlash, Bf16OddSizesLayoutsAndChunks) {
  std::vector<Case> cases;
  {
    Case c = base("odd dims", ElementType::bfloat16);
    c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = 13, c.Tk = 29, c.D = 7, c.Dv = 5, c.causal = true, c.offsets = {16, -2};
    c.kv_lens = {29, 11};
    cases.push_back(c);
  }
  {
    Case c = base("odd rows, permuted, dropout", ElementType::bfloat16);
    c.B = 1, c.H = 2, c.Hkv = 2, c.Tq = 71, c.Tk = 131, c.D = c.Dv = 33, c.layout = Layout::bthd, c.p = 0.2;
    c.q_lens = {69};
    cases.push_back(c);
  }
  {
    Case c = base("packed gqa causal", ElementType::bfloat16);
    c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = c.Tk = 50, c.D = c.Dv = 16, c.causal = true, c.layout = Layout::packed;
    cases.push_back(c);
  }
  {
    Case c = base("padded rows D=64", ElementType::bfloat16);
    c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = c.Tk = 150, c.D = c.Dv = 64, c.causal = true, c.layout = Layout::padded;
    c.p = 0.1, c.broadcast = true;
    cases.push_back(c);
  }
  {
    Case c = base("kv chunks", ElementType::bfloat16);
    c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = 91, c.Tk = 700, c.D = c.Dv = 16, c.causal = true, c.offsets = {609};
    c.p = 0.1;
    cases.push_back(c);
  }
  for (const Case& c : cases) check_case(c);
}

// docs/numerics.md: rounding the weights P to bfloat16 for P V moves each
// output element by at most 2^-8 max_j |v_j| (P >= 0 and sum_j P_j = l), and
// storing it in bfloat16 by 2^-8 |o|; the float32 sums add orders of
// magnitude less. Checked against the float64 reference on the same
// bfloat16 inputs, element by element.
TEST(CpuFlash, Bf16PairsOutputWithinTheDerivedBound) {
  const std::string missing = missing_cpu_flags(CpuIsa::avx512_bf16, cpu_features());
  if (!missing.empty()) GTEST_SKIP() << "avx512_bf16: this CPU lacks " << missing;
  Case c = base("bound", ElementType::bfloat16);
  c.B = 1, c.H = 2, c.Hkv = 2, c.Tq = 150, c.Tk = 300, c.D = c.Dv = 64;
  const Inputs in = make_inputs(c);
  const Oracle ref = oracle(c, in);
  KernelRun r = prepare(c, in);
  flash_attention_forward_cpu(r.p, serial_parallel_for(), CpuIsa::avx512_bf16);
  constexpr double u = 1.0 / 256;  // bfloat16's unit roundoff
  double worst = 0;                // the largest error as a share of its bound
  for (int64_t h = 0; h < c.H; ++h) {
    double vmax = 0;
    for (int64_t j = 0; j < c.Tk; ++j)
      for (int64_t e = 0; e < c.Dv; ++e) vmax = std::max(vmax, std::abs(in.v(0, h, j, e)));
    for (int64_t i = 0; i < c.Tq; ++i)
      for (int64_t e = 0; e < c.Dv; ++e) {
        const double want = ref.out(0, h, i, e), got = r.out.buf->get(r.out.at(0, h, i, e));
        const double bound = u * (vmax + std::abs(want)) + 1e-5 * vmax;
        ASSERT_LE(std::abs(got - want), bound) << "out[" << h << ", " << i << ", " << e << "]";
        worst = std::max(worst, std::abs(got - want) / bound);
      }
  }
  std::cout << "[ bf16 pairs ] largest output error: " << worst << " of the bound\n";
}

}  // namespace
}  // namespace dimattn::kernels
