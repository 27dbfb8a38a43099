#pragma once
// How dimattn's own code raises dimattn::Error. Internal: not installed
// (users catch dimattn::Error, dimattn/error.h).
#include <sstream>
#include <string>

#include "dimattn/error.h"

namespace dimattn::detail {
// Throws dimattn::Error "[op] parts...".
template <class... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::ostringstream os;
  os << '[' << op << "] ";
  (os << ... << parts);
  throw Error(os.str());
}
}  // namespace dimattn::detail

// DIMATTN_CHECK(cond, op, parts...): throws dimattn::Error "[op] parts..."
// when cond is false. The message parts (dims printed with repr, say) are
// evaluated only then: built on every call, they cost each dot_attention
// tens of microseconds of string formatting.
#define DIMATTN_CHECK(cond, ...)                       \
  do {                                                 \
    if (!(cond)) ::dimattn::detail::fail(__VA_ARGS__); \
  } while (0)
