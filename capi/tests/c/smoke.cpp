// C++ smoke test of byzcoll.h against the shared library: the header compiles as C++, and a
// world of one joined from the environment (BYZCOLL_RANK=0, BYZCOLL_WORLD_SIZE=1) computes a
// trimmed mean in place into a std::vector and a Krum selection with its report.
#include <byzcoll.h>

#include <cstdio>
#include <string>
#include <vector>

int main() {
    byzcoll_comm_t *comm = nullptr;
    byzcoll_config_t config = BYZCOLL_CONFIG_INIT;
    config.agreement = BYZCOLL_AGREEMENT_DETECT;
    byzcoll_status_t st = byzcoll_init_from_env(&config, &comm);
    if (st != BYZCOLL_OK) {
        std::fprintf(stderr, "init_from_env: %s: %s\n", byzcoll_status_string(st), byzcoll_last_error());
        return 1;
    }
    std::vector<float> v(1000, 3.5f);
    byzcoll_rule_params_t params = BYZCOLL_RULE_PARAMS_INIT;
    st = byzcoll_robust_allreduce(comm, v.data(), v.data(), v.size(), BYZCOLL_FLOAT32, "trimmed-mean",
                                  &params, nullptr);
    if (st != BYZCOLL_OK || v[999] != 3.5f) {
        std::fprintf(stderr, "trimmed-mean: %s: %s\n", byzcoll_status_string(st), byzcoll_comm_last_error(comm));
        return 1;
    }
    std::vector<uint32_t> selected(4, 99);
    byzcoll_report_t report = BYZCOLL_REPORT_INIT;
    report.capacity = selected.size();
    report.selected_ranks = selected.data();
    std::vector<char> text(128);
    report.text = text.data();
    report.text_capacity = text.size();
    st = byzcoll_robust_allreduce(comm, v.data(), v.data(), v.size(), BYZCOLL_FLOAT32, "median", &params, &report);
    if (st != BYZCOLL_OK || report.has_selection || report.inputs != 1 || report.num_faults != 0 ||
        !report.agreement_checked || text[0] != 0) {
        std::fprintf(stderr, "median: %s: %s (inputs %zu)\n", byzcoll_status_string(st),
                     byzcoll_comm_last_error(comm), report.inputs);
        return 1;
    }
    st = byzcoll_robust_allreduce(comm, v.data(), v.data(), v.size(), BYZCOLL_FLOAT32, "krum", &params, &report);
    if (st != BYZCOLL_PRECONDITION || std::string(byzcoll_comm_last_error(comm)).find("krum needs") == std::string::npos) {
        std::fprintf(stderr, "krum: %s: %s\n", byzcoll_status_string(st), byzcoll_comm_last_error(comm));
        return 1;
    }
    byzcoll_comm_finalize(comm);
    // A NULL config: the defaults.
    st = byzcoll_init_from_env(nullptr, &comm);
    if (st != BYZCOLL_OK || byzcoll_comm_size(comm) != 1) {
        std::fprintf(stderr, "init_from_env(NULL): %s: %s\n", byzcoll_status_string(st), byzcoll_last_error());
        return 1;
    }
    byzcoll_comm_finalize(comm);
    std::printf("smoke.cpp: byzcoll %s OK\n", std::string(byzcoll_version()).c_str());
    return 0;
}
