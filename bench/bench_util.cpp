#include "bench_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

namespace dimattn::bench {

// ---------------------------------------------------------------------------
// Clocks and statistics

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double cpu_s() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

namespace {
bool g_cpu_clock = false;
}  // namespace

void use_cpu_clock(bool cpu) { g_cpu_clock = cpu; }

double time_call(const std::function<void()>& f) {
  const double t0 = g_cpu_clock ? cpu_s() : now_s();
  f();
  return (g_cpu_clock ? cpu_s() : now_s()) - t0;
}

double time_on_threads(int threads, const std::function<void(int)>& fn) {
  const double t0 = now_s();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(fn, t);
  for (auto& th : pool) th.join();
  return now_s() - t0;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ---------------------------------------------------------------------------
// The machine

std::string read_file(const char* path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string load_average() {
  std::string s = read_file("/proc/loadavg");
  // "0.52 0.58 0.59 1/123 4567": the three averages.
  std::stringstream ss(s);
  std::string a, b, c;
  ss >> a >> b >> c;
  return a + " " + b + " " + c;
}

std::string cpu_model() {
  std::stringstream ss(read_file("/proc/cpuinfo"));
  std::string name = "unknown", family, model;
  auto value = [](const std::string& line) { return line.substr(line.find(':') + 2); };
  for (std::string line; std::getline(ss, line) && !line.empty();) {
    if (line.rfind("model name", 0) == 0) name = value(line);
    else if (line.rfind("cpu family", 0) == 0) family = value(line);
    else if (line.rfind("model", 0) == 0 && line.find(':') != std::string::npos) model = value(line);
  }
  // Machines of one name differ (an EPYC may be Zen 3, 4 or 5): family and model say which.
  return family.empty() ? name : name + " (family " + family + " model " + model + ")";
}

std::string cpu_flags() {
  std::stringstream ss(read_file("/proc/cpuinfo"));
  std::string flags;
  for (std::string line; std::getline(ss, line);)
    if (line.rfind("flags", 0) == 0) {
      // Appended, not " " + line.substr(...): inlined there, GCC 12 gives a
      // false -Wrestrict warning.
      flags.assign(1, ' ').append(line, line.find(':') + 1).append(1, ' ');
      break;
    }
  std::string out;
  for (const char* f : {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    if (flags.find(std::string(" ") + f + " ") != std::string::npos) out += std::string(out.empty() ? "" : " ") + f;
  return out.empty() ? "none of avx2/fma/avx512" : out;
}

std::string today() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", std::localtime(&t));
  return buf;
}

int64_t status_bytes(const char* key) {
  std::stringstream ss(read_file("/proc/self/status"));
  for (std::string line; std::getline(ss, line);)
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::string(key).size() + 1)) * 1024;  // "kB"
  return -1;
}

// ---------------------------------------------------------------------------
// Command line

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int64_t> split_ints(const std::string& s) {
  std::vector<int64_t> out;
  for (const std::string& x : split(s)) out.push_back(std::stoll(x));
  return out;
}

std::optional<std::string> value_of(const std::string& arg, const char* name) {
  const std::string prefix = std::string(name) + "=";
  if (arg.rfind(prefix, 0) != 0) return std::nullopt;
  return arg.substr(prefix.size());
}

bool threads_and_rounds(int argc, char** argv, const char* tool, int& threads, int& rounds) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (auto x = value_of(a, "--threads"); x && std::atoi(x->c_str()) >= 1) {
      threads = std::atoi(x->c_str());
    } else if (auto y = value_of(a, "--rounds"); y && std::atoi(y->c_str()) >= 1) {
      rounds = std::atoi(y->c_str());
    } else {
      std::fprintf(stderr, "usage: %s [--threads=N (>= 1)] [--rounds=N (>= 1)]\n", tool);
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// Text output

std::string strprintf(const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list again;
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), out.size() + 1, format, again);
  va_end(again);
  return out;
}

std::string fmt(const char* f, double x) {
  if (std::isnan(x)) return "–";
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

std::string fmt_ms(double s) {
  if (std::isnan(s)) return "–";
  const double ms = s * 1e3;
  return fmt(ms < 1 ? "%.3f" : ms < 100 ? "%.2f" : "%.0f", ms);
}

double gflops(double flops, double s) { return std::isnan(s) ? NAN : flops / s / 1e9; }

void print_table_row(const std::vector<std::string>& cells) {
  std::string line;
  for (const std::string& c : cells) line += c.empty() ? "| " : "| " + c + " ";
  line += "|\n";
  std::fputs(line.c_str(), stdout);
}

void print_table_header(const std::vector<std::string>& columns) {
  print_table_row(columns);
  std::string rule;
  for (size_t i = 0; i < columns.size(); ++i) rule += "|---";
  rule += "|\n";
  std::fputs(rule.c_str(), stdout);
}

void print_run_line(int threads, int rounds) {
  std::printf("# %s; %s; %d threads, best of %d rounds; %s\n", cpu_model().c_str(), cpu_flags().c_str(), threads,
              rounds, today().c_str());
}

}  // namespace dimattn::bench
