// The `dimattn` command-line tool, run as a process on small inputs: its
// stdout, the files it writes and its exit status (docs/cli.md).
#include <algorithm>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "dimattn/forcing.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"

namespace {
namespace fs = std::filesystem;

struct Result {
  int status = -1;
  std::string out, err;
};

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

fs::path temp_dir() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("dimattn_cli_test_" + std::to_string(getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

// Runs `dimattn <args>` with `env` ("NAME=value ...") added to the
// environment; stderr goes to a file, so it is not a terminal.
Result run(const std::string& args, const std::string& env = "") {
  const fs::path err = temp_dir() / "stderr.txt";
  const std::string cmd = env + " '" + DIMATTN_CLI + "' " + args + " 2>'" + err.string() + "'";
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr) << cmd;
  Result r;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
  const int raw = pclose(p);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.err = read_file(err);
  return r;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t i = text.find(what); i != std::string::npos; i = text.find(what, i + 1)) ++n;
  return n;
}

bool one_line(const std::string& s) { return !s.empty() && count(s, "\n") == 1 && s.back() == '\n'; }

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// Each run loads LibTorch (about a second): the tests keep the runs few.
TEST(Cli, HelpForEveryCommandExitsZero) {
  const Result top = run("--help");
  EXPECT_EQ(top.status, 0);
  for (const std::string cmd : {"bench", "explain", "check", "example"}) {
    EXPECT_NE(top.out.find(cmd), std::string::npos) << cmd;
    const Result r = run(cmd + " --help");
    EXPECT_EQ(r.status, 0) << cmd;
    EXPECT_NE(r.out.find("usage: dimattn " + cmd), std::string::npos) << r.out;
    EXPECT_TRUE(r.err.empty()) << r.err;
    if (cmd == "bench") {
      EXPECT_NE(r.out.find("--json FILE"), std::string::npos) << r.out;
    }
    if (cmd == "explain") {
      EXPECT_NE(r.out.find("--broadcast-dropout"), std::string::npos) << r.out;
    }
  }
}

TEST(Cli, BadArgumentsGiveOneLineAndStatusTwo) {
  for (const char* args : {"frobnicate", "bench --frobnicate", "bench --dtype int32,float32", "explain --batch",
                           "explain --lengths 3,4 --batch 3", "check stray"}) {
    const Result r = run(args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_TRUE(one_line(r.err)) << args << ": " << r.err;
    EXPECT_EQ(r.err.rfind("dimattn", 0), 0u) << r.err;
  }
}

// Whether a built backend's kernel table has `kernel` (forcing knows no other).
bool built_kernel(const std::string& kernel) {
  const std::vector<std::string> known = dimattn::all_kernel_names();
  return std::find(known.begin(), known.end(), kernel) != known.end();
}

TEST(Cli, LibraryErrorsGiveOneLineAndStatusOne) {
  if (!built_kernel("aten_flash_cpu")) GTEST_SKIP() << "built without the torch backend (aten_flash_cpu)";
  // aten_flash_cpu cannot take dropout (and is no kernel of eigen): selection throws.
  const Result r = run("explain --force aten_flash_cpu --dropout 0.1 --train --seq-q 8 --batch 2 --heads 2");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(one_line(r.err)) << r.err;
  EXPECT_NE(r.err.find("[dot_attention]"), std::string::npos) << r.err;
}

// DIMATTN_CPU_ISA caps cpu_flash's instruction set: explain names the one
// that runs (avx512's code for float32 under avx512_bf16), and an unknown
// name is a one-line error saying what to use. (A cap the CPU lacks is
// checked in tests/kernels, CpuIsa.CapNamesWhatIsMissing, on any CPU.)
TEST(Cli, CpuIsaCapIsNamedAndChecked) {
  const std::string call = "explain --backend eigen --batch 1 --heads 2 --seq-q 8 --head-dim 8";
  const Result generic = run(call + " --dtype bfloat16", "DIMATTN_CPU_ISA=generic");
  ASSERT_EQ(generic.status, 0) << generic.err;
  EXPECT_NE(generic.out.find("selected  cpu_flash (isa generic)\n"), std::string::npos) << generic.out;
  const Result best = run(call + " --dtype bfloat16");
  ASSERT_EQ(best.status, 0) << best.err;
  EXPECT_NE(best.out.find("selected  cpu_flash (isa "), std::string::npos) << best.out;
  const Result bad = run(call, "DIMATTN_CPU_ISA=avx9");
  EXPECT_EQ(bad.status, 1) << bad.out;
  EXPECT_TRUE(one_line(bad.err)) << bad.err;
  EXPECT_NE(bad.err.find("DIMATTN_CPU_ISA=avx9 names no instruction set of cpu_flash; use generic, avx2, avx512 or "
                         "avx512_bf16"),
            std::string::npos)
      << bad.err;
}

// Every candidate of the backend is listed: the selected one, and each other
// one rejected with a reason or able to run at lower priority.
TEST(Cli, ExplainListsEveryCandidate) {
  const std::string backend = dimattn::default_backend().name();
  const auto kernels = dimattn::get_backend(backend).attention_kernels(dimattn::kCPU);
  for (const char* extra : {"", " --causal --groups 4 --seq-k 20 --offset 4,0,2 --lengths 16,9,0",
                            " --step --groups 3 --dtype bfloat16 --dropout 0.1 --broadcast-dropout --train"}) {
    const Result r = run("explain --batch 3 --heads 2 --seq-q 16 --head-dim 8" + std::string(extra));
    ASSERT_EQ(r.status, 0) << extra << ": " << r.err;
    EXPECT_NE(r.out.find("params    device=cpu"), std::string::npos) << r.out;
    int selected = 0;
    for (const std::string& k : kernels) {
      bool listed = false;
      for (const std::string& line : lines_of(r.out)) {
        if (line.rfind("  " + k + " ", 0) != 0) continue;
        listed = true;
        const bool sel = line.find(" selected") != std::string::npos;
        selected += sel;
        if (sel) {  // cpu_flash adds its instruction set
          EXPECT_TRUE(r.out.find("selected  " + k + "\n") != std::string::npos ||
                      r.out.find("selected  " + k + " (isa ") != std::string::npos)
              << r.out;
        }
        const size_t why = line.find("rejected: ");
        EXPECT_TRUE(sel || line.find("could run") != std::string::npos ||
                    (why != std::string::npos && line.size() > why + 10))
            << line;
      }
      EXPECT_TRUE(listed) << k << " in\n" << r.out;
    }
    EXPECT_EQ(selected, 1) << r.out;
  }
}

TEST(Cli, BenchWritesTableJsonAndPlot) {
  const fs::path json = temp_dir() / "bench.json", svg = temp_dir() / "bench.svg";
  // One thread: OpenMP waits badly on a loaded machine, and only the output is checked here.
  const Result r = run("bench --quick --seq 8,16 --repeats 2 --threads 1 --device cpu --json '" + json.string() +
                       "' --plot '" + svg.string() + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(r.err.empty()) << "progress goes to stderr only on a terminal: " << r.err;
  EXPECT_NE(r.out.find("median_ms"), std::string::npos) << r.out;
  // 3 kinds x 2 lengths per backend, each with a reference and an auto row.
  const int configs = 6 * static_cast<int>(dimattn::backend_names().size());
  EXPECT_EQ(count(r.out, "  reference "), configs) << r.out;
  EXPECT_EQ(count(r.out, " auto ("), configs) << r.out;

  const std::string j = read_file(json);
  EXPECT_EQ(j.front(), '[');
  const int records = count(j, "\"config\": {\"kind\": ");
  EXPECT_GE(records, 2 * configs);
  for (const char* kind : {"self", "causal", "cross"})
    EXPECT_EQ(3 * count(j, "\"kind\": \"" + std::string(kind) + "\""), records) << kind;
  for (const char* field : {"\"device\": \"cpu\"", "\"dtype\": \"float32\"", "\"B\": 8", "\"H\": 8", "\"Tq\": ",
                            "\"Tk\": ", "\"D\": 64", "\"causal\": ", "\"kernel\": ", "\"median_ms\": ",
                            "\"min_ms\": ", "\"gflops\": ", "\"of_peak\": ", "\"speedup_vs_reference\": ",
                            "\"max_abs_err\": ", "\"selected\": "})
    EXPECT_EQ(count(j, field), records) << field;
  // Every CPU row that ran is set against the machine's peak, measured first.
  EXPECT_NE(r.out.find("machine peak on 1 threads: float32 "), std::string::npos) << r.out;
  EXPECT_EQ(count(j, "\"of_peak\": null"), count(j, "\"rejected_reason\": ")) << j;
  EXPECT_EQ(count(j, "\"kernel\": \"reference\""), configs);
  EXPECT_EQ(count(j, "\"kernel\": \"auto\""), configs);
  EXPECT_EQ(count(j, "\"selected\": true"), configs) << "one row per config is the kernel auto picks";

  const std::string s = read_file(svg);
  EXPECT_EQ(s.rfind("<svg", 0), 0u);
  EXPECT_NE(s.find("</svg>"), std::string::npos);
  for (const char* text : {">self<", ">causal<", ">cross<", ">legend<", "T (log)", "ms (log)", "<polyline"})
    EXPECT_NE(s.find(text), std::string::npos) << text;
}

TEST(Cli, BenchListsRejectedKernelsWithTheirReason) {
  if (!built_kernel("cuda_flash")) GTEST_SKIP() << "built without the torch backend (cuda_flash)";
  const fs::path json = temp_dir() / "rejected.json";
  const std::string backend = dimattn::default_backend().name();
  const Result r = run("bench --quick --seq 8 --repeats 1 --threads 1 --backend " + backend +
                       " --device cpu --kernels cuda_flash --json '" + json.string() + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(count(r.out, "cuda_flash "), 3) << r.out;
  EXPECT_EQ(count(r.out, "rejected: "), 3) << r.out;
  EXPECT_EQ(count(read_file(json), "\"rejected_reason\": \""), 3);
}

// Variant options reach selection (explain shows the presence bits) and
// every bench config that can take them; the others are left out.
TEST(Cli, VariantOptionsReachExplainAndBench) {
  const Result e = run("explain --batch 2 --heads 2 --seq-q 8 --seq-k 12 --head-dim 8 --window 4: --softcap 30 "
                       "--alibi --sinks --bias htk --mask bk");
  ASSERT_EQ(e.status, 0) << e.err;
  EXPECT_NE(e.out.find("variants=window,softcap,alibi,sinks,bias,mask "), std::string::npos) << e.out;
  const Result b = run("bench --quick --seq 8 --repeats 1 --threads 1 --device cpu --bias htk --window 4:");
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_NE(b.out.find("variants on every config: window=[4,-] bias=htk"), std::string::npos) << b.out;
  // A bias over the query time (t) needs the cross kind's own kv dim.
  const int backends = static_cast<int>(dimattn::backend_names().size());
  EXPECT_EQ(count(b.out, "  reference "), backends) << b.out;
  EXPECT_GE(count(b.out, "\ncross "), 3 * backends) << b.out;
  EXPECT_EQ(count(b.out, "\nself "), 0) << b.out;
  EXPECT_EQ(count(b.out, "\ncausal "), 0) << b.out;
  // Letters that name no dim are a usage error, not a suite left empty.
  const Result letters = run("bench --quick --seq 8 --bias xk");
  EXPECT_EQ(letters.status, 2) << letters.out << letters.err;
  EXPECT_NE(letters.err.find("--bias"), std::string::npos) << letters.err;
}

TEST(Cli, CheckPassesAndSummarises) {
  const Result r = run("check --cases 200 --seed 1");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("check: 200 cases (seed 1)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", 0 disagreements"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rejections by reason:"), std::string::npos) << r.out;
}

TEST(Cli, ExampleRuns) {
  const Result r = run("example");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("softmax over time"), std::string::npos);
}

}  // namespace
