#pragma once
// The one exception type dimattn throws for bad input or unsupported requests.
// Messages start with the op in brackets ("[matmul] ..."), name the dims
// involved with their sizes, and say what to do instead where there is an
// alternative.
#include <stdexcept>
#include <string>

namespace dimattn {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace dimattn
