// The dual-implementation harness: every attention case, written once as
// data (dimattn/testing/cases.h), runs on every kernel of every device of
// every backend and is compared with the reference path on that backend and
// device — outputs, and gradients of q, k and v: through autograd on the
// torch backend, through dot_attention_backward on the Eigen backend. CUDA
// runs happen where LibTorch sees a device (scripts/gpu-check); elsewhere
// they are left out, and the CPU runs of the same cases still happen.
// It cannot pass vacuously: each case states which kernels must take it (the
// rule below, derived from the kernels' gates), a rejection by one of those
// fails, an acceptance by one expected to reject fails (so the rule stays
// true), and every case checks that exactly the runs it expects happened.
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "dimattn/tolerance.h"
#include "dimattn/attention.h"
#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/selection.h"
#include "dimattn/trace.h"
#include "support/test_util.h"

namespace dimattn {
namespace {
using testing::AttentionCase;
using testing::error_of;
using testing::Kind;
using testing::Layout;

// The kernels each backend's table lists besides the reference, per device
// (backends/eigen/eigen_backend.cpp, backends/torch/torch_attention.cpp). A
// CPU kernel added to a table fails DualKernels.EveryCpuKernelHasExpectations
// until the rule below covers it.
const std::map<std::string, std::set<std::string>>& cpu_kernels() {
  static const std::map<std::string, std::set<std::string>> k = {
      {"eigen", {"cpu_flash"}}, {"torch", {"cpu_flash", "aten_flash_cpu", "aten_math"}}};
  return k;
}

// Which kernels must take a case on a backend and device. On the CPU every
// other kernel of that backend must reject it. From the gates, read as data:
// - cpu_flash (backends/adapters/cpu_flash_path.cpp) takes every CPU case
//   here: float32, float64, bfloat16 and float16, dropout, offsets, groups.
// - ATen's CPU kernels (backends/torch/torch_attention.cpp) are never offered
//   dropout (their masks come from ATen's RNG, not the shared Philox stream);
//   aten_flash_cpu also rejects causal attention with query groups (GQA/beam)
//   and unequal qk and v head dims; both reject kv lengths over the query's
//   own dims (per-row lengths: their mask is per batch entry).
// - cuda_flash (backends/adapters/cuda_flash_gate.cpp) takes bfloat16 and
//   float16 with equal head dims of 64 or 128, without relative positions. ATen's CUDA kernels may take
//   or reject a case (optional_kernels): their gates are ATen's, not checked
//   on a device here.
std::set<std::string> expected_kernels(const AttentionCase& c, const std::string& backend, Device device) {
  std::set<std::string> k;
  if (device.type == DeviceType::cuda) {
    const bool half = c.dtype == DType::bfloat16 || c.dtype == DType::float16;
    // Relative positions: rejected until cuda_flash has run on a GPU.
    if (half && c.head_dim == c.head_dim_v && (c.head_dim == 64 || c.head_dim == 128) && !c.variants.rel_pos)
      k.insert("cuda_flash");
    return k;
  }
  k.insert("cpu_flash");
  // ATen's kernels take no variant (docs/selection.md).
  if (backend == "torch" && c.dropout == 0 && !c.variants.any() && !c.per_row_lengths()) {
    k.insert("aten_math");
    if (!(c.causal && c.groups > 1) && c.head_dim == c.head_dim_v) k.insert("aten_flash_cpu");
  }
  return k;
}

// The instruction set cpu_flash must run a case of `dtype` on: the cap
// DIMATTN_CPU_ISA names (ctest's dual_tests_isa_* runs set it), avx512's
// code for other dtypes than bfloat16 under avx512_bf16; "" without a cap
// (the CPU's best, whichever it is).
std::string expected_cpu_isa(DType dtype) {
  const char* cap = std::getenv("DIMATTN_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return "";
  if (std::string(cap) == "avx512_bf16" && dtype != DType::bfloat16) return "avx512";
  return cap;
}

// Under a cap this CPU lacks, every cpu_flash call fails saying so: the
// harness skips, with that reason (an unknown name fails instead).
class CpuIsaCap : public ::testing::Environment {
 public:
  void SetUp() override {
    if (expected_cpu_isa(DType::bfloat16).empty()) return;
    const testing::Operands ops = testing::make_operands(AttentionCase{});
    const std::string err = error_of([&] {
      ForceKernels force("cpu_flash");
      explain_attention(ops.q, ops.k, ops.v, ops.opts);
    });
    if (err.find("this CPU lacks") != std::string::npos) {
      std::cout << "[ dual ] skipped: " << err << "\n";  // for ctest's SKIP_REGULAR_EXPRESSION, under --gtest_brief too
      GTEST_SKIP() << err;
    }
    ASSERT_EQ(err, "");
  }
};
::testing::Environment* const kCpuIsaCap = ::testing::AddGlobalTestEnvironment(new CpuIsaCap);

// Kernels whose acceptance the harness does not assert (but whose results,
// when they run, it compares like any other).
bool optional_kernel(const std::string& kernel, Device device) {
  return device.type == DeviceType::cuda && kernel != "cuda_flash";
}

// Output tolerance of a case against the reference, before scaling by the
// compared values' magnitude (testing::tolerance_at_scale: values grow, e.g.
// by 1/(1-p) with dropout, and 16-bit rounding with them). Unit-normal
// logits: reference_tolerance (DESIGN.md §6). Extreme logits (logit scale L,
// i.e. |q·k·scale| ~ L): a kernel and the reference sum q·k in different
// orders, so their logits differ by ~ eps·L at the compute precision
// (float32 for 16-bit and float32 inputs, float64 for float64), and the
// softmax passes a logit difference δ to the output as at most ~2·max|v|·δ.
// So the tolerance grows with L: the dtype's own tolerance (the output's
// rounding) plus L times the compute precision's tolerance at unit logits.
double output_tolerance(const AttentionCase& c) {
  const double tol = reference_tolerance(c.dtype);
  const double L = c.logit_scale();
  if (L <= 1) return tol;
  const DType compute = c.dtype == DType::float64 ? DType::float64 : DType::float32;
  return tol + L * reference_tolerance(compute);
}

// Gradient tolerance (before scaling by the compared values' magnitude):
// twice the output's, and for dq and dk (i = 0, 1) also scale · u, u the
// dtype's unit roundoff. A fused backward keeps some unit-size quantities of
// dS in the input dtype (e.g. the output it reads back for rowsum(dO · O)),
// and dq = scale · dS · K, dk = scale · dSᵀ · Q carry the softmax scale, so
// one rounding reaches them as scale · u. At extreme logits that dominates:
// float16 with |q·k·scale| ~ 1e4 (scale ~3.5e3) gives dq, dk off by 1.2 and
// 2.6 at max |dq| 2.4 for cpu_flash and ATen's CPU flash kernel alike
// (float32 from the same values: 6e-3). Equivalently, one rounding of q or k
// moves a logit by δ = L · u, i.e. scale · u = δ / |q| with |q| ~ sqrt(D).
// docs/numerics.md has the rule.
double gradient_tolerance(const AttentionCase& c, size_t i) {
  const double t = 2 * output_tolerance(c);
  return i < 2 ? t + std::abs(c.softmax_scale()) * unit_roundoff(c.dtype) : t;
}

// The cases first written for the CPU kernels, in four dtypes.
void add_cpu_cases(std::vector<AttentionCase>& out) {
  // |q·k·scale| ~ 1e4 for unit-normal q, k with D = 8 (q·k ~ sqrt(8)).
  const double extreme = 1e4 / std::sqrt(8.0);
  for (DType dt : {DType::float32, DType::float64, DType::bfloat16, DType::float16}) {
    const std::string s = std::string("_") + dtype_name(dt);
    out.push_back({.name = "self" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9});
    out.push_back({.name = "causal" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9, .causal = true});
    out.push_back({.name = "cross_lengths" + s, .dtype = dt, .lengths = {7, 3}});
    out.push_back({.name = "causal_lengths" + s, .dtype = dt, .kind = Kind::self, .seq_q = 7, .seq_k = 7,
                   .causal = true, .lengths = {7, 4}});
    // A chunk of 4 steps appended to a history of 5: query i sees kv <= i + 5.
    out.push_back({.name = "causal_offset" + s, .dtype = dt, .seq_q = 4, .seq_k = 9, .causal = true, .offsets = {5}});
    // Per-batch histories (5 and 2 steps) in one padded kv buffer.
    out.push_back({.name = "causal_offset_per_batch" + s, .dtype = dt, .seq_q = 4, .seq_k = 9, .causal = true,
                   .lengths = {9, 6}, .offsets = {5, 2}});
    // A negative offset leaves the first query rows without any kv position.
    out.push_back({.name = "causal_offset_negative" + s, .dtype = dt, .seq_q = 4, .seq_k = 9, .causal = true,
                   .offsets = {5, -2}});
    out.push_back({.name = "gqa_causal_offset" + s, .dtype = dt, .groups = 2, .seq_q = 3, .seq_k = 8, .causal = true,
                   .lengths = {8, 6}, .offsets = {5, 3}});
    out.push_back({.name = "gqa" + s, .dtype = dt, .groups = 4, .seq_q = 6, .seq_k = 6});
    out.push_back({.name = "gqa_causal" + s, .dtype = dt, .groups = 4, .seq_q = 6, .seq_k = 6, .causal = true});
    out.push_back({.name = "gqa_causal_lengths" + s, .dtype = dt, .kind = Kind::self, .groups = 2, .seq_q = 6,
                   .seq_k = 6, .causal = true, .lengths = {6, 3}});
    out.push_back({.name = "mqa" + s, .dtype = dt, .heads = 1, .groups = 8, .seq_q = 5, .seq_k = 9});
    out.push_back({.name = "beam_cross" + s, .dtype = dt, .groups = 3, .group_name = "beam", .seq_q = 4,
                   .lengths = {7, 5}});
    out.push_back({.name = "single_step" + s, .dtype = dt, .kind = Kind::step, .seq_q = 1, .lengths = {7, 2}});
    // A dim only keys and values have: the query broadcasts over it (keys and
    // values reach the kernels as views; the broadcast query is one counted copy).
    out.push_back({.name = "keys_only" + s, .dtype = dt, .keys_only = 3, .seq_q = 4, .lengths = {7, 5}});
    out.push_back({.name = "keys_only_gqa_causal_dropout" + s, .dtype = dt, .groups = 2, .keys_only = 2, .seq_q = 4,
                   .seq_k = 9, .causal = true, .offsets = {5, 2}, .dropout = 0.25});
    // Layouts (docs/layouts.md): q, k and v as views of one packed
    // [B, T, 3, H, D] buffer, and each drawn as [B, T, H, D] (the spatial dim
    // before the heads); every kernel must take them as views (the check in
    // the TEST_P below). ATen's kernels once got 3 counted copies of the
    // packed views with batch > 1: their form merged batch and heads.
    out.push_back({.name = "packed_qkv_causal" + s, .dtype = dt, .kind = Kind::self, .layout = Layout::packed_qkv,
                   .seq_q = 9, .seq_k = 9, .causal = true});
    out.push_back({.name = "packed_qkv_lengths_dropout" + s, .dtype = dt, .kind = Kind::self,
                   .layout = Layout::packed_qkv, .seq_q = 9, .seq_k = 9, .lengths = {9, 5}, .dropout = 0.2});
    out.push_back({.name = "permuted_gqa_causal_offset" + s, .dtype = dt, .groups = 2, .layout = Layout::permuted,
                   .seq_q = 4, .seq_k = 9, .causal = true, .offsets = {5, 2}});
    out.push_back({.name = "permuted_self_lengths" + s, .dtype = dt, .kind = Kind::self, .layout = Layout::permuted,
                   .seq_q = 7, .seq_k = 7, .lengths = {7, 4}});
    out.push_back({.name = "dropout" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9, .causal = true,
                   .lengths = {9, 5}, .dropout = 0.3});
    out.push_back({.name = "dropout_gqa" + s, .dtype = dt, .groups = 2, .seq_q = 6, .seq_k = 6, .dropout = 0.2});
    out.push_back({.name = "dropout_causal_offset" + s, .dtype = dt, .seq_q = 4, .seq_k = 9, .causal = true,
                   .offsets = {5, 3}, .dropout = 0.25});
    out.push_back({.name = "broadcast_dropout" + s, .dtype = dt, .lengths = {7, 4}, .dropout = 0.5,
                   .broadcast_dropout = true});
    // Rates other than 0.5: at 0.5 a kept weight's scale 1/(1-p) equals 1/p.
    for (const auto& [rate, tag] : {std::pair{0.1, "p01"}, std::pair{0.9, "p09"}}) {
      out.push_back({.name = std::string("dropout_") + tag + s, .dtype = dt, .kind = Kind::self, .seq_q = 9,
                     .seq_k = 9, .causal = true, .lengths = {9, 6}, .dropout = rate});
      out.push_back({.name = std::string("broadcast_dropout_") + tag + s, .dtype = dt, .groups = 2, .lengths = {7, 4},
                     .dropout = rate, .broadcast_dropout = true});
    }
    // |q·k·scale| ~ 1e4: the online softmax must subtract the running max
    // (exp overflows otherwise) and rescale exactly when it grows. Gradients
    // are held to gradient_tolerance, which grows with the scale.
    out.push_back({.name = "extreme_logits" + s, .dtype = dt, .seq_q = 9, .seq_k = 33, .lengths = {33, 20},
                   .scale = extreme});
    out.push_back({.name = "extreme_logits_causal" + s, .dtype = dt, .kind = Kind::self, .seq_q = 33, .seq_k = 33,
                   .causal = true, .scale = extreme});
    // Variants (docs/api.md): windows, soft-capping, ALiBi, sinks, and all
    // of them with GQA, offsets, padding and dropout.
    out.push_back({.name = "window_causal" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9,
                   .causal = true, .variants = {.scalars = {.window = AttentionWindow{3, {}}}}});
    out.push_back({.name = "window_two_sided_offsets" + s, .dtype = dt, .seq_q = 5, .seq_k = 9, .offsets = {2, 4},
                   .variants = {.scalars = {.window = AttentionWindow{2, 1}}}});
    out.push_back({.name = "softcap" + s, .dtype = dt, .scale = 1.0, .variants = {.scalars = {.softcap = 1.5}}});
    out.push_back({.name = "alibi_causal" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9,
                   .causal = true, .variants = {.alibi = true}});
    out.push_back({.name = "sinks_empty_entry" + s, .dtype = dt, .lengths = {7, 0}, .variants = {.sinks = true}});
    out.push_back({.name = "variants_gqa_dropout" + s, .dtype = dt, .groups = 2, .seq_q = 4, .seq_k = 9,
                   .causal = true, .lengths = {9, 6}, .offsets = {5, 2}, .dropout = 0.25,
                   .variants = {.scalars = {.window = AttentionWindow{4, {}}, .softcap = 2.0}, .alibi = true, .sinks = true}});
    // Bias and masks over named dims: T5-style {heads, Tq, Tk}; one {Tq, Tk}
    // plane shared by every head and query group (d(bias) summed over them);
    // per-kv-position bias and mask (key padding) in causal self-attention;
    // a mask over every dim that leaves some rows without a position; beam
    // queries with their own mask; one decoding step; and all variants at once.
    out.push_back({.name = "bias_heads_tq_tk" + s, .dtype = dt, .lengths = {7, 4}, .variants = {.bias = "htk"}});
    out.push_back({.name = "bias_shared_plane_gqa" + s, .dtype = dt, .groups = 2, .seq_q = 4, .seq_k = 9,
                   .causal = true, .offsets = {5, 2}, .variants = {.bias = "tk"}});
    out.push_back({.name = "bias_mask_kv_causal_self" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9,
                   .causal = true, .lengths = {9, 5}, .variants = {.bias = "bk", .mask = "k"}});
    out.push_back({.name = "mask_every_dim" + s, .dtype = dt, .seq_q = 6, .seq_k = 3, .variants = {.mask = "bhtk"}});
    out.push_back({.name = "mask_beam" + s, .dtype = dt, .groups = 3, .group_name = "beam", .seq_q = 4,
                   .lengths = {7, 5}, .variants = {.bias = "gk", .mask = "gtk"}});
    out.push_back({.name = "bias_mask_step" + s, .dtype = dt, .kind = Kind::step, .lengths = {7, 2},
                   .variants = {.bias = "bhk", .mask = "hk"}});
    // Per-row kv lengths (lengths over the query's own dims: a chunk
    // attending a history whose lengths vary per query position, beams, GQA
    // heads), rows of length 0 among them; with GQA, causal offsets,
    // dropout, an entry without any position, a decoding step, and the
    // variants. Lengths over a keys-only dim (per kv head) are per entry.
    out.push_back({.name = "lengths_per_query_row" + s, .dtype = dt, .seq_q = 7, .seq_k = 9, .lengths = {9, 5},
                   .lengths_over = "bt"});
    out.push_back({.name = "lengths_per_row_gqa_causal_offset" + s, .dtype = dt, .groups = 2, .seq_q = 4,
                   .seq_k = 9, .causal = true, .lengths = {9, 6}, .lengths_over = "bhgt", .offsets = {5, 2}});
    out.push_back({.name = "lengths_per_beam" + s, .dtype = dt, .groups = 3, .group_name = "beam", .seq_q = 4,
                   .lengths = {7, 5}, .lengths_over = "bg"});
    out.push_back({.name = "lengths_per_beam_self" + s, .dtype = dt, .kind = Kind::self, .groups = 3,
                   .group_name = "beam", .seq_q = 6, .seq_k = 6, .lengths = {6, 4}, .lengths_over = "bg"});
    out.push_back({.name = "lengths_per_beam_step" + s, .dtype = dt, .kind = Kind::step, .groups = 4,
                   .group_name = "beam", .lengths = {7, 3}, .lengths_over = "gb"});
    out.push_back({.name = "lengths_per_row_dropout" + s, .dtype = dt, .groups = 2, .seq_q = 6, .seq_k = 9,
                   .lengths = {9, 4}, .lengths_over = "btg", .dropout = 0.25});
    out.push_back({.name = "lengths_per_row_broadcast_dropout" + s, .dtype = dt, .seq_q = 6, .lengths = {7, 4},
                   .lengths_over = "bt", .dropout = 0.5, .broadcast_dropout = true});
    out.push_back({.name = "lengths_per_row_empty_entry" + s, .dtype = dt, .seq_q = 5, .lengths = {7, 0},
                   .lengths_over = "bt"});
    out.push_back({.name = "lengths_per_row_variants" + s, .dtype = dt, .groups = 2, .seq_q = 4, .seq_k = 9,
                   .causal = true, .lengths = {9, 6}, .lengths_over = "bt", .offsets = {5, 2},
                   .variants = {.scalars = {.window = AttentionWindow{4, {}}, .softcap = 2.0}, .alibi = true,
                                .sinks = true, .bias = "htk"}});
    out.push_back({.name = "keys_only_lengths" + s, .dtype = dt, .keys_only = 3, .seq_q = 4, .lengths = {7, 5},
                   .lengths_over = "be"});
    out.push_back({.name = "all_variants" + s, .dtype = dt, .groups = 2, .seq_q = 4, .seq_k = 9, .causal = true,
                   .lengths = {9, 6}, .offsets = {5, 2}, .dropout = 0.25,
                   .variants = {.scalars = {.window = AttentionWindow{4, {}}, .softcap = 2.0}, .alibi = true, .sinks = true, .bias = "htk",
                                .mask = "tk"}});
    // Segment ids with every variant (and a bool mask), per (batch, head).
    out.push_back({.name = "segments_all_variants" + s, .dtype = dt, .groups = 2, .seq_q = 4, .seq_k = 9,
                   .causal = true, .lengths = {9, 6}, .offsets = {5, 2}, .dropout = 0.25,
                   .variants = {.scalars = {.window = AttentionWindow{6, {}}, .softcap = 2.0}, .alibi = true,
                                .sinks = true, .bias = "htk", .mask = "tk", .segment_docs = 3, .segments_over = "bh"}});
  }
  // Documents masks (CaseVariants::mask_docs), whose blocks cpu_flash
  // classifies: 640 positions in documents of 300 (200) give kv tiles and
  // query blocks that the mask forbids entirely (skipped), allows entirely
  // (no per-element mask) and allows in part, in the forward's tiles and the
  // backward's alike (CpuFlash.MaskTilesOfEveryClass counts them); one plane
  // for every head, one per head (shifted), one per (batch, head), with
  // causal, GQA, padding, dropout and soft-capping.
  for (DType dt : {DType::float32, DType::bfloat16}) {
    const std::string s = std::string("_") + dtype_name(dt);
    out.push_back({.name = "mask_docs_causal_shared" + s, .dtype = dt, .seq_q = 640, .seq_k = 640, .causal = true,
                   .variants = {.mask = "tk", .mask_docs = 300}});
    out.push_back({.name = "mask_docs_heads_gqa_dropout" + s, .dtype = dt, .groups = 2, .seq_q = 640, .seq_k = 640,
                   .causal = true, .lengths = {640, 500}, .dropout = 0.1,
                   .variants = {.mask = "htk", .mask_docs = 300}});
    out.push_back({.name = "mask_docs_every_dim_softcap" + s, .dtype = dt, .seq_q = 300, .seq_k = 640,
                   .variants = {.scalars = {.softcap = 5.0}, .mask = "bhtk", .mask_docs = 200}});
  }
  // Segments (CaseVariants::segment_docs): documents of irregular lengths
  // as integer ids, never a [t, kv] mask, whose blocks cpu_flash classifies
  // from the ids' ranges (empty, full and partial ones at these sizes:
  // CpuFlash.SegmentTilesOfEveryClass); causal self-attention with one
  // tensor as both sides, with a window, with GQA, kv lengths and dropout
  // and ids per (batch, head), cross-attention with soft-capping, and with
  // kv lengths per query row.
  for (DType dt : {DType::float32, DType::bfloat16}) {
    const std::string s = std::string("_") + dtype_name(dt);
    out.push_back({.name = "segments_causal_self" + s, .dtype = dt, .kind = Kind::self, .seq_q = 640, .seq_k = 640,
                   .causal = true, .variants = {.segment_docs = 300}});
    out.push_back({.name = "segments_window_self" + s, .dtype = dt, .kind = Kind::self, .seq_q = 640, .seq_k = 640,
                   .causal = true, .variants = {.scalars = {.window = AttentionWindow{200, {}}}, .segment_docs = 300}});
    out.push_back({.name = "segments_heads_gqa_dropout" + s, .dtype = dt, .kind = Kind::self, .groups = 2,
                   .seq_q = 640, .seq_k = 640, .causal = true, .lengths = {640, 500}, .dropout = 0.1,
                   .variants = {.segment_docs = 300, .segments_over = "bh"}});
    out.push_back({.name = "segments_cross_softcap" + s, .dtype = dt, .seq_q = 300, .seq_k = 640,
                   .variants = {.scalars = {.softcap = 5.0}, .segment_docs = 200}});
    // Per-query-row kv lengths with segments (packed_attention between two
    // packings: each query token's causal end as its kv length).
    out.push_back({.name = "segments_row_lengths_dropout" + s, .dtype = dt, .groups = 2, .seq_q = 300, .seq_k = 640,
                   .lengths = {640, 500}, .lengths_over = "bt", .dropout = 0.1, .variants = {.segment_docs = 200}});
  }
  // Relative positions (pos_emb, Transformer-XL): one table per head or
  // shared, with u and v, in self-attention (RETURNN's RelPosSelfAttention:
  // a table of 2T - 1 rows) with padding, causal (RelPosCausalSelfAttention:
  // per-row kv lengths of a hist dim, and a chunk after a history), dropout
  // and broadcast dropout, GQA (a table per query head), cross-attention, a
  // decoding step over a table of the kv dim itself (no shift), the other
  // variants, and sizes past one tile of either pass (blocks that keep band
  // columns from the last tile, and step tiles of the backward).
  for (DType dt : {DType::float32, DType::float64, DType::bfloat16, DType::float16}) {
    const std::string s = std::string("_") + dtype_name(dt);
    const testing::CaseVariants rel{.rel_pos = "h", .rel_pos_biases = true};
    out.push_back({.name = "rel_pos_self_lengths" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9,
                   .lengths = {9, 5}, .variants = rel});
    out.push_back({.name = "rel_pos_shared_no_biases" + s, .dtype = dt, .kind = Kind::self, .seq_q = 7, .seq_k = 7,
                   .variants = {.rel_pos = ""}});
    out.push_back({.name = "rel_pos_causal_dropout" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9,
                   .causal = true, .lengths = {9, 6}, .dropout = 0.25, .variants = rel});
    out.push_back({.name = "rel_pos_broadcast_dropout" + s, .dtype = dt, .kind = Kind::self, .seq_q = 8, .seq_k = 8,
                   .lengths = {8, 3}, .dropout = 0.5, .broadcast_dropout = true, .variants = rel});
    out.push_back({.name = "rel_pos_gqa_cross" + s, .dtype = dt, .groups = 2, .seq_q = 5, .seq_k = 9,
                   .lengths = {9, 4}, .variants = {.rel_pos = "hg", .rel_pos_biases = true}});
    out.push_back({.name = "rel_pos_chunk_after_history" + s, .dtype = dt, .seq_q = 4, .seq_k = 9, .causal = true,
                   .lengths = {9, 6}, .offsets = {5, 2}, .variants = rel});
    out.push_back({.name = "rel_pos_row_lengths" + s, .dtype = dt, .seq_q = 6, .seq_k = 9, .lengths = {9, 5},
                   .lengths_over = "bt", .variants = rel});
    out.push_back({.name = "rel_pos_step" + s, .dtype = dt, .kind = Kind::step, .lengths = {7, 3}, .variants = rel});
    out.push_back({.name = "rel_pos_variants" + s, .dtype = dt, .kind = Kind::self, .seq_q = 9, .seq_k = 9,
                   .causal = true, .lengths = {9, 6},
                   .variants = {.scalars = {.window = AttentionWindow{4, {}}, .softcap = 2.0}, .sinks = true,
                                .bias = "bhk", .rel_pos = "bh", .rel_pos_biases = true}});
  }
  for (DType dt : {DType::float32, DType::bfloat16}) {
    const std::string s = std::string("_") + dtype_name(dt);
    out.push_back({.name = "rel_pos_tiles" + s, .dtype = dt, .kind = Kind::self, .batch = 1, .seq_q = 300,
                   .seq_k = 300, .head_dim = 16, .head_dim_v = 16, .lengths = {300},
                   .variants = {.rel_pos = "h", .rel_pos_biases = true}});
    out.push_back({.name = "rel_pos_tiles_causal_gqa" + s, .dtype = dt, .kind = Kind::self, .batch = 1, .groups = 2,
                   .seq_q = 300, .seq_k = 300, .head_dim = 16, .head_dim_v = 16, .causal = true, .dropout = 0.1,
                   .variants = {.rel_pos = "", .rel_pos_biases = true}});
  }
  out.push_back({.name = "t1", .seq_q = 1, .seq_k = 1});
  out.push_back({.name = "odd_head_dims", .head_dim = 5, .head_dim_v = 3});
  out.push_back({.name = "d128", .kind = Kind::self, .batch = 1, .seq_q = 16, .seq_k = 16, .head_dim = 128,
                 .head_dim_v = 128, .causal = true});
  out.push_back({.name = "empty_entry", .lengths = {0, 7}});
  // Long: 8192 kv positions, many blocks past one tile, kept cheap: one entry,
  // one head, D = 8, and the last 256 queries of the sequence (causal offset
  // 7936), so that the reference materialises 256 x 8192 weights, not 8192^2
  // (a full 8192 x 8192 causal case took 40 s here).
  out.push_back({.name = "t8192_causal_chunk", .batch = 1, .heads = 1, .seq_q = 256, .seq_k = 8192, .causal = true,
                 .offsets = {7936}});
}

// The cases first written for cuda_flash: its dtypes and head dims at sizes
// past one tile (64 and 128 rows); they run on the CPU kernels as well.
void add_cuda_cases(std::vector<AttentionCase>& out) {
  for (DType dt : {DType::bfloat16, DType::float16})
    for (int64_t D : {64, 128}) {
      const std::string s = std::string("_") + dtype_name(dt) + "_d" + std::to_string(D);
      const AttentionCase base{.dtype = dt, .seq_q = 100, .seq_k = 130, .head_dim = D, .head_dim_v = D};
      auto with = [&](AttentionCase c, const std::string& name) {
        c.name = name + s;
        return c;
      };
      AttentionCase c = base;
      out.push_back(with(c, "cross"));
      c = base, c.kind = Kind::self, c.seq_q = 130, c.causal = true;
      out.push_back(with(c, "causal_self"));
      c = base, c.lengths = {130, 41};
      out.push_back(with(c, "lengths"));
      c = base, c.causal = true, c.offsets = {30, -3};
      out.push_back(with(c, "causal_offset"));
      c = base, c.kind = Kind::self, c.groups = 4, c.seq_q = 130, c.causal = true, c.lengths = {130, 77};
      out.push_back(with(c, "gqa_causal_lengths"));
      c = base, c.heads = 1, c.groups = 8;
      out.push_back(with(c, "mqa"));
      c = base, c.keys_only = 2, c.groups = 2, c.lengths = {130, 41};
      out.push_back(with(c, "keys_only_gqa"));
      c = base, c.kind = Kind::self, c.seq_q = 130, c.causal = true, c.layout = Layout::packed_qkv;
      out.push_back(with(c, "packed_qkv_causal"));
      c = base, c.groups = 2, c.layout = Layout::permuted, c.lengths = {130, 66};
      out.push_back(with(c, "permuted_gqa_lengths"));
      c = base, c.kind = Kind::self, c.seq_q = 130, c.causal = true, c.lengths = {130, 90}, c.dropout = 0.3;
      out.push_back(with(c, "dropout"));
      c = base, c.groups = 2, c.dropout = 0.2;
      out.push_back(with(c, "dropout_gqa"));
      c = base, c.lengths = {120, 9}, c.dropout = 0.5, c.broadcast_dropout = true;
      out.push_back(with(c, "broadcast_dropout"));
      c = base, c.kind = Kind::self, c.groups = 2, c.seq_q = 130, c.causal = true, c.lengths = {130, 97},
      c.dropout = 0.2, c.variants = {.scalars = {.window = AttentionWindow{50, {}}, .softcap = 3.0}, .alibi = true, .sinks = true};
      out.push_back(with(c, "variants_gqa_dropout"));
      c = base, c.groups = 2, c.causal = true, c.offsets = {30, 5}, c.lengths = {130, 70}, c.dropout = 0.1,
      c.variants = {.bias = "htk", .mask = "btk"};
      out.push_back(with(c, "bias_mask_gqa_dropout"));
      c = base, c.lengths = {130, 77}, c.lengths_over = "bt";
      out.push_back(with(c, "lengths_per_query_row"));
      c = base, c.groups = 2, c.causal = true, c.offsets = {30, 5}, c.lengths = {130, 90}, c.lengths_over = "bgt",
      c.dropout = 0.2;
      out.push_back(with(c, "lengths_per_row_gqa_causal_dropout"));
      c = base, c.kind = Kind::self, c.groups = 2, c.seq_q = 130, c.causal = true, c.lengths = {130, 97},
      c.dropout = 0.2, c.variants = {.segment_docs = 40, .segments_over = "bh"};
      out.push_back(with(c, "segments_gqa_causal_dropout"));
    }
}

std::vector<AttentionCase> cpu_cases() {
  std::vector<AttentionCase> out;
  add_cpu_cases(out);
  return out;
}

std::vector<AttentionCase> cuda_cases() {
  std::vector<AttentionCase> out;
  add_cuda_cases(out);
  return out;
}

// A case's operands and the upstream gradient: drawn once on the CPU (on the
// first registered backend) and moved to each backend, so that every backend
// computes from the same values and the Eigen backend's gradients can be
// checked against the torch backend's reference; drawn on the device for
// CUDA runs (compared with the reference there).
struct Operands : testing::Operands {
  Tensor w;  // upstream gradient over out_order, 0 on padded query rows
};

Operands make_operands(AttentionCase c, const std::string& backend, Device device) {
  c.backend = backend;
  c.device = device;
  testing::Operands ops = testing::make_operands(c);
  Tensor w = testing::upstream_gradient(c, ops);
  return {std::move(ops), std::move(w)};
}

// Packed operands as views of a buffer again (after a copy of the buffer).
void repack(Operands& ops) {
  const testing::PackedParts p = testing::packed_parts(*ops.buffer);
  ops.q = p.q, ops.k = p.k, ops.v = p.v;
}

Operands on_backend(Operands ops, const std::string& backend) {
  ops.w = to_backend(ops.w, backend);
  if (ops.buffer) {  // move the buffer once; q, k and v are its views again
    ops.buffer = to_backend(*ops.buffer, backend);
    repack(ops);
  } else {
    for (Tensor* t : {&ops.q, &ops.k, &ops.v}) *t = to_backend(*t, backend);
  }
  if (ops.opts.causal_offset) ops.opts.causal_offset = to_backend(*ops.opts.causal_offset, backend);
  AttentionVariants::for_each_field(ops.opts.variants, [&](const char*, auto& field) {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(field)>, std::optional<Tensor>>)
      if (field) field = to_backend(*field, backend);
  });
  return ops;
}

// The inputs gradients are checked for: q, k, v, then the learnable variant
// tensors the case has (sinks, bias, pos_emb, pos_bias_u, pos_bias_v).
std::vector<std::string> grad_names(const Operands& ops) {
  std::vector<std::string> n = {"q", "k", "v"};
  AttentionVariants::for_each_learnable(ops.opts.variants, [&](const char* name, const std::optional<Tensor>& t) {
    if (t) n.push_back(name);
  });
  return n;
}

struct RunResult {
  std::string kernel;
  Tensor out;
  std::vector<Tensor> grads;  // in grad_names' order; empty without autograd
  std::string isa;            // the code path that ran (AttentionTrace::isa)
};

// A new leaf with x's dims and values, so that gradients never accumulate across runs.
Tensor fresh_leaf(const Tensor& x) {
  return from_host(x.dims(), to_host(x), {.dtype = x.dtype(), .device = x.device(), .backend = x.backend().name()});
}

RunResult run(Operands ops, const std::string& force) {
  ForceKernels guard(force);
  const bool grad = ops.q.backend().has_autograd();
  // Packed operands: the buffer is the leaf, q, k and v stay its views.
  std::vector<Tensor*> leaves = ops.buffer ? std::vector<Tensor*>{&*ops.buffer} : std::vector<Tensor*>{&ops.q, &ops.k, &ops.v};
  AttentionVariants::for_each_learnable(ops.opts.variants, [&](const char*, std::optional<Tensor>& t) {
    if (t) leaves.push_back(&*t);
  });
  if (grad) {
    for (Tensor* t : leaves) *t = fresh_leaf(*t).requires_grad(true);
    if (ops.buffer) repack(ops);
  }
  // Every run draws the same dropout seed, so kernels and the reference must
  // apply the identical mask (the shared Philox stream).
  TrainFlagScope train(ops.opts.att_dropout > 0);
  set_random_seed(1234);
  TraceScope trace(false);  // names the code path, captures nothing
  Tensor out = dot_attention(ops.q, ops.k, ops.v, ops.opts);
  RunResult r{force, out, {}, trace.records().empty() ? "" : trace.records().back().isa};
  if (grad) {
    reduce_sum(mul(out, ops.w), ops.out_order).backward();
    for (Tensor* t : leaves) r.grads.push_back(*t->grad());
    if (ops.buffer) {  // d(buffer) as dq, dk, dv
      const testing::PackedParts d = testing::packed_parts(r.grads[0]);
      r.grads.erase(r.grads.begin());
      r.grads.insert(r.grads.begin(), {d.q, d.k, d.v});
    }
  }
  return r;
}

// Gradients through dot_attention_backward (the backends without autograd),
// with the dropout seed of run().
std::vector<Tensor> backward_grads(const Operands& ops) {
  TrainFlagScope train(ops.opts.att_dropout > 0);
  set_random_seed(1234);
  const AttentionGrads g = dot_attention_backward(ops.q, ops.k, ops.v, ops.opts, ops.w);
  std::vector<Tensor> out = {g.query, g.keys, g.values};
  AttentionVariants::for_each_learnable(g.variants, [&](const char*, const std::optional<Tensor>& t) {
    if (t) out.push_back(*t);
  });
  return out;
}

// Central differences of sum(out · w) through the reference path at a few
// elements of q, k and v (float64 only): the check of dot_attention_backward
// that needs no torch backend. Step 1e-5: truncation ~1e-10·|f'''| and
// rounding ~1e-16·|f|/1e-5, both far below the 1e-7 it is held to.
void expect_grads_match_finite_differences(const std::string& name, const Operands& ops,
                                           const std::vector<Tensor>& grads) {
  auto loss = [&](const Operands& o) {
    ForceKernels force(kReferenceKernel);
    TrainFlagScope train(o.opts.att_dropout > 0);
    set_random_seed(1234);
    return item(reduce_sum(mul(dot_attention(o.q, o.k, o.v, o.opts), o.w), o.out_order));
  };
  constexpr double h = 1e-5;
  Tensor Operands::* const members[] = {&Operands::q, &Operands::k, &Operands::v};
  for (size_t i = 0; i < 3; ++i) {
    const Tensor& x = ops.*members[i];
    const std::vector<double> base = to_host(x, x.dims()), g = to_host(grads[i], x.dims());
    const size_t stride = std::max<size_t>(1, base.size() / 7);
    for (size_t e = 0; e < base.size(); e += stride) {
      double f[2];
      for (int side = 0; side < 2; ++side) {
        std::vector<double> moved = base;
        moved[e] += side == 0 ? h : -h;
        Operands o = ops;
        o.*members[i] = from_host(x.dims(), moved, {.dtype = x.dtype(), .backend = x.backend().name()});
        f[side] = loss(o);
      }
      EXPECT_NEAR(g[e], (f[0] - f[1]) / (2 * h), 1e-7) << name << " d" << "qkv"[i] << " element " << e;
    }
  }
}

bool torch_cuda_available() { return has_backend("torch") && get_backend("torch").supports(kCUDA); }

class Dual : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(Dual, EveryKernelAgreesWithTheReference) {
  const AttentionCase& c = GetParam();
  ASSERT_FALSE(testing::invalid_reason(c)) << c.name << ": " << *testing::invalid_reason(c);
  const Operands source = make_operands(c, backend_names().front(), kCPU);
  const double tol = output_tolerance(c);
  // The reference on the torch backend's CPU: also the Eigen backend's gradients' reference.
  std::optional<RunResult> torch_ref;
  if (has_backend("torch")) torch_ref = run(on_backend(source, "torch"), kReferenceKernel);
  static std::once_flag no_cuda_note;
  if (!torch_cuda_available())
    std::call_once(no_cuda_note, [] { std::cout << "[ dual ] LibTorch sees no CUDA device: CPU runs only\n"; });

  // Under an instruction-set cap (ctest's dual_tests_isa_* runs) only
  // cpu_flash's code changes: those runs check cpu_flash alone, on the CPU of
  // one backend (torch where built: its autograd runs the kernel's backward),
  // against the same reference; every other run is the uncapped harness's.
  const bool isa_run = !expected_cpu_isa(DType::float32).empty();
  const std::vector<std::string> backends =
      !isa_run ? backend_names() : std::vector<std::string>{has_backend("torch") ? "torch" : backend_names().front()};

  // "backend/kernel[@cuda]" for each run, ".../grads" for each gradient check.
  std::set<std::string> expected_runs, runs;
  for (const std::string& backend : backends) {
    ASSERT_TRUE(cpu_kernels().count(backend)) << "backend '" << backend << "' has no expectations here";
    const bool autograd = get_backend(backend).has_autograd();
    for (const Device device : {kCPU, kCUDA}) {
      if (!get_backend(backend).supports(device) || (isa_run && device != kCPU)) continue;
      const bool cpu = device == kCPU;
      const std::string at = cpu ? "" : "@" + device_name(device);
      std::set<std::string> accepts = expected_kernels(c, backend, device);
      if (isa_run) accepts = {"cpu_flash"};
      for (const std::string& k : accepts) {
        expected_runs.insert(backend + "/" + k + at);
        // Gradients: through autograd, or dot_attention_backward (cpu_flash)
        // against the torch backend's reference and float64 finite differences.
        if (autograd || (k == "cpu_flash" && torch_ref)) expected_runs.insert(backend + "/" + k + at + "/grads");
        if (!autograd && k == "cpu_flash" && c.dtype == DType::float64 && c.logit_scale() == 1)
          expected_runs.insert(backend + "/" + k + "/finite_differences");
      }
      const Operands ops = cpu ? on_backend(source, backend) : make_operands(c, backend, device);
      const RunResult ref = cpu && backend == "torch" ? *torch_ref : run(ops, kReferenceKernel);
      for (const std::string& kernel : get_backend(backend).attention_kernels(device)) {
        if (kernel == kReferenceKernel || (isa_run && kernel != "cpu_flash")) continue;
        const std::string run_name = backend + "/" + kernel + at;
        const std::string where = c.name + " " + run_name;
        std::optional<RunResult> got;
        const uint64_t copies_before = selection_stats().layout_copies;
        const std::string err = error_of([&] { got = run(ops, kernel); });
        if (!err.empty()) {
          EXPECT_NE(err.find("[dot_attention]"), std::string::npos) << err;
          // The kernel's own reason, from the decision with it first in line.
          std::string reason = err;
          {
            TrainFlagScope train(ops.opts.att_dropout > 0);
            reason = testing::rejection(ops, kernel).value_or(err);
          }
          EXPECT_FALSE(reason.empty()) << where;
          EXPECT_FALSE(accepts.count(kernel)) << where << " must take this case but rejected it: " << reason;
          std::cout << "[ dual ] " << where << ": rejected: " << reason << "\n";
          continue;
        }
        EXPECT_TRUE(accepts.count(kernel) || optional_kernel(kernel, device))
            << where << " took a case its gate should reject (see expected_kernels)";
        // A layout case reaches the kernel as it lies (detected from strides)
        // and as views: always for dimattn's kernels; for ATen's without query
        // groups (with them kv is expanded per group, and [B, H, G, T, D] with a
        // zero G stride merges into no [B, H, T, D] head axis: one counted copy).
        if (c.layout != Layout::separate) {
          const bool views = c.groups == 1 || kernel.rfind("aten_", 0) != 0;  // ATen's kernels are aten_*
          const LayoutClass want = c.layout == Layout::packed_qkv ? LayoutClass::packed_qkv : LayoutClass::permuted;
          {
            ForceKernels force(kernel);
            EXPECT_EQ(std::string(layout_name(explain_attention(ops.q, ops.k, ops.v, ops.opts).params.layout)),
                      layout_name(want))
                << where;
          }
          if (views) EXPECT_EQ(selection_stats().layout_copies, copies_before) << where << " copied q, k or v";
        }
        if (accepts.count(kernel)) runs.insert(run_name);
        if (kernel == "cpu_flash") {
          const std::string isa = expected_cpu_isa(c.dtype);
          if (isa.empty())
            EXPECT_FALSE(got->isa.empty()) << where << ": cpu_flash named no instruction set";
          else
            EXPECT_EQ(got->isa, isa) << where << ": DIMATTN_CPU_ISA=" << std::getenv("DIMATTN_CPU_ISA");
        }
        const double e = testing::max_abs_diff(got->out, ref.out, ops.out_order);
        std::cout << "[ dual ] " << where << ": max abs err " << e;
        EXPECT_LE(e, testing::tolerance_at_scale(tol, ref.out)) << where;
        auto expect_grads_close = [&](const std::vector<Tensor>& grads, const std::vector<Tensor>& want) {
          const std::vector<std::string> names = grad_names(ops);
          ASSERT_EQ(grads.size(), names.size()) << where << ": a gradient is missing";
          ASSERT_EQ(want.size(), names.size()) << where << ": a reference gradient is missing";
          for (size_t i = 0; i < grads.size(); ++i) {
            const double ge = testing::max_abs_diff(grads[i], want[i], grads[i].dims());
            std::cout << ", d" << names[i] << " " << ge;
            EXPECT_LE(ge, testing::tolerance_at_scale(gradient_tolerance(c, i), want[i]))
                << where << " grad of " << names[i];
          }
          if (accepts.count(kernel)) runs.insert(run_name + "/grads");
        };
        if (!got->grads.empty()) {
          expect_grads_close(got->grads, ref.grads);
        } else if (kernel == "cpu_flash") {
          // No autograd: dot_attention_backward, against the torch backend's
          // reference from the same values, and (float64) finite differences.
          const std::vector<Tensor> grads = backward_grads(ops);
          if (torch_ref) expect_grads_close(grads, torch_ref->grads);
          if (c.dtype == DType::float64 && c.logit_scale() == 1) {
            expect_grads_match_finite_differences(where, ops, grads);
            runs.insert(run_name + "/finite_differences");
          }
        }
        std::cout << "\n";
      }
    }
  }
  EXPECT_EQ(runs, expected_runs) << c.name << ": the runs and gradient checks that happened, and those expected";
}

// Each backend's table lists exactly the CPU kernels the rule above knows.
TEST(DualKernels, EveryCpuKernelHasExpectations) {
  ASSERT_FALSE(backend_names().empty());
  for (const std::string& backend : backend_names()) {
    ASSERT_TRUE(cpu_kernels().count(backend)) << backend;
    std::set<std::string> listed;
    for (const std::string& k : get_backend(backend).attention_kernels(kCPU))
      if (k != kReferenceKernel) listed.insert(k);
    EXPECT_EQ(listed, cpu_kernels().at(backend)) << backend;
  }
}

std::string case_name(const ::testing::TestParamInfo<AttentionCase>& i) { return i.param.name; }

// One harness, two instantiations: the prefix CudaDual keeps the cuda_flash
// cases selectable as scripts/gpu-check selects them ('*CudaDual*').
INSTANTIATE_TEST_SUITE_P(Cases, Dual, ::testing::ValuesIn(cpu_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(CudaDual, Dual, ::testing::ValuesIn(cuda_cases()), case_name);

// q, k, v as views of one packed [T, B, 3, H, D] buffer reach cuda_flash
// without a copy.
TEST(CudaDualLayouts, PackedQkvIsZeroCopy) {
  if (!torch_cuda_available()) GTEST_SKIP() << "LibTorch sees no CUDA device";
  Dim time("time", 256), batch("batch", 2), three("qkv", 3), heads("heads", 4), feat("feat", 64);
  Dim one("one", 1);
  Tensor buffer = random_normal({time, batch, three, heads, feat}, 7,
                                {.dtype = DType::bfloat16, .device = kCUDA, .backend = "torch"});
  Tensor q = slice(buffer, three, 0, 1, one).first;
  Tensor k = slice(buffer, three, 1, 2, one).first;
  Tensor v = slice(buffer, three, 2, 3, one).first;
  AttentionOptions o{.key_dim = feat, .axis = time, .causal_query_spatial_dim = time};
  ForceKernels force("cuda_flash");
  const uint64_t copies_before = selection_stats().layout_copies;
  Tensor fast = dot_attention(q, k, v, o);
  EXPECT_EQ(selection_stats().layout_copies, copies_before) << "q, k and v reach the kernel as views";
  Tensor ref = [&] {
    ForceKernels ref_force("reference");
    return dot_attention(q, k, v, o);
  }();
  EXPECT_LE(testing::max_abs_diff(fast, ref, {time, batch, one, heads, feat}),
            reference_tolerance(DType::bfloat16));
}

// q, k and v split from one fused [T, B, Hq + 2*Hkv, D] buffer (GQA, 16 query
// heads, one kv head): a kernel that took the layout from a label rather than
// the strides once gave a max error of 6.19 here.
TEST(DualLayouts, FusedGqaBufferSplitIntoQkv) {
  for (const std::string& backend : backend_names()) {
    Dim time("time", 2048), batch("batch", 1), all_heads("heads", 18), feat("feat", 64);
    Dim q_heads("q_heads", 16), kv_heads("kv_heads", 1);
    Tensor buffer = random_normal({time, batch, all_heads, feat}, 7, {.backend = backend});
    Tensor q = slice(buffer, all_heads, 0, 16, q_heads).first;
    Tensor k = slice(buffer, all_heads, 16, 17, kv_heads).first;
    Tensor v = slice(buffer, all_heads, 17, 18, kv_heads).first;
    for (bool causal : {false, true}) {
      AttentionOptions o{.key_dim = feat, .axis = time};
      if (causal) o.causal_query_spatial_dim = time;
      const uint64_t copies_before = selection_stats().layout_copies;
      Tensor fast = dot_attention(q, k, v, o);
      EXPECT_EQ(selection_stats().layout_copies, copies_before) << "q, k and v reach the kernel as views";
      const Decision d = explain_attention(q, k, v, o);
      Tensor ref = [&] {
        ForceKernels force("reference");
        return dot_attention(q, k, v, o);
      }();
      const double e = testing::max_abs_diff(fast, ref, {time, batch, kv_heads, q_heads, feat});
      std::cout << "[ dual ] fused GQA buffer, " << backend << ", causal " << causal << ": " << d.explain()
                << "\n  max abs err " << e << "\n";
      EXPECT_LE(e, 1e-5);
    }
  }
}

TEST(DualSelection, OneSelectionPerDistinctKeyOver1000Calls) {
  reset_selection_cache();
  std::set<std::string> keys_seen;
  uint64_t calls = 0;
  TrainFlagScope train(true);
  for (int i = 0; i < 1000; ++i) {
    const std::string backend = backend_names()[i % backend_names().size()];
    const int64_t B = 1 + i % 4, T = 1 + (i * 7) % 13;
    std::vector<double> lens;
    for (int64_t b = 0; b < B; ++b) lens.push_back(static_cast<double>((i + b) % (T + 1)));
    Dim batch("batch", B), feat("feat", 4);
    Dim time = Dim::dynamic("time", from_host({batch}, lens, {.dtype = DType::int64, .backend = backend}), T);
    const DType dt = i % 3 == 0 ? DType::float64 : DType::float32;
    Tensor x = random_normal({batch, time, feat}, static_cast<uint64_t>(i), {.dtype = dt, .backend = backend});
    AttentionOptions o{.key_dim = feat, .axis = time, .att_dropout = i % 5 == 0 ? 0.1 : 0.0};
    if (i % 2) o.causal_query_spatial_dim = time;
    dot_attention(x, x, x, o);
    ++calls;
    keys_seen.insert(backend + (i % 3 == 0 ? "f64" : "f32") + (i % 2 ? "c" : "n") + (i % 5 == 0 ? "d" : ""));
  }
  const SelectionStats s = selection_stats();
  EXPECT_EQ(s.lookups, calls);
  EXPECT_EQ(s.selections, s.entries);
  EXPECT_EQ(s.entries, keys_seen.size()) << "batch sizes, lengths and seeds must not be part of the key";
}

TEST(DualConcurrency, EightThreadsWithMixedConfigsAndForcing) {
  struct Config {
    std::string backend, force;
    bool causal;
  };
  std::vector<Config> configs;
  for (const std::string& b : backend_names())
    for (const std::string& k : get_backend(b).attention_kernels(kCPU))
      for (bool causal : {false, true}) configs.push_back({b, k, causal});
  Dim batch("batch", 2), time("time", 16), feat("feat", 8);
  auto compute = [&](const Config& c) {
    ForceKernels force(c.force);
    Tensor x = random_normal({batch, time, feat}, 5, {.backend = c.backend});
    AttentionOptions o{.key_dim = feat, .axis = time};
    if (c.causal) o.causal_query_spatial_dim = time;
    return to_host(dot_attention(x, x, x, o), Dims{batch, time, feat});
  };
  std::vector<std::vector<double>> expected;
  for (const Config& c : configs) expected.push_back(compute(c));
  const SelectionStats before = selection_stats();
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  constexpr int kThreads = 8, kCalls = 100;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        const size_t c = static_cast<size_t>(t * 31 + i) % configs.size();
        if (compute(configs[c]) != expected[c]) ++mismatches;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  const SelectionStats after = selection_stats();
  EXPECT_EQ(after.lookups - before.lookups, static_cast<uint64_t>(kThreads * kCalls));
  EXPECT_EQ(after.selections, after.entries);
}

}  // namespace
}  // namespace dimattn
