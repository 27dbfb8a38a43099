// Built when DIMATTN_WITH_EIGEN=OFF: the Eigen backend registers nothing.
#include "backends/src/builtin_backends.h"

namespace dimattn::detail {
void register_eigen_backend() {}
}  // namespace dimattn::detail
