/* Every error path of the C ABI, exercised from C in one process (a world of one through
 * byzcoll_init_oob, and fake all-gathers that misbehave). Prints "errors.c: N checks passed"
 * and exits 0, or names the first check that failed and exits 1. */
#define _POSIX_C_SOURCE 200809L
#include <byzcoll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int checks = 0;

static int contains(const char *msg, const char *needle) { return !needle || strstr(msg, needle); }
static const char *show(const char *needle) { return needle ? needle : ""; }

#define EXPECT(call, want, needle)                                                           \
    do {                                                                                     \
        byzcoll_status_t got_ = (call);                                                      \
        const char *msg_ = byzcoll_last_error();                                             \
        checks++;                                                                            \
        if (got_ != (want) || !contains(msg_, needle)) {                           \
            fprintf(stderr, "FAILED line %d: %s -> %d (%s) \"%s\", expected %d with \"%s\"\n", \
                    __LINE__, #call, (int)got_, byzcoll_status_string(got_), msg_, (int)(want), \
                    show(needle));                                                   \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

static int copy_gather(const void *send, void *recv, size_t bytes, void *ctx) {
    (void)ctx;
    memcpy(recv, send, bytes);
    return 0;
}

static int failing_gather(const void *send, void *recv, size_t bytes, void *ctx) {
    (void)send, (void)recv, (void)bytes, (void)ctx;
    return 42;
}

/* Claims a world of two but returns this rank's record twice: out of rank order. */
static int duplicate_gather(const void *send, void *recv, size_t bytes, void *ctx) {
    (void)ctx;
    memcpy(recv, send, bytes);
    memcpy((char *)recv + bytes, send, bytes);
    return 0;
}

/* Flips one byte of the magic: another protocol. */
static int foreign_gather(const void *send, void *recv, size_t bytes, void *ctx) {
    (void)ctx;
    memcpy(recv, send, bytes);
    ((char *)recv)[0] ^= 1;
    return 0;
}

int main(void) {
    byzcoll_comm_t *comm = (byzcoll_comm_t *)1;
    byzcoll_config_t config = BYZCOLL_CONFIG_INIT;
    config.listen_addr = "127.0.0.1";

    /* Bootstrap arguments. */
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &config, NULL), BYZCOLL_INVALID_ARGUMENT, "NULL");
    EXPECT(byzcoll_init_oob(0, 1, NULL, NULL, &config, &comm), BYZCOLL_INVALID_ARGUMENT, "allgather is NULL");
    if (comm != NULL) { fprintf(stderr, "FAILED: *comm not NULL after a failed init\n"); return 1; }
    EXPECT(byzcoll_init_oob(1, 1, copy_gather, NULL, &config, &comm), BYZCOLL_INVALID_ARGUMENT, "rank 1 of a world of 1");
    EXPECT(byzcoll_init_oob(0, -3, copy_gather, NULL, &config, &comm), BYZCOLL_INVALID_ARGUMENT, "non-negative");
    EXPECT(byzcoll_init_oob(-1, 4, copy_gather, NULL, &config, &comm), BYZCOLL_INVALID_ARGUMENT, "non-negative");
    EXPECT(byzcoll_init_oob(0, 2, failing_gather, NULL, &config, &comm), BYZCOLL_BOOTSTRAP, "returned 42");
    EXPECT(byzcoll_init_oob(0, 2, duplicate_gather, NULL, &config, &comm), BYZCOLL_BOOTSTRAP, "rank order");
    EXPECT(byzcoll_init_oob(0, 1, foreign_gather, NULL, &config, &comm), BYZCOLL_BOOTSTRAP, "protocol");

    /* What the job could not use: an address nobody can connect to, a bad BYZCOLL_AGREEMENT. */
    byzcoll_config_t any = config;
    any.listen_addr = "0.0.0.0";
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &any, &comm), BYZCOLL_BOOTSTRAP, "no peer can connect to");
    setenv("BYZCOLL_AGREEMENT", "sometimes", 1);
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &config, &comm), BYZCOLL_BOOTSTRAP, "BYZCOLL_AGREEMENT");
    unsetenv("BYZCOLL_AGREEMENT");

    /* Config checks. */
    byzcoll_config_t bad = config;
    bad.size = sizeof(bad) - 8;
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &bad, &comm), BYZCOLL_INVALID_ARGUMENT, "config->size");
    bad = config;
    bad.version = 99;
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &bad, &comm), BYZCOLL_INVALID_ARGUMENT, "config->version");
    bad = config;
    bad.agreement = 7;
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &bad, &comm), BYZCOLL_INVALID_ARGUMENT, "config->agreement");
    bad = config;
    bad.listen_addr = "not-an-ip";
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &bad, &comm), BYZCOLL_INVALID_ARGUMENT, "listen_addr");
    bad = config;
    bad.step_timeout_ms = UINT64_MAX;
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &bad, &comm), BYZCOLL_INVALID_ARGUMENT, "step_timeout_ms");
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, (const byzcoll_config_t *)((char *)&config + 1), &comm),
           BYZCOLL_INVALID_ARGUMENT, "aligned");

    /* NULL config: the defaults, listening on BYZCOLL_TCP_ADDR. */
    setenv("BYZCOLL_TCP_ADDR", "127.0.0.1", 1);
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, NULL, &comm), BYZCOLL_OK, NULL);
    EXPECT(byzcoll_comm_finalize(comm), BYZCOLL_OK, NULL);
    unsetenv("BYZCOLL_TCP_ADDR");

    /* A world of one. */
    config.step_timeout_ms = 5000;
    EXPECT(byzcoll_init_oob(0, 1, copy_gather, NULL, &config, &comm), BYZCOLL_OK, NULL);
    if (byzcoll_comm_rank(comm) != 0 || byzcoll_comm_size(comm) != 1) {
        fprintf(stderr, "FAILED: rank/size %d/%d\n", byzcoll_comm_rank(comm), byzcoll_comm_size(comm));
        return 1;
    }
    double v[8] = {1, 2, 3, 4, 5, 6, 7, 8}, out[8];
    byzcoll_rule_params_t params = BYZCOLL_RULE_PARAMS_INIT;
    byzcoll_report_t report = BYZCOLL_REPORT_INIT;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &params, &report), BYZCOLL_OK, NULL);
    for (int i = 0; i < 8; i++)
        if (out[i] != v[i]) { fprintf(stderr, "FAILED: median of one vector changed it\n"); return 1; }
    if (report.inputs != 1 || report.num_faults != 0) { fprintf(stderr, "FAILED: report %zu inputs\n", report.inputs); return 1; }
    if (report.identity != BYZCOLL_IDENTITY_LOCAL) { fprintf(stderr, "FAILED: identity %d in a world of one\n", report.identity); return 1; }
    /* The attribution of a world of one: one input, the result itself. */
    if (report.num_attributed != 1 || report.num_outlying != 0) { fprintf(stderr, "FAILED: attribution of %zu ranks\n", report.num_attributed); return 1; }

    /* Health: no peers in a world of one; the count alone with NULL; bad arguments. */
    {
        byzcoll_peer_health_t peers[2];
        size_t npeers = 99;
        EXPECT(byzcoll_comm_health(comm, peers, 2, sizeof peers[0], &npeers), BYZCOLL_OK, NULL);
        if (npeers != 0) { fprintf(stderr, "FAILED: %zu peers in a world of one\n", npeers); return 1; }
        EXPECT(byzcoll_comm_health(comm, NULL, 0, sizeof peers[0], &npeers), BYZCOLL_OK, NULL);
        EXPECT(byzcoll_comm_health(comm, peers, 2, sizeof peers[0] - 8, &npeers), BYZCOLL_INVALID_ARGUMENT, "elem_size");
        EXPECT(byzcoll_comm_health(comm, peers, 2, sizeof peers[0], NULL), BYZCOLL_INVALID_ARGUMENT, "count is NULL");
        EXPECT(byzcoll_comm_health(comm, NULL, 2, sizeof peers[0], &npeers), BYZCOLL_INVALID_ARGUMENT, "peers is NULL");
        EXPECT(byzcoll_comm_health(NULL, peers, 2, sizeof peers[0], &npeers), BYZCOLL_INVALID_ARGUMENT, "comm is NULL");
    }

    /* Collective arguments. */
    EXPECT(byzcoll_robust_allreduce(NULL, v, v, 8, BYZCOLL_FLOAT64, "median", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "comm is NULL");
    EXPECT(byzcoll_robust_allreduce(comm, NULL, v, 8, BYZCOLL_FLOAT64, "median", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "sendbuf is NULL");
    EXPECT(byzcoll_robust_allreduce(comm, v, NULL, 8, BYZCOLL_FLOAT64, "median", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "recvbuf is NULL");
    EXPECT(byzcoll_robust_allreduce(comm, v, (char *)out + 1, 4, BYZCOLL_FLOAT64, "median", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "aligned");
    EXPECT(byzcoll_robust_allreduce(comm, v, v + 1, 4, BYZCOLL_FLOAT64, "median", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "overlap");
    EXPECT(byzcoll_robust_allreduce(comm, v, out, SIZE_MAX / 2, BYZCOLL_FLOAT64, "median", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "too large");
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, 5, "median", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "dtype is 5");
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, -1, "median", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "dtype is -1");
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, NULL, &params, NULL), BYZCOLL_INVALID_ARGUMENT, "no default");
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "average", &params, NULL), BYZCOLL_INVALID_ARGUMENT, "average");
    /* NULL params: those of BYZCOLL_RULE_PARAMS_INIT (f = 0: krum's n > 2f + 2 fails alone). */
    memset(out, 0, sizeof out);
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", NULL, NULL), BYZCOLL_OK, NULL);
    if (memcmp(out, v, sizeof out)) { fprintf(stderr, "FAILED: median with NULL params\n"); return 1; }
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "krum", NULL, NULL), BYZCOLL_PRECONDITION, "f = 0");
    {
        /* 16-bit elements on host buffers: 1.5, -2.25 and 3 as binary16 and bfloat16 words;
           one rank's median is its input, bit for bit, and a misaligned buffer is refused. */
        uint16_t h[4] = {0x3e00, 0xc080, 0x4200, 0}, hb[4] = {0x3fc0, 0xc010, 0x4040, 0}, r16[4];
        EXPECT(byzcoll_robust_allreduce(comm, h, r16, 3, BYZCOLL_FLOAT16, "median", NULL, NULL), BYZCOLL_OK, NULL);
        if (memcmp(r16, h, 3 * sizeof h[0])) { fprintf(stderr, "FAILED: float16 median\n"); return 1; }
        EXPECT(byzcoll_robust_allreduce(comm, hb, r16, 3, BYZCOLL_BFLOAT16, "median", NULL, NULL), BYZCOLL_OK, NULL);
        if (memcmp(r16, hb, 3 * sizeof hb[0])) { fprintf(stderr, "FAILED: bfloat16 median\n"); return 1; }
        EXPECT(byzcoll_robust_allreduce(comm, (char *)h + 1, r16, 2, BYZCOLL_FLOAT16, "median", NULL, NULL), BYZCOLL_INVALID_ARGUMENT, "aligned");
    }
    byzcoll_rule_params_t p2 = params;
    p2.size = 3;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_INVALID_ARGUMENT, "params->size");
    p2 = params;
    p2.policy = 9;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_INVALID_ARGUMENT, "params->policy");
    p2 = params;
    p2.replicas = 3;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_INVALID_ARGUMENT, "replicas");
    p2 = params;
    p2.policy = BYZCOLL_POLICY_AUTO;
    p2.replicas = 3;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_INVALID_ARGUMENT, "auto policy");
    /* Auto on one rank: gather. */
    p2.replicas = 0;
    memset(out, 0, sizeof out);
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_OK, NULL);
    if (memcmp(out, v, sizeof out)) { fprintf(stderr, "FAILED: median with the auto policy\n"); return 1; }
    p2.policy = BYZCOLL_POLICY_AUDITED;
    p2.replicas = 1;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_INVALID_ARGUMENT, "audited policy");
    /* Audited on one rank: its own shard, audited by nobody. */
    p2.replicas = 0;
    memset(out, 0, sizeof out);
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_OK, NULL);
    if (memcmp(out, v, sizeof out)) { fprintf(stderr, "FAILED: median with the audited policy\n"); return 1; }
    p2 = params;
    p2.tau = -1;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "centered-clipping", &p2, NULL), BYZCOLL_INVALID_ARGUMENT, "tau");
    p2 = params;
    p2.m = 2;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_INVALID_ARGUMENT, "does not apply");
    p2 = params;
    p2.f = 1;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &p2, NULL), BYZCOLL_PRECONDITION, NULL);
    byzcoll_report_t r2 = report;
    r2.size = 8;
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &params, &r2), BYZCOLL_INVALID_ARGUMENT, "report->size");
    r2 = report;
    r2.capacity = 4;
    r2.fault_ranks = (uint32_t *)((char *)out + 1);
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &params, &r2), BYZCOLL_INVALID_ARGUMENT, "fault_ranks");
    EXPECT(byzcoll_all_reduce(comm, v, out, 8, BYZCOLL_FLOAT64, 17), BYZCOLL_INVALID_ARGUMENT, "op is 17");
    EXPECT(byzcoll_all_reduce(comm, v, out, 8, BYZCOLL_FLOAT64, BYZCOLL_SUM), BYZCOLL_OK, NULL);
    EXPECT(byzcoll_all_gather(comm, v, v + 2, 4, BYZCOLL_FLOAT64), BYZCOLL_INVALID_ARGUMENT, "overlap");
    EXPECT(byzcoll_all_gather(comm, v, out, 8, BYZCOLL_FLOAT64), BYZCOLL_OK, NULL);
    EXPECT(byzcoll_barrier(NULL), BYZCOLL_INVALID_ARGUMENT, "comm is NULL");
    EXPECT(byzcoll_barrier(comm), BYZCOLL_OK, NULL);
    EXPECT(byzcoll_comm_set_step(NULL, 1), BYZCOLL_INVALID_ARGUMENT, "comm is NULL");
    EXPECT(byzcoll_comm_set_step(comm, 41), BYZCOLL_OK, NULL);
    EXPECT(byzcoll_barrier(comm), BYZCOLL_OK, NULL);
    EXPECT(byzcoll_comm_set_step(comm, BYZCOLL_NO_STEP), BYZCOLL_OK, NULL);

    /* Shrink: a world of one keeps its one rank. */
    byzcoll_comm_t *sub = NULL;
    EXPECT(byzcoll_comm_shrink(NULL, &sub), BYZCOLL_INVALID_ARGUMENT, "comm is NULL");
    EXPECT(byzcoll_comm_shrink(comm, NULL), BYZCOLL_INVALID_ARGUMENT, "NULL");
    EXPECT(byzcoll_comm_shrink(comm, &sub), BYZCOLL_OK, NULL);
    if (sub == NULL || byzcoll_comm_size(sub) != 1 || byzcoll_comm_rank(sub) != 0) {
        fprintf(stderr, "FAILED: shrink of a world of one\n");
        return 1;
    }
    EXPECT(byzcoll_robust_allreduce(sub, v, out, 8, BYZCOLL_FLOAT64, "median", &params, NULL), BYZCOLL_OK, NULL);
    checks++;
    if (byzcoll_comm_job_rank(sub, 0) != 0 || byzcoll_comm_job_rank(sub, 1) != -1 ||
        byzcoll_comm_job_rank(sub, -1) != -1 || byzcoll_comm_job_rank(NULL, 0) != -1 ||
        byzcoll_comm_epoch(sub) != 0 || byzcoll_comm_epoch(NULL) != -1) {
        fprintf(stderr, "FAILED: job ranks or epoch\n");
        return 1;
    }
    EXPECT(byzcoll_comm_finalize(sub), BYZCOLL_OK, NULL);

    if (!strstr(byzcoll_comm_last_error(comm), "op is 17") && !strstr(byzcoll_comm_last_error(comm), "overlap")) {
        fprintf(stderr, "FAILED: comm last error \"%s\"\n", byzcoll_comm_last_error(comm));
        return 1;
    }

    /* Admit: a communicator joined out of band has no store to admit through. */
    EXPECT(byzcoll_comm_admit(NULL, &sub), BYZCOLL_INVALID_ARGUMENT, "comm is NULL");
    EXPECT(byzcoll_comm_admit(comm, NULL), BYZCOLL_INVALID_ARGUMENT, "newcomm is NULL");
    EXPECT(byzcoll_comm_admit(comm, &sub), BYZCOLL_INVALID_ARGUMENT, "byzcoll_init_from_env");
    checks++;
    if (sub != NULL) {
        fprintf(stderr, "FAILED: a refused admit left *newcomm set\n");
        return 1;
    }

    /* Device vectors with host pointers: refused, saying why (no cuda feature, no driver, or
     * not device memory where there is a GPU). */
    {
        float hv[4] = {1, 2, 3, 4};
        byzcoll_status_t st = byzcoll_robust_allreduce_device(comm, hv, hv, 4, BYZCOLL_FLOAT32, "median",
                                                              &params, NULL, NULL);
        const char *msg = byzcoll_comm_last_error(comm);
        checks++;
        if (!((st == BYZCOLL_UNSUPPORTED && (strstr(msg, "cuda feature") || strstr(msg, "libcuda"))) ||
              (st == BYZCOLL_INVALID_ARGUMENT && strstr(msg, "CUDA driver knows")))) {
            fprintf(stderr, "FAILED: device call with host pointers -> %d \"%s\"\n", (int)st, msg);
            return 1;
        }
        printf("device vectors here: %s\n", msg);
    }
    EXPECT(byzcoll_robust_allreduce_device(NULL, v, v, 8, BYZCOLL_FLOAT32, "median", &params, NULL, NULL),
           BYZCOLL_INVALID_ARGUMENT, "comm is NULL");

    /* Strings. */
    if (strcmp(byzcoll_status_string(BYZCOLL_OK), "success") || strcmp(byzcoll_status_string(1234), "unknown status") ||
        strcmp(byzcoll_status_string(-1), "unknown status") ||
        strcmp(byzcoll_status_string(BYZCOLL_DEVICE), "a CUDA call failed") ||
        strcmp(byzcoll_status_string(BYZCOLL_EXCLUDED), "the other ranks shrank the communicator without this rank") ||
        strcmp(byzcoll_status_string(BYZCOLL_FELL_BEHIND), "this rank fell behind its peers, which went on without it") ||
        byzcoll_version()[0] == 0 ||
        byzcoll_comm_rank(NULL) != -1 || byzcoll_comm_size(NULL) != -1 ||
        strcmp(byzcoll_comm_last_error(NULL), "comm is NULL")) {
        fprintf(stderr, "FAILED: strings or NULL getters\n");
        return 1;
    }

    /* Abort: every later call says so; finalize still frees. */
    EXPECT(byzcoll_comm_abort(comm), BYZCOLL_OK, NULL);
    EXPECT(byzcoll_barrier(comm), BYZCOLL_ABORTED, "aborted");
    EXPECT(byzcoll_robust_allreduce(comm, v, out, 8, BYZCOLL_FLOAT64, "median", &params, NULL), BYZCOLL_ABORTED, "aborted");
    EXPECT(byzcoll_comm_finalize(comm), BYZCOLL_OK, NULL);
    EXPECT(byzcoll_comm_finalize(NULL), BYZCOLL_OK, NULL);
    printf("errors.c: %d checks passed\n", checks);
    return 0;
}
