// Entry points that run kernels/robust.cu under the CPU emulation in emu.h, one instantiation
// per element type. Launch geometry is chosen by the caller (the Rust side's launch plans).
#include "emu.h"

#include <mutex>

thread_local emu_dim3 threadIdx;
thread_local emu_dim3 blockIdx;
emu_dim3 blockDim;
emu_dim3 gridDim;
unsigned char* emu_dynamic_shared;
std::barrier<>* emu_block_barrier;
int emu_n, emu_mode, emu_lo, emu_hi;
const std::vector<std::pair<int, int>>* emu_network;

namespace elem_f32 {
#define ELEM 0
#include "../kernels/robust.cu"
#undef ELEM
}  // namespace elem_f32
namespace elem_bf16 {
#define ELEM 1
#include "../kernels/robust.cu"
#undef ELEM
}  // namespace elem_bf16
namespace elem_f16 {
#define ELEM 2
#include "../kernels/robust.cu"
#undef ELEM
}  // namespace elem_f16
namespace elem_f32_tile16 {
#define ELEM 0
#undef DTILE
#define DTILE 16
#include "../kernels/robust.cu"
#undef DTILE
#undef ELEM
}  // namespace elem_f32_tile16
namespace elem_bf16_tile16 {
#define ELEM 1
#undef DTILE
#define DTILE 16
#include "../kernels/robust.cu"
#undef DTILE
#undef ELEM
}  // namespace elem_bf16_tile16
namespace elem_f16_tile16 {
#define ELEM 2
#undef DTILE
#define DTILE 16
#include "../kernels/robust.cu"
#undef DTILE
#undef ELEM
}  // namespace elem_f16_tile16
namespace elem_f32_tile32 {
#define ELEM 0
#undef DTILE
#define DTILE 32
#include "../kernels/robust.cu"
#undef DTILE
#undef ELEM
}  // namespace elem_f32_tile32
namespace elem_bf16_tile32 {
#define ELEM 1
#undef DTILE
#define DTILE 32
#include "../kernels/robust.cu"
#undef DTILE
#undef ELEM
}  // namespace elem_bf16_tile32
namespace elem_f16_tile32 {
#define ELEM 2
#undef DTILE
#define DTILE 32
#include "../kernels/robust.cu"
#undef DTILE
#undef ELEM
}  // namespace elem_f16_tile32
namespace {

// One emulated launch at a time: the grid dimensions, the barrier and `__shared__` statics are
// process-wide, like one device running one kernel.
std::mutex device;

// Runs `kernel` over a grid of grid_x × grid_y blocks of `block` threads.
template <class F>
void launch(unsigned grid_x, unsigned grid_y, unsigned block, size_t shared, bool synchronising,
            F kernel) {
    gridDim = {grid_x, grid_y, 1};
    blockDim = {block, 1, 1};
    std::vector<unsigned char> dynamic(shared + 1);
    emu_dynamic_shared = dynamic.data();
    for (unsigned by = 0; by < grid_y; by++) {
        for (unsigned bx = 0; bx < grid_x; bx++) {
            if (!synchronising) {
                for (unsigned t = 0; t < block; t++) {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    kernel();
                }
                continue;
            }
            std::barrier<> barrier(block);
            emu_block_barrier = &barrier;
            std::vector<std::thread> threads;
            threads.reserve(block);
            for (unsigned t = 0; t < block; t++) {
                threads.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    kernel();
                });
            }
            for (auto& th : threads) th.join();
        }
    }
}

std::vector<std::pair<int, int>> pairs_of(const u32* pairs, size_t count) {
    std::vector<std::pair<int, int>> out;
    for (size_t i = 0; i < count; i++) out.emplace_back((int)pairs[2 * i], (int)pairs[2 * i + 1]);
    return out;
}

}  // namespace

#define DISPATCH(elem, call)                      \
    switch (elem) {                               \
        case 0: { using namespace elem_f32; call; break; }  \
        case 1: { using namespace elem_bf16; call; break; } \
        case 2: { using namespace elem_f16; call; break; }  \
        default: return -1;                       \
    }

extern "C" {

int byzcoll_emu_coordinate_network(int elem, const void* const* rows, void* out, u64 d, int n,
                                   int mode, int lo, int hi, const u32* pairs, size_t count,
                                   u64* bad, unsigned grid, unsigned block) {
    std::lock_guard<std::mutex> lock(device);
    auto network = pairs_of(pairs, count);
    emu_n = n, emu_mode = mode, emu_lo = lo, emu_hi = hi, emu_network = &network;
    DISPATCH(elem, launch(grid, 1, block, 0, false, [&] {
                 coordinate_network((const elem_t* const*)rows, (elem_t*)out, d, bad);
             }));
    return 0;
}

int byzcoll_emu_bulyan_network(int elem, const void* const* rows, void* out, u64 d, int n,
                               int beta, const u32* pairs, size_t count, u64* bad, unsigned grid,
                               unsigned block) {
    std::lock_guard<std::mutex> lock(device);
    auto network = pairs_of(pairs, count);
    emu_n = n, emu_lo = 0, emu_hi = n, emu_network = &network;
    DISPATCH(elem, launch(grid, 1, block, 0, false, [&] {
                 bulyan_network((const elem_t* const*)rows, (elem_t*)out, d, beta, bad);
             }));
    return 0;
}

int byzcoll_emu_coordinate_select(int elem, const void* const* rows, void* out, u64 d, int n,
                                  int f, int mode, u64* bad, unsigned grid, unsigned block,
                                  size_t shared) {
    std::lock_guard<std::mutex> lock(device);
    DISPATCH(elem, launch(grid, 1, block, shared, false, [&] {
                 coordinate_select((const elem_t* const*)rows, (elem_t*)out, d, n, f, mode, bad);
             }));
    return 0;
}

int byzcoll_emu_mean_rows(int elem, const void* const* rows, int m, void* out, u64 d, u64* bad,
                          unsigned grid, unsigned block) {
    std::lock_guard<std::mutex> lock(device);
    DISPATCH(elem, launch(grid, 1, block, 0, false, [&] {
                 mean_rows((const elem_t* const*)rows, m, (elem_t*)out, d, bad);
             }));
    return 0;
}

int byzcoll_emu_distance(int elem, int tile, const void* const* rows, int n, u64 d,
                         const int* tile_rows,
                         const int* tile_cols, int tiles, unsigned splits, double* partial,
                         u32* flags, double* table, unsigned reduce_grid, unsigned reduce_block) {
    std::lock_guard<std::mutex> lock(device);
    auto run = [&](auto tiles_kernel, auto reduce_kernel) {
        launch(splits, tiles, 256, 0, true, [&] {
            tiles_kernel((const void* const*)rows, n, d, tile_rows, tile_cols, partial, flags);
        });
        launch(reduce_grid, 1, reduce_block, 0, false, [&] {
            reduce_kernel(partial, (int)splits, tiles, n, tile_rows, tile_cols, table);
        });
    };
#define TILED(ns)                                                                          \
    run([](const void* const* r, int n_, u64 d_, const int* tr, const int* tc, double* p, \
           u32* fl) { ns::distance_tiles((const ns::elem_t* const*)r, n_, d_, tr, tc, p, fl); }, \
        ns::distance_reduce)
    int key = elem * 100 + tile;
    switch (key) {
        case 64: TILED(elem_f32); break;
        case 164: TILED(elem_bf16); break;
        case 264: TILED(elem_f16); break;
        case 16: TILED(elem_f32_tile16); break;
        case 116: TILED(elem_bf16_tile16); break;
        case 216: TILED(elem_f16_tile16); break;
        case 32: TILED(elem_f32_tile32); break;
        case 132: TILED(elem_bf16_tile32); break;
        case 232: TILED(elem_f16_tile32); break;
        default: return -1;
    }
    return 0;
}

}  // extern "C"
