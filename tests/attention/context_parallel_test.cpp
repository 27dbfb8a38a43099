// context_parallel_attention on one process: which positions each rank holds
// (context_shard_ranges), and the errors of a call that has no group to split
// over — no group of that name (every backend; Eigen has no groups), and, on
// the torch backend, a c10d group of size 1. The calls over several ranks are
// tests/python/test_context_parallel.py's (processes joined by Gloo).
#include <string>
#include <utility>
#include <vector>

#include "dimattn/context_parallel.h"
#include "dimattn/registry.h"
#include "support/test_util.h"

#ifdef DIMATTN_TEST_TORCH
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace dimattn {
namespace {

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

TEST(ContextShardRanges, ContiguousAndLoadBalanced) {
  // Uneven contiguous shards: the first ranks hold one more position.
  EXPECT_EQ(context_shard_ranges(25, 3, 0, ContextSharding::contiguous), (Ranges{{0, 9}}));
  EXPECT_EQ(context_shard_ranges(25, 3, 1, ContextSharding::contiguous), (Ranges{{9, 17}}));
  EXPECT_EQ(context_shard_ranges(25, 3, 2, ContextSharding::contiguous), (Ranges{{17, 25}}));
  // Load-balanced: chunks r and 2N-1-r of 2N.
  EXPECT_EQ(context_shard_ranges(16, 2, 0, ContextSharding::load_balanced), (Ranges{{0, 4}, {12, 16}}));
  EXPECT_EQ(context_shard_ranges(16, 2, 1, ContextSharding::load_balanced), (Ranges{{4, 8}, {8, 12}}));
  testing::expect_error([] { context_shard_ranges(10, 3, 0, ContextSharding::load_balanced); },
                        "context_shard_ranges", {"not a multiple of 6"});
  testing::expect_error([] { context_shard_ranges(10, 3, 3, ContextSharding::contiguous); }, "context_shard_ranges",
                        {"0 <= rank < world"});
}

class ContextParallelOnOneProcess : public ::testing::TestWithParam<std::string> {
 protected:
  Dim batch{"batch", 2}, time{"time", 4}, feat{"feat", 8};
  Tensor x = random_normal({batch, time, feat}, 1, {.backend = GetParam()});
  AttentionOptions opts{.key_dim = feat, .axis = time, .causal_query_spatial_dim = time};
};

TEST_P(ContextParallelOnOneProcess, NoGroupOfThatNameIsAnError) {
  testing::expect_error([&] { context_parallel_attention(x, x, x, opts, {.group = "dimattn_no_such_group"}); },
                        "context_parallel_attention", {"no process group named 'dimattn_no_such_group'"});
}

#ifdef DIMATTN_TEST_TORCH
// A group that holds this process alone (as torch.distributed.new_group([rank])
// makes one): nothing to split, said before any collective runs.
TEST_P(ContextParallelOnOneProcess, GroupOfOneIsAnError) {
  if (GetParam() != "torch") GTEST_SKIP() << "process groups are c10d's (the torch backend)";
  const std::string name = "dimattn_test_solo";
  const auto solo = c10::make_intrusive<c10d::ProcessGroup>(0, 1);  // the registry holds it weakly
  c10d::register_process_group(name, solo);
  const std::string msg = testing::error_of([&] { context_parallel_attention(x, x, x, opts, {.group = name}); });
  c10d::unregister_process_group(name);
  EXPECT_EQ(msg.rfind("[context_parallel_attention] over a process group of size 1 ('dimattn_test_solo'): there is "
                      "nothing to split; call dot_attention on one process",
                      0),
            0u)
      << msg;
}
#endif

INSTANTIATE_TEST_SUITE_P(Backends, ContextParallelOnOneProcess, ::testing::ValuesIn(backend_names()),
                         testing::backend_param_name);

}  // namespace
}  // namespace dimattn
