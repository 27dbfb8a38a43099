#pragma once
// A host emulation of the CUDA execution model, just enough for cuda_flash:
// a grid of blocks run one after another, each CUDA thread of a block a
// fiber on one host thread (switched only at barriers and warp collectives,
// so runs are deterministic), and the warp-collective instructions
// (mma.sync m16n8k16, ldmatrix .x4 [.trans], shfl.xor) computed from the
// fragment layouts of the PTX ISA. It checks what a GPU would not report:
//   - shared memory, at 2-byte granularity, per barrier interval: a read of
//     another thread's write, a write over another thread's read or write
//     (races), a read of bytes nobody wrote (uninitialised), any access to
//     bytes a cp.async is still copying (a too-early or missing wait_group),
//     accesses outside the launch's dynamic shared memory;
//   - convergence: every lane of a warp at the same collective (same call
//     site, same count of collectives so far), every live thread of a block
//     at the same barrier; a lane that exits while its warp waits, deadlocks;
//   - launches: block size, grid limits, dynamic shared memory above 48 KiB
//     without the attribute that allows it, cp.async groups never waited.
// Global memory is host memory: ASan (the asan-eigen preset) checks it.
//
// Written from the PTX ISA's definitions (docs/gpu.md); a test tool, not a
// backend. cuda/primitives.cuh's host side (primitives_host.h) calls it.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dimattn::cuda_emu {

struct Uint3 {
  unsigned x = 1, y = 1, z = 1;
};

// The executing CUDA thread's coordinates (pre: inside a launch).
const Uint3& thread_idx();
const Uint3& block_idx();
const Uint3& block_dim();
const Uint3& grid_dim();

// Where a primitive was called from: std::source_location's part that the
// checks compare (written out, since clang 14, the sanitized build's
// compiler, cannot build libstdc++'s std::source_location).
struct Site {
  const char* file = "";
  unsigned line_no = 0;
  static constexpr Site current(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
    return {file, line};
  }
  const char* file_name() const { return file; }
  unsigned line() const { return line_no; }
};

// --- warp collectives and barriers (every lane / thread takes part) ---

void block_barrier(Site site);
// r[m] of this lane from the four 8x8 b16 matrices whose row addresses lanes
// 8m .. 8m + 7 give (p: this lane's row address, in shared memory).
void ldmatrix_x4(uint32_t (&r)[4], const void* p, bool trans, Site site);
enum class MmaType { bf16, f16 };
void mma_m16n8k16(MmaType type, float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, Site site);
float shfl_xor(float x, int lane_mask, Site site);

// --- shared and global memory ---

unsigned char* dynamic_smem();
// Checks an access of `bytes` at p (shared memory) by this thread.
void smem_access(const void* p, size_t bytes, bool write, Site site);
void cp_async_16(void* smem, const void* gmem, bool valid, Site site);
void cp_async_commit();
void cp_async_wait(int pending_groups, Site site);

// --- launches ---

// Records the largest dynamic shared memory `kernel` may be launched with.
void allow_dynamic_smem(const void* kernel, size_t bytes);
// Runs body() as every thread of every block of the grid. Returns "" or why
// the launch failed (a CUDA launch error, or a fatal finding: out-of-bounds
// shared memory, divergence, deadlock).
std::string launch(const char* what, const void* kernel, Uint3 grid, Uint3 block, size_t smem_bytes,
                   const std::function<void()>& body);

// --- what the checks found ---

// Findings since the last call (races, uninitialised reads, fatal errors),
// each "kernel: what, where"; the same finding at the same site is reported
// once, with a count.
std::vector<std::string> take_findings();

// Counts since the process started, for the tests' summaries.
struct Counts {
  uint64_t launches = 0, blocks = 0, threads = 0, warp_collectives = 0, barriers = 0;
};
Counts counts();

}  // namespace dimattn::cuda_emu
