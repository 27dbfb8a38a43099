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

// The variants' example of docs/api.md: a local and a sink layer.
std::pair<Tensor, Tensor> variants_example() {
  Dim batch("batch", 2), heads("heads", 4), time("time", 9), feat("feat", 16), vfeat("vfeat", 16);
  Tensor q = random_normal({batch, heads, time, feat}, 1);
  Tensor k = random_normal({batch, heads, time, feat}, 2);
  Tensor v = random_normal({batch, heads, time, vfeat}, 3);
  // --- variants example begin ---
  // Gemma-2 style: a local layer with a 4096-position causal window and soft-capped logits.
  Tensor local = dot_attention(q, k, v, {.key_dim = feat, .axis = time,
                                         .causal_query_spatial_dim = time,
                                         .variants = {.window = AttentionWindow{4096, std::nullopt},
                                                      .softcap = 50.0}});
  // GPT-OSS style: per-head sinks (learnable: requires_grad on the torch backend)
  // with a 128-position sliding window.
  Tensor sinks = zeros({heads});
  Tensor out = dot_attention(q, k, v, {.key_dim = feat, .axis = time,
                                       .causal_query_spatial_dim = time,
                                       .variants = {.window = AttentionWindow{128, std::nullopt},
                                                    .sinks = sinks}});
  // --- variants example end ---
  return {local, out};
}

Tensor bias_example() {
  Dim batch("batch", 2), heads("heads", 4), time("time", 9), feat("feat", 16), vfeat("vfeat", 16);
  Tensor q = random_normal({batch, heads, time, feat}, 1);
  Tensor k = random_normal({batch, heads, time, feat}, 2);
  Tensor v = random_normal({batch, heads, time, vfeat}, 3);
  // --- bias example begin ---
  // T5 style: a learnable bias over {heads, query time, kv time}, and a bool
  // document mask over {batch, query time, kv time}. Keys and values get their
  // own kv dim, so that the bias can name both positions.
  Dim kv("kv", 9);
  Tensor keys = replace_dim(k, time, kv), values = replace_dim(v, time, kv);
  Tensor rel_bias = random_normal({heads, time, kv}, 4);
  Tensor same_doc = compare(random_uniform({batch, time, kv}, 5), Compare::ge, 0.2);
  Tensor out = dot_attention(q, keys, values, {.key_dim = feat, .axis = kv,
                                               .causal_query_spatial_dim = time,
                                               .variants = {.bias = rel_bias, .mask = same_doc}});
  // --- bias example end ---
  return out;
}

TEST(ApiExample, RunsAndHasTheDocumentedDims) {
  Tensor out = attend_example();
  EXPECT_EQ(out.rank(), 4);
  EXPECT_EQ(out.dims()[0].name(), "batch");
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The text of this file between "// --- <what> begin ---" and its end marker,
// each line without its first `indent` spaces (a function body's).
std::string example_text(const std::string& what, size_t indent) {
  const std::string self = read_file(DIMATTN_SOURCE_DIR "/tests/attention/api_example_test.cpp");
  const std::string begin = "// --- " + what + " begin ---\n", end = "// --- " + what + " end ---";
  const size_t b = self.find(begin) + begin.size();
  const std::string text = self.substr(b, self.find(end, b) - b);
  if (indent == 0) return text;
  std::string out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (line.find_first_not_of(' ') != std::string::npos) out += line.substr(std::min(indent, line.size())) + "\n";
  return out;
}

TEST(ApiExample, DocsShowThisExample) {
  const std::string example = example_text("example", 0);
  for (const char* doc : {"/docs/api.md", "/README.md"})
    EXPECT_NE(read_file(std::string(DIMATTN_SOURCE_DIR) + doc).find(example), std::string::npos)
        << doc << " does not show the example of this file";
}

TEST(ApiExample, VariantsExampleRunsAndIsTheDocumented) {
  const auto [local, out] = variants_example();
  EXPECT_EQ(local.rank(), 4);
  EXPECT_EQ(out.rank(), 4);
  const std::string example = example_text("variants example", 2);
  EXPECT_NE(read_file(DIMATTN_SOURCE_DIR "/docs/api.md").find(example), std::string::npos)
      << "docs/api.md does not show the variants example of this file:\n" << example;
}

TEST(ApiExample, BiasExampleRunsAndIsTheDocumented) {
  const Tensor out = bias_example();
  EXPECT_EQ(out.rank(), 4);
  const std::string example = example_text("bias example", 2);
  EXPECT_NE(read_file(DIMATTN_SOURCE_DIR "/docs/api.md").find(example), std::string::npos)
      << "docs/api.md does not show the bias example of this file:\n" << example;
}
