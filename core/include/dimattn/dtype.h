#pragma once
// Element types and devices, shared by the frontend and every backend.
#include <cstdint>
#include <string>

namespace dimattn {

enum class DType { float32, float64, bfloat16, float16, int32, int64, boolean };

enum class DeviceType { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};

inline constexpr Device kCPU{DeviceType::cpu, 0};
inline constexpr Device kCUDA{DeviceType::cuda, 0};

const char* dtype_name(DType);
DType parse_dtype(const std::string& name);  // throws Error on unknown names
int dtype_size(DType);
bool is_floating(DType);
std::string device_name(Device);
Device parse_device(const std::string& name);

}  // namespace dimattn
