#include "cli_args.h"

#include <algorithm>
#include <cstdlib>

#include "dimattn/error.h"

namespace dimattn::cli {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end - start));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

}  // namespace

std::string one_line(std::string s) {
  for (size_t i; (i = s.find('\n')) != std::string::npos;) {
    const size_t end = s.find_first_not_of(' ', i + 1);
    const bool after_colon = i > 0 && s[i - 1] == ':';
    s.replace(i, (end == std::string::npos ? s.size() : end) - i, after_colon ? " " : "; ");
  }
  return s;
}

Args::Args(std::string command, std::string summary, std::vector<Option> options, int argc, char** argv, int first)
    : command_(std::move(command)), summary_(std::move(summary)), options_(std::move(options)) {
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + arg + "'");
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const Option& o = declared(name);
    if (o.value_name.empty()) {
      if (inline_value) fail(name, "takes no value");
    } else if (!inline_value) {
      if (i + 1 >= argc) fail(name, "needs a value (" + o.value_name + ")");
      value = argv[++i];
    }
    given_.emplace_back(name, value);
  }
}

const Option& Args::declared(const std::string& name) const {
  for (const Option& o : options_)
    if (o.name == name) return o;
  throw UsageError("unknown option '--" + name + "' (see dimattn " + command_ + " --help)");
}

void Args::fail(const std::string& name, const std::string& what) const {
  throw UsageError("--" + name + ": " + what);
}

std::string Args::usage() const {
  std::string s = summary_ + "\n\nOptions:\n";
  size_t width = 0;
  for (const Option& o : options_) width = std::max(width, o.name.size() + o.value_name.size() + 1);
  for (const Option& o : options_) {
    std::string left = "--" + o.name + (o.value_name.empty() ? "" : " " + o.value_name);
    left.resize(width + 4, ' ');
    s += "  " + left + o.help + "\n";
  }
  std::string help = "--help";
  help.resize(width + 4, ' ');
  return s + "  " + help + "this text\n";
}

bool Args::flag(const std::string& name) const {
  declared(name);
  for (const auto& [n, v] : given_)
    if (n == name) return true;
  return false;
}

std::optional<std::string> Args::value(const std::string& name) const {
  declared(name);
  std::optional<std::string> last;  // the last occurrence wins
  for (const auto& [n, v] : given_)
    if (n == name) last = v;
  return last;
}

std::string Args::text(const std::string& name, const std::string& fallback) const {
  return value(name).value_or(fallback);
}

int64_t Args::integer(const std::string& name, int64_t fallback, int64_t min) const {
  const auto v = value(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  if (v->empty() || *end != '\0') fail(name, "'" + *v + "' is not an integer");
  if (n < min) fail(name, "must be at least " + std::to_string(min) + ", got " + *v);
  return n;
}

double Args::number(const std::string& name, double fallback) const {
  const auto v = value(name);
  if (!v) return fallback;
  char* end = nullptr;
  const double x = std::strtod(v->c_str(), &end);
  if (v->empty() || *end != '\0') fail(name, "'" + *v + "' is not a number");
  return x;
}

std::vector<std::string> Args::texts(const std::string& name, const std::vector<std::string>& fallback) const {
  const auto v = value(name);
  if (!v) return fallback;
  std::vector<std::string> out = split(*v, ',');
  for (const std::string& s : out)
    if (s.empty()) fail(name, "empty entry in '" + *v + "'");
  return out;
}

std::vector<int64_t> Args::integers(const std::string& name, const std::vector<int64_t>& fallback,
                                    int64_t min) const {
  const auto v = value(name);
  if (!v) return fallback;
  std::vector<int64_t> out;
  for (const std::string& s : split(*v, ',')) {
    char* end = nullptr;
    const long long n = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0') fail(name, "'" + s + "' is not an integer");
    if (n < min) fail(name, "values must be at least " + std::to_string(min) + ", got " + s);
    out.push_back(n);
  }
  return out;
}

std::vector<DType> Args::dtypes(const std::string& name, const std::vector<DType>& fallback) const {
  if (!value(name)) return fallback;
  std::vector<DType> out;
  for (const std::string& s : texts(name, {})) {
    DType d;
    try {
      d = parse_dtype(s);
    } catch (const Error&) {
      fail(name, "unknown dtype '" + s + "'");
    }
    if (!is_floating(d)) fail(name, "attention needs a floating dtype, got '" + s + "'");
    out.push_back(d);
  }
  return out;
}

}  // namespace dimattn::cli
