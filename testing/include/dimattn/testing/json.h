#pragma once
// The one JSON writer of the tools (`dimattn bench --json`, bench/'s
// programs): string literals and numbers; callers lay out objects themselves.
#include <string>

namespace dimattn::testing {

// A JSON string literal of s: quotes and backslashes escaped, control
// characters (below U+0020) as \b \f \n \r \t or \u00XX; other bytes as they
// are (UTF-8 passes through).
std::string json_string(const std::string& s);

// A JSON number with 6 significant digits; null for NaN and infinities.
std::string json_number(double x);

}  // namespace dimattn::testing
