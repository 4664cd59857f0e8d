/* A robust all-reduce from an MPI program through libbyzcoll, bootstrapped over MPI_Allgather
 * (no store port, no BYZCOLL_SECRET: rank 0 draws the job secret and MPI hands it out).
 *
 *   scripts/install-capi.sh PREFIX
 *   mpicc -O2 examples/c/mpi_robust_allreduce.c \
 *       $(PKG_CONFIG_PATH=PREFIX/lib/pkgconfig pkg-config --cflags --libs byzcoll)
 *   mpirun -n 4 -x BYZCOLL_TCP_ADDR=127.0.0.1 ./a.out [--byzantine] [--bench]
 *
 * Rank r contributes r + 1 at every coordinate. With --byzantine the last rank contributes 1e9
 * instead; every honest rank checks that the median (f = 1) is still the honest one, names the
 * liar from the report's attribution, and shows what the plain SUM all-reduce makes of the same
 * inputs. With --bench, rank 0 prints the time
 * of byzcoll's robust all-reduce next to MPI_Allreduce (SUM) and MPI_Allgather followed by a
 * local median, in the same program, at 4 KiB, 1 MiB and 64 MiB per rank. */
#include <byzcoll.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int mpi_allgather(const void *sendbuf, void *recvbuf, size_t bytes, void *ctx) {
    MPI_Comm comm = *(MPI_Comm *)ctx;
    if (bytes > (size_t)INT32_MAX) return -1;
    return MPI_Allgather(sendbuf, (int)bytes, MPI_BYTE, recvbuf, (int)bytes, MPI_BYTE, comm) ==
                   MPI_SUCCESS
               ? 0
               : -1;
}

static void fail(const char *what, byzcoll_status_t status, byzcoll_comm_t *comm) {
    fprintf(stderr, "%s: %s: %s\n", what, byzcoll_status_string(status),
            comm ? byzcoll_comm_last_error(comm) : byzcoll_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Median of n values (sorted in place; n is small). */
static float median_of(float *v, int n) {
    for (int i = 1; i < n; i++) {
        float x = v[i];
        int j = i - 1;
        for (; j >= 0 && v[j] > x; j--) v[j + 1] = v[j];
        v[j + 1] = x;
    }
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static double now(void) { return MPI_Wtime(); }

static void bench(byzcoll_comm_t *comm, int rank, int size) {
    const size_t sizes[] = {4096, 1 << 20, 64 << 20};
    byzcoll_rule_params_t params = BYZCOLL_RULE_PARAMS_INIT;
    params.f = 1;
    if (rank == 0)
        printf("%10s %14s %14s %16s %10s %12s\n", "bytes", "byzcoll ms", "MPI SUM ms",
               "MPI gather+med ms", "vs SUM", "vs gather");
    for (int s = 0; s < 3; s++) {
        size_t count = sizes[s] / sizeof(float);
        int iters = sizes[s] >= (64 << 20) ? 3 : sizes[s] >= (1 << 20) ? 20 : 200;
        float *buf = malloc(count * sizeof(float));
        float *all = malloc(count * sizeof(float) * size);
        float *col = malloc(sizeof(float) * size);
        if (!buf || !all || !col) MPI_Abort(MPI_COMM_WORLD, 2);
        double t[3] = {1e30, 1e30, 1e30};
        for (int it = -1; it < iters; it++) { /* it = -1 warms up */
            for (size_t i = 0; i < count; i++) buf[i] = (float)(rank + 1);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = now();
            byzcoll_status_t st =
                byzcoll_robust_allreduce(comm, buf, buf, count, BYZCOLL_FLOAT32, "median", &params, NULL);
            if (st != BYZCOLL_OK) fail("robust_allreduce", st, comm);
            double t1 = now();
            MPI_Barrier(MPI_COMM_WORLD);
            double t2 = now();
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double t3 = now();
            MPI_Barrier(MPI_COMM_WORLD);
            double t4 = now();
            MPI_Allgather(buf, (int)count, MPI_FLOAT, all, (int)count, MPI_FLOAT, MPI_COMM_WORLD);
            for (size_t i = 0; i < count; i++) {
                for (int r = 0; r < size; r++) col[r] = all[(size_t)r * count + i];
                buf[i] = median_of(col, size);
            }
            double t5 = now();
            if (it >= 0) {
                double local[3] = {t1 - t0, t3 - t2, t5 - t4}, slowest[3];
                MPI_Allreduce(local, slowest, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                for (int k = 0; k < 3; k++)
                    if (slowest[k] < t[k]) t[k] = slowest[k];
            }
        }
        if (rank == 0)
            printf("%10zu %14.3f %14.3f %16.3f %10.2f %12.2f\n", sizes[s], t[0] * 1e3, t[1] * 1e3,
                   t[2] * 1e3, t[0] / t[1], t[0] / t[2]);
        free(buf);
        free(all);
        free(col);
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size, byzantine = 0, timing = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--byzantine")) byzantine = 1;
        else if (!strcmp(argv[i], "--bench")) timing = 1;
    }

    MPI_Comm world = MPI_COMM_WORLD;
    byzcoll_comm_t *comm = NULL;
    byzcoll_config_t config = BYZCOLL_CONFIG_INIT;
    byzcoll_status_t st = byzcoll_init_oob(rank, size, mpi_allgather, &world, &config, &comm);
    if (st != BYZCOLL_OK) fail("byzcoll_init_oob", st, NULL);

    if (timing) {
        bench(comm, rank, size);
    } else {
        enum { COUNT = 1000 };
        float *v = malloc(COUNT * sizeof(float)), *sum = malloc(COUNT * sizeof(float));
        int liar = byzantine && rank == size - 1;
        for (int i = 0; i < COUNT; i++) v[i] = liar ? 1e9f : (float)(rank + 1);

        uint32_t faults[64], outlying[64];
        int32_t kinds[64];
        double scores[64];
        char text[256];
        byzcoll_report_t report = BYZCOLL_REPORT_INIT;
        report.capacity = 64;
        report.fault_ranks = faults;
        report.fault_kinds = kinds;
        report.outlying_ranks = outlying;
        report.attribution_scores = scores;
        report.text = text;
        report.text_capacity = sizeof text;
        byzcoll_rule_params_t params = BYZCOLL_RULE_PARAMS_INIT;
        params.f = 1;
        st = byzcoll_robust_allreduce(comm, v, v, COUNT, BYZCOLL_FLOAT32, "median", &params, &report);
        if (st != BYZCOLL_OK) fail("byzcoll_robust_allreduce", st, comm);

        /* The honest median of 1..size-1 and the liar's 1e9 (or of 1..size). */
        float expect;
        {
            float *all = malloc(sizeof(float) * size);
            if (!all) MPI_Abort(MPI_COMM_WORLD, 2);
            for (int r = 0; r < size; r++) all[r] = byzantine && r == size - 1 ? 1e9f : (float)(r + 1);
            expect = median_of(all, size);
            free(all);
        }
        int ok = 1;
        for (int i = 0; i < COUNT; i++) ok &= v[i] == expect;
        for (int i = 0; i < COUNT; i++) sum[i] = liar ? 1e9f : (float)(rank + 1);
        st = byzcoll_all_reduce(comm, sum, sum, COUNT, BYZCOLL_FLOAT32, BYZCOLL_SUM);
        if (st != BYZCOLL_OK) fail("byzcoll_all_reduce", st, comm);
        if (!liar) {
            printf("rank %d of %d: median %s (%g, expected %g; %zu inputs, %zu faults%s%s); "
                   "SUM all-reduce %g",
                   rank, size, ok ? "OK" : "WRONG", v[0], expect, report.inputs,
                   report.num_faults, report.text[0] ? ": " : "", report.text, sum[0]);
            /* Who to look at: the ranks whose input lay far from the median (evidence only). */
            for (size_t i = 0; i < report.num_outlying && i < report.capacity; i++)
                printf("; rank %u outlying (score %.2g)", (unsigned)outlying[i],
                       outlying[i] < report.num_attributed ? scores[outlying[i]] : 0.0);
            /* And across rounds: what this rank has seen of each peer. */
            byzcoll_peer_health_t peers[64];
            size_t npeers = 0;
            st = byzcoll_comm_health(comm, peers, 64, sizeof peers[0], &npeers);
            if (st != BYZCOLL_OK) fail("byzcoll_comm_health", st, comm);
            for (size_t i = 0; i < npeers && i < 64; i++)
                if (peers[i].outlying > 0)
                    printf("; health: rank %u outlying in %llu round(s)", (unsigned)peers[i].rank,
                           (unsigned long long)peers[i].outlying);
            printf("\n");
        }
        fflush(stdout);
        free(v);
        free(sum);
        if (!ok && !liar) {
            byzcoll_comm_finalize(comm);
            MPI_Abort(MPI_COMM_WORLD, 3);
        }
    }
    st = byzcoll_barrier(comm);
    if (st != BYZCOLL_OK) fail("byzcoll_barrier", st, comm);
    byzcoll_comm_finalize(comm);
    MPI_Finalize();
    return 0;
}
