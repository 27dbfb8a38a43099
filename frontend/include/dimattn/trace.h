#pragma once
// Tracing dot_attention calls. While a TraceScope is active on a thread, each
// dot_attention call on that thread is recorded in every active scope. With
// capture_tensors (the default) the call runs the reference path and the
// record holds `energy` (q·k·scale, before masking and softmax) and
// `att_weights` (after masking, softmax and dropout) as named tensors with the
// call's own dims; without, the call runs as selected and only the kernel name
// and output are recorded.
#include <optional>
#include <string>
#include <vector>

#include "dimattn/tensor.h"

namespace dimattn {

struct AttentionTrace {
  std::string kernel;  // the kernel that ran ("reference", "aten_flash_cpu", ...)
  Tensor output;
  std::optional<Tensor> energy;       // when captured
  std::optional<Tensor> att_weights;  // when captured
  // Shapes of query, keys and values as the kernel received them (after
  // roles were formed): shows that keys/values were not tiled over query dims.
  std::vector<int64_t> query_shape, keys_shape, values_shape;
  std::string isa;  // the kernel's code path where it has several (Decision::isa), else ""
};

class TraceScope {
 public:
  explicit TraceScope(bool capture_tensors = true);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

  bool capture_tensors() const { return capture_; }
  const std::vector<AttentionTrace>& records() const { return records_; }

  // Used by dot_attention.
  static bool active();
  static bool capturing();  // any active scope captures tensors
  static void record(const AttentionTrace& trace);

 private:
  bool capture_;
  std::vector<AttentionTrace> records_;
};

}  // namespace dimattn
