/* The C half of the overhead benchmark (python/bench/overhead.sh runs it beside the Rust and
 * Python halves): the timing loop of examples/overhead.rs, call for call, through the C ABI.
 * Every rep enters a barrier, times one byzcoll_robust_allreduce (median, f = 1, gather), and
 * takes the slowest rank's time (a MAX all-reduce); rank 0 prints the median over the reps in
 * ms, as "bytes ms" lines.
 *
 *   cargo build --release -p byzcoll-capi
 *   cc -O2 -Icapi/include capi/bench/overhead.c -Ltarget/release -lbyzcoll \
 *      -Wl,-rpath,$PWD/target/release -o target/release/overhead_c
 *   target/release/byzcoll launch -n 4 -- target/release/overhead_c 15
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "byzcoll.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int fail(const char *what) {
    fprintf(stderr, "overhead_c: %s: %s\n", what, byzcoll_last_error());
    return 1;
}

int main(int argc, char **argv) {
    long reps_arg = argc > 1 ? strtol(argv[1], NULL, 10) : 15;
    if (reps_arg < 1 || reps_arg > 10000) {
        fprintf(stderr, "overhead_c: reps must be 1 to 10000\n");
        return 2;
    }
    byzcoll_comm_t *comm = NULL;
    if (byzcoll_init_from_env(NULL, &comm) != BYZCOLL_OK) return fail("init");
    int me = byzcoll_comm_rank(comm);
    byzcoll_rule_params_t params = BYZCOLL_RULE_PARAMS_INIT;
    params.f = 1;
    if (me == 0) printf("# %d ranks, median f = 1, gather, from C\n", byzcoll_comm_size(comm));
    const size_t sizes[] = {4096, 1 << 20, 64 << 20};
    for (int s = 0; s < 3; s++) {
        size_t bytes = sizes[s], count = bytes / 4;
        long reps = bytes <= (64 << 10) ? reps_arg * 10 : bytes < (64 << 20) ? reps_arg
                    : (reps_arg < 5 ? reps_arg : 5);
        float *x = malloc(bytes);
        double *times = malloc(sizeof(double) * (size_t)reps);
        if (x == NULL || times == NULL) return 1;
        for (size_t i = 0; i < count; i++) x[i] = (float)me;
        for (long i = 0; i <= reps; i++) {
            if (byzcoll_barrier(comm) != BYZCOLL_OK) return fail("barrier");
            double t0 = now();
            if (byzcoll_robust_allreduce(comm, x, x, count, BYZCOLL_FLOAT32, "median", &params,
                                         NULL) != BYZCOLL_OK)
                return fail("robust_allreduce");
            double t = now() - t0;
            if (byzcoll_all_reduce(comm, &t, &t, 1, BYZCOLL_FLOAT64, BYZCOLL_MAX) != BYZCOLL_OK)
                return fail("all_reduce");
            if (i > 0) times[i - 1] = t;
        }
        qsort(times, (size_t)reps, sizeof(double), by_value);
        double median = reps % 2 ? times[reps / 2] : (times[reps / 2 - 1] + times[reps / 2]) / 2;
        if (me == 0) printf("%10zu %10.3f\n", bytes, median * 1e3);
        free(x);
        free(times);
    }
    byzcoll_comm_finalize(comm);
    return 0;
}
