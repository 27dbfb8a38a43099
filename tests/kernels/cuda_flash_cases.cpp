#include "kernels/cuda_flash_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "cpu/flash_attention.h"
#include "cpu/thread_pool.h"
#include "cuda/flash_attention_cuda.h"

namespace dimattn::kernels::test {
namespace {

// A CUDA case as written in the list below: the shape of every case
// (B = 2; defaults H = 4, Hkv = 2, Tq = 100, Tk = 130) and the variants as
// flags, made into a Case for each dtype and head dim by to_case.
struct Spec {
  std::string name;
  int64_t H = 4, Hkv = 2, Tq = 100, Tk = 130;
  bool causal = false;
  bool packed_qkv = false;  // q, k, v are views of one [T, B, H + 2 Hkv, D] buffer (Tq = Tk)
  std::vector<int64_t> q_lens, kv_lens, offsets;
  // Per-row kv lengths (with_row_lengths): per (b, h, row), or per (b, row)
  // shared by the heads (their plane offsets repeat).
  enum class RowLengths { off, per_head, shared_by_heads } row_lengths = RowLengths::off;
  double p = 0;
  bool broadcast = false;
  bool zero_queries = false;
  double scale = 0;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  bool alibi = false, sinks = false, bias = false, mask = false;
  int64_t mask_docs = 0;  // > 0: the mask is documents of this many positions (with_document_mask)
  bool segments = false;
  std::vector<int64_t> packed;  // with segments: packed sequences of these lengths (with_segments)
  int64_t q_position = 0, kv_position = 0;
};

Case to_case(const Spec& s, const std::string& suffix, ElementType t, int64_t D) {
  Case c = base(s.name + suffix, t);
  c.B = 2, c.H = s.H, c.Hkv = s.Hkv, c.Tq = s.Tq, c.Tk = s.Tk, c.D = c.Dv = D;
  c.causal = s.causal;
  c.layout = s.packed_qkv ? Layout::packed : Layout::contiguous;
  c.q_lens = s.q_lens, c.kv_lens = s.kv_lens, c.offsets = s.offsets;
  c.p = s.p, c.broadcast = s.broadcast, c.zero_queries = s.zero_queries, c.scale = s.scale;
  c.seed = 7, c.rng_offset = 3;
  c.q_position = s.q_position, c.kv_position = s.kv_position;
  c.window_left = s.window_left, c.window_right = s.window_right, c.softcap = s.softcap;
  if (s.row_lengths != Spec::RowLengths::off)
    with_row_lengths(c, true, s.row_lengths == Spec::RowLengths::shared_by_heads);
  if (s.alibi) with_alibi(c);
  if (s.sinks) with_sinks(c);
  if (s.bias) with_bias(c);
  if (s.mask) s.mask_docs > 0 ? with_document_mask(c, s.mask_docs) : with_random_mask(c);
  if (s.segments) with_segments(c, s.packed);
  return c;
}

}  // namespace

std::vector<Case> cuda_kernel_cases() {
  std::vector<Case> out;
  for (ElementType t : {ElementType::bfloat16, ElementType::float16})
    for (int64_t D : {64, 128}) {
      const std::string s = std::string("_") + element_type_name(t) + "_d" + std::to_string(D);
      auto add = [&](const Spec& spec) { out.push_back(to_case(spec, s, t, D)); };
      // The CUDA dual harness's cases (tests/dual/cuda_dual_test.cpp).
      add({.name = "cross"});
      add({.name = "causal_self", .Tq = 130, .causal = true});
      add({.name = "lengths", .kv_lens = {130, 41}});
      add({.name = "causal_offset", .causal = true, .offsets = {30, -3}});
      add({.name = "gqa_causal_lengths", .H = 8, .Hkv = 2, .Tq = 130, .causal = true, .kv_lens = {130, 77}});
      add({.name = "mqa", .H = 8, .Hkv = 1});
      add({.name = "dropout", .Tq = 130, .causal = true, .kv_lens = {130, 90}, .p = 0.3});
      add({.name = "dropout_gqa", .p = 0.2});
      add({.name = "broadcast_dropout", .kv_lens = {120, 9}, .p = 0.5, .broadcast = true});
      add({.name = "packed_qkv_causal", .Tq = 130, .causal = true, .packed_qkv = true});
      // Edge cases: an entry with no kv position, query lengths with a
      // negative offset (rows without a position), no query rows at all.
      add({.name = "mqa_empty_entry", .Hkv = 1, .kv_lens = {0, 65}});
      add({.name = "query_lengths_offsets", .causal = true, .q_lens = {100, 37}, .offsets = {-20, 5}});
      if (D == 64) add({.name = "no_query_rows", .Tq = 0});
      // Each query row its own kv length (a chunk attending a history whose
      // lengths vary per position, beams, GQA heads), rows of length 0 among them.
      add({.name = "row_lengths", .row_lengths = Spec::RowLengths::per_head});
      add({.name = "row_lengths_gqa_causal_dropout", .H = 8, .Hkv = 2, .causal = true, .offsets = {30, 5},
           .row_lengths = Spec::RowLengths::per_head, .p = 0.2});
      add({.name = "row_lengths_shared_sinks_bias", .kv_lens = {130, 60},
           .row_lengths = Spec::RowLengths::shared_by_heads, .sinks = true, .bias = true});
      // Variants.
      add({.name = "all_variants_gqa_dropout", .H = 8, .Hkv = 2, .Tq = 130, .causal = true, .kv_lens = {130, 97},
           .offsets = {0, -9}, .p = 0.2, .window_left = 50, .softcap = 3.0, .alibi = true, .sinks = true,
           .bias = true, .mask = true, .segments = true});
      add({.name = "segments_gqa_causal_dropout", .H = 8, .Hkv = 2, .Tq = 130, .causal = true, .kv_lens = {130, 97},
           .p = 0.2, .segments = true});
      add({.name = "segments_cross_bias", .kv_lens = {130, 70}, .offsets = {30, -5}, .window_left = 60,
           .window_right = 10, .bias = true, .segments = true});
      // Packed sequences of lengths 1, odd and long, and of kv length 0.
      add({.name = "packed_sequences_causal_dropout", .H = 8, .Hkv = 2, .Tq = 300, .Tk = 300, .causal = true,
           .p = 0.2, .segments = true, .packed = {1, 37, 130, 1, 5, 64}});
      // A block of a longer sequence (context parallelism): its causal offset
      // beyond its own extents, an odd first kv position for dropout's keys
      // (a pair of columns straddles two Philox counters), windows and ALiBi
      // measured from the global diagonal.
      add({.name = "block_of_a_sequence", .causal = true, .offsets = {250, 251}, .p = 0.3, .window_left = 300,
           .alibi = true, .q_position = 387, .kv_position = 137});
      add({.name = "block_broadcast_dropout", .offsets = {-50, 0}, .p = 0.4, .broadcast = true, .window_left = 20,
           .window_right = 20, .q_position = 11, .kv_position = 61});
      add({.name = "bias_mask_gqa", .H = 8, .Hkv = 2, .causal = true, .kv_lens = {130, 61}, .offsets = {30, 2},
           .bias = true, .mask = true});
      if (D == 64) {
        add({.name = "window_causal", .Tq = 130, .causal = true, .window_left = 40});
        add({.name = "window_two_sided", .kv_lens = {130, 57}, .offsets = {30, -5}, .window_left = 20,
             .window_right = 10});
        add({.name = "softcap", .scale = 0.5, .softcap = 2.0});
        add({.name = "alibi_causal", .Tq = 130, .causal = true, .alibi = true});
        add({.name = "sinks_empty_entry", .kv_lens = {130, 0}, .sinks = true});
        add({.name = "bias_softcap_dropout", .p = 0.25, .softcap = 2.0, .bias = true});
        add({.name = "mask", .kv_lens = {130, 90}, .mask = true});
      }
      // Documents as a bool mask: its blocks classified (empty, full, partial).
      add({.name = "mask_docs_causal_gqa_dropout", .H = 8, .Hkv = 2, .Tq = 200, .Tk = 200, .causal = true,
           .kv_lens = {200, 170}, .p = 0.2, .mask = true, .mask_docs = 70});
      if (D == 64)
        add({.name = "mask_docs_cross_softcap", .Tq = 150, .Tk = 260, .softcap = 2.0, .mask = true, .mask_docs = 90});
    }
  // float16 with p near 1: 1 / (1 - p) = 1e5 times a weight near 1 overflows
  // float16 unless the rescale is applied in float32 at the end.
  out.push_back(to_case({.name = "dropout_near_one_float16", .Tq = 256, .Tk = 256, .p = 0.99999, .zero_queries = true},
                        "_d64", ElementType::float16, 64));
  return out;
}


namespace {

bool is_half(ElementType t) { return t == ElementType::float16; }

// Memory on the runner, freed with it.
struct Buf {
  CudaFlashRunner& r;
  void* p = nullptr;
  size_t bytes;
  Buf(CudaFlashRunner& runner, size_t n) : r(runner), bytes(n) {
    if (n > 0) p = r.alloc(n);
  }
  ~Buf() {
    if (p) r.free(p);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

// A KernelRun's operands copied to the runner: every host array its params
// point at gets a copy there, and params() is the same call over the copies.
class OnRunner {
 public:
  OnRunner(CudaFlashRunner& runner, KernelRun& host, const Case& c) : runner_(runner) {
    for (Buffer& b : host.buffers) copy(b.bytes.data(), b.bytes.size());
    copy(host.lse.data(), host.lse.size());
    // What the kernel writes: out, lse, the gradients, d(sinks), d(bias).
    for (const View* v : {&host.out, &host.dq, &host.dk, &host.dv})
      outputs_.push_back({v->buf->bytes.data(), v->buf->bytes.size()});
    outputs_.push_back({host.lse.data(), host.lse.size()});
    outputs_.push_back({host.dsinks.data(), host.dsinks.size() * sizeof(double)});
    outputs_.push_back({host.p.score.dbias, host.dbias_bytes()});
    AttentionKernelParams& p = p_;
    p = host.p;
    for (const void** x : {&p.q, &p.k, &p.v, &p.dout}) *x = where(*x);
    for (void** x : {&p.out, &p.lse, &p.dq, &p.dk, &p.dv}) *x = where(*x);
    const size_t B = static_cast<size_t>(c.B), BH = static_cast<size_t>(c.B * c.H);
    p.q_lengths = array(p.q_lengths, B);
    p.kv_lengths = array(p.kv_lengths, B);
    p.causal_offset = array(p.causal_offset, B);
    planes(p.kv_row_lengths, c.row_lens.size() * 8, BH);
    ScoreParams& s = p.score;
    s.alibi.data = array(s.alibi.data, static_cast<size_t>(c.H));
    s.sinks.data = array(s.sinks.data, static_cast<size_t>(c.H));
    s.dsinks = array(s.dsinks, BH);
    planes(s.bias, host.dbias_bytes(), BH);  // the bias in the accumulation type, as d(bias)
    s.dbias = copy(s.dbias, host.dbias_bytes());
    planes(s.mask, c.mask.size(), BH);
    planes(s.query_segments, c.qseg.size() * 8, BH);
    planes(s.kv_segments, c.kseg.size() * 8, BH);
  }
  const AttentionKernelParams& params() const { return p_; }
  // The kernel's outputs back into the host run's buffers.
  void download() {
    for (const auto& key : outputs_)
      if (auto it = copies_.find(key); it != copies_.end()) runner_.download(key.first, it->second->p, key.second);
  }

 private:
  // Copies [p, p + bytes) once; outputs come back by download().
  void* copy(const void* p, size_t bytes) {
    if (p == nullptr || bytes == 0) return nullptr;
    auto key = std::make_pair(const_cast<void*>(p), bytes);
    auto it = copies_.find(key);
    if (it == copies_.end()) {
      auto dev = std::make_unique<Buf>(runner_, bytes);
      runner_.upload(dev->p, p, bytes);
      it = copies_.emplace(key, std::move(dev)).first;
    }
    return it->second->p;
  }
  // The copy of the host buffer holding p, at p's offset in it.
  void* where(const void* p) const {
    if (p == nullptr) return nullptr;
    const auto* x = static_cast<const unsigned char*>(p);
    for (const auto& [host, dev] : copies_) {
      const auto* lo = static_cast<const unsigned char*>(host.first);
      if (x >= lo && x < lo + host.second) return static_cast<unsigned char*>(dev->p) + (x - lo);
    }
    ADD_FAILURE() << "a kernel argument points outside the case's buffers";
    return nullptr;
  }
  template <class T>
  T* array(T* p, size_t n) {
    return static_cast<T*>(copy(p, n * sizeof(T)));
  }
  void planes(ScorePlanes& s, size_t data_bytes, size_t planes) {
    if (!s.on()) return;
    s.data = copy(s.data, data_bytes);
    s.offsets = array(s.offsets, planes);
  }

  CudaFlashRunner& runner_;
  std::map<std::pair<void*, size_t>, std::unique_ptr<Buf>> copies_;
  std::vector<std::pair<void*, size_t>> outputs_;
  AttentionKernelParams p_;
};

// err <= 2 (u (|ref| + M) + s (1 + A)) per element: twice the first-order
// bound of the 16-bit roundings (the float32 sums add far less), where s is
// float16's absolute rounding error below its normal range (2^-25: weights
// and dS values that small round to subnormals) and A the sum of the factors
// such rounded terms are multiplied by.
void compare(const Case& c, const char* what, const Array4& ref, const Array4& mag, const Array4& sub,
             const View& cuda, const View& cpu) {
  const bool half = is_half(c.dtype);
  const double u = half ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  const double s = half ? std::ldexp(1.0, -25) : 0.0;  // bfloat16 has float32's exponent range
  double worst_cuda = 0, worst_cpu = 0, worst_pair = 0;
  int64_t bad = 0;
  for (int64_t a = 0; a < ref.n[0]; ++a)
    for (int64_t b = 0; b < ref.n[1]; ++b)
      for (int64_t i = 0; i < ref.n[2]; ++i)
        for (int64_t d = 0; d < ref.n[3]; ++d) {
          const double want = ref(a, b, i, d);
          const double tol = 2 * (u * (std::abs(want) + mag(a, b, i, d)) + s * (1 + sub(a, b, i, d))) + 1e-30;
          const double g = cuda.buf->get(cuda.at(a, b, i, d)), h = cpu.buf->get(cpu.at(a, b, i, d));
          if (std::isnan(g) || std::isinf(g)) {
            if (bad++ < 3)
              ADD_FAILURE() << c.name << " " << what << "[" << a << ", " << b << ", " << i << ", " << d << "] is " << g
                            << " (unwritten, overflowed)";
            continue;
          }
          worst_cuda = std::max(worst_cuda, std::abs(g - want) / tol);
          worst_cpu = std::max(worst_cpu, std::abs(h - want) / tol);
          worst_pair = std::max(worst_pair, std::abs(g - h) / (2 * tol));
        }
  std::cout << "[ cuda_flash ] " << c.name << " " << what << ": error / tolerance " << worst_cuda
            << " (cpu_flash " << worst_cpu << ", cuda vs cpu " << worst_pair << ")\n";
  EXPECT_LE(worst_cuda, 1.0) << c.name << " " << what << ": cuda_flash vs the float64 oracle";
  EXPECT_LE(worst_cpu, 1.0) << c.name << " " << what << ": cpu_flash vs the float64 oracle";
  EXPECT_LE(worst_pair, 1.0) << c.name << " " << what << ": cuda_flash vs cpu_flash";
}

}  // namespace

void check_cuda_flash_case(const Case& c, CudaFlashRunner& runner) {
  SCOPED_TRACE(c.name);
  const Inputs in = make_inputs(c);
  const Oracle o = oracle(c, in);
  if (c.zero_queries) {
    EXPECT_GT(o.kept_overflowing, 0) << "the case keeps no weight that 1/(1-p) pushes past float16's range";
  }

  // cpu_flash on the same bits.
  KernelRun cpu = prepare(c, in);
  ThreadPool pool(2);
  flash_attention_forward_cpu(cpu.p, pool.as_parallel_for());
  flash_attention_backward_cpu(cpu.p, pool.as_parallel_for());

  // cuda_flash on the runner, over copies of a fresh run's operands; its
  // outputs come back into that run's buffers.
  KernelRun gpu = prepare(c, in);
  OnRunner dev(runner, gpu, c);
  const AttentionKernelParams& p = dev.params();
  ASSERT_EQ(cuda_flash_gate(p, true), "");
  // A workspace of 0 bytes (no query rows) is passed as null.
  Buf ws(runner, cuda_flash_backward_workspace_bytes(p));
  runner.forward(p);
  runner.backward(p, ws.p);
  dev.download();

  compare(c, "out", o.out, o.m_out, o.a_out, gpu.out, cpu.out);
  compare(c, "dq", o.dq, o.m_dq, o.a_dq, gpu.dq, cpu.dq);
  compare(c, "dk", o.dk, o.m_dk, o.a_dk, gpu.dk, cpu.dk);
  compare(c, "dv", o.dv, o.m_dv, o.a_dv, gpu.dv, cpu.dv);
  const double u = is_half(c.dtype) ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  for (size_t x = 0; x < o.dsinks.size() && !c.sinks.empty(); ++x) {
    const double tol = 2 * u * (std::abs(o.dsinks[x]) + o.m_dsinks[x]) + 1e-6;
    EXPECT_NEAR(gpu.dsinks[x], o.dsinks[x], tol) << c.name << " dsinks[" << x << "], cuda_flash";
    EXPECT_NEAR(cpu.dsinks[x], o.dsinks[x], tol) << c.name << " dsinks[" << x << "], cpu_flash";
  }
  if (!c.bias.empty()) {
    double worst_cuda = 0, worst_cpu = 0;
    for (size_t x = 0; x < o.dbias.size(); ++x) {
      const double tol = 2 * u * (std::abs(o.dbias[x]) + o.m_dbias[x]) + 1e-6;
      worst_cuda = std::max(worst_cuda, std::abs(gpu.dbias(x) - o.dbias[x]) / tol);
      worst_cpu = std::max(worst_cpu, std::abs(cpu.dbias(x) - o.dbias[x]) / tol);
    }
    std::cout << "[ cuda_flash ] " << c.name << " dbias: error / tolerance " << worst_cuda << " (cpu_flash "
              << worst_cpu << ")\n";
    EXPECT_LE(worst_cuda, 1.0) << c.name << " dbias: cuda_flash vs the float64 oracle";
    EXPECT_LE(worst_cpu, 1.0) << c.name << " dbias: cpu_flash vs the float64 oracle";
  }
  int64_t lse_bad = 0;
  for (int64_t r = 0; r < c.B * c.H * c.Tq; ++r) {
    const double want = o.lse.v[r], got = lse_at(gpu, c, r);
    const bool ok = std::isinf(want) ? std::isinf(got) && got < 0
                                     : std::abs(got - want) <= 1e-4 * std::max(1.0, std::abs(want));
    if (!ok && lse_bad++ < 3) ADD_FAILURE() << c.name << " lse row " << r << ": " << got << " vs " << want;
  }
}

}  // namespace dimattn::kernels::test
