// The `dimattn` command-line tool.
//   dimattn example   named tensors, matmul and masked softmax on every backend
#include <cstdio>
#include <cstring>
#include <string>

#include "dimattn/error.h"
#include "dimattn/ops.h"
#include "dimattn/registry.h"

namespace {
using namespace dimattn;

void print(const char* label, const Tensor& t, const Dims& order) {
  std::printf("  %s %s:", label, repr(order).c_str());
  for (double v : to_host(t, order)) std::printf(" %.4f", v);
  std::printf("\n");
}

int run_example() {
  Dim batch("batch", 2), feat("feat", 2);
  for (const std::string& name : backend_names()) {
    TensorOptions opts{.backend = name};
    Tensor lengths = from_host({batch}, {3, 2}, {.dtype = DType::int64, .backend = name});
    Dim time = Dim::dynamic("time", lengths);
    Tensor x = from_host({batch, time, feat}, {1, 0, 0, 1, 1, 1, 2, 0, 0, 2, 9, 9}, opts);
    Tensor w = from_host({feat}, {0.5, -1}, opts);
    Tensor scores = matmul(x, w, {feat});
    Tensor probs = softmax(scores, time);
    std::printf("backend %s, time %s:\n", name.c_str(), time.repr().c_str());
    print("scores", scores, {batch, time});
    print("softmax over time (padding masked)", probs, {batch, time});
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc >= 2 && std::strcmp(argv[1], "example") == 0) return run_example();
    std::fprintf(stderr, "usage: dimattn example\n");
    return 2;
  } catch (const dimattn::Error& e) {
    std::fprintf(stderr, "dimattn: %s\n", e.what());
    return 1;
  }
}
