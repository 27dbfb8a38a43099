#pragma once
// What the fuzz targets share: their dtype choice, and for their plain-loop
// oracles a tensor's values read by named index and the softmax average.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "dimattn/ops.h"
#include "dimattn/tensor.h"

namespace dimattn::fuzz {

// DIMATTN_FUZZ_STATS=1: what the inputs gave, printed at exit (to see that
// they reach the kernels).
struct Stats {
  const char* target;
  long results = 0, checked = 0, errors = 0, appends = 0;
  ~Stats() {
    if (std::getenv("DIMATTN_FUZZ_STATS"))
      std::fprintf(stderr, "%s: %ld results (%ld value-checked), %ld errors, %ld appends checked\n", target, results,
                   checked, errors, appends);
  }
};

// Mostly float32; float64, bfloat16, float16 and int32 one in 16 each.
inline DType pick_dtype(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 12: return DType::float64;
    case 13: return DType::bfloat16;
    case 14: return DType::float16;
    case 15: return DType::int32;
    default: return DType::float32;
  }
}

// sum_t softmax(logits)_t * value(t), a sink logit (if any) joining the
// denominator only; 0 without logits.
inline double softmax_average(const std::vector<double>& logits, std::optional<double> sink,
                              const std::function<double(size_t)>& value) {
  if (logits.empty()) return 0;
  const double mx = std::max(*std::max_element(logits.begin(), logits.end()), sink.value_or(-INFINITY));
  double z = sink ? std::exp(*sink - mx) : 0.0, out = 0;
  for (double x : logits) z += std::exp(x - mx);
  for (size_t t = 0; t < logits.size(); ++t) out += std::exp(logits[t] - mx) / z * value(t);
  return out;
}

// A tensor's values on the host, read by named index (an index map may hold
// more dims than the tensor has; those are ignored).
struct Host {
  Dims dims;
  std::vector<double> data;
  std::vector<int64_t> strides;
  explicit Host(const Tensor& t) : dims(t.dims()), data(to_host(t)), strides(dims.size()) {
    int64_t s = 1;
    for (int a = static_cast<int>(dims.size()) - 1; a >= 0; --a) {
      strides[a] = s;
      s *= dims[a].extent();
    }
  }
  double at(const std::map<Dim, int64_t>& idx) const {
    int64_t off = 0;
    for (size_t a = 0; a < dims.size(); ++a) off += idx.at(dims[a]) * strides[a];
    return data[static_cast<size_t>(off)];
  }
  // Whether every dim of the tensor has an index in idx.
  bool indexed_by(const std::map<Dim, int64_t>& idx) const {
    for (const Dim& d : dims)
      if (!idx.count(d)) return false;
    return true;
  }
};

}  // namespace dimattn::fuzz

// One thread for dimattn's own CPU kernels: a fuzzer uses one core (the thread
// pool is the concurrency tests' and TSan's subject, not the fuzzers'). Each
// target that includes this header gets it as its libFuzzer initializer.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("DIMATTN_NUM_THREADS", "1", /*overwrite=*/0);
  return 0;
}
