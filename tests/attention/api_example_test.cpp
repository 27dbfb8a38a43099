// The example of docs/api.md and README.md, compiled and run. Keep the three
// in sync: the text between the markers is the documented example.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

// --- example begin ---
#include "dimattn/attention.h"
#include "dimattn/ops.h"
#include "dimattn/trace.h"

using namespace dimattn;

Tensor attend_example() {
  Dim batch("batch", 2), heads("heads", 4), feat("feat", 16), vfeat("vfeat", 16);
  Tensor lens = from_host({batch}, {7, 5}, {.dtype = DType::int64});
  Dim time = Dim::dynamic("time", lens);  // extent 7; entry 1 is padded after 5
  Tensor q = random_normal({batch, heads, time, feat}, /*seed=*/1);
  Tensor k = random_normal({batch, heads, time, feat}, 2);
  Tensor v = random_normal({batch, heads, time, vfeat}, 3);

  // Causal self-attention: `time` is in the query, so the kv side is relabelled.
  Tensor out = dot_attention(q, k, v, {.key_dim = feat, .axis = time, .causal_query_spatial_dim = time});

  // The same call traced: runs the reference path and keeps energy and weights.
  TraceScope trace;
  dot_attention(q, k, v, {.key_dim = feat, .axis = time, .causal_query_spatial_dim = time});
  const Tensor& weights = *trace.records()[0].att_weights;  // {batch, heads, time, time'}
  (void)weights;
  return out;  // {batch, heads, time, vfeat}
}
// --- example end ---

TEST(ApiExample, RunsAndHasTheDocumentedDims) {
  Tensor out = attend_example();
  EXPECT_EQ(out.rank(), 4);
  EXPECT_EQ(out.dims()[0].name(), "batch");
}

TEST(ApiExample, DocsShowThisExample) {
  auto read = [](const std::string& path) {
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  const std::string self = read(DIMATTN_SOURCE_DIR "/tests/attention/api_example_test.cpp");
  const std::string begin = "// --- example begin ---\n", end = "// --- example end ---";
  const size_t b = self.find(begin) + begin.size();
  const std::string example = self.substr(b, self.find(end, b) - b);
  for (const char* doc : {"/docs/api.md", "/README.md"})
    EXPECT_NE(read(std::string(DIMATTN_SOURCE_DIR) + doc).find(example), std::string::npos)
        << doc << " does not show the example of this file";
}
