// Keeps the memory CPython gives back, for CPU engines.
//
// CPython takes the memory of its object arenas and of its call stack (data stack chunks of 16 KiB and up) straight
// from mmap, and unmaps each one as soon as it is empty. A loop whose call depth sits at a chunk boundary (the
// engine's step loop can, depending on how deep its caller is) maps and unmaps a chunk thousands of times a decode
// step, and each munmap flushes the TLB of every CPU the process runs on: an interrupt to the OpenMP threads, which
// in a VM is an exit to the hypervisor. Measured on the default model (GGUF weights kept, 2-vCPU Intel VM,
// `kvforge bench latency`): 70 tokens/s started from the `kvforge` script against 150 with one more Python frame
// around the loop, and the difference was 5 s of system time in TLB shootdowns (perf) from munmap in
// _PyThreadState_PopFrame (strace -k).
//
// The allocator installed here is CPython's own (mmap, munmap) with a cache: up to kCacheBytes of freed blocks are
// kept and handed out again for the same size, so a chunk that is freed and taken again every step is mapped once.
#include <Python.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

namespace kvforge_cpu {
namespace {

constexpr size_t kCacheBytes = 16u << 20;

struct FreedBlocks {
  std::mutex lock;
  std::vector<std::pair<void*, size_t>> blocks;
  size_t bytes = 0;
};

FreedBlocks& freed() {
  static FreedBlocks* blocks = new FreedBlocks();  // never destroyed: CPython may free arenas at exit
  return *blocks;
}

void* take(void*, size_t size) {
  FreedBlocks& cache = freed();
  {
    std::lock_guard<std::mutex> guard(cache.lock);
    for (size_t i = 0; i < cache.blocks.size(); ++i)
      if (cache.blocks[i].second == size) {
        void* block = cache.blocks[i].first;
        cache.blocks[i] = cache.blocks.back();
        cache.blocks.pop_back();
        cache.bytes -= size;
        return block;
      }
  }
  void* block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return block == MAP_FAILED ? nullptr : block;
}

void give_back(void*, void* block, size_t size) {
  FreedBlocks& cache = freed();
  {
    std::lock_guard<std::mutex> guard(cache.lock);
    if (cache.bytes + size <= kCacheBytes) {
      cache.blocks.emplace_back(block, size);
      cache.bytes += size;
      return;
    }
  }
  munmap(block, size);
}

}  // namespace

// Installs the caching allocator for CPython's arenas and stack chunks (once per process; blocks the default
// allocator mapped are unmapped or cached alike, both being whole mmap regions).
void cache_python_arenas() {
  static std::once_flag once;
  std::call_once(once, [] {
    PyObjectArenaAllocator allocator{nullptr, take, give_back};
    PyObject_SetArenaAllocator(&allocator);
  });
}

}  // namespace kvforge_cpu
