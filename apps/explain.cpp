// `dimattn explain`: which kernel a described dot_attention call would run,
// and why each other candidate would not.
#include <cstdio>

#include "cli_args.h"
#include "commands.h"
#include "dimattn/ext/backend.h"
#include "dimattn/error.h"
#include "dimattn/forcing.h"
#include "dimattn/registry.h"
#include "dimattn/run_context.h"
#include "problem.h"

namespace dimattn::cli {
namespace {

const char* const kSummary =
    "usage: dimattn explain [options]\n"
    "\n"
    "Builds the named q, k, v of the described call ({batch, heads, [group], time, feat}\n"
    "attending {batch, heads, kv, feat}), asks kernel selection which kernel dot_attention\n"
    "would run (explain_attention; nothing runs), and prints the selection params, the\n"
    "chosen kernel and, for every other candidate, why it was rejected.";

const std::vector<Option> kOptions = with_variant_options({
    {"backend", "NAME", "backend (default: the default backend)"},
    {"device", "DEV", "cpu, cuda or cuda:N (default cpu)"},
    {"dtype", "DTYPE", "float32, float64, bfloat16 or float16 (default float32)"},
    {"batch", "N", "batch size (default 8)"},
    {"heads", "N", "kv heads (default 8)"},
    {"groups", "N", "query heads per kv head (GQA), a dim only the query has (default 1)"},
    {"keys-only", "N", "entries of a dim only keys and values have, the query broadcast over it (default 1: none)"},
    {"layout", "L", "separate, permuted ([B, T, H, D] tensors) or packed_qkv (views of one [B, T, 3, H, D] buffer)"},
    {"seq-q", "N", "query length (default 128)"},
    {"seq-k", "N", "kv length (default: --seq-q)"},
    {"head-dim", "N", "q/k head dim (default 64)"},
    {"head-dim-v", "N", "v head dim (default: --head-dim)"},
    {"cross", "", "cross-attention: the query's time dim is not the kv dim (implied by --seq-q != --seq-k)"},
    {"step", "", "one decoding step: a query without a time dim"},
    {"causal", "", "causal attention"},
    {"offset", "LIST", "causal offset (history length), one value or one per batch entry; implies --cross"},
    {"dropout", "P", "attention dropout probability (acts only with --train)"},
    {"broadcast-dropout", "", "one dropout mask over the kv axis, shared by every other dim"},
    {"lengths", "LIST", "kv lengths per batch entry (a dynamic, padded kv dim)"},
    {"padded", "", "a dynamic kv dim with every length --seq-k (padding present, none masked)"},
    {"train", "", "train flag on (dropout acts) and q, k, v requiring gradients where the backend has autograd"},
    {"deterministic", "", "deterministic algorithms only"},
    {"force", "SPEC", "kernel forcing as DIMATTN_SDPA: auto, reference or a,b (default auto)"},
});

AttentionCase problem_of(const Args& a) {
  AttentionCase p;
  p.backend = a.text("backend", default_backend().name());
  if (!has_backend(p.backend)) a.fail("backend", "unknown backend '" + p.backend + "'");
  try {
    p.device = parse_device(a.text("device", "cpu"));
  } catch (const Error&) {
    a.fail("device", "expected cpu, cuda or cuda:N, got '" + a.text("device", "") + "'");
  }
  const std::vector<DType> dt = a.dtypes("dtype", {DType::float32});
  if (dt.size() != 1) a.fail("dtype", "give one dtype");
  p.dtype = dt[0];
  p.batch = a.integer("batch", 8, 1);
  p.heads = a.integer("heads", 8, 1);
  p.groups = a.integer("groups", 1, 1);
  p.keys_only = a.integer("keys-only", 1, 1);
  const std::string layout = a.text("layout", "separate");
  bool known = false;
  for (Layout l : {Layout::separate, Layout::permuted, Layout::packed_qkv})
    if (layout == testing::layout_name(l)) p.layout = l, known = true;
  if (!known) a.fail("layout", "expected separate, permuted or packed_qkv, got '" + layout + "'");
  p.seq_q = a.integer("seq-q", 128, 1);
  p.seq_k = a.integer("seq-k", p.seq_q, 1);
  p.head_dim = a.integer("head-dim", 64, 1);
  p.head_dim_v = a.integer("head-dim-v", p.head_dim, 1);
  p.causal = a.flag("causal");
  p.offsets = a.integers("offset", {}, 0);
  if (p.offsets.size() == 1) p.offsets.assign(static_cast<size_t>(p.batch), p.offsets[0]);
  const bool cross = a.flag("cross") || p.seq_q != p.seq_k || !p.offsets.empty();
  p.kind = a.flag("step") ? Kind::step : cross ? Kind::cross : Kind::self;
  p.dropout = a.number("dropout", 0);
  p.broadcast_dropout = a.flag("broadcast-dropout");
  p.lengths = a.integers("lengths", {}, 0);
  if (a.flag("padded")) {
    if (!p.lengths.empty()) a.fail("padded", "give either --padded or --lengths");
    p.lengths.assign(static_cast<size_t>(p.batch), p.seq_k);
  }
  apply_variants(a, p.variants);
  check_kernel_names("force", a.texts("force", {}));
  validate(p);
  return p;
}

}  // namespace

int run_explain(int argc, char** argv, int first) {
  const Args args("explain", kSummary, kOptions, argc, argv, first);
  if (args.help()) {
    std::printf("%s", args.usage().c_str());
    return 0;
  }
  AttentionCase p = problem_of(args);
  if (!get_backend(p.backend).supports(p.device))
    throw Error("backend " + p.backend + " does not run on " + device_name(p.device) + " here");
  if (args.flag("deterministic")) set_deterministic_algorithms(true);
  TrainFlagScope train(args.flag("train"));
  const Operands ops = make_operands(p, args.flag("train"));

  ForceKernels force(args.text("force", "auto"));
  const Decision d = explain_attention(ops.q, ops.k, ops.v, ops.opts);
  std::printf("call      %s\n", p.describe().c_str());
  std::printf("query     %s\nkeys      %s\nvalues    %s\n", ops.q.repr().c_str(), ops.k.repr().c_str(),
              ops.v.repr().c_str());
  std::printf("params    %s\n", d.params.describe().c_str());
  std::printf("selected  %s%s\n", d.kernel.c_str(), d.isa.empty() ? "" : (" (isa " + d.isa + ")").c_str());
  std::printf("candidates of %s on %s, in priority order:\n", p.backend.c_str(), device_name(p.device).c_str());
  bool after = false;  // candidates after the chosen one were not tried: ask each on its own
  for (const std::string& k : get_backend(p.backend).attention_kernels(p.device)) {
    std::string verdict;
    if (k == d.kernel) {
      verdict = "selected";
      after = true;
    } else if (!after) {
      for (const Rejection& r : d.rejected)
        if (r.kernel == k) verdict = "rejected: " + r.reason;
    } else {
      const auto why = rejection(ops, k);
      verdict = why ? "rejected: " + *why : "could run; lower priority";
    }
    std::printf("  %-16s %s\n", k.c_str(), verdict.c_str());
  }
  return 0;
}

}  // namespace dimattn::cli
