// Kernel selection: decisions with reasons, forcing, the debug log, the cache key.
#include <cstdlib>
#include <fstream>
#include <map>

#include "dimattn/attention.h"
#include "dimattn/forcing.h"
#include "dimattn/run_context.h"
#include "dimattn/selection.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"
#include "support/test_util.h"

namespace dimattn {
namespace {
using testing::error_of;

struct Call {
  Dim batch{"batch", 2}, heads{"heads", 2}, time{"time", 8}, feat{"feat", 16};
  Tensor x;
  explicit Call(const std::string& backend) : x(random_normal({batch, heads, time, feat}, 1, {.backend = backend})) {}
  AttentionOptions opts(double dropout = 0) const { return {.key_dim = feat, .axis = time, .att_dropout = dropout}; }
};

TEST(Selection, ExplainGivesTheChoiceAndEveryRejectionWithItsReason) {
  if (!has_backend("torch")) GTEST_SKIP() << "built without the torch backend";
  Call c("torch");
  EXPECT_EQ(explain_attention(c.x, c.x, c.x, c.opts()).kernel, "cpu_flash");
  TrainFlagScope train(true);
  EXPECT_EQ(explain_attention(c.x, c.x, c.x, c.opts(0.1)).kernel, "cpu_flash") << "dropout through the shared RNG";
  ForceKernels force("aten_flash_cpu,aten_math,reference");
  const Decision d = explain_attention(c.x, c.x, c.x, c.opts(0.1));
  EXPECT_EQ(d.kernel, "reference");
  ASSERT_EQ(d.rejected.size(), 3u);
  EXPECT_EQ(d.rejected[0].kernel, "cpu_flash");
  EXPECT_NE(d.rejected[0].reason.find("not among the forced kernels"), std::string::npos) << d.rejected[0].reason;
  EXPECT_EQ(d.rejected[1].kernel, "aten_flash_cpu");
  EXPECT_NE(d.rejected[1].reason.find("dropout"), std::string::npos) << d.rejected[1].reason;
  EXPECT_NE(d.explain().find("rejected aten_math"), std::string::npos) << d.explain();
}

// docs/selection.md's candidate table, row by row, against every registered
// backend's kernel table: the docs cannot go stale silently.
TEST(Selection, DocsTableMatchesTheKernelTables) {
  std::ifstream in(std::string(DIMATTN_SOURCE_DIR) + "/docs/selection.md");
  ASSERT_TRUE(in) << "docs/selection.md";
  std::map<std::string, std::vector<std::string>> documented;  // "torch / cpu" -> names
  for (std::string line; std::getline(in, line);) {
    // "| torch / cpu | `cpu_flash`, `aten_flash_cpu`, ... |"
    const size_t sep = line.find(" | ");
    if (line.rfind("| ", 0) != 0 || sep == std::string::npos || line.find(" / ") > sep) continue;
    std::vector<std::string>& names = documented[line.substr(2, sep - 2)];
    for (size_t open = line.find('`', sep); open != std::string::npos; open = line.find('`', open + 1)) {
      const size_t close = line.find('`', open + 1);
      names.push_back(line.substr(open + 1, close - open - 1));
      open = close;
    }
  }
  int checked = 0;
  for (const std::string& b : backend_names())
    for (const Device device : {kCPU, kCUDA}) {
      const std::vector<std::string> kernels = get_backend(b).attention_kernels(device);
      const std::string key = b + " / " + device_name(device);
      if (kernels.size() <= 1 && !documented.count(key)) continue;  // no table, or the reference alone: no row
      ASSERT_TRUE(documented.count(key)) << "docs/selection.md has no row for " << key;
      EXPECT_EQ(documented[key], kernels) << key;
      ++checked;
    }
  EXPECT_GE(checked, 1) << "no backend's table was checked";
}

TEST(Selection, AForcedKernelThatCannotRunIsAnErrorWithReasons) {
  if (!has_backend("torch")) GTEST_SKIP() << "built without the torch backend";
  Call c("torch");
  TrainFlagScope train(true);
  ForceKernels force("aten_flash_cpu");
  const std::string msg = error_of([&] { dot_attention(c.x, c.x, c.x, c.opts(0.1)); });
  EXPECT_NE(msg.find("[dot_attention] no forced kernel can run this call"), std::string::npos) << msg;
  EXPECT_NE(msg.find("aten_flash_cpu: dropout"), std::string::npos) << msg;
}

TEST(Selection, EnvironmentVariableForcesAndAGuardOverridesIt) {
  for (const std::string& backend : backend_names()) {
    Call c(backend);
    setenv("DIMATTN_SDPA", "reference", 1);
    EXPECT_EQ(explain_attention(c.x, c.x, c.x, c.opts()).kernel, "reference");
    {
      ForceKernels force("auto");
      EXPECT_EQ(explain_attention(c.x, c.x, c.x, c.opts()).kernel, get_backend(backend).attention_kernels(kCPU)[0]);
    }
    setenv("DIMATTN_SDPA", "no_such_kernel", 1);
    EXPECT_NE(error_of([&] { explain_attention(c.x, c.x, c.x, c.opts()); }).find("unknown kernel 'no_such_kernel'"),
              std::string::npos);
    unsetenv("DIMATTN_SDPA");
  }
}

TEST(Selection, DebugLogsOncePerNewKey) {
  reset_selection_cache();
  setenv("DIMATTN_DEBUG", "1", 1);
  ::testing::internal::CaptureStderr();
  for (const std::string& backend : backend_names()) {
    Call c(backend);
    for (int i = 0; i < 3; ++i) dot_attention(c.x, c.x, c.x, c.opts());
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  unsetenv("DIMATTN_DEBUG");
  size_t lines = 0;
  for (size_t p = log.find("[dimattn]"); p != std::string::npos; p = log.find("[dimattn]", p + 1)) ++lines;
  EXPECT_EQ(lines, backend_names().size()) << log;
  EXPECT_NE(log.find("selected"), std::string::npos) << log;
}

TEST(Selection, KeyHoldsOnlyFieldsThatCanChangeTheDecision) {
  AttentionParams a, b;
  a.head_dim_qk = b.head_dim_qk = 64;
  EXPECT_EQ(a, b);
  EXPECT_EQ(AttentionParamsHash()(a), AttentionParamsHash()(b));
  b.causal = true;
  EXPECT_NE(a, b);
  // Nothing per step can reach the key: AttentionParams has no field for
  // batch sizes, lengths, pointers or seeds. Two calls differing only in
  // those share one decision (checked over 1000 calls in dual_test.cpp).
  const std::string d = a.describe();
  for (const char* absent : {"batch", "seed", "length"}) EXPECT_EQ(d.find(absent), std::string::npos) << d;
}

}  // namespace
}  // namespace dimattn
