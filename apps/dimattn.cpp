// The `dimattn` command-line tool (docs/cli.md).
//   dimattn bench     kernels vs the reference path, timed side by side
//   dimattn explain   which kernel a described call would run, and why
//   dimattn check     random calls through every kernel vs the reference path
//   dimattn example   named tensors, matmul and masked softmax on every backend
// Exit status: 0 success, 1 a library error or a failed check, 2 bad arguments.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli_args.h"
#include "commands.h"
#include "dimattn/error.h"
#include "dimattn/ops.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"

namespace dimattn::cli {
namespace {

const char* const kUsage =
    "usage: dimattn <command> [options]\n"
    "\n"
    "Commands:\n"
    "  bench     time every eligible attention kernel, the reference path and auto\n"
    "  explain   which kernel a described dot_attention call would run, and why not the others\n"
    "  check     random calls through every eligible kernel, compared with the reference path\n"
    "  example   named tensors, matmul and masked softmax on every backend\n"
    "\n"
    "`dimattn <command> --help` describes each command's options (docs/cli.md).\n";

void print(const char* label, const Tensor& t, const Dims& order) {
  std::printf("  %s %s:", label, repr(order).c_str());
  for (double v : to_host(t, order)) std::printf(" %.4f", v);
  std::printf("\n");
}

}  // namespace

int run_example(int argc, char** argv, int first) {
  const Args args("example", "usage: dimattn example\n\nNamed tensors, matmul and a masked softmax on every backend.",
                  {}, argc, argv, first);
  if (args.help()) {
    std::printf("%s", args.usage().c_str());
    return 0;
  }
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

int main(int argc, char** argv) {
  const std::string command = argc >= 2 ? argv[1] : "";
  try {
    if (command == "bench") return run_bench(argc, argv, 2);
    if (command == "explain") return run_explain(argc, argv, 2);
    if (command == "check") return run_check(argc, argv, 2);
    if (command == "example") return run_example(argc, argv, 2);
    if (command == "--help" || command == "-h" || command == "help") {
      std::printf("%s", kUsage);
      return 0;
    }
    std::fprintf(stderr, "dimattn: %s (see dimattn --help)\n",
                 command.empty() ? "missing command" : ("unknown command '" + command + "'").c_str());
    return 2;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "dimattn %s: %s\n", command.c_str(), e.what());
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "dimattn %s: %s\n", command.c_str(), one_line(e.what()).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dimattn %s: internal error: %s\n", command.c_str(), one_line(e.what()).c_str());
    return 1;
  }
}

}  // namespace dimattn::cli

int main(int argc, char** argv) { return dimattn::cli::main(argc, argv); }
