#pragma once
// The call spec: how a dot_attention call's dims and options cross the torch
// op boundary. Tensors travel as op arguments (query, keys, values, and the
// auxiliary list: lengths of dynamic dims, causal offsets, the dropout seed);
// everything else travels in one string, so that a framework maps its own dim
// objects onto names, and a new option is one entry here and one in
// python/dimattn/_spec.py, not a new op schema.
//
//   q=batch,heads,time,feat;k=batch,heads,kv,feat;v=batch,heads,kv,vfeat;
//   out=batch,heads,time,vfeat;key_dim=feat;axis=kv;dyn.kv=0:batch;
//   causal=time;causal_offset=1:batch;dropout=0.1;broadcast=1;train=1;seed=2;
//   scale=0.125;force=reference;size.x=4
//
// Entries are separated by ';', the key ends at the first '='. Lists are
// comma-separated names. "dyn.NAME=I:d1,d2" makes NAME a dynamic dim whose
// lengths are aux[I] over dims d1, d2; "causal_offset=I:dims" is aux[I] over
// dims (or "causal_offset_int=N" for a constant); "seed=I" is the dropout
// seed in aux[I] (an int64 scalar); "size.NAME=N" is the size of a dim that is
// in no operand (so that an error can name it with its size). Names hold no
// ';', ',', '=' or ':' (the Python side makes them so).
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dimattn::python {

struct DynamicDimSpec {
  std::string name;
  int lengths = -1;               // index into aux
  std::vector<std::string> over;  // the lengths tensor's dims, in its order
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
};

// Throws dimattn::Error "[dimattn op] ..." for a malformed spec or an unknown
// key (a package and a library of different versions).
CallSpec parse_call_spec(std::string_view text);

}  // namespace dimattn::python
