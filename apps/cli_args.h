#pragma once
// The one argument parser of the `dimattn` subcommands: `--name value`,
// `--name=value` and `--flag`, declared per subcommand with a help line each.
// Bad arguments throw UsageError, which main() prints as one line on stderr,
// "dimattn <command>: <message>", exiting with status 2.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dimattn/dtype.h"

namespace dimattn::cli {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Option {
  std::string name;        // without the leading "--"
  std::string value_name;  // empty for a flag
  std::string help;
};

class Args {
 public:
  // Parses argv[first..]. `--help`/`-h` is always accepted.
  // pre: `summary` is the subcommand's usage line and purpose, several lines allowed.
  Args(std::string command, std::string summary, std::vector<Option> options, int argc, char** argv, int first);

  bool help() const { return help_; }
  std::string usage() const;  // summary + every option, for --help

  bool flag(const std::string& name) const;
  std::optional<std::string> value(const std::string& name) const;
  std::string text(const std::string& name, const std::string& fallback) const;
  int64_t integer(const std::string& name, int64_t fallback, int64_t min = INT64_MIN) const;
  double number(const std::string& name, double fallback) const;
  // Comma-separated lists.
  std::vector<std::string> texts(const std::string& name, const std::vector<std::string>& fallback) const;
  std::vector<int64_t> integers(const std::string& name, const std::vector<int64_t>& fallback,
                                int64_t min = INT64_MIN) const;
  std::vector<DType> dtypes(const std::string& name, const std::vector<DType>& fallback) const;

  // UsageError "--name: <what>".
  [[noreturn]] void fail(const std::string& name, const std::string& what) const;

 private:
  const Option& declared(const std::string& name) const;

  std::string command_, summary_;
  std::vector<Option> options_;
  std::vector<std::pair<std::string, std::string>> given_;  // name, value ("" for flags)
  bool help_ = false;
};

// A multi-line message (library errors list reasons on indented lines) as one line.
std::string one_line(std::string s);

}  // namespace dimattn::cli
