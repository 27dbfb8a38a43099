#pragma once
// The call spec: how a dot_attention call's dims and options cross the torch
// op boundary. Tensors travel as op arguments (query, keys, values, and the
// auxiliary list: lengths of dynamic dims, causal offsets, ALiBi slopes,
// sinks, bias, mask, the dropout seed); everything else travels in one string, so that a
// framework maps its own dim objects onto names, and a new option is one
// entry here and one in python/dimattn/_attention.py, not a new op schema.
//
//   q=batch,heads,time,feat;k=batch,heads,kv,feat;v=batch,heads,kv,vfeat;
//   out=batch,heads,time,vfeat;key_dim=feat;axis=kv;dyn.kv=0:batch;
//   causal=time;causal_offset=1:batch;dropout=0.1;broadcast=1;train=1;seed=4;
//   scale=0.125;force=reference;size.x=4;query_position=time;window=128:;
//   softcap=50.0;alibi=2:heads;sinks=3:heads;sink_off_by_one=1;
//   bias=5:heads,time,kv;mask=6:batch,kv;cp=load_balanced:ring:60.0:0
//
// Entries are separated by ';', the key ends at the first '='. Lists are
// comma-separated names. "dyn.NAME=I:d1,d2" makes NAME a dynamic dim whose
// lengths are aux[I] over dims d1, d2; "causal_offset=I:dims" is aux[I] over
// dims (or "causal_offset_int=N" for a constant); "seed=I" is the dropout
// seed in aux[I] (an int64 scalar); "size.NAME=N" is the size of a dim that is
// in no operand (so that an error can name it with its size). The variants:
// "query_position=NAME" (AttentionOptions::query_position_dim),
// "window=LEFT:RIGHT" (an empty side is unbounded), "softcap=X",
// "alibi=I:dims" and "sinks=I:dims" (aux[I] over dims), "sink_off_by_one=1",
// "bias=I:dims" (a float aux[I], AttentionOptions::bias) and "mask=I:dims"
// (a bool aux[I], AttentionOptions::mask); "cp=SHARDING:STRATEGY:TIMEOUT:GROUP" (context_parallel_attention's ContextParallel:
// contiguous or load_balanced, ring or all_gather, seconds or empty, the c10d
// group's name, last: it may hold ':') and "cp_lengths=I:dims" (its lengths).
// Names hold no ';', ',', '=' or ':' (the Python side makes them so).
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dimattn::python {

struct DynamicDimSpec {
  std::string name;
  int lengths = -1;               // index into aux
  std::vector<std::string> over;  // the lengths tensor's dims, in its order
};

// An auxiliary tensor and the names of its dims, in its order.
struct AuxTensorSpec {
  int index = -1;  // into aux
  std::vector<std::string> over;
};

struct WindowSpec {
  std::optional<int64_t> left, right;  // unset: unbounded
};

struct CallSpec {
  std::vector<std::string> q, k, v, out;
  std::vector<std::string> energy;  // trace op: the energy's dims in order ("'" = the kv dim of self-attention)
  std::string key_dim, axis;
  std::vector<DynamicDimSpec> dynamic;
  std::map<std::string, int64_t> sizes;  // dims in no operand
  std::optional<std::string> causal;
  std::optional<int> causal_offset;  // index into aux
  std::vector<std::string> causal_offset_dims;
  std::optional<int64_t> causal_offset_int;
  double dropout = 0.0;
  bool broadcast = false;
  bool train = false;
  std::optional<int> seed;  // index into aux
  std::optional<double> scale;
  std::optional<std::string> force;
  // variants
  std::optional<std::string> query_position;
  std::optional<WindowSpec> window;
  std::optional<double> softcap;
  std::optional<AuxTensorSpec> alibi, sinks;
  bool sink_off_by_one = false;
  std::optional<AuxTensorSpec> bias, mask;
  struct ContextParallelSpec {
    std::string sharding, strategy, group;
    std::optional<double> timeout;
  };
  std::optional<ContextParallelSpec> context_parallel;
  std::optional<AuxTensorSpec> cp_lengths;
};

// Throws dimattn::Error "[dimattn op] ..." for a malformed spec or an unknown
// key (a package and a library of different versions).
CallSpec parse_call_spec(std::string_view text);

}  // namespace dimattn::python
