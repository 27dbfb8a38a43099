#include "problem.h"

#include <algorithm>
#include <cstdlib>
#include <optional>

#include "cli_args.h"
#include "dimattn/forcing.h"
#include "dimattn/ops.h"

namespace dimattn::cli {

void validate(const AttentionCase& p) {
  if (const auto why = testing::invalid_reason(p)) throw UsageError(*why);
  for (int64_t o : p.offsets)
    if (o < 0) throw UsageError("causal offsets must be at least 0");
}

namespace {

// The option of each scalar variant, by its field's kind (AttentionVariants::
// for_each_field): "--window LEFT:RIGHT", "--NAME X" for a number, "--NAME"
// for a flag (underscores become dashes).
// Tensor variants are made per case (the options below).
std::string option_name(const char* field) {
  std::string s = field;
  std::replace(s.begin(), s.end(), '_', '-');
  return s;
}
std::optional<Option> scalar_option(const char* f, const std::optional<AttentionWindow>&) {
  return Option{option_name(f), "LEFT:RIGHT", "sliding window: kv positions left and right of the diagonal each "
                                              "query sees (a side left empty is unbounded; right not with --causal)"};
}
std::optional<Option> scalar_option(const char* f, const std::optional<double>&) {
  return Option{option_name(f), "X", std::string("the variant ") + f + " (docs/api.md, \"Variants\")"};
}
std::optional<Option> scalar_option(const char* f, bool) {
  return Option{option_name(f), "", std::string("the variant ") + f + " (docs/api.md, \"Variants\")"};
}
std::optional<Option> scalar_option(const char*, const std::optional<Tensor>&) { return std::nullopt; }

void parse(const Args& a, const char* f, std::optional<AttentionWindow>& w) {
  const std::string name = option_name(f);
  const std::optional<std::string> v = a.value(name);
  if (!v) return;
  const size_t colon = v->find(':');
  if (colon == std::string::npos) a.fail(name, "'" + *v + "' is not LEFT:RIGHT (a side may be empty)");
  auto side = [&](const std::string& text) -> std::optional<int64_t> {
    if (text.empty()) return std::nullopt;
    char* end = nullptr;
    const long long n = std::strtoll(text.c_str(), &end, 10);
    if (*end != '\0' || n < 0) a.fail(name, "'" + text + "' is not a number of kv positions >= 0");
    return n;
  };
  w = AttentionWindow{side(v->substr(0, colon)), side(v->substr(colon + 1))};
}
void parse(const Args& a, const char* f, std::optional<double>& x) {
  if (a.value(option_name(f))) x = a.number(option_name(f), 0);
}
void parse(const Args& a, const char* f, bool& on) { on = a.flag(option_name(f)); }
void parse(const Args&, const char*, std::optional<Tensor>&) {}

}  // namespace

std::vector<Option> with_variant_options(std::vector<Option> options) {
  AttentionVariants none;
  AttentionVariants::for_each_field(none, [&](const char* f, const auto& field) {
    if (std::optional<Option> o = scalar_option(f, field)) options.push_back(*o);
  });
  options.insert(options.end(),
                 {{"alibi", "", "ALiBi slopes per head"},
                  {"sinks", "", "a sink logit per head"},
                  {"bias", "DIMS", "an additive bias over the dims named by letters of bhgtk (batch, heads, "
                                   "group, query time, kv), e.g. htk"},
                  {"mask", "DIMS", "a bool mask over dims as --bias, true with probability 3/4"}});
  return options;
}

void apply_variants(const Args& a, testing::CaseVariants& p) {
  AttentionVariants::for_each_field(p.scalars, [&](const char* f, auto& field) { parse(a, f, field); });
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
