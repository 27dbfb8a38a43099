// The CUDA host emulation (emulator.h): fibers, the scheduler of one block,
// warp collectives, and the shared-memory checks.
#include "cuda_emu/emulator.h"

#include "support/bf16_bits.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <utility>

// ASan is told about every fiber switch. g++ says it is on with
// __SANITIZE_ADDRESS__, clang 14 (the asan-eigen build) with __has_feature.
#if defined(__SANITIZE_ADDRESS__)
#define DIMATTN_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DIMATTN_EMU_ASAN 1
#endif
#endif

#if defined(DIMATTN_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "the CUDA emulation's fiber switch is written for x86-64"
#endif

// Saves the callee-saved registers on the current stack, stores the stack
// pointer in *save, loads `to` (a stack saved the same way, or a new one
// prepared by start_stack) and returns into it (System V x86-64).
extern "C" void dimattn_emu_switch(void** save, void* to);
asm(R"(
  .text
  .globl dimattn_emu_switch
  .type dimattn_emu_switch, @function
dimattn_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dimattn_emu_switch, .-dimattn_emu_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace dimattn::cuda_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // kernel frames are small; ASan's redzones are not
constexpr unsigned kMaxBlockThreads = 1024;
constexpr size_t kStaticSmemLimit = 48 * 1024;  // without cudaFuncAttributeMaxDynamicSharedMemorySize
constexpr size_t kSmemLimit = 227 * 1024;       // sm_90's largest opt-in dynamic shared memory
constexpr int kManyReaders = -2;

enum class Op : uint8_t { barrier, ldmatrix, ldmatrix_trans, mma_bf16, mma_f16, shfl_xor };
const char* op_name(Op op) {
  switch (op) {
    case Op::barrier: return "__syncthreads";
    case Op::ldmatrix: return "ldmatrix.x4";
    case Op::ldmatrix_trans: return "ldmatrix.x4.trans";
    case Op::mma_bf16: return "mma.sync.m16n8k16.bf16";
    case Op::mma_f16: return "mma.sync.m16n8k16.f16";
    case Op::shfl_xor: return "shfl.sync.bfly";
  }
  return "?";
}

std::string where(const Site& s) {
  std::string f = s.file_name();
  if (const size_t k = f.rfind("kernels/"); k != std::string::npos) f = f.substr(k);
  return f + ":" + std::to_string(s.line());
}

enum class State : uint8_t { runnable, at_warp, at_barrier, done };

struct Copy {
  unsigned char* dst;
  const unsigned char* src;
  bool valid;
};

struct Thread {
  Uint3 idx;
  int linear = 0;
  State state = State::runnable;
  void* sp = nullptr;
  unsigned char* stack = nullptr;
  // The collective it waits at.
  Op op = Op::barrier;
  Site site;
  uint64_t warp_seq = 0, barrier_seq = 0;  // collectives / barriers passed
  void* args = nullptr;                    // the collective's operands and results
  std::vector<Copy> uncommitted;
  std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
};

// Shadow state of 2 bytes of shared memory.
struct Granule {
  uint32_t write_epoch = ~0u, read_epoch = ~0u;
  int16_t writer = -1, reader = -1, pending = -1;
  bool init = false;
};

struct Aborted {};

struct Emulator {
  // The launch and block being run.
  const std::function<void()>* body = nullptr;
  Uint3 grid, block, block_idx;
  std::vector<Thread> threads;
  std::vector<std::unique_ptr<unsigned char[]>> stacks;
  std::vector<unsigned char> smem;
  std::vector<Granule> shadow;
  uint32_t epoch = 0;
  Thread* current = nullptr;
  void* scheduler_sp = nullptr;
  bool aborted = false;
  std::string fatal_message;
  std::map<const void*, size_t> smem_allowed;
  // Findings: message -> count.
  std::vector<std::pair<std::string, uint64_t>> findings;
  std::map<std::string, size_t> finding_index;
  Counts counts;
#if defined(DIMATTN_EMU_ASAN)
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
#endif
};

Emulator& emu() {
  static Emulator e;
  return e;
}

// One finding per key (its kind and site): the first message, and a count.
void record(const std::string& key, const std::string& what) {
  Emulator& e = emu();
  auto [it, fresh] = e.finding_index.try_emplace(key, e.findings.size());
  if (fresh)
    e.findings.emplace_back(what, 1);
  else
    ++e.findings[it->second].second;
}
void record(const std::string& what) { record(what, what); }

std::string thread_name(int linear) {
  const Emulator& e = emu();
  std::ostringstream s;
  s << "thread " << linear << " (warp " << linear / 32 << ", lane " << linear % 32 << ") of block ("
    << e.block_idx.x << "," << e.block_idx.y << "," << e.block_idx.z << ")";
  return s.str();
}

// --- fibers ---

void switch_to_scheduler(bool exiting) {
  Emulator& e = emu();
  Thread* t = e.current;
#if defined(DIMATTN_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, e.main_stack_bottom, e.main_stack_size);
  dimattn_emu_switch(&t->sp, e.scheduler_sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)exiting;
  dimattn_emu_switch(&t->sp, e.scheduler_sp);
#endif
}

void check_block_barrier();
void check_warp(int warp);

[[noreturn]] void fiber_main() {
#if defined(DIMATTN_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &emu().main_stack_bottom, &emu().main_stack_size);
#endif
  Emulator& e = emu();
  try {
    (*e.body)();
    Thread* t = e.current;
    if (!t->uncommitted.empty() || !t->groups.empty())
      record("cp.async copies issued and never waited for at exit, " + thread_name(t->linear));
    t->state = State::done;
    // A waiting warp whose lane exits can never complete; a barrier whose
    // other threads all wait completes now.
    check_warp(t->linear / 32);
    check_block_barrier();
  } catch (const Aborted&) {
    // fatal() unwound this thread's frames (their temporaries freed); it
    // never runs again, nor does the rest of the block.
    e.current->state = State::done;
  }
  switch_to_scheduler(true);
  __builtin_unreachable();
}

// A fresh stack whose first switch-in enters fiber_main.
void start_stack(Thread& t) {
#if defined(DIMATTN_EMU_ASAN)
  ASAN_UNPOISON_MEMORY_REGION(t.stack, kStackBytes);
#endif
  auto top = reinterpret_cast<uintptr_t>(t.stack + kStackBytes) & ~uintptr_t{15};
  auto* slot = reinterpret_cast<void**>(top - 16);  // 16-byte aligned: fiber_main starts as if called
  slot[0] = reinterpret_cast<void*>(&fiber_main);
  slot[1] = nullptr;
  void** sp = slot - 6;  // r15, r14, r13, r12, rbx, rbp
  for (int r = 0; r < 6; ++r) sp[r] = nullptr;
  t.sp = sp;
}

void switch_to(Thread& t) {
  Emulator& e = emu();
  e.current = &t;
#if defined(DIMATTN_EMU_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, t.stack, kStackBytes);
  dimattn_emu_switch(&e.scheduler_sp, t.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  dimattn_emu_switch(&e.scheduler_sp, t.sp);
#endif
  e.current = nullptr;
}

// Ends the block: records the message and unwinds the calling thread's
// stack to fiber_main (so that nothing on it leaks), which then leaves.
[[noreturn]] void fatal(const std::string& what) {
  Emulator& e = emu();
  record(what);
  if (e.fatal_message.empty()) e.fatal_message = what;
  e.aborted = true;
  throw Aborted{};
}

// --- collectives ---

struct MmaArgs {
  MmaType type;
  float* c;
  const uint32_t* a;
  uint32_t b0, b1;
};
struct LdmatrixArgs {
  uint32_t* r;
  const unsigned char* p;
};
struct ShflArgs {
  float x;
  int mask;
  float out;
};

float half_value(uint16_t bits, MmaType t) {
  return t == MmaType::bf16 ? kernels::test::bf16_value(bits) : kernels::test::f16_value(bits);
}
float lo_half(uint32_t r, MmaType t) { return half_value(static_cast<uint16_t>(r & 0xffff), t); }
float hi_half(uint32_t r, MmaType t) { return half_value(static_cast<uint16_t>(r >> 16), t); }

// D = A B + C over the warp's fragments (PTX ISA, mma.m16n8k16 with .bf16 /
// .f16 inputs and .f32 accumulators). Products of 16-bit values are exact in
// double; the sum is rounded to float32 once (the tensor cores' own order and
// rounding of the sum are not specified).
void exec_mma(Thread* lanes[32]) {
  const MmaType type = static_cast<MmaArgs*>(lanes[0]->args)->type;
  double A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const auto& m = *static_cast<MmaArgs*>(lanes[l]->args);
    const int g = l / 4, t = l % 4;
    const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int i = 0; i < 4; ++i) {
      A[rows[i]][cols[i]] = lo_half(m.a[i], type);
      A[rows[i]][cols[i] + 1] = hi_half(m.a[i], type);
    }
    B[2 * t][g] = lo_half(m.b0, type);
    B[2 * t + 1][g] = hi_half(m.b0, type);
    B[2 * t + 8][g] = lo_half(m.b1, type);
    B[2 * t + 9][g] = hi_half(m.b1, type);
    C[g][2 * t] = m.c[0];
    C[g][2 * t + 1] = m.c[1];
    C[g + 8][2 * t] = m.c[2];
    C[g + 8][2 * t + 1] = m.c[3];
  }
  for (int l = 0; l < 32; ++l) {
    const auto& m = *static_cast<MmaArgs*>(lanes[l]->args);
    const int g = l / 4, t = l % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
      double d = C[rows[i]][cols[i]];
      for (int k = 0; k < 16; ++k) d += A[rows[i]][k] * B[k][cols[i]];
      m.c[i] = static_cast<float>(d);
    }
  }
}

// ldmatrix .x4: lanes 8m .. 8m + 7 address the rows of matrix m. The reads
// are checked as the addressing lane's.
void check_smem(const void* p, size_t bytes, bool write, const Site& site, int thread);

void exec_ldmatrix(Thread* lanes[32], bool trans, const Site& site) {
  uint16_t m[4][8][8];
  for (int l = 0; l < 32; ++l) {
    const unsigned char* row = static_cast<LdmatrixArgs*>(lanes[l]->args)->p;
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
      fatal("ldmatrix row address of " + thread_name(lanes[l]->linear) + " is not 16-byte aligned, at " +
            where(site));
    check_smem(row, 16, false, site, lanes[l]->linear);
    std::memcpy(m[l / 8][l % 8], row, 16);
  }
  for (int l = 0; l < 32; ++l) {
    uint32_t* r = static_cast<LdmatrixArgs*>(lanes[l]->args)->r;
    const int g = l / 4, t = l % 4;
    for (int k = 0; k < 4; ++k) {
      const uint16_t lo = trans ? m[k][2 * t][g] : m[k][g][2 * t];
      const uint16_t hi = trans ? m[k][2 * t + 1][g] : m[k][g][2 * t + 1];
      r[k] = lo | uint32_t{hi} << 16;
    }
  }
}

void exec_shfl(Thread* lanes[32]) {
  for (int l = 0; l < 32; ++l) {
    auto* a = static_cast<ShflArgs*>(lanes[l]->args);
    if (a->mask != static_cast<ShflArgs*>(lanes[0]->args)->mask)
      fatal("shfl.xor with different lane masks in one warp, " + thread_name(lanes[l]->linear) + " at " +
            where(lanes[l]->site));
    a->out = static_cast<ShflArgs*>(lanes[l ^ (a->mask & 31)]->args)->x;
  }
}

// Runs the warp's collective when all its lanes wait at it.
void check_warp(int warp) {
  Emulator& e = emu();
  const int n = static_cast<int>(e.threads.size());
  if ((warp + 1) * 32 > n) {
    // A partial warp: only the launches of whole warps use collectives here.
    for (int l = warp * 32; l < n; ++l)
      if (e.threads[l].state == State::at_warp)
        fatal(std::string(op_name(e.threads[l].op)) + " in a partial warp, at " + where(e.threads[l].site));
    return;
  }
  Thread* lanes[32];
  int waiting = 0, done = 0;
  for (int l = 0; l < 32; ++l) {
    lanes[l] = &e.threads[warp * 32 + l];
    waiting += lanes[l]->state == State::at_warp;
    done += lanes[l]->state == State::done;
  }
  if (waiting == 0) return;
  if (waiting + done == 32 && done > 0) {
    for (Thread* t : lanes)
      if (t->state == State::at_warp)
        fatal(std::string(op_name(t->op)) + " with a full lane mask while lanes of warp " + std::to_string(warp) +
              " have exited: " + thread_name(t->linear) + " waits at " + where(t->site));
  }
  if (waiting < 32) return;
  const Thread& first = *lanes[0];
  for (Thread* t : lanes)
    if (t->op != first.op || t->warp_seq != first.warp_seq || t->site.line() != first.site.line() ||
        std::strcmp(t->site.file_name(), first.site.file_name()) != 0)
      fatal("divergent warp " + std::to_string(warp) + ": lane " + std::to_string(first.linear % 32) + " at " +
            op_name(first.op) + " (" + where(first.site) + ", collective #" + std::to_string(first.warp_seq) +
            "), lane " + std::to_string(t->linear % 32) + " at " + op_name(t->op) + " (" + where(t->site) +
            ", collective #" + std::to_string(t->warp_seq) + ")");
  ++e.counts.warp_collectives;
  switch (first.op) {
    case Op::mma_bf16:
    case Op::mma_f16: exec_mma(lanes); break;
    case Op::ldmatrix: exec_ldmatrix(lanes, false, first.site); break;
    case Op::ldmatrix_trans: exec_ldmatrix(lanes, true, first.site); break;
    case Op::shfl_xor: exec_shfl(lanes); break;
    case Op::barrier: break;
  }
  for (Thread* t : lanes) {
    ++t->warp_seq;
    t->state = State::runnable;
  }
}

// Releases the block's barrier when every live thread waits at it.
void check_block_barrier() {
  Emulator& e = emu();
  const Thread* first = nullptr;
  for (const Thread& t : e.threads) {
    if (t.state == State::done) continue;
    if (t.state != State::at_barrier) return;
    if (!first) first = &t;
  }
  if (!first) return;
  for (const Thread& t : e.threads)
    if (t.state == State::at_barrier &&
        (t.barrier_seq != first->barrier_seq || t.site.line() != first->site.line() ||
         std::strcmp(t.site.file_name(), first->site.file_name()) != 0))
      fatal("threads at different barriers: " + thread_name(first->linear) + " at " + where(first->site) +
            " (barrier #" + std::to_string(first->barrier_seq) + "), " + thread_name(t.linear) + " at " +
            where(t.site) + " (barrier #" + std::to_string(t.barrier_seq) + ")");
  ++e.epoch;
  ++e.counts.barriers;
  for (Thread& t : e.threads)
    if (t.state == State::at_barrier) {
      ++t.barrier_seq;
      t.state = State::runnable;
    }
}

void arrive_warp(Op op, const Site& site, void* args) {
  Emulator& e = emu();
  Thread* t = e.current;
  t->op = op;
  t->site = site;
  t->args = args;
  t->state = State::at_warp;
  check_warp(t->linear / 32);
  if (t->state != State::runnable) switch_to_scheduler(false);
}

// --- shared memory ---

void check_smem(const void* p, size_t bytes, bool write, const Site& site, int thread) {
  Emulator& e = emu();
  const auto* b = static_cast<const unsigned char*>(p);
  if (e.smem.empty() || b < e.smem.data() || b + bytes > e.smem.data() + e.smem.size())
    fatal(std::string(write ? "write" : "read") + " of " + std::to_string(bytes) +
          " bytes outside the block's dynamic shared memory (" + std::to_string(e.smem.size()) + " bytes) by " +
          thread_name(thread) + " at " + where(site));
  const size_t off = static_cast<size_t>(b - e.smem.data());
  const auto me = static_cast<int16_t>(thread);
  // Messages are built only for findings: this runs for every access.
  auto report = [&](const char* kind, size_t g, const std::string& detail) {
    record(std::string(kind) + where(site),
           std::string(kind) + " shared byte " + std::to_string(2 * g) + " by " + thread_name(thread) + " at " +
               where(site) + detail);
  };
  auto other = [](int16_t who) {
    return who == kManyReaders ? std::string("other threads") : "thread " + std::to_string(who);
  };
  for (size_t g = off / 2; g < (off + bytes + 1) / 2; ++g) {
    Granule& s = e.shadow[g];
    if (s.pending >= 0)
      report(write ? "write to" : "read of", g,
             " while a cp.async of thread " + std::to_string(s.pending) +
                 " is still copying there (wait_group too early or missing)");
    if (write) {
      if (s.write_epoch == e.epoch && s.writer != me)
        report("write-after-write race on", g, ": " + other(s.writer) + " wrote it since the last barrier");
      if (s.read_epoch == e.epoch && s.reader != me)
        report("write-after-read race on", g, ": " + other(s.reader) + " read it since the last barrier");
      s.write_epoch = e.epoch;
      s.writer = me;
      s.init = true;
    } else {
      if (!s.init) report("uninitialised read of", g, "");
      if (s.write_epoch == e.epoch && s.writer != me)
        report("read-after-write race on", g, ": " + other(s.writer) + " wrote it since the last barrier");
      if (s.read_epoch != e.epoch) {
        s.read_epoch = e.epoch;
        s.reader = me;
      } else if (s.reader != me) {
        s.reader = kManyReaders;
      }
    }
  }
}

void complete(Thread& t, const std::vector<Copy>& group) {
  Emulator& e = emu();
  for (const Copy& c : group) {
    const size_t g0 = static_cast<size_t>(c.dst - e.smem.data()) / 2;
    for (size_t g = g0; g < g0 + 8; ++g) {
      Granule& s = e.shadow[g];
      s.pending = -1;
      s.write_epoch = e.epoch;
      s.writer = static_cast<int16_t>(t.linear);
      s.init = true;
    }
    if (c.valid)
      std::memcpy(c.dst, c.src, 16);
    else
      std::memset(c.dst, 0, 16);
  }
}

}  // namespace

// --- the API ---

const Uint3& thread_idx() { return emu().current->idx; }
const Uint3& block_idx() { return emu().block_idx; }
const Uint3& block_dim() { return emu().block; }
const Uint3& grid_dim() { return emu().grid; }

void block_barrier(Site site) {
  Emulator& e = emu();
  Thread* t = e.current;
  t->site = site;
  t->state = State::at_barrier;
  check_block_barrier();
  if (t->state != State::runnable) switch_to_scheduler(false);
}

void ldmatrix_x4(uint32_t (&r)[4], const void* p, bool trans, Site site) {
  LdmatrixArgs a{r, static_cast<const unsigned char*>(p)};
  arrive_warp(trans ? Op::ldmatrix_trans : Op::ldmatrix, site, &a);
}

void mma_m16n8k16(MmaType type, float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, Site site) {
  MmaArgs m{type, c, a, b0, b1};
  arrive_warp(type == MmaType::bf16 ? Op::mma_bf16 : Op::mma_f16, site, &m);
}

float shfl_xor(float x, int lane_mask, Site site) {
  ShflArgs s{x, lane_mask, 0.f};
  arrive_warp(Op::shfl_xor, site, &s);
  return s.out;
}

unsigned char* dynamic_smem() { return emu().smem.data(); }

void smem_access(const void* p, size_t bytes, bool write, Site site) {
  check_smem(p, bytes, write, site, emu().current->linear);
}

void cp_async_16(void* smem, const void* gmem, bool valid, Site site) {
  Emulator& e = emu();
  Thread* t = e.current;
  auto* dst = static_cast<unsigned char*>(smem);
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || (valid && reinterpret_cast<uintptr_t>(gmem) % 16 != 0))
    fatal("cp.async of 16 bytes with an address that is not 16-byte aligned, " + thread_name(t->linear) + " at " +
          where(site));
  // The copy may land at any time until its wait: it conflicts with any
  // access by another thread since the last barrier, as a write now would.
  check_smem(dst, 16, true, site, t->linear);
  const size_t g0 = static_cast<size_t>(dst - e.smem.data()) / 2;
  for (size_t g = g0; g < g0 + 8; ++g) e.shadow[g].pending = static_cast<int16_t>(t->linear);
  t->uncommitted.push_back({dst, static_cast<const unsigned char*>(gmem), valid});
}

void cp_async_commit() {
  Thread* t = emu().current;
  t->groups.push_back(std::move(t->uncommitted));
  t->uncommitted.clear();
}

void cp_async_wait(int pending_groups, Site) {
  Thread* t = emu().current;
  while (static_cast<int>(t->groups.size()) > pending_groups) {
    complete(*t, t->groups.front());
    t->groups.erase(t->groups.begin());
  }
}

void allow_dynamic_smem(const void* kernel, size_t bytes) { emu().smem_allowed[kernel] = bytes; }

std::string launch(const char* what, const void* kernel, Uint3 grid, Uint3 block, size_t smem_bytes,
                   const std::function<void()>& body) {
  Emulator& e = emu();
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxBlockThreads || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535)
    return "cudaErrorInvalidConfiguration (emulated: block of " + std::to_string(threads) + " threads, grid " +
           std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" + std::to_string(grid.z) + ")";
  const auto allowed = e.smem_allowed.find(kernel);
  const size_t limit = allowed == e.smem_allowed.end() ? kStaticSmemLimit : std::min(allowed->second, kSmemLimit);
  if (smem_bytes > limit)
    return "cudaErrorInvalidValue (emulated: " + std::to_string(smem_bytes) + " bytes of dynamic shared memory, " +
           std::to_string(limit) + " allowed" +
           (allowed == e.smem_allowed.end() ? std::string(" without cudaFuncSetAttribute") : std::string()) + ")";
  ++e.counts.launches;
  e.body = &body;
  e.grid = grid;
  e.block = block;
  e.aborted = false;
  e.fatal_message.clear();
  while (e.stacks.size() < threads) e.stacks.push_back(std::make_unique<unsigned char[]>(kStackBytes));
  for (unsigned z = 0; z < grid.z && !e.aborted; ++z)
    for (unsigned y = 0; y < grid.y && !e.aborted; ++y)
      for (unsigned x = 0; x < grid.x && !e.aborted; ++x) {
        e.block_idx = {x, y, z};
        // Uninitialised shared memory: NaN in every 16-bit and 32-bit float view.
        e.smem.assign(smem_bytes, 0xFF);
        e.shadow.assign((smem_bytes + 1) / 2, Granule{});
        e.epoch = 0;
        e.threads.assign(threads, Thread{});
        for (unsigned i = 0; i < threads; ++i) {
          Thread& t = e.threads[i];
          t.linear = static_cast<int>(i);
          t.idx = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
          t.stack = e.stacks[i].get();
          start_stack(t);
        }
        ++e.counts.blocks;
        e.counts.threads += threads;
        // Runs each runnable thread up to its next collective, until all are done.
        for (;;) {
          bool ran = false, all_done = true;
          for (Thread& t : e.threads) {
            if (t.state == State::runnable) {
              switch_to(t);
              ran = true;
              if (e.aborted) break;
            }
            all_done = all_done && t.state == State::done;
          }
          if (e.aborted) break;
          if (all_done) break;
          if (!ran) {
            std::string states;
            for (const Thread& t : e.threads)
              if (t.state != State::done && states.size() < 600)
                states += "\n  " + thread_name(t.linear) + " waits at " +
                          (t.state == State::at_barrier ? std::string("__syncthreads") : op_name(t.op)) + " (" +
                          where(t.site) + ")";
            const std::string msg = "deadlock: no thread can go on" + states;
            record(msg);
            e.fatal_message = msg;
            e.aborted = true;
          }
        }
      }
  e.threads.clear();
  e.body = nullptr;
  if (e.aborted) return std::string("emulated launch of ") + what + " stopped: " + e.fatal_message;
  return {};
}

std::vector<std::string> take_findings() {
  Emulator& e = emu();
  std::vector<std::string> out;
  for (const auto& [what, n] : e.findings)
    out.push_back(n > 1 ? what + " (" + std::to_string(n) + " times)" : what);
  e.findings.clear();
  e.finding_index.clear();
  return out;
}

Counts counts() { return emu().counts; }

}  // namespace dimattn::cuda_emu
