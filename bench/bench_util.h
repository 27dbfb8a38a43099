#pragma once
// What the benchmark programs share: clocks and medians (DESIGN.md §9),
// facts about the machine for the record docs/perf.md keeps, command-line
// helpers, and markdown-table and JSON output. No LibTorch, so that any bench
// program can link it.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "dimattn/testing/json.h"

namespace dimattn::bench {

// ---------------------------------------------------------------------------
// Clocks and statistics

double now_s();  // steady clock, in seconds
double cpu_s();  // CPU time of the whole process (every thread), in seconds

// Which clock time_call reads, for the whole process: wall (the default) or
// process CPU time, which is robust to other load on a single thread.
void use_cpu_clock(bool cpu);

// Seconds f took, by the clock use_cpu_clock chose.
double time_call(const std::function<void()>& f);

// NAN for no values.
double median(std::vector<double> v);

// Wall seconds that fn(0), ..., fn(threads - 1) take, each on its own thread.
double time_on_threads(int threads, const std::function<void(int)>& fn);

// ---------------------------------------------------------------------------
// The machine (Linux /proc)

std::string read_file(const char* path);  // "" when unreadable
std::string load_average();               // the 1, 5 and 15 minute averages
std::string cpu_model();  // the model name, with family and model where /proc/cpuinfo has them
// Which of avx2, fma, avx512f, avx512_bf16, amx_bf16 the CPU has.
std::string cpu_flags();
std::string today();  // local "YYYY-MM-DD HH:MM"
// A "kB" entry of /proc/self/status (e.g. "VmRSS:", "VmHWM:") in bytes; -1 if absent.
int64_t status_bytes(const char* key);

// ---------------------------------------------------------------------------
// Command line

// "a,b,,c" -> {"a", "b", "c"}.
std::vector<std::string> split(const std::string& s);
// As split, each item read by std::stoll (which throws std::logic_error on bad input).
std::vector<int64_t> split_ints(const std::string& s);
// "--name=value": value, else nullopt.
std::optional<std::string> value_of(const std::string& arg, const char* name);
// The memory benches' options, --threads=N and --rounds=N (each >= 1), into
// threads and rounds; false, with a usage line on stderr, on anything else.
bool threads_and_rounds(int argc, char** argv, const char* tool, int& threads, int& rounds);

// ---------------------------------------------------------------------------
// Text output

// printf into a string.
std::string strprintf(const char* format, ...) __attribute__((format(printf, 1, 2)));
// x formatted by f; "–" for NAN (not run).
std::string fmt(const char* f, double x);
// Seconds as milliseconds with 3 significant-ish digits; "–" for NAN.
std::string fmt_ms(double s);
// NAN when s is.
double gflops(double flops, double s);

// A markdown table on stdout, a line at a time (so that rows appear as they
// are measured): "| a | b |" and the "|---|---|" rule under the header. An
// empty cell prints as "| |".
void print_table_header(const std::vector<std::string>& columns);
void print_table_row(const std::vector<std::string>& cells);
// "# cpu; flags; N threads, best of R rounds; date", the memory benches' first line.
void print_run_line(int threads, int rounds);

// ---------------------------------------------------------------------------
// JSON values: the one writer of the tools (dimattn/testing/json.h).

using testing::json_number;
using testing::json_string;

}  // namespace dimattn::bench
