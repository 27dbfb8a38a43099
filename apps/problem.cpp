#include "problem.h"

#include <algorithm>

#include "cli_args.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"

namespace dimattn::cli {

void validate(const AttentionCase& p) {
  if (const auto why = testing::invalid_reason(p)) throw UsageError(*why);
  for (int64_t o : p.offsets)
    if (o < 0) throw UsageError("causal offsets must be at least 0");
}

void check_kernel_names(const std::string& option, const std::vector<std::string>& names) {
  const std::vector<std::string>& known = all_kernel_names();
  for (const std::string& k : names)
    if (k != "auto" && std::find(known.begin(), known.end(), k) == known.end()) {
      std::string list;
      for (const std::string& n : known) list += " " + n;
      throw UsageError("--" + option + ": unknown kernel '" + k + "'; kernels: auto" + list);
    }
}

void synchronize(const Tensor& x) {
  if (x.device().type == DeviceType::cpu) return;
  // Copying one element to the host waits for the work queued before it.
  Tensor one = x;
  for (const Dim& d : x.dims())
    if (!d.is_dynamic() && d.extent() > 1) one = slice(one, d, 0, 1).first;
  to_host(one);
}

}  // namespace dimattn::cli
