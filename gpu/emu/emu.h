// A CPU emulation of the CUDA execution model, just enough to run kernels/robust.cu on the host
// where there is no GPU: blocks run one after another; the threads of a block run one after
// another too, except in kernels that synchronise (`__syncthreads`), whose threads run as OS
// threads meeting at a barrier. `__shared__` arrays become statics shared by the block running
// at the time. Compile-time kernel parameters (N, MODE, LO, HI, NETWORK) become variables set
// before a launch. It checks the kernels' logic, not their speed or memory-model subtleties.
#pragma once
#define BYZCOLL_EMU 1

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

typedef unsigned long long u64;
typedef unsigned int u32;

struct emu_dim3 {
    unsigned x, y, z;
};
extern thread_local emu_dim3 threadIdx;
extern thread_local emu_dim3 blockIdx;
extern emu_dim3 blockDim;
extern emu_dim3 gridDim;
extern unsigned char* emu_dynamic_shared;
extern std::barrier<>* emu_block_barrier;

// Network-kernel parameters.
extern int emu_n, emu_mode, emu_lo, emu_hi;
extern const std::vector<std::pair<int, int>>* emu_network;

#define __device__
#define __forceinline__ inline
#define __shared__ static
#define KERNEL static
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu_dynamic_shared)
#define N emu_n
#define MODE emu_mode
#define LO emu_lo
#define HI emu_hi
#define NETWORK \
    for (const auto& c_ : *emu_network) CS(c_.first, c_.second)

using std::fmaf;
using std::max;
using std::min;

inline float __uint_as_float(u32 u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline u32 __float_as_uint(float f) {
    u32 u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float emu_half_to_float(unsigned short h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
inline unsigned short emu_float_to_half(float v) {
    _Float16 x = (_Float16)v;
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}
inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline u32 atomicOr(u32* p, u32 v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline u64 atomicMin(u64* p, u64 v) {
    u64 old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST,
                                                   __ATOMIC_SEQ_CST)) {
    }
    return old;
}
