// byzcoll's CUDA kernels for robust aggregation.
//
// Compiled at run time by NVRTC for the device's architecture (see src/kernels.rs), with these
// macros defined in front of this file:
//   ELEM   element type of inputs and output: 0 float, 1 bfloat16, 2 float16
//   N, MODE, LO, HI, NETWORK   (network kernels only) the number of inputs, median or trimmed
//          mean, the sorted ranks the rule reads, and the sorting network as CS(a, b) steps
//
// The same file compiles as C++ on the host with emu/emu.h, which runs the grid on CPU threads;
// the crate's tests use that to check the kernels' logic where there is no GPU.
//
// Conventions shared with the CPU rules (aggregators/src):
// - values are ordered by IEEE-754 totalOrder through 32-bit keys (-NaN < -inf < ... < +inf <
//   +NaN), so NaN and infinities are extremes that the median and trimmed mean discard;
// - sums are accumulated in double in ascending order of keys, so f32 results on the network
//   path are bitwise those of the CPU reference;
// - a coordinate whose result is not finite is reported through `bad` (atomicMin of the
//   coordinate), never returned as a silent NaN: the host turns it into an error.

#ifndef BYZCOLL_EMU
typedef unsigned long long u64;
typedef unsigned int u32;
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define KERNEL extern "C" __global__
#endif

#if ELEM == 0
typedef float elem_t;
__device__ __forceinline__ float load_elem(elem_t v) { return v; }
__device__ __forceinline__ elem_t store_elem(float v) { return v; }
#elif ELEM == 1
typedef unsigned short elem_t;
__device__ __forceinline__ float load_elem(elem_t v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ elem_t store_elem(float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (elem_t)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (elem_t)(u >> 16);
}
#elif ELEM == 2
typedef unsigned short elem_t;
#ifdef BYZCOLL_EMU
__device__ __forceinline__ float load_elem(elem_t v) { return emu_half_to_float(v); }
__device__ __forceinline__ elem_t store_elem(float v) { return emu_float_to_half(v); }
#else
__device__ __forceinline__ float load_elem(elem_t v) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
    return r;
}
__device__ __forceinline__ elem_t store_elem(float v) {
    elem_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}
#endif
#else
#error "ELEM must be 0 (float), 1 (bfloat16) or 2 (float16)"
#endif

// totalOrder key of a float: flip all bits of negatives, the sign bit of positives.
__device__ __forceinline__ u32 key_of(float v) {
    u32 u = __float_as_uint(v);
    return u ^ ((u32)((int)u >> 31) | 0x80000000u);
}

__device__ __forceinline__ float value_of(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

__device__ __forceinline__ bool finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ bool finite_d(double v) { return v - v == 0.0; }

// Records that coordinate j has a non-finite result.
__device__ __forceinline__ void report_bad(u64* bad, u64 j) { atomicMin(bad, j); }

// Modes of the coordinate-wise kernels (src/kernels.rs: Mode).
#define MODE_MEDIAN 0
#define MODE_TRIMMED 1

#ifdef N
// ---------------------------------------------------------------------------------------------
// Network kernels: one thread per coordinate, its N keys in registers, sorted by the host's
// sorting network (byzcoll_aggregators::sorting_network, the one the CPU rules use), pruned to
// the ranks [LO, HI) the rule reads and emitted as straight-line CS(a, b) compare-exchanges in
// NETWORK, so every index is a constant and nothing spills to local memory. MODE, LO and HI are
// compile-time constants too.

#define CS(a, b)                      \
    {                                 \
        u32 low_ = min(k[a], k[b]);   \
        k[b] = max(k[a], k[b]);       \
        k[a] = low_;                  \
    }

KERNEL void coordinate_network(const elem_t* const* rows, elem_t* out, u64 d, u64* bad) {
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < d;
         j += (u64)gridDim.x * blockDim.x) {
        u32 k[N];
#pragma unroll
        for (int i = 0; i < N; i++) k[i] = key_of(load_elem(rows[i][j]));
        NETWORK
        double r;
        if (MODE == MODE_MEDIAN) {
            if (N % 2 == 1) {
                r = value_of(k[N / 2]);
            } else {
                r = (double)value_of(k[N / 2 - 1]) * 0.5 + (double)value_of(k[N / 2]) * 0.5;
            }
        } else {
            double sum = 0.0;
#pragma unroll
            for (int i = LO; i < HI; i++) sum += (double)value_of(k[i]);
            r = sum * (1.0 / (double)(HI - LO));
        }
        float v = (float)r;
        if (!finite(v)) report_bad(bad, j);
        out[j] = store_elem(v);
    }
}

// Bulyan's coordinate phase over the N = θ selected inputs (NETWORK sorts all of them): the
// mean of the β values nearest the coordinate's median, a contiguous run of the sorted column
// found by shrinking from the farther end, as the CPU rule does.
KERNEL void bulyan_network(const elem_t* const* rows, elem_t* out, u64 d, int beta,
                                          u64* bad) {
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < d;
         j += (u64)gridDim.x * blockDim.x) {
        u32 k[N];
#pragma unroll
        for (int i = 0; i < N; i++) k[i] = key_of(load_elem(rows[i][j]));
        NETWORK
        double median = (N % 2 == 1) ? (double)value_of(k[N / 2])
                                     : (double)value_of(k[N / 2 - 1]) * 0.5 +
                                           (double)value_of(k[N / 2]) * 0.5;
        int lo = 0, hi = N;
        while (hi - lo > beta) {
            // Dynamic indices: the run is found once, then summed by the unrolled loop below.
            double vlo = 0.0, vhi = 0.0;
#pragma unroll
            for (int i = 0; i < N; i++) {
                if (i == lo) vlo = value_of(k[i]);
                if (i == hi - 1) vhi = value_of(k[i]);
            }
            if (median - vlo > vhi - median) {
                lo++;
            } else {
                hi--;
            }
        }
        double sum = 0.0;
#pragma unroll
        for (int i = 0; i < N; i++) {
            if (i >= lo && i < hi) sum += (double)value_of(k[i]);
        }
        float v = (float)(sum / (double)beta);
        if (!finite(v)) report_bad(bad, j);
        out[j] = store_elem(v);
    }
}
#endif  // N

#if !defined(N) || defined(BYZCOLL_EMU)  // the generic build (network builds skip it)
// ---------------------------------------------------------------------------------------------
// General coordinate kernel for any n: each thread copies its coordinate's n keys into its own
// column of shared memory (no thread reads another's column) and finds order statistics by
// radix selection, 4 bits per pass: 8 passes of n reads each, whatever the values (no
// data-dependent worst case that Byzantine inputs could provoke, unlike quickselect).

#define SELECT_THREADS 32

// Key of rank `rank` (0-based) among the column's n keys (stride SELECT_THREADS).
__device__ u32 select_key(const u32* col, int n, int rank) {
    u32 prefix = 0, mask = 0;
    for (int shift = 28; shift >= 0; shift -= 4) {
        int count[16];
#pragma unroll
        for (int b = 0; b < 16; b++) count[b] = 0;
        for (int i = 0; i < n; i++) {
            u32 k = col[i * SELECT_THREADS];
            if ((k & mask) == prefix) count[(k >> shift) & 15u]++;
        }
        int b = 0;
        while (rank >= count[b]) {
            rank -= count[b];
            b++;
        }
        prefix |= (u32)b << shift;
        mask |= 15u << shift;
    }
    return prefix;
}

KERNEL void coordinate_select(const elem_t* const* rows, elem_t* out, u64 d, int n,
                                             int f, int mode, u64* bad) {
    DYNAMIC_SHARED(u32, columns);
    u32* col = columns + threadIdx.x;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < d;
         j += (u64)gridDim.x * blockDim.x) {
        for (int i = 0; i < n; i++) col[i * SELECT_THREADS] = key_of(load_elem(rows[i][j]));
        double r;
        if (mode == MODE_MEDIAN) {
            u32 hi = select_key(col, n, n / 2);
            if (n % 2 == 1) {
                r = value_of(hi);
            } else {
                u32 lo = select_key(col, n, n / 2 - 1);
                r = (double)value_of(lo) * 0.5 + (double)value_of(hi) * 0.5;
            }
        } else {
            // The window of ranks [f, n - f): its extremes by selection, the values strictly
            // between them summed, and the copies of the extremes that fall inside counted.
            u32 klo = select_key(col, n, f);
            u32 khi = select_key(col, n, n - f - 1);
            int keep = n - 2 * f;
            double vlo = value_of(klo), vhi = value_of(khi);
            if (klo == khi) {
                r = vlo;
            } else {
                int below_lo = 0, at_lo = 0, below_hi = 0;
                double between = 0.0;
                for (int i = 0; i < n; i++) {
                    u32 k = col[i * SELECT_THREADS];
                    below_lo += k < klo;
                    at_lo += k == klo;
                    below_hi += k < khi;
                    if (k > klo && k < khi) between += (double)value_of(k);
                }
                int lo_in = min(below_lo + at_lo, n - f) - f;
                int hi_in = (n - f) - max(below_hi, f);
                r = (between + vlo * lo_in + vhi * hi_in) / (double)keep;
            }
            // A non-finite value inside the window makes the result non-finite.
            if (!finite_d(vlo) || !finite_d(vhi)) r = value_of(0xffffffffu);
        }
        float v = (float)r;
        if (!finite(v)) report_bad(bad, j);
        out[j] = store_elem(v);
    }
}

// ---------------------------------------------------------------------------------------------
// Mean of m selected inputs (Multi-Krum), accumulated in double in the given order.
KERNEL void mean_rows(const elem_t* const* rows, int m, elem_t* out, u64 d,
                                     u64* bad) {
    double scale = 1.0 / (double)m;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < d;
         j += (u64)gridDim.x * blockDim.x) {
        double sum = 0.0;
        for (int i = 0; i < m; i++) sum += (double)load_elem(rows[i][j]);
        float v = (float)(sum * scale);
        if (!finite(v)) report_bad(bad, j);
        out[j] = store_elem(v);
    }
}

// ---------------------------------------------------------------------------------------------
// Pairwise squared distances, tiled like a matrix product: a block owns a DTILE × DTILE tile of
// the n × n table (an upper-triangle pair of row blocks) and a share of the coordinates; it
// stages 32 coordinates of its DTILE + DTILE rows in shared memory, and each of its 256 threads
// accumulates a MICRO × MICRO patch of pairs from differences (never |a|² + |b|² - 2ab, which
// cancels). DTILE (16, 32 or 64, the host picks the smallest that holds n up to 64) keeps small
// n from computing empty pairs. Each chunk of 32 coordinates is summed in float, then added
// into double; a chunk that overflows float is redone in double. Partial tables go to
// `partial[(tile * splits + split) * DTILE² + ...]` and `distance_reduce` adds them in split
// order, so the table is the same on every run.

#ifndef DTILE
#define DTILE 64
#endif
#define MICRO (DTILE / 16)
#define CHUNK 32
#define DIST_THREADS 256

__device__ __forceinline__ void stage_rows(const elem_t* const* rows, int n, u64 d, int row0,
                                           u64 c0, float (*s)[CHUNK + 1], u32* flags) {
    for (int e = threadIdx.x; e < DTILE * CHUNK; e += DIST_THREADS) {
        int r = e / CHUNK, c = e % CHUNK;
        float v = 0.0f;
        if (row0 + r < n && c0 + c < d) {
            v = load_elem(rows[row0 + r][c0 + c]);
            if (!finite(v)) {
                atomicOr(&flags[row0 + r], 1u);
                v = 0.0f;  // the host marks the row infinitely far; keep the sums finite
            }
        }
        s[r][c] = v;
    }
}

KERNEL void distance_tiles(const elem_t* const* rows, int n, u64 d,
                                          const int* tile_rows, const int* tile_cols,
                                          double* partial, u32* flags) {
    __shared__ float si[DTILE][CHUNK + 1];
    __shared__ float sj[DTILE][CHUNK + 1];
    int tile = blockIdx.y;
    int row0 = tile_rows[tile] * DTILE, col0 = tile_cols[tile] * DTILE;
    int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
    double acc[MICRO][MICRO];
#pragma unroll
    for (int a = 0; a < MICRO; a++)
#pragma unroll
        for (int b = 0; b < MICRO; b++) acc[a][b] = 0.0;
    u64 chunks = (d + CHUNK - 1) / CHUNK;
    for (u64 chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        u64 c0 = chunk * CHUNK;
        __syncthreads();
        stage_rows(rows, n, d, row0, c0, si, flags);
        stage_rows(rows, n, d, col0, c0, sj, flags);
        __syncthreads();
        float part[MICRO][MICRO];
#pragma unroll
        for (int a = 0; a < MICRO; a++)
#pragma unroll
            for (int b = 0; b < MICRO; b++) part[a][b] = 0.0f;
#pragma unroll 8
        for (int c = 0; c < CHUNK; c++) {
            float x[MICRO], y[MICRO];
#pragma unroll
            for (int a = 0; a < MICRO; a++) x[a] = si[ty * MICRO + a][c];
#pragma unroll
            for (int b = 0; b < MICRO; b++) y[b] = sj[tx * MICRO + b][c];
#pragma unroll
            for (int a = 0; a < MICRO; a++)
#pragma unroll
                for (int b = 0; b < MICRO; b++) {
                    float t = x[a] - y[b];
                    part[a][b] = fmaf(t, t, part[a][b]);
                }
        }
#pragma unroll
        for (int a = 0; a < MICRO; a++)
#pragma unroll
            for (int b = 0; b < MICRO; b++) {
                if (finite(part[a][b])) {
                    acc[a][b] += (double)part[a][b];
                } else {
                    double redo = 0.0;
                    for (int c = 0; c < CHUNK; c++) {
                        double t = (double)si[ty * MICRO + a][c] - (double)sj[tx * MICRO + b][c];
                        redo += t * t;
                    }
                    acc[a][b] += redo;
                }
            }
    }
    double* out = partial + ((u64)tile * gridDim.x + blockIdx.x) * (DTILE * DTILE);
#pragma unroll
    for (int a = 0; a < MICRO; a++)
#pragma unroll
        for (int b = 0; b < MICRO; b++) out[(ty * MICRO + a) * DTILE + tx * MICRO + b] = acc[a][b];
}

// Adds the partial tables of every split, in split order, into the symmetric n × n table.
KERNEL void distance_reduce(const double* partial, int splits, int tiles, int n,
                                           const int* tile_rows, const int* tile_cols,
                                           double* table) {
    u64 total = (u64)tiles * DTILE * DTILE;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (u64)gridDim.x * blockDim.x) {
        int tile = (int)(e / (DTILE * DTILE));
        int within = (int)(e % (DTILE * DTILE));
        int i = tile_rows[tile] * DTILE + within / DTILE;
        int j = tile_cols[tile] * DTILE + within % DTILE;
        if (i >= n || j >= n || j < i) continue;
        double sum = 0.0;
        for (int s = 0; s < splits; s++) sum += partial[((u64)tile * splits + s) * (DTILE * DTILE) + within];
        if (i == j) sum = 0.0;
        table[(u64)i * n + j] = sum;
        table[(u64)j * n + i] = sum;
    }
}
#endif  // generic build
