// Built when DIMATTN_WITH_TORCH=OFF: the torch backend registers nothing.
#include "backends/src/builtin_backends.h"

namespace dimattn::detail {
void register_torch_backend() {}
}  // namespace dimattn::detail
