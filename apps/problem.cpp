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

std::vector<Option> with_variant_options(std::vector<Option> options) {
  options.insert(options.end(),
                 {{"window-left", "N", "sliding window: kv positions left of the diagonal each query sees"},
                  {"window-right", "N", "sliding window: kv positions right of the diagonal (not with --causal)"},
                  {"softcap", "X", "logit soft-capping: energies -> X tanh(energy / X)"},
                  {"alibi", "", "ALiBi slopes per head"},
                  {"sinks", "", "a sink logit per head"},
                  {"bias", "DIMS", "an additive bias over the dims named by letters of bhgtk (batch, heads, "
                                   "group, query time, kv), e.g. htk"},
                  {"mask", "DIMS", "a bool mask over dims as --bias, true with probability 3/4"}});
  return options;
}

void apply_variants(const Args& a, testing::CaseVariants& p) {
  if (a.value("window-left")) p.window_left = a.integer("window-left", 0, 0);
  if (a.value("window-right")) p.window_right = a.integer("window-right", 0, 0);
  if (a.value("softcap")) p.softcap = a.number("softcap", 0);
  p.alibi = a.flag("alibi");
  p.sinks = a.flag("sinks");
  p.bias = a.text("bias", "");
  p.mask = a.text("mask", "");
  for (const char* option : {"bias", "mask"})
    for (char x : a.text(option, ""))
      if (std::string("bhgtk").find(x) == std::string::npos)
        a.fail(option, std::string("'") + x + "' names no dim; use letters of bhgtk (batch, heads, group, query time, kv)");
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
