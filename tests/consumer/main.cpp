// Builds a tiny attention call through the installed package.
#include <cstdio>

#include "dimattn/attention.h"
#include "dimattn/ops.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"

int main() {
  using namespace dimattn;
  for (const std::string& backend : backend_names()) {
    Dim time("time", 3), feat("feat", 2);
    TensorOptions opts{.backend = backend};
    Tensor x = from_host({time, feat}, {1, 0, 0, 1, 1, 1}, opts);
    Tensor y = dot_attention(x, x, x, {.key_dim = feat, .axis = time});
    std::vector<double> host = to_host(y, Dims{time, feat});
    std::printf("%s: %zu values, first %.4f\n", backend.c_str(), host.size(), host[0]);
    if (host.size() != 6) return 1;
  }
  return backend_names().empty() ? 1 : 0;
}
