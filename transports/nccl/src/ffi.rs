//! A non-blocking NCCL communicator as an RAII handle over cudarc's `nccl::{sys, result}`.
//!
//! cudarc's safe `Comm` is blocking (its calls cannot be timed out) and panics if
//! `ncclCommAbort` fails in `Drop`; this handle creates the communicator with
//! `config.blocking = 0`, so every call returns at once and completion is polled with
//! `ncclCommGetAsyncError`, and its `Drop` aborts without panicking.

use std::ffi::{c_void, CStr};
use std::mem::MaybeUninit;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::{result, sys};

use crate::setup::ID_BYTES;

/// `NCCL_CONFIG_UNDEF_INT`: leave a config field at NCCL's default.
const UNDEF_INT: i32 = i32::MIN;
/// The `ncclConfig_t` layout these bindings describe (NCCL 2.28); NCCL reads only the fields
/// that version had, and older libraries only the prefix they know.
const CONFIG_VERSION: u32 = 22800;

/// NCCL's message for `r`.
pub(crate) fn error_string(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string (or null).
    let p = unsafe { sys::ncclGetErrorString(r) };
    if p.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
    format!("{r:?}: {s}")
}

fn nccl_err(e: result::NcclError) -> String {
    error_string(e.0)
}

/// A fresh unique id (rank 0 calls this, everyone joins with it).
pub(crate) fn unique_id() -> Result<[u8; ID_BYTES], String> {
    let id = result::get_uniqueid().map_err(nccl_err)?;
    Ok(id.internal.map(|c| c as u8))
}

/// The loaded library's version code.
pub(crate) fn version() -> Result<i32, String> {
    result::get_nccl_version().map_err(nccl_err)
}

/// Whether an asynchronous NCCL call has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Ready,
    InProgress,
}

/// An owned, non-blocking NCCL communicator; aborted when dropped.
#[derive(Debug)]
pub(crate) struct Comm {
    raw: sys::ncclComm_t,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; the transport serializes them (one step at a time, under a lock).
unsafe impl Send for Comm {}
// SAFETY: as above; `&Comm` methods are only called with the transport's step lock held.
unsafe impl Sync for Comm {}

impl Comm {
    /// Starts joining communicator `id` as `rank` of `size`, without blocking; poll
    /// [`Comm::state`] until it is ready. The caller's thread must have the CUDA context of
    /// the device to use current.
    pub(crate) fn start(size: usize, id: &[u8; ID_BYTES], rank: usize) -> Result<Comm, String> {
        let nranks = i32::try_from(size).map_err(|_| format!("world of {size} ranks"))?;
        let rank = i32::try_from(rank).map_err(|_| format!("rank {rank}"))?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as ::core::ffi::c_char),
        };
        let mut config = sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: CONFIG_VERSION,
            blocking: 0,
            cgaClusterSize: UNDEF_INT,
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: UNDEF_INT,
            trafficClass: UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: UNDEF_INT,
            CTAPolicy: UNDEF_INT,
            shrinkShare: UNDEF_INT,
            nvlsCTAs: UNDEF_INT,
            nChannelsPerNetPeer: UNDEF_INT,
            nvlinkCentricSched: UNDEF_INT,
        };
        let mut raw = MaybeUninit::<sys::ncclComm_t>::uninit();
        // SAFETY: `raw` and `config` are valid for the call; NCCL copies the config.
        unsafe { result::comm_init_rank_config(raw.as_mut_ptr(), nranks, id, rank, &mut config) }
            .map_err(nccl_err)?;
        // SAFETY: a successful (or in-progress) init has written the handle.
        let raw = unsafe { raw.assume_init() };
        if raw.is_null() {
            return Err("ncclCommInitRankConfig returned no communicator".into());
        }
        Ok(Comm { raw })
    }

    /// Whether the last asynchronous call (init, group end) has finished; an error when NCCL
    /// reports one (the communicator must then be aborted).
    pub(crate) fn state(&self) -> Result<State, String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `self.raw` is a live communicator; `state` is a valid out-pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(self.describe(r));
        }
        match state {
            sys::ncclResult_t::ncclSuccess => Ok(State::Ready),
            sys::ncclResult_t::ncclInProgress => Ok(State::InProgress),
            e => Err(self.describe(e)),
        }
    }

    fn describe(&self, r: sys::ncclResult_t) -> String {
        // SAFETY: `self.raw` is live; the string is owned by NCCL and copied at once.
        let last = unsafe { sys::ncclGetLastError(self.raw) };
        let detail = if last.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated.
            unsafe { CStr::from_ptr(last) }
                .to_string_lossy()
                .into_owned()
        };
        if detail.is_empty() {
            error_string(r)
        } else {
            format!("{} ({detail})", error_string(r))
        }
    }

    /// Posts a send of `len` bytes at `ptr` to `peer` on `stream`.
    ///
    /// # Safety
    /// `ptr..ptr+len` is device memory of this communicator's device that stays allocated,
    /// and is not written, until the work posted on `stream` has completed or the
    /// communicator has been aborted; `stream` is a live stream of that device.
    pub(crate) unsafe fn send(
        &self,
        ptr: u64,
        len: usize,
        peer: usize,
        stream: CUstream,
    ) -> Result<(), String> {
        let peer = i32::try_from(peer).map_err(|_| format!("peer {peer}"))?;
        // SAFETY: per this function's contract.
        unsafe {
            result::send(
                ptr as *const c_void,
                len,
                sys::ncclDataType_t::ncclUint8,
                peer,
                self.raw,
                stream as sys::cudaStream_t,
            )
        }
        .map(drop)
        .map_err(|e| self.describe(e.0))
    }

    /// Posts a receive of `len` bytes into `ptr` from `peer` on `stream`.
    ///
    /// # Safety
    /// As [`Comm::send`], and nothing else reads or writes the range until then.
    pub(crate) unsafe fn recv(
        &self,
        ptr: u64,
        len: usize,
        peer: usize,
        stream: CUstream,
    ) -> Result<(), String> {
        let peer = i32::try_from(peer).map_err(|_| format!("peer {peer}"))?;
        // SAFETY: per this function's contract.
        unsafe {
            result::recv(
                ptr as *mut c_void,
                len,
                sys::ncclDataType_t::ncclUint8,
                peer,
                self.raw,
                stream as sys::cudaStream_t,
            )
        }
        .map(drop)
        .map_err(|e| self.describe(e.0))
    }

    /// Aborts the communicator: operations still running on the device are stopped and its
    /// resources freed. May take a while (it joins NCCL's threads).
    pub(crate) fn abort(self) -> Result<(), String> {
        let raw = self.raw;
        std::mem::forget(self);
        // SAFETY: `raw` is live and, `self` being forgotten, aborted exactly once.
        unsafe { result::comm_abort(raw) }
            .map(drop)
            .map_err(nccl_err)
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: `self.raw` is live and this is its only release.
        if let Err(e) = unsafe { result::comm_abort(self.raw) } {
            tracing::warn!(error = %nccl_err(e), "ncclCommAbort failed while dropping the communicator");
        }
    }
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd` on this thread. The group is closed
/// even when `f` fails (NCCL's group depth is per thread). Returns whether the group end is
/// still in progress (non-blocking communicators), or the first error.
pub(crate) fn group<T>(f: impl FnOnce() -> Result<T, String>) -> Result<(T, State), String> {
    result::group_start().map_err(|e| format!("ncclGroupStart: {}", nccl_err(e)))?;
    let inner = f();
    let end = result::group_end();
    let value = inner?;
    match end {
        Ok(result::NcclStatus::InProgress) => Ok((value, State::InProgress)),
        Ok(_) => Ok((value, State::Ready)),
        Err(e) => Err(format!("ncclGroupEnd: {}", nccl_err(e))),
    }
}
