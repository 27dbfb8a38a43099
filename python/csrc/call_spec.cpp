// Parsing the call spec (call_spec.h). No LibTorch here: it compiles fast and
// stays testable without it.
#include "call_spec.h"

#include <charconv>
#include <cstdlib>

#include "dimattn/error.h"

namespace dimattn::python {
namespace {

[[noreturn]] void bad(std::string_view entry, const std::string& why) {
  throw Error("[dimattn op] bad call spec entry '" + std::string(entry) + "': " + why +
              "; the dimattn Python package and its op library may be of different versions");
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> parts;
  if (s.empty()) return parts;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    parts.emplace_back(s.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return parts;
}

int64_t to_int(std::string_view entry, std::string_view s) {
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) bad(entry, "'" + std::string(s) + "' is not an integer");
  return v;
}

double to_double(std::string_view entry, const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) bad(entry, "'" + s + "' is not a number");
  return v;
}

// "I:d1,d2" -> (I, [d1, d2])
std::pair<int, std::vector<std::string>> indexed(std::string_view entry, std::string_view value) {
  const size_t colon = value.find(':');
  if (colon == std::string_view::npos) bad(entry, "expected INDEX:dims");
  return {static_cast<int>(to_int(entry, value.substr(0, colon))), split(value.substr(colon + 1), ',')};
}

// "LEFT:RIGHT", either side empty for unbounded.
WindowSpec window(std::string_view entry, std::string_view value) {
  const size_t colon = value.find(':');
  if (colon == std::string_view::npos) bad(entry, "expected LEFT:RIGHT");
  auto side = [&](std::string_view v) { return v.empty() ? std::nullopt : std::optional<int64_t>(to_int(entry, v)); };
  return {side(value.substr(0, colon)), side(value.substr(colon + 1))};
}

}  // namespace

CallSpec parse_call_spec(std::string_view text) {
  CallSpec s;
  for (const std::string& entry : split(text, ';')) {
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string::npos) bad(entry, "expected key=value");
    const std::string_view key = std::string_view(entry).substr(0, eq);
    const std::string value = entry.substr(eq + 1);
    if (key == "q") s.q = split(value, ',');
    else if (key == "k") s.k = split(value, ',');
    else if (key == "v") s.v = split(value, ',');
    else if (key == "out") s.out = split(value, ',');
    else if (key == "energy") s.energy = split(value, ',');
    else if (key == "key_dim") s.key_dim = value;
    else if (key == "axis") s.axis = value;
    else if (key.starts_with("dyn.")) {
      auto [index, over] = indexed(entry, value);
      s.dynamic.push_back({std::string(key.substr(4)), index, std::move(over)});
    } else if (key.starts_with("size.")) s.sizes[std::string(key.substr(5))] = to_int(entry, value);
    else if (key == "causal") s.causal = value;
    else if (key == "causal_offset") {
      auto [index, over] = indexed(entry, value);
      s.causal_offset = index;
      s.causal_offset_dims = std::move(over);
    } else if (key == "causal_offset_int") s.causal_offset_int = to_int(entry, value);
    else if (key == "dropout") s.dropout = to_double(entry, value);
    else if (key == "broadcast") s.broadcast = value == "1";
    else if (key == "train") s.train = value == "1";
    else if (key == "seed") s.seed = static_cast<int>(to_int(entry, value));
    else if (key == "scale") s.scale = to_double(entry, value);
    else if (key == "force") s.force = value;
    else if (key == "query_position") s.query_position = value;
    else if (key == "window") s.window = window(entry, value);
    else if (key == "softcap") s.softcap = to_double(entry, value);
    else if (key == "alibi" || key == "sinks" || key == "bias" || key == "mask") {
      auto [index, over] = indexed(entry, value);
      std::optional<AuxTensorSpec>& t =
          key == "alibi" ? s.alibi : key == "sinks" ? s.sinks : key == "bias" ? s.bias : s.mask;
      t = AuxTensorSpec{index, std::move(over)};
    } else if (key == "sink_off_by_one") s.sink_off_by_one = value == "1";
    else if (key == "cp") {
      const std::vector<std::string> parts = split(value, ':');
      if (parts.size() < 4) bad(entry, "expected SHARDING:STRATEGY:TIMEOUT:GROUP");
      std::string group = parts[3];
      for (size_t i = 4; i < parts.size(); ++i) group += ":" + parts[i];
      s.context_parallel = CallSpec::ContextParallelSpec{
          parts[0], parts[1], group, parts[2].empty() ? std::nullopt : std::optional<double>(to_double(entry, parts[2]))};
    } else if (key == "cp_lengths") {
      auto [index, over] = indexed(entry, value);
      s.cp_lengths = AuxTensorSpec{index, std::move(over)};
    }
    else bad(entry, "unknown key '" + std::string(key) + "'");
  }
  if (s.key_dim.empty() || s.axis.empty()) bad(text, "key_dim and axis are required");
  return s;
}

}  // namespace dimattn::python
