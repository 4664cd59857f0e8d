//! Device vectors (feature `cuda`): the caller's CUDA buffers lent to the communicator's
//! device entry point (`byzcoll::blocking::device`, which Python calls too).

use std::ffi::c_void;

use byzcoll_rs::blocking::device::{robust_all_reduce_lent, DeviceCall, DeviceType};

use crate::buffers::DType;
use crate::report;
use crate::status::{byzcoll_status_t::*, Failure};
use crate::{byzcoll_comm_t, byzcoll_report_t, byzcoll_rule_params_t};

/// See `byzcoll_robust_allreduce_device`: reads the rule and the element type, then lends the
/// buffers to [`robust_all_reduce_lent`], which checks them.
///
/// # Safety
/// As `byzcoll_robust_allreduce_device`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn robust_allreduce(
    comm: &byzcoll_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dtype: i32,
    rule: *const std::ffi::c_char,
    params: *const byzcoll_rule_params_t,
    stream: *mut c_void,
    report: *mut byzcoll_report_t,
) -> Result<(), Failure> {
    // SAFETY: forwarded.
    let mut report = unsafe { report::Out::new(report)? };
    // SAFETY: forwarded.
    let (name, params, policy) = unsafe { crate::read_rule_spec(rule, params)? };
    let dtype = match DType::parse(dtype)? {
        DType::F32 => DeviceType::F32,
        DType::BF16 => DeviceType::BF16,
        DType::F16 => DeviceType::F16,
        DType::F64 => {
            return Err(Failure::new(
                BYZCOLL_UNSUPPORTED,
                "device vectors are BYZCOLL_FLOAT32, BYZCOLL_BFLOAT16 or BYZCOLL_FLOAT16 (the \
                 CUDA rules' element types)",
            ))
        }
    };
    let call = DeviceCall {
        rule: &name,
        params: &params,
        policy,
    };
    // SAFETY: the caller's word, as `byzcoll_robust_allreduce_device` states it; the pointers
    // are checked there before use.
    let round = unsafe {
        robust_all_reduce_lent(&comm.inner, sendbuf, recvbuf, count, dtype, &call, stream)
    };
    report.record(round.map_err(crate::refused))
}
