#pragma once
// The one exception type dimattn throws for bad input or unsupported requests.
// Messages start with the op in brackets ("[matmul] ..."), name the dims
// involved with their sizes, and say what to do instead where there is an
// alternative.
#include <sstream>
#include <stdexcept>
#include <string>

namespace dimattn {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::ostringstream os;
  os << '[' << op << "] ";
  (os << ... << parts);
  throw Error(os.str());
}
}  // namespace detail

// Throws dimattn::Error "[op] parts..." when cond is false.
template <class... Parts>
void check(bool cond, const char* op, const Parts&... parts) {
  if (!cond) detail::fail(op, parts...);
}

// check() for hot paths: the message parts (dims printed with repr, say)
// are evaluated only when cond is false. check()'s arguments are built on
// every call, which cost dot_attention microseconds of string formatting.
#define DIMATTN_CHECK(cond, ...)                                  \
  do {                                                            \
    if (!(cond)) ::dimattn::detail::fail(__VA_ARGS__);            \
  } while (0)

}  // namespace dimattn
