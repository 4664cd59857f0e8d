#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_tagged.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>

/* Real functions for the header's `static inline` calls and function-like macros (shim.c). */
uint32_t byzcoll_fi_version(void);
int byzcoll_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int byzcoll_fi_domain(struct fid_fabric *fabric, struct fi_info *info,
                      struct fid_domain **domain, void *context);
int byzcoll_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
                        void *context);
int byzcoll_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
                       void *context);
int byzcoll_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
                       void *context);
int byzcoll_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int byzcoll_fi_enable(struct fid_ep *ep);
int byzcoll_fi_getname(struct fid *fid, void *addr, size_t *addrlen);
int byzcoll_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
                         uint64_t flags, void *context);
ssize_t byzcoll_fi_tsend(struct fid_ep *ep, const void *buf, size_t len, void *desc,
                         fi_addr_t dest_addr, uint64_t tag, void *context);
ssize_t byzcoll_fi_trecv(struct fid_ep *ep, void *buf, size_t len, void *desc,
                         fi_addr_t src_addr, uint64_t tag, uint64_t ignore, void *context);
ssize_t byzcoll_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t byzcoll_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *byzcoll_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data,
                                   char *buf, size_t len);
int byzcoll_fi_close(struct fid *fid);
ssize_t byzcoll_fi_cancel(struct fid *fid, void *context);
int byzcoll_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
                      uint64_t offset, uint64_t requested_key, uint64_t flags,
                      struct fid_mr **mr, void *context);
void *byzcoll_fi_mr_desc(struct fid_mr *mr);
int byzcoll_fi_control(struct fid *fid, int command, void *arg);
int byzcoll_fi_trywait(struct fid_fabric *fabric, struct fid **fids, int count);
