#pragma once
// An attention call described by sizes and flags (what the subcommands vary),
// its named operands, and running one kernel on them.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/dtype.h"
#include "dimattn/tensor.h"

namespace dimattn::cli {

enum class Kind {
  self,   // q, k, v over one time dim (axis in the query)
  cross,  // query time vs a separate kv dim
  step,   // one decoding step: a query without a spatial dim
};
const char* kind_name(Kind);

struct Problem {
  std::string backend = "torch";
  Device device = kCPU;
  DType dtype = DType::float32;
  Kind kind = Kind::self;
  int64_t batch = 1, heads = 1;
  // Query rows per kv head from a dim only the query has: GQA query heads
  // ("group"), or beam hypotheses ("beam"). 1: no such dim.
  int64_t groups = 1;
  std::string group_name = "group";
  int64_t seq_q = 1, seq_k = 1;  // seq_q is ignored for Kind::step; equals seq_k for Kind::self
  int64_t head_dim = 8, head_dim_v = 8;
  bool causal = false;
  std::vector<int64_t> lengths;  // kv lengths per batch entry; empty: a static kv dim
  std::vector<int64_t> offsets;  // causal offset (history length) per batch entry; empty: none
  double dropout = 0;
  bool broadcast_dropout = false;
  std::optional<double> scale;
  uint64_t seed = 1;

  // Query rows attending each kv row: groups x query positions.
  int64_t query_rows() const { return groups * (kind == Kind::step ? 1 : seq_q); }
  // Forward FLOPs, 4·B·H·rows·Tk·D, halved for causal (DESIGN.md §9).
  double flops() const;
  std::string describe() const;  // one line, for reports
};

// Throws UsageError when the sizes and flags do not make one call.
void validate(const Problem& p);

// Throws UsageError naming `option` when a name is neither a kernel nor "auto".
void check_kernel_names(const std::string& option, const std::vector<std::string>& names);

struct Operands {
  Tensor q, k, v;
  AttentionOptions opts;
  Dims out_order;  // the output's dims in a fixed order, for comparisons
};

// Unit-normal q, k, v (seeds from p.seed); with requires_grad on backends with autograd.
Operands make_operands(const Problem& p, bool requires_grad = false);

// Why `kernel` cannot run these operands (its gate's reason), or nullopt when
// it can. "reference" always can.
std::optional<std::string> rejection(const Operands& ops, const std::string& kernel);

// dot_attention with kernels forced to `spec` ("auto", "reference", a kernel name).
Tensor run_forced(const Operands& ops, const std::string& spec);

// Largest |a - b| over `order`; NaN anywhere gives +inf.
double max_abs_diff(const Tensor& a, const Tensor& b, const Dims& order);
double max_abs(const Tensor& a);

// Waits for the device work that produced x (a no-op on the CPU).
void synchronize(const Tensor& x);

}  // namespace dimattn::cli
