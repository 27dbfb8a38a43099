#include "dimattn/dtype.h"

#include "dimattn/error.h"
#include "dimattn/internal/check.h"

namespace dimattn {
namespace {
struct DTypeInfo {
  DType dtype;
  const char* name;
  int size;
  bool floating;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::float32, "float32", 4, true}, {DType::float64, "float64", 8, true},
    {DType::bfloat16, "bfloat16", 2, true}, {DType::float16, "float16", 2, true},
    {DType::int32, "int32", 4, false},     {DType::int64, "int64", 8, false},
    {DType::boolean, "bool", 1, false},
};
const DTypeInfo& info(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return i;
  detail::fail("dtype", "unknown dtype value ", static_cast<int>(d));
}
}  // namespace

const char* dtype_name(DType d) { return info(d).name; }
int dtype_size(DType d) { return info(d).size; }
bool is_floating(DType d) { return info(d).floating; }

DType parse_dtype(const std::string& name) {
  for (const auto& i : kDTypes)
    if (name == i.name) return i.dtype;
  if (name == "bf16") return DType::bfloat16;
  if (name == "fp16" || name == "half") return DType::float16;
  if (name == "fp32" || name == "float") return DType::float32;
  if (name == "fp64" || name == "double") return DType::float64;
  detail::fail("dtype", "unknown dtype '", name,
               "'; expected one of float32, float64, bfloat16, float16, int32, int64, bool");
}

std::string device_name(Device d) {
  if (d.type == DeviceType::cpu) return "cpu";
  return d.index == 0 ? "cuda" : "cuda:" + std::to_string(d.index);
}

Device parse_device(const std::string& name) {
  if (name == "cpu") return kCPU;
  if (name == "cuda") return kCUDA;
  if (name.rfind("cuda:", 0) == 0) {
    try {
      return Device{DeviceType::cuda, std::stoi(name.substr(5))};
    } catch (const std::exception&) {
    }
  }
  detail::fail("device", "unknown device '", name, "'; expected cpu, cuda or cuda:N");
}

}  // namespace dimattn
