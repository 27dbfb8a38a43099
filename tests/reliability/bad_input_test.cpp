// Bad and unusual inputs (docs/errors.md): one test per row of its tables,
// on every backend.
// - "Errors": the call throws dimattn::Error whose message begins with the
//   row's message (the doc shows the message for the row's example dims).
// - "Inputs with defined results": the call returns what the row says, on
//   every CPU kernel of every backend, never crashing.
// A test checks that the doc's rows and this file's cases are the same set.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "dimattn/attention.h"
#include "dimattn/kv_cache.h"
#include "dimattn/context_parallel.h"
#include "dimattn/ext/backend.h"
#include "dimattn/forcing.h"
#include "dimattn/ext/backend.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "dimattn/tolerance.h"
#include "dimattn/trace.h"
#include "support/test_util.h"

namespace dimattn {
namespace {

using testing::error_of;

// --- docs/errors.md ---

struct DocRow {
  std::string id, message;
};

// Rows of the table under the heading `section`: | `id` | ... | last |, where
// the last cell of an error row is the message's beginning in backticks.
std::vector<DocRow> doc_rows(const std::string& section) {
  std::ifstream f(std::string(DIMATTN_SOURCE_DIR) + "/docs/errors.md");
  std::vector<DocRow> rows;
  std::string line;
  bool in_section = false;
  static const std::regex row(R"(^\| `([a-z0-9_]+)` \|.*\|\s*$)");
  while (std::getline(f, line)) {
    if (line.rfind("## ", 0) == 0) in_section = line == "## " + section;
    std::smatch m;
    if (!in_section || !std::regex_match(line, m, row)) continue;
    const size_t end = line.find_last_of('|');
    const size_t start = line.find_last_of('|', end - 1);
    std::string last = line.substr(start + 1, end - start - 1);
    last = last.substr(last.find_first_not_of(' '));
    last = last.substr(0, last.find_last_not_of(' ') + 1);
    if (last.size() >= 2 && last.front() == '`' && last.back() == '`') last = last.substr(1, last.size() - 2);
    rows.push_back({m[1], last});
  }
  return rows;
}

std::string doc_message(const std::string& section, const std::string& id) {
  for (const DocRow& r : doc_rows(section))
    if (r.id == id) return r.message;
  return "";
}

// --- the error cases ---

// Example dims shared by the rows (the doc's messages name them).
struct Ex {
  std::string be;
  TensorOptions f32, i64;
  Dim batch{"batch", 2}, time{"time", 3}, enc{"enc", 5}, feat{"feat", 4}, vfeat{"vfeat", 4};
  Tensor q, k, v;
  explicit Ex(const std::string& backend)
      : be(backend),
        f32{.backend = backend},
        i64{.dtype = DType::int64, .backend = backend},
        q(random_normal({batch, time, feat}, 1, f32)),
        k(random_normal({batch, enc, feat}, 2, f32)),
        v(random_normal({batch, enc, vfeat}, 3, f32)) {}
  AttentionOptions opts() const { return {.key_dim = feat, .axis = enc}; }
  Tensor lens(const std::vector<double>& l, DType dtype = DType::int64) const {
    return from_host({batch}, l, {.dtype = dtype, .backend = be});
  }
};

// A paged cache for the kv_cache rows: pools of block[3] x slot[2] positions,
// a one-step query over {batch, feat}, tables over {batch, table[2]}.
struct KvFixture {
  const Ex& e;
  Dim block{"block", 3}, slot{"slot", 2}, table{"table", 2};
  Tensor q;
  explicit KvFixture(const Ex& ex) : e(ex), q(random_normal({ex.batch, ex.feat}, 1, ex.f32)) {}
  PagedKvCache cache(const std::vector<double>& entries) const { return cache_of(block, slot, entries); }
  // Pools of other block and slot dims.
  PagedKvCache cache_of(const Dim& blk, const Dim& pos, const std::vector<double>& entries) const {
    return {.keys = random_normal({blk, pos, e.feat}, 2, e.f32),
            .values = random_normal({blk, pos, e.vfeat}, 3, e.f32),
            .block = blk,
            .slot = pos,
            .block_table = from_host({e.batch, table}, entries, {.dtype = DType::int32, .backend = e.be}),
            .table = table};
  }
};

struct ErrorCase {
  std::function<void(const Ex&)> run;
  // "" always runs; "two_backends", "cuda": skipped when the build lacks them;
  // a kernel's name ("cuda_flash", "aten_math"): skipped when no built
  // backend's kernel table has it (forcing knows the kernels of the built
  // backends only).
  std::string needs;
};

std::string other_backend(const std::string& be) {
  for (const std::string& n : backend_names())
    if (n != be) return n;
  return "";
}

const std::map<std::string, ErrorCase>& error_cases() {
  static const std::map<std::string, ErrorCase> cases = {
      // --- dims ---
      {"key_dim_not_in_query",
       {[](const Ex& e) {
          Dim other("other", 4);
          dot_attention(e.q, e.k, e.v, {.key_dim = other, .axis = e.enc});
        }}},
      {"key_dim_not_in_keys",
       {[](const Ex& e) {
          dot_attention(e.q, random_normal({e.batch, e.enc, e.vfeat}, 2, e.f32), e.v, e.opts());
        }}},
      {"key_dim_mismatch",
       {[](const Ex& e) {
          Dim feat2("feat", 4);  // same name and size, made separately: another dim
          dot_attention(e.q, random_normal({e.batch, e.enc, feat2}, 2, e.f32), e.v, e.opts());
        }}},
      {"key_dim_dynamic",
       {[](const Ex& e) {
          Dim dfeat = Dim::dynamic("dfeat", e.lens({4, 2}));
          Tensor q = random_normal({e.batch, e.time, dfeat}, 1, e.f32);
          dot_attention(q, random_normal({e.batch, e.enc, dfeat}, 2, e.f32), e.v, {.key_dim = dfeat, .axis = e.enc});
        }}},
      {"key_dim_empty",
       {[](const Ex& e) {
          Dim f0("f0", 0);
          dot_attention(random_normal({e.batch, e.time, f0}, 1, e.f32), random_normal({e.batch, e.enc, f0}, 2, e.f32),
                        e.v, {.key_dim = f0, .axis = e.enc});
        }}},
      {"key_dim_is_axis", {[](const Ex& e) { dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.feat}); }}},
      {"axis_not_in_keys", {[](const Ex& e) { dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.time}); }}},
      {"axis_not_in_values",
       {[](const Ex& e) {
          dot_attention(e.q, e.k, random_normal({e.batch, e.time, e.vfeat}, 3, e.f32), e.opts());
        }}},
      {"values_without_feature_dim",
       {[](const Ex& e) { dot_attention(e.q, e.k, random_normal({e.batch, e.enc}, 3, e.f32), e.opts()); }}},
      {"duplicated_dim", {[](const Ex& e) { random_normal({e.batch, e.enc, e.batch}, 1, e.f32); }}},
      // --- dtypes, devices, backends ---
      {"mixed_dtypes",
       {[](const Ex& e) { dot_attention(e.q, e.k, cast(e.v, DType::float64), e.opts()); }}},
      {"integer_operands",
       {[](const Ex& e) {
          dot_attention(cast(e.q, DType::int64), cast(e.k, DType::int64), cast(e.v, DType::int64), e.opts());
        }}},
      {"mixed_backends",
       {[](const Ex& e) { dot_attention(e.q, to_backend(e.k, other_backend(e.be)), e.v, e.opts()); },
        "two_backends"}},
      {"mixed_devices",
       {[](const Ex& e) { dot_attention(e.q, to_device(e.k, kCUDA), e.v, e.opts()); }, "cuda"}},
      // --- options ---
      {"dropout_negative",
       {[](const Ex& e) { dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .att_dropout = -0.1}); }}},
      {"dropout_one",
       {[](const Ex& e) { dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .att_dropout = 1.0}); }}},
      {"dropout_nan",
       {[](const Ex& e) { dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .att_dropout = NAN}); }}},
      {"scale_nan", {[](const Ex& e) { dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .scale = NAN}); }}},
      {"scale_infinite",
       {[](const Ex& e) { dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .scale = -INFINITY}); }}},
      // --- lengths ---
      {"lengths_negative", {[](const Ex& e) { Dim::dynamic("len", e.lens({3, -1})); }}},
      {"lengths_above_extent", {[](const Ex& e) { Dim::dynamic("len", e.lens({6, 2}), 5); }}},
      {"lengths_not_integer", {[](const Ex& e) { Dim::dynamic("len", e.lens({3, 2}, DType::float32)); }}},
      {"lengths_over_foreign_dim",
       {[](const Ex& e) {
          Dim other("other", 2);
          Dim len = Dim::dynamic("len", from_host({other}, {5, 2}, e.i64));
          dot_attention(e.q, random_normal({e.batch, len, e.feat}, 2, e.f32),
                        random_normal({e.batch, len, e.vfeat}, 3, e.f32), {.key_dim = e.feat, .axis = len});
        }}},
      {"lengths_over_value_feature",
       {[](const Ex& e) {
          Dim len = Dim::dynamic("len", from_host({e.vfeat}, {5, 2, 1, 0}, e.i64));
          dot_attention(e.q, random_normal({e.batch, len, e.feat}, 2, e.f32),
                        random_normal({e.batch, len, e.vfeat}, 3, e.f32), {.key_dim = e.feat, .axis = len});
        }}},
      {"lengths_over_key_dim",
       {[](const Ex& e) {
          Dim len = Dim::dynamic("len", from_host({e.feat}, {5, 2, 1, 0}, e.i64));
          dot_attention(e.q, random_normal({e.batch, len, e.feat}, 2, e.f32),
                        random_normal({e.batch, len, e.vfeat}, 3, e.f32), {.key_dim = e.feat, .axis = len});
        }}},
      {"dim_lengths_over_key_dim",
       {[](const Ex& e) {
          // A keys' dim other than the axis, its lengths over key_dim (fuzz_dot_attention found such a
          // dim, with values' feature dim as well, failing the gradients deep inside [copy_transpose]).
          Dim kd = Dim::dynamic("kd", from_host({e.feat}, {2, 1, 2, 0}, e.i64));
          dot_attention(e.q, random_normal({e.batch, e.enc, kd, e.feat}, 2, e.f32),
                        random_normal({e.batch, e.enc, kd, e.vfeat}, 3, e.f32), e.opts());
        }}},
      {"dim_lengths_over_value_feature",
       {[](const Ex& e) {
          Dim kd = Dim::dynamic("kd", from_host({e.vfeat}, {2, 1, 2, 0}, e.i64));
          dot_attention(e.q, random_normal({e.batch, e.enc, kd, e.feat}, 2, e.f32),
                        random_normal({e.batch, e.enc, kd, e.vfeat}, 3, e.f32), e.opts());
        }}},
      // --- causal ---
      {"causal_extents_differ",
       {[](const Ex& e) {
          dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .causal_query_spatial_dim = e.time});
        }}},
      {"causal_dim_not_in_query",
       {[](const Ex& e) {
          Dim other("other", 5);
          dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .causal_query_spatial_dim = other});
        }}},
      {"causal_dim_shared_with_keys",
       {[](const Ex& e) {
          dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .causal_query_spatial_dim = e.batch});
        }}},
      {"causal_offset_without_causal",
       {[](const Ex& e) {
          dot_attention(e.q, e.k, e.v, {.key_dim = e.feat, .axis = e.enc, .causal_offset = e.lens({1, 2})});
        }}},
      // --- variants ---
      {"window_negative",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          o.variants.window = AttentionWindow{-2, std::nullopt};
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"window_empty",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          o.variants.window = AttentionWindow{};
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"window_without_position",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.window = AttentionWindow{2, 2};
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"alibi_without_position",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.alibi_slopes = from_host({e.batch}, {0.5, 0.25}, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"window_right_with_causal",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.causal_query_spatial_dim = e.time;
          o.causal_offset = e.lens({2, 2});
          o.variants.window = AttentionWindow{2, 1};
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"position_dim_not_query_only",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.batch;
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"position_dim_not_causal_dim",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.causal_query_spatial_dim = e.time;
          o.causal_offset = e.lens({2, 2});
          o.query_position_dim = e.batch;
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"alibi_slopes_over_position",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          o.variants.alibi_slopes = from_host({e.time}, {0.5, 0.25, 0.1}, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"sinks_foreign_dim",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.sinks = from_host({Dim("other", 3)}, {0, 0, 0}, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"sinks_not_float",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.sinks = from_host({e.batch}, {0, 0}, e.i64);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"softcap_not_positive",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.softcap = 0.0;
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"sinks_and_off_by_one",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.sinks = from_host({e.batch}, {0, 0}, e.f32);
          o.variants.sink_off_by_one = true;
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"bias_foreign_dim",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.bias = from_host({e.batch, Dim("other", 3)}, {0, 0, 0, 0, 0, 0}, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"bias_over_feature",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.bias = from_host({e.feat}, {0, 0, 0, 0}, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"bias_not_float",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.bias = from_host({e.batch}, {0, 0}, e.i64);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"mask_not_bool",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.mask = from_host({e.enc}, {1, 1, 1, 0, 0}, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"mask_foreign_dim",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.mask = compare(from_host({Dim("other", 2)}, {1, 0}, e.f32), Compare::gt, 0.5);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"segments_one_side",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.query_segments = from_host({e.batch, e.time}, {0, 0, 1, 0, 1, 1}, e.i64);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"segments_not_integer",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.query_segments = from_host({e.batch, e.time}, {0, 0, 1, 0, 1, 1}, e.f32);
          o.variants.kv_segments = from_host({e.enc}, {0, 0, 1, 1, 1}, e.i64);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"segments_kv_over_query_dim",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.query_segments = from_host({e.time}, {0, 0, 1}, e.i64);
          o.variants.kv_segments = from_host({e.batch, e.time}, {0, 0, 1, 0, 1, 1}, e.i64);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"segments_query_over_axis",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.query_segments = from_host({e.enc}, {0, 0, 1, 1, 1}, e.i64);
          o.variants.kv_segments = from_host({e.enc}, {0, 0, 1, 1, 1}, e.i64);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"rel_pos_biases_without_table",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.pos_bias_u = random_normal({e.feat}, 5, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"rel_pos_table_without_key_dim",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          o.variants.pos_emb = random_normal({Dim("rel", 7)}, 5, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"rel_pos_table_two_own_dims",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          o.variants.pos_emb = random_normal({Dim("rel", 7), Dim("other", 2), e.feat}, 5, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"rel_pos_table_extent",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          o.variants.pos_emb = random_normal({Dim("rel", 6), e.feat}, 5, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"rel_pos_without_position",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.pos_emb = random_normal({Dim("rel", 7), e.feat}, 5, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"rel_pos_table_over_self_attention_axis",
       {[](const Ex& e) {
          const Tensor x = random_normal({e.batch, e.enc, e.feat}, 1, e.f32);
          AttentionOptions o{.key_dim = e.feat, .axis = e.enc};
          o.variants.pos_emb = random_normal({e.enc, e.feat}, 5, e.f32);
          dot_attention(x, x, x, o);
        }}},
      {"rel_pos_in_a_block",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          o.positions = AttentionPositions{3, 0};
          o.variants.pos_emb = random_normal({Dim("rel", 7), e.feat}, 5, e.f32);
          dot_attention(e.q, e.k, e.v, o);
        }}},
      // --- blocks of a longer sequence ---
      {"positions_without_position",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.positions = AttentionPositions{3, 0};
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"positions_negative",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          o.positions = AttentionPositions{-1, 0};
          dot_attention(e.q, e.k, e.v, o);
        }}},
      {"block_with_sinks",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.variants.sinks = from_host({e.batch}, {0.5, 0.5}, e.f32);
          dot_attention_block(e.q, e.k, e.v, o);
        }}},
      {"context_parallel_unknown_group",
       {[](const Ex& e) {
          context_parallel_attention(e.q, e.q, e.q, {.key_dim = e.feat, .axis = e.time}, ContextParallel{"nope"});
        }}},
      {"context_parallel_cross_attention",
       {[](const Ex& e) { context_parallel_attention(e.q, e.k, e.v, e.opts(), ContextParallel{"0"}); }}},
      {"context_parallel_position_not_axis",
       {[](const Ex& e) {
          context_parallel_attention(e.q, e.q, e.q, {.key_dim = e.feat, .axis = e.time, .query_position_dim = e.batch},
                                     ContextParallel{"0"});
        }}},
      {"context_parallel_with_mask",
       {[](const Ex& e) {
          context_parallel_attention(
              e.q, e.q, e.q,
              {.key_dim = e.feat, .axis = e.time, .variants = {.mask = compare(e.lens({1, 2}), Compare::gt, 0.0)}},
              ContextParallel{"0"});
        }}},
      {"context_parallel_segments_over_features",
       {[](const Ex& e) {
          const Tensor ids = from_host({e.feat, e.time}, std::vector<double>(12, 0.0), e.i64);
          context_parallel_attention(e.q, e.q, e.q,
                                     {.key_dim = e.feat, .axis = e.time,
                                      .variants = {.query_segments = ids, .kv_segments = ids}},
                                     ContextParallel{"0"});
        }}},
      {"context_parallel_lengths_not_integer",
       {[](const Ex& e) {
          context_parallel_attention(e.q, e.q, e.q, {.key_dim = e.feat, .axis = e.time},
                                     ContextParallel{.group = "0", .lengths = e.lens({3, 2}, DType::float32)});
        }}},
      {"causal_offset_not_integer",
       {[](const Ex& e) {
          dot_attention(e.q, e.k, e.v,
                        {.key_dim = e.feat,
                         .axis = e.enc,
                         .causal_query_spatial_dim = e.time,
                         .causal_offset = e.lens({1, 2}, DType::float32)});
        }}},
      {"causal_offset_not_batch",
       {[](const Ex& e) {
          dot_attention(e.q, e.k, e.v,
                        {.key_dim = e.feat,
                         .axis = e.enc,
                         .causal_query_spatial_dim = e.time,
                         .causal_offset = from_host({e.time}, {0, 1, 2}, e.i64)});
        }}},
      // --- limits, kernels, tracing ---
      {"reference_memory_limit",
       {[](const Ex& e) {
          const int64_t saved = reference_memory_limit();
          set_reference_memory_limit(1 << 10);
          ForceKernels force("reference");
          Dim t("t", 64);
          Tensor x = random_normal({e.batch, t, e.feat}, 1, e.f32);
          std::string msg = error_of([&] { dot_attention(x, x, x, {.key_dim = e.feat, .axis = t}); });
          set_reference_memory_limit(saved);
          if (!msg.empty()) throw Error(msg);
        }}},
      {"forced_kernel_cannot_run",
       {[](const Ex& e) {
          ForceKernels force("cuda_flash");
          dot_attention(e.q, e.k, e.v, e.opts());
        },
        "cuda_flash"}},
      {"block_forced_reference",
       {[](const Ex& e) {
          AttentionOptions o = e.opts();
          o.query_position_dim = e.time;
          ForceKernels force("reference");
          dot_attention_block(e.q, e.k, e.v, o);
        }}},
      {"backward_forced_aten_math",
       {[](const Ex& e) {
          const Tensor dout = zeros({e.batch, e.time, e.vfeat}, e.f32);
          ForceKernels force("aten_math");
          dot_attention_backward(e.q, e.k, e.v, e.opts(), dout);
        },
        "aten_math"}},
      {"forced_unknown_kernel", {[](const Ex&) { ForceKernels force("flash"); }}},
      {"capturing_trace_with_forced_kernel",
       {[](const Ex& e) {
          ForceKernels force("cpu_flash");
          TraceScope trace;
          dot_attention(e.q, e.k, e.v, e.opts());
        }}},
      // --- kv caches (dimattn/kv_cache.h): pools of 3 blocks of 2 positions, tables of 2 ---
      {"kv_cache_block_out_of_range",
       {[](const Ex& e) {
          const KvFixture f(e);
          kv_cache_attention(f.q, f.cache({0, 7, 1, 2}), {.key_dim = e.feat, .lengths = e.lens({4, 3})});
        }}},
      {"kv_cache_length_past_capacity",
       {[](const Ex& e) {
          const KvFixture f(e);
          kv_cache_attention(f.q, f.cache({0, 1, 2, 0}), {.key_dim = e.feat, .lengths = e.lens({4, 9})});
        }}},
      {"kv_cache_pools_mismatch",
       {[](const Ex& e) {
          const KvFixture f(e);
          PagedKvCache c = f.cache({0, 1, 2, 0});
          c.values = random_normal({Dim("blocks2", 3), f.slot, e.vfeat}, 3, e.f32);
          kv_cache_attention(f.q, c, {.key_dim = e.feat, .lengths = e.lens({4, 3})});
        }}},
      {"kv_cache_empty_slot",
       {[](const Ex& e) {
          const KvFixture f(e);
          kv_cache_attention(f.q, f.cache_of(f.block, Dim("slot", 0), {0, 1, 2, 0}),
                             {.key_dim = e.feat, .lengths = e.lens({0, 0})});
        }}},
      {"kv_cache_negative_length",
       {[](const Ex& e) {
          const KvFixture f(e);
          kv_cache_attention(f.q, f.cache({0, 1, 2, 0}), {.key_dim = e.feat, .lengths = e.lens({-1, 3})});
        }}},
      {"kv_cache_float_lengths",
       {[](const Ex& e) {
          const KvFixture f(e);
          kv_cache_attention(f.q, f.cache({0, 1, 2, 0}),
                             {.key_dim = e.feat, .lengths = e.lens({4, 3}, DType::float32)});
        }}},
      {"kv_cache_query_lacks_query_spatial",
       {[](const Ex& e) {
          const KvFixture f(e);
          kv_cache_attention(f.q, f.cache({0, 1, 2, 0}),
                             {.key_dim = e.feat, .lengths = e.lens({4, 3}), .query_spatial = e.time});
        }}},
      {"kv_cache_alibi_over_other_dim",
       {[](const Ex& e) {
          const KvFixture f(e);
          const Tensor q = random_normal({e.batch, e.time, e.feat}, 1, e.f32);
          KvCacheAttentionOptions o{.key_dim = e.feat, .lengths = e.lens({4, 3}), .query_spatial = e.time};
          o.variants.alibi_slopes = random_normal({e.time}, 4, e.f32);
          kv_cache_attention(q, f.cache({0, 1, 2, 0}), o);
        }}},
      {"kv_cache_slot_twice",
       {[](const Ex& e) {
          const KvFixture f(e);
          const Dim tokens("tokens", 3);
          kv_cache_append(f.cache({0, 1, 2, 0}), random_normal({tokens, e.feat}, 1, e.f32),
                          random_normal({tokens, e.vfeat}, 2, e.f32), from_host({tokens}, {1, -1, 1}, e.i64));
        }}},
      {"kv_cache_slot_out_of_range",
       {[](const Ex& e) {
          const KvFixture f(e);
          const Dim tokens("tokens", 1);
          kv_cache_append(f.cache({0, 1, 2, 0}), random_normal({tokens, e.feat}, 1, e.f32),
                          random_normal({tokens, e.vfeat}, 2, e.f32), from_host({tokens}, {6}, e.i64));
        }}},
      {"unknown_backend",
       {[](const Ex& e) { random_normal({e.batch}, 1, {.backend = "jax"}); }}},
  };
  return cases;
}

struct Param {
  std::string id, backend;
};
std::vector<Param> error_params() {
  std::vector<Param> ps;
  for (const auto& [id, c] : error_cases())
    for (const std::string& be : backend_names()) ps.push_back({id, be});
  return ps;
}

class Errors : public ::testing::TestWithParam<Param> {};

TEST_P(Errors, MessageBeginsAsDocumented) {
  const auto& [id, be] = GetParam();
  const ErrorCase& c = error_cases().at(id);
  if (c.needs == "two_backends" && backend_names().size() < 2) GTEST_SKIP() << "needs two backends";
  if (c.needs == "cuda" && !get_backend(be).supports(kCUDA)) GTEST_SKIP() << "needs CUDA";
  if (!c.needs.empty() && c.needs != "two_backends" && c.needs != "cuda") {
    const std::vector<std::string> known = all_kernel_names();
    if (std::find(known.begin(), known.end(), c.needs) == known.end())
      GTEST_SKIP() << "no built backend has " << c.needs << " (built without the torch backend)";
  }
  const std::string want = doc_message("Errors", id);
  ASSERT_FALSE(want.empty()) << "docs/errors.md has no row `" << id << "`";
  Ex e(be);
  std::string got;
  try {
    c.run(e);
  } catch (const Error& err) {
    got = err.what();
  }  // any other exception fails the test as thrown
  ASSERT_FALSE(got.empty()) << id << ": no dimattn::Error was thrown";
  EXPECT_EQ(got.rfind(want, 0), 0u) << id << " on " << be << ":\n  got:  " << got << "\n  want: " << want << "...";
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) { return info.param.id + "_" + info.param.backend; }
INSTANTIATE_TEST_SUITE_P(Rows, Errors, ::testing::ValuesIn(error_params()), param_name);

// --- inputs with defined results, on every CPU kernel ---

struct KernelParam {
  std::string backend, kernel;
};
void PrintTo(const KernelParam& k, std::ostream* os) { *os << k.backend << "/" << k.kernel; }
std::vector<KernelParam> kernel_params() {
  std::vector<KernelParam> ps;
  for (const std::string& be : backend_names())
    for (const std::string& k : get_backend(be).attention_kernels(kCPU)) ps.push_back({be, k});
  return ps;
}

// Which kernel runs which row (docs/errors.md): every CPU kernel of every
// backend runs every row of the defined-results table, in every dtype the row
// uses, except the gate rejections listed here, which are the documented
// behaviour (the gate's reason, as it appears in the error). A rejection of
// any other call is a failure, never a skip.
std::optional<std::string> documented_rejection(const std::string& row, const std::string& kernel) {
  if (row == "empty_value_feature" && kernel == "aten_flash_cpu") return "needs equal qk and v head dims";
  if (row == "row_lengths_zero" && (kernel == "aten_flash_cpu" || kernel == "aten_math"))
    return "kv lengths vary over the query's own dims";
  return std::nullopt;
}

// The row of the running test: its name up to the parameter.
std::string current_row() {
  const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  return name.substr(0, name.find('/'));
}

class Defined : public ::testing::TestWithParam<KernelParam> {
 protected:
  void SetUp() override { force_.emplace(GetParam().kernel); }
  TensorOptions o(DType dt = DType::float32) const { return {.dtype = dt, .backend = GetParam().backend}; }
  Tensor lens(const Dim& batch, const std::vector<double>& l) const {
    return from_host({batch}, l, {.dtype = DType::int64, .backend = GetParam().backend});
  }
  // dot_attention under this kernel. nullopt when the gate rejects the call:
  // with skip_reason_ set when the rejection is documented, else after a
  // failure. A documented rejection that runs after all fails too.
  std::optional<Tensor> attend(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& opts) {
    const std::string row = current_row(), kernel = GetParam().kernel;
    const std::optional<std::string> documented = documented_rejection(row, kernel);
    try {
      Tensor out = dot_attention(q, k, v, opts);
      if (documented)
        ADD_FAILURE() << kernel << " ran " << row << ", whose rejection (" << *documented
                      << ") is documented: update documented_rejection() and docs/errors.md";
      return out;
    } catch (const Error& e) {
      const std::string msg = e.what();
      if (msg.find("no forced kernel can run") == std::string::npos) throw;
      if (!documented) {
        ADD_FAILURE() << kernel << " must run " << row << " (docs/errors.md: every CPU kernel runs every row), "
                      << "but its gate rejected it: " << msg;
      } else if (msg.find(*documented) == std::string::npos) {
        ADD_FAILURE() << kernel << " rejected " << row << " for another reason than the documented '" << *documented
                      << "': " << msg;
      } else {
        skip_reason_ = "documented rejection (docs/errors.md): " + kernel + " " + *documented;
      }
      return {};
    }
  }
  std::optional<ForceKernels> force_;
  std::string skip_reason_;
};

// Binds `var` to the result; returns (failed) on an unexpected rejection and
// skips, printing the gate's reason, on a documented one.
#define ATTEND(var, ...)                                 \
  std::optional<Tensor> var##_opt = attend(__VA_ARGS__); \
  if (!var##_opt) {                                      \
    if (skip_reason_.empty()) return;                    \
    GTEST_SKIP() << skip_reason_;                        \
  }                                                      \
  const Tensor& var = *var##_opt

std::set<std::string>& defined_ids() {
  static std::set<std::string> ids;
  return ids;
}
// Registers a row id at static-initialisation time (for the doc check).
struct RegisterDefined {
  explicit RegisterDefined(const char* id) { defined_ids().insert(id); }
};
#define DEFINED_ROW(id)                              \
  static const RegisterDefined register_##id(#id); \
  TEST_P(Defined, id)

bool all_equal(const std::vector<double>& xs, double want) {
  for (double x : xs)
    if (!(x == want)) return false;
  return true;
}
bool all_near(const std::vector<double>& xs, double want, double tol) {
  for (double x : xs)
    if (!(std::abs(x - want) <= tol)) return false;
  return true;
}
bool all_nan(const std::vector<double>& xs) {
  for (double x : xs)
    if (!std::isnan(x)) return false;
  return true;
}
bool none_nan(const std::vector<double>& xs) {
  for (double x : xs)
    if (std::isnan(x)) return false;
  return true;
}

DEFINED_ROW(empty_batch) {
  Dim batch("batch", 0), time("time", 3), feat("feat", 4);
  Tensor x = random_normal({batch, time, feat}, 1, o());
  ATTEND(out, x, x, x, {.key_dim = feat, .axis = time, .causal_query_spatial_dim = time});
  EXPECT_EQ(out.numel(), 0);
  EXPECT_TRUE(testing::same_dims(out.dims(), {batch, time, feat}));
}

DEFINED_ROW(empty_query) {
  Dim batch("batch", 2), tq("tq", 0), tk("tk", 3), feat("feat", 4);
  ATTEND(out, random_normal({batch, tq, feat}, 1, o()), random_normal({batch, tk, feat}, 2, o()),
                 random_normal({batch, tk, feat}, 3, o()), {.key_dim = feat, .axis = tk});
  EXPECT_EQ(out.numel(), 0);
}

DEFINED_ROW(empty_kv) {
  Dim batch("batch", 2), tq("tq", 3), tk("tk", 0), feat("feat", 4);
  ATTEND(out, random_normal({batch, tq, feat}, 1, o()), random_normal({batch, tk, feat}, 2, o()),
                 random_normal({batch, tk, feat}, 3, o()), {.key_dim = feat, .axis = tk});
  EXPECT_TRUE(all_equal(to_host(out), 0.0));
  EXPECT_EQ(out.numel(), 2 * 3 * 4);
}

DEFINED_ROW(empty_self_attention) {
  Dim batch("batch", 2), time("time", 0), feat("feat", 4);
  Tensor x = random_normal({batch, time, feat}, 1, o());
  ATTEND(out, x, x, x, {.key_dim = feat, .axis = time, .causal_query_spatial_dim = time});
  EXPECT_EQ(out.numel(), 0);
}

DEFINED_ROW(empty_value_feature) {
  Dim batch("batch", 2), tq("tq", 3), tk("tk", 4), feat("feat", 4), v0("v0", 0);
  ATTEND(out, random_normal({batch, tq, feat}, 1, o()), random_normal({batch, tk, feat}, 2, o()),
                 random_normal({batch, tk, v0}, 3, o()), {.key_dim = feat, .axis = tk});
  EXPECT_EQ(out.numel(), 0);
  EXPECT_TRUE(testing::same_dims(out.dims(), {batch, tq, v0}));
}

DEFINED_ROW(all_lengths_zero) {
  Dim batch("batch", 2), tq("tq", 3), feat("feat", 4);
  Dim tk = Dim::dynamic("tk", lens(batch, {0, 0}), 4);
  ATTEND(out, random_normal({batch, tq, feat}, 1, o()), random_normal({batch, tk, feat}, 2, o()),
                 random_normal({batch, tk, feat}, 3, o()), {.key_dim = feat, .axis = tk});
  EXPECT_TRUE(all_equal(to_host(out), 0.0));
}

DEFINED_ROW(kv_cache_empty_pool) {
  // kv_cache_attention over pools without a block: on cpu_flash the pools are
  // read in place, on the other kernels the (zero) pages are gathered. Not
  // causal: aten_flash_cpu takes causal query groups only with kv repeated.
  Dim batch("batch", 2), group("group", 3), feat("feat", 4), block("block", 0), slot("slot", 2), table("table", 2);
  const PagedKvCache cache{.keys = random_normal({block, slot, feat}, 2, o()),
                           .values = random_normal({block, slot, feat}, 3, o()),
                           .block = block,
                           .slot = slot,
                           .block_table = from_host({batch, table}, {0, 0, 0, 0},
                                                    {.dtype = DType::int32, .backend = GetParam().backend}),
                           .table = table};
  const Tensor out = kv_cache_attention(random_normal({batch, group, feat}, 1, o()), cache,
                                        {.key_dim = feat, .lengths = lens(batch, {0, 0}), .causal = false});
  EXPECT_TRUE(testing::same_dims(out.dims(), {batch, group, feat}));
  EXPECT_EQ(out.numel(), 2 * 3 * 4);
  EXPECT_TRUE(all_equal(to_host(out), 0.0));
}

DEFINED_ROW(row_lengths_zero) {
  // kv lengths over (batch, tq): rows (0, 1) and (1, 0) see nothing; entry 1's
  // last kv position is padding to every row, and holds NaN.
  Dim batch("batch", 2), tq("tq", 3), feat("feat", 2);
  Dim tk = Dim::dynamic("tk", from_host({batch, tq}, {2, 0, 4, 0, 1, 3}, {.dtype = DType::int64,
                                                                          .backend = GetParam().backend}), 4);
  std::vector<double> v(16, 1.0);
  v[(1 * 4 + 3) * 2] = NAN;
  ATTEND(out, random_normal({batch, tq, feat}, 1, o()), random_normal({batch, tk, feat}, 2, o()),
                 from_host({batch, tk, feat}, v, o()), {.key_dim = feat, .axis = tk});
  const std::vector<double> h = to_host(out, Dims{batch, tq, feat});
  EXPECT_TRUE(none_nan(h));
  for (size_t row : {1, 3}) EXPECT_TRUE(all_equal({h.begin() + 2 * row, h.begin() + 2 * row + 2}, 0.0)) << row;
  // Rows that see some positions average ones: 1 up to the rounding of
  // their float32 softmax weights' sum (a row of 4 is 1 - 2^-24).
  for (size_t row : {0, 2, 4, 5}) EXPECT_TRUE(all_near({h.begin() + 2 * row, h.begin() + 2 * row + 2}, 1.0, 1e-6)) << row;
}

DEFINED_ROW(causal_offset_negative) {
  // Query row i sees kv positions <= i - 2: rows 0 and 1 see nothing.
  Dim batch("batch", 1), tq("tq", 3), tk("tk", 3), feat("feat", 4);
  ATTEND(out, random_normal({batch, tq, feat}, 1, o()), random_normal({batch, tk, feat}, 2, o()),
                 random_normal({batch, tk, feat}, 3, o()),
                 {.key_dim = feat, .axis = tk, .causal_query_spatial_dim = tq, .causal_offset = lens(batch, {-2})});
  const std::vector<double> h = to_host(out, Dims{batch, tq, feat});
  EXPECT_TRUE(all_equal({h.begin(), h.begin() + 8}, 0.0));
  EXPECT_TRUE(none_nan(h));
  EXPECT_FALSE(all_equal({h.begin() + 8, h.end()}, 0.0));
}

DEFINED_ROW(scale_zero) {
  // Uniform weights over the valid positions: the mean of their values.
  Dim batch("batch", 1), tq("tq", 2), tk("tk", 3), feat("feat", 2);
  Tensor v = from_host({batch, tk, feat}, {1, 2, 3, 4, 5, 6}, o());
  ATTEND(out, random_normal({batch, tq, feat}, 1, o()), random_normal({batch, tk, feat}, 2, o()), v,
                 {.key_dim = feat, .axis = tk, .scale = 0.0});
  const std::vector<double> h = to_host(out, Dims{batch, tq, feat});
  for (size_t i = 0; i < h.size(); ++i) EXPECT_NEAR(h[i], i % 2 == 0 ? 3.0 : 4.0, 1e-6);
}

// NaN and Inf: batch entry 1 of a [batch 2, time 3, feat 2] call, kv lengths
// {3, 2} (position 2 of entry 1 is padding). Entry 0 never changes.
struct NanCall {
  Dim batch{"batch", 2}, time{"time", 3}, feat{"feat", 2};
  std::vector<double> q = std::vector<double>(12, 0.5), k = std::vector<double>(12, 0.25), v;
  NanCall() {
    for (int i = 0; i < 12; ++i) v.push_back(0.1 * i);
  }
  static size_t at(int b, int t, int f) { return static_cast<size_t>((b * 3 + t) * 2 + f); }
};

using EntryOutputs = std::pair<std::vector<double>, std::vector<double>>;

// Runs the call in `dtype` under the kernel forced now; returns entry 0's and
// entry 1's outputs ([time, feat] each). Every kernel must run every NaN row
// in every dtype (no documented rejection): a rejection is a failure and
// gives nullopt.
std::optional<EntryOutputs> run_nan(const NanCall& c, bool causal, const std::string& be, DType dtype) {
  const TensorOptions o{.dtype = dtype, .backend = be};
  Dim kv = c.time;
  AttentionOptions opts{.key_dim = c.feat, .axis = c.time, .causal_query_spatial_dim = c.time};
  if (!causal) {
    kv = Dim::dynamic("kv", from_host({c.batch}, {3, 2}, {.dtype = DType::int64, .backend = be}), 3);
    opts = {.key_dim = c.feat, .axis = kv};
  }
  Tensor q = from_host({c.batch, c.time, c.feat}, c.q, o);
  Tensor k = from_host({c.batch, kv, c.feat}, c.k, o), v = from_host({c.batch, kv, c.feat}, c.v, o);
  std::optional<Tensor> out;
  try {
    out = dot_attention(q, k, v, opts);
  } catch (const Error& e) {
    if (std::string(e.what()).find("no forced kernel can run") == std::string::npos) throw;
    ADD_FAILURE() << current_kernel_force().describe() << " must run " << current_row() << " in "
                  << dtype_name(dtype) << " on " << be << " (docs/errors.md), but its gate rejected it: " << e.what();
    return std::nullopt;
  }
  std::vector<double> h = to_host(*out, Dims{c.batch, c.time, c.feat});
  return EntryOutputs(std::vector<double>(h.begin(), h.begin() + 6), std::vector<double>(h.begin() + 6, h.end()));
}

// A float32 row: `mutate` puts the NaN or Inf into `c`; `check` sees entry
// 1's outputs with it (e1) and without it (clean1).
#define NAN_ROW(id, causal, mutate, check)                                         \
  DEFINED_ROW(id) {                                                                \
    NanCall clean, c;                                                              \
    mutate;                                                                        \
    auto base = run_nan(clean, causal, GetParam().backend, DType::float32);        \
    auto got = run_nan(c, causal, GetParam().backend, DType::float32);             \
    if (!base || !got) return;                                                     \
    EXPECT_EQ(got->first, base->first) << "entry 0 must not change";               \
    const std::vector<double>& e1 = got->second;                                   \
    const std::vector<double>& clean1 = base->second;                              \
    (void)clean1;                                                                  \
    check;                                                                         \
  }

// A NaN in a query row makes that row's output NaN, and only that row's.
NAN_ROW(nan_in_query, false, c.q[NanCall::at(1, 0, 0)] = NAN, {
  EXPECT_TRUE(all_nan({e1.begin(), e1.begin() + 2}));
  EXPECT_EQ(std::vector<double>(e1.begin() + 2, e1.end()), std::vector<double>(clean1.begin() + 2, clean1.end()));
})
// A NaN or +Inf in a valid key or value position makes every row that attends it NaN.
NAN_ROW(nan_in_keys, false, c.k[NanCall::at(1, 0, 1)] = NAN, EXPECT_TRUE(all_nan(e1)))
NAN_ROW(nan_in_values, false, c.v[NanCall::at(1, 1, 0)] = NAN, {
  for (int t = 0; t < 3; ++t) EXPECT_TRUE(std::isnan(e1[static_cast<size_t>(t * 2)])) << t;
  for (int t = 0; t < 3; ++t) EXPECT_EQ(e1[static_cast<size_t>(t * 2 + 1)], clean1[static_cast<size_t>(t * 2 + 1)]);
})
NAN_ROW(inf_in_keys, false, c.k[NanCall::at(1, 0, 0)] = INFINITY, EXPECT_TRUE(all_nan(e1)))
NAN_ROW(inf_in_values, false, c.v[NanCall::at(1, 0, 0)] = INFINITY, {
  for (int t = 0; t < 3; ++t) EXPECT_FALSE(std::isfinite(e1[static_cast<size_t>(t * 2)])) << t;
})

// Padding is not data: whatever it holds never reaches the result, on every
// kernel (cpu_flash, aten_flash_cpu, aten_math, reference; torch and Eigen) in
// float32, bfloat16 and float16. Per dtype: entry 0 and entry 1 equal the
// same kernel's result with finite padding, bit for bit, and entry 1 is the
// reference path's result for this input within reference_tolerance(dtype).
const DType kPaddingDtypes[] = {DType::float32, DType::bfloat16, DType::float16};

#define PADDING_ROW(id, mutate)                                                                             \
  DEFINED_ROW(id) {                                                                                         \
    NanCall clean, c;                                                                                       \
    mutate;                                                                                                 \
    const std::string& be = GetParam().backend;                                                             \
    size_t ran = 0;                                                                                         \
    for (DType dt : kPaddingDtypes) {                                                                       \
      SCOPED_TRACE(dtype_name(dt));                                                                         \
      std::optional<EntryOutputs> ref;                                                                      \
      {                                                                                                     \
        ForceKernels reference("reference");                                                                \
        ref = run_nan(c, false, be, dt);                                                                    \
      }                                                                                                     \
      auto base = run_nan(clean, false, be, dt);                                                            \
      auto got = run_nan(c, false, be, dt);                                                                 \
      if (!ref || !base || !got) continue;                                                                  \
      ++ran;                                                                                                \
      EXPECT_EQ(got->first, base->first) << "entry 0 must not change";                                      \
      EXPECT_EQ(got->second, base->second) << "the padding of entry 1 reached its result";                 \
      const double tol = reference_tolerance(dt);                                                           \
      for (size_t i = 0; i < got->second.size(); ++i)                                                       \
        EXPECT_TRUE(std::abs(got->second[i] - ref->second[i]) <= tol * std::max(1.0, std::abs(ref->second[i]))) \
            << "entry 1 [" << i << "]: " << got->second[i] << ", the reference gives " << ref->second[i];     \
    }                                                                                                       \
    EXPECT_EQ(ran, std::size(kPaddingDtypes)) << "dtypes that ran";                                         \
  }

PADDING_ROW(nan_in_key_padding, c.k[NanCall::at(1, 2, 0)] = NAN)
PADDING_ROW(inf_in_key_padding, c.k[NanCall::at(1, 2, 0)] = INFINITY)
PADDING_ROW(nan_in_value_padding, c.v[NanCall::at(1, 2, 0)] = NAN)
PADDING_ROW(inf_in_value_padding, c.v[NanCall::at(1, 2, 0)] = INFINITY)

// Causally masked (future) positions: a NaN key there is masked, except on
// aten_math, whose causal mask is an additive bias (NaN + -inf = NaN): there
// every row of the entry is NaN (docs/errors.md, known deviation). A NaN
// value there reaches earlier rows as 0·NaN (documented in docs/errors.md).
NAN_ROW(nan_in_causal_future_key, true, c.k[NanCall::at(1, 2, 0)] = NAN, {
  if (GetParam().kernel == "aten_math") {
    EXPECT_TRUE(all_nan(e1)) << "aten_math's documented deviation changed: update docs/errors.md";
  } else {
    EXPECT_EQ(std::vector<double>(e1.begin(), e1.begin() + 4),
              std::vector<double>(clean1.begin(), clean1.begin() + 4));
    EXPECT_TRUE(all_nan({e1.begin() + 4, e1.end()}));
  }
})
NAN_ROW(nan_in_causal_future_value, true, c.v[NanCall::at(1, 2, 0)] = NAN, {
  for (int t = 0; t < 3; ++t) EXPECT_TRUE(std::isnan(e1[static_cast<size_t>(t * 2)])) << t;
})

std::string kernel_param_name(const ::testing::TestParamInfo<KernelParam>& info) {
  return info.param.backend + "_" + info.param.kernel;
}
INSTANTIATE_TEST_SUITE_P(CpuKernels, Defined, ::testing::ValuesIn(kernel_params()), kernel_param_name);

// --- the doc and this file list the same rows ---

TEST(ErrorsDoc, RowsAndTestsAreTheSameSet) {
  std::set<std::string> doc_errors, code_errors, doc_defined;
  for (const DocRow& r : doc_rows("Errors")) EXPECT_TRUE(doc_errors.insert(r.id).second) << "duplicate row " << r.id;
  for (const auto& [id, c] : error_cases()) code_errors.insert(id);
  for (const DocRow& r : doc_rows("Inputs with defined results"))
    EXPECT_TRUE(doc_defined.insert(r.id).second) << "duplicate row " << r.id;
  EXPECT_EQ(doc_errors, code_errors) << "docs/errors.md's Errors table and error_cases() differ";
  EXPECT_EQ(doc_defined, defined_ids()) << "docs/errors.md's defined-results table and the DEFINED_ROW tests differ";
  EXPECT_GE(doc_errors.size(), 30u);
}

}  // namespace
}  // namespace dimattn
