//! A safe layer over UCP: results instead of status codes, RAII handles, owned buffers.
//!
//! The handles are not `Sync`: the worker is created with `UCS_THREAD_MODE_SERIALIZED`, so
//! any thread may use it and its endpoints and requests, one at a time (the transport keeps
//! them behind one mutex).

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::ptr;

use byzcoll_ucx_sys as sys;

/// A UCX call that failed, with its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UcxError {
    /// The UCX status.
    pub status: sys::ucs_status_t::Type,
    /// The call that failed.
    pub call: &'static str,
}

impl fmt::Display for UcxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string.
        let text = unsafe { CStr::from_ptr(sys::ucs_status_string(self.status)) };
        write!(f, "{} failed: {}", self.call, text.to_string_lossy())
    }
}

impl std::error::Error for UcxError {}

fn check(status: sys::ucs_status_t::Type, call: &'static str) -> Result<(), UcxError> {
    if status == sys::ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(UcxError { status, call })
    }
}

/// The UCX library version, e.g. `1.13.1`.
pub fn version() -> String {
    // SAFETY: returns a pointer to a static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::ucp_get_version_string()) }
        .to_string_lossy()
        .into_owned()
}

/// A UCP context (`ucp_context_h`) with tag matching. Workers keep it alive.
#[derive(Debug, Clone)]
pub struct Context {
    inner: std::sync::Arc<ContextHandle>,
}

#[derive(Debug)]
struct ContextHandle {
    raw: sys::ucp_context_h,
}

// SAFETY: a UCP context may be shared between threads (UCP's contexts are created
// thread-safe by default: UCP_PARAM_FIELD_MT_WORKERS_SHARED is not needed for workers that
// are each used by one thread); it is only read after creation.
unsafe impl Send for ContextHandle {}
// SAFETY: as above.
unsafe impl Sync for ContextHandle {}

impl Context {
    /// Reads UCX's configuration from the environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...) and
    /// initialises a context with the tag-matching and wakeup features (so that a worker's
    /// thread can block on [`Worker::event_fd`] instead of polling).
    ///
    /// # Errors
    /// When the configuration cannot be read or UCP cannot initialise.
    pub fn new() -> Result<Self, UcxError> {
        Self::with_settings(&[])
    }

    /// As [`Context::new`], then sets each `(name, value)` of `settings` on this context's
    /// configuration with `ucp_config_modify`, over what the environment says. UCP's own
    /// settings are named without the `UCX_` prefix (`RNDV_THRESH`); a transport's are named
    /// without the transport's prefix either (`TX_SEG_SIZE` for `UCX_TCP_TX_SEG_SIZE`) and
    /// apply to every transport that has such a setting. A setting UCX refuses is skipped
    /// (logged at debug level): settings tune, they are never needed for correctness.
    ///
    /// # Errors
    /// As [`Context::new`].
    pub fn with_settings(settings: &[(&str, &str)]) -> Result<Self, UcxError> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: a null prefix and file name read the default UCX_ variables; config is
        // writable.
        check(
            unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) },
            "ucp_config_read",
        )?;
        for &(name, value) in settings {
            let (Ok(c_name), Ok(c_value)) = (CString::new(name), CString::new(value)) else {
                continue;
            };
            // SAFETY: config came from ucp_config_read and is not yet released; both strings
            // are NUL-terminated and outlive the call (UCX copies them).
            let status =
                unsafe { sys::ucp_config_modify(config, c_name.as_ptr(), c_value.as_ptr()) };
            if let Err(e) = check(status, "ucp_config_modify") {
                tracing::debug!(name, value, error = %e, "ucx: setting skipped");
            }
        }
        let params = sys::ucp_params_t {
            field_mask: sys::ucp_params_field::UCP_PARAM_FIELD_FEATURES as u64,
            features: (sys::ucp_feature::UCP_FEATURE_TAG | sys::ucp_feature::UCP_FEATURE_WAKEUP)
                as u64,
            ..Default::default()
        };
        let mut raw: sys::ucp_context_h = ptr::null_mut();
        // SAFETY: params and config are valid; raw is writable.
        let status = unsafe { sys::ucp_init(&params, config, &mut raw) };
        // SAFETY: config came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(config) };
        check(status, "ucp_init")?;
        Ok(Context {
            inner: std::sync::Arc::new(ContextHandle { raw }),
        })
    }

    /// Creates a worker for use by one thread at a time (`UCS_THREAD_MODE_SERIALIZED`: not
    /// always the same thread).
    ///
    /// # Errors
    /// When UCP cannot create the worker.
    pub fn worker(&self) -> Result<Worker, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::ucs_thread_mode_t::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut raw: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: the context is alive; params is valid; raw is writable.
        check(
            unsafe { sys::ucp_worker_create(self.inner.raw, &params, &mut raw) },
            "ucp_worker_create",
        )?;
        Ok(Worker {
            raw,
            _context: self.clone(),
        })
    }
}

impl Drop for ContextHandle {
    fn drop(&mut self) {
        // SAFETY: every worker holds a clone of the context, so this runs after the last
        // worker has been destroyed.
        unsafe { sys::ucp_cleanup(self.raw) };
    }
}

/// A UCP worker (`ucp_worker_h`).
#[derive(Debug)]
pub struct Worker {
    raw: sys::ucp_worker_h,
    _context: Context,
}

// SAFETY: the worker is created UCS_THREAD_MODE_SERIALIZED, so any thread may use it, one at a
// time; without `Sync` only the thread that owns (or exclusively borrows) it can reach it. It
// is moved once, from the thread that sets the transport up to the one that runs its turns.
unsafe impl Send for Worker {}

/// A message found by [`Worker::probe`] and removed from UCX's unexpected queue.
#[derive(Debug)]
pub struct Probed {
    /// Handle to receive it with [`Worker::recv_probed`].
    pub handle: sys::ucp_tag_message_h,
    /// The sender's tag.
    pub tag: u64,
    /// Its length in bytes.
    pub length: usize,
}

impl Worker {
    /// This worker's address, to be published for peers.
    ///
    /// # Errors
    /// When UCP cannot report it.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: the worker is alive; addr and len are writable.
        check(
            unsafe { sys::ucp_worker_get_address(self.raw, &mut addr, &mut len) },
            "ucp_worker_get_address",
        )?;
        // SAFETY: UCP returned `len` readable bytes at `addr`, released just below.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: addr came from ucp_worker_get_address on this worker.
        unsafe { sys::ucp_worker_release_address(self.raw, addr) };
        Ok(bytes)
    }

    /// Creates an endpoint to the worker whose address is `remote`. With `on_error`, failures
    /// of the peer are reported through it (called from [`Worker::progress`] with `peer`),
    /// which needs transports that support peer failure handling (TCP and InfiniBand do,
    /// shared memory does not).
    ///
    /// # Errors
    /// When UCP rejects the address, or cannot handle peer failures over the selected
    /// transports.
    pub fn connect(
        &self,
        remote: &[u8],
        peer: usize,
        on_error: Option<sys::ucp_err_handler_cb_t>,
    ) -> Result<Endpoint, UcxError> {
        let mut params = sys::ucp_ep_params_t {
            field_mask: sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64,
            address: remote.as_ptr().cast::<sys::ucp_address_t>(),
            ..Default::default()
        };
        if let Some(cb) = on_error {
            params.field_mask |= (sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                as u64)
                | (sys::ucp_ep_params_field::UCP_EP_PARAM_FIELD_ERR_HANDLER as u64);
            params.err_mode = sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler = sys::ucp_err_handler_t {
                cb,
                arg: peer as *mut c_void,
            };
        }
        let mut raw: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: the worker is alive; `remote` is a worker address (UCP copies what it needs
        // during the call); raw is writable.
        check(
            unsafe { sys::ucp_ep_create(self.raw, &params, &mut raw) },
            "ucp_ep_create",
        )?;
        Ok(Endpoint { raw })
    }

    /// Advances communication; returns how many events it processed.
    pub fn progress(&self) -> u32 {
        // SAFETY: the worker is alive and used by one thread at a time (`&self` is not `Sync`).
        unsafe { sys::ucp_worker_progress(self.raw) }
    }

    /// Takes the next message whose tag matches `tag` under `mask` out of the unexpected
    /// queue, if one has arrived.
    pub fn probe(&self, tag: u64, mask: u64) -> Option<Probed> {
        let mut info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: the worker is alive; info is writable; remove = 1 hands the message to us.
        let handle = unsafe { sys::ucp_tag_probe_nb(self.raw, tag, mask, 1, &mut info) };
        (!handle.is_null()).then_some(Probed {
            handle,
            tag: info.sender_tag,
            length: info.length,
        })
    }

    /// Receives a probed message into `buf[..len]`.
    ///
    /// # Safety
    /// `buf` must stay valid and unaliased for `len` bytes until the request completes (or is
    /// cancelled and completed); `probed` must come from this worker and be used once.
    ///
    /// # Errors
    /// When UCP refuses the receive.
    pub unsafe fn recv_probed(
        &self,
        buf: *mut u8,
        len: usize,
        probed: &Probed,
    ) -> Result<Request, UcxError> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: per this function's contract.
        let ptr =
            unsafe { sys::ucp_tag_msg_recv_nbx(self.raw, buf.cast(), len, probed.handle, &param) };
        // The probe told the length; an immediate completion received all of it.
        let info = sys::ucp_tag_recv_info_t {
            sender_tag: probed.tag,
            length: probed.length.min(len),
        };
        Request::from_recv_ptr(ptr, &info, "ucp_tag_msg_recv_nbx")
    }

    /// Posts a receive of a message whose tag matches `tag` under `mask` into `buf[..len]`.
    /// A longer message completes with `UCS_ERR_MESSAGE_TRUNCATED` (and is consumed). A
    /// receive that completes at once, with an error too, is a request that is already done,
    /// which [`Request::poll_recv`] reports.
    ///
    /// # Safety
    /// `buf` must stay valid and unaliased for `len` bytes until the request completes (or is
    /// cancelled and completed).
    pub unsafe fn recv(&self, buf: *mut u8, len: usize, tag: u64, mask: u64) -> Request {
        // Always a request (UCX 1.13 does not report the length of an immediate completion).
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            ..Default::default()
        };
        let info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: per this function's contract.
        let ptr = unsafe { sys::ucp_tag_recv_nbx(self.raw, buf.cast(), len, tag, mask, &param) };
        match Request::from_recv_ptr(ptr, &info, "ucp_tag_recv_nbx") {
            Ok(r) => r,
            Err(e) => Request {
                raw: None,
                immediate: Err(e.status),
            },
        }
    }

    /// The file descriptor that becomes readable when the worker has events, after
    /// [`Worker::arm`] returned `true`.
    ///
    /// # Errors
    /// When the context was created without the wakeup feature.
    pub fn event_fd(&self) -> Result<i32, UcxError> {
        let mut fd = -1;
        // SAFETY: the worker is alive; fd is writable.
        check(
            unsafe { sys::ucp_worker_get_efd(self.raw, &mut fd) },
            "ucp_worker_get_efd",
        )?;
        Ok(fd)
    }

    /// Arms the worker's event file descriptor: `Ok(true)` when the thread may now block on
    /// it, `Ok(false)` when events are already pending (progress first).
    ///
    /// # Errors
    /// When UCP cannot arm the worker.
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: the worker is alive and used by one thread at a time (`&self` is not `Sync`).
        match unsafe { sys::ucp_worker_arm(self.raw) } {
            sys::ucs_status_t::UCS_ERR_BUSY => Ok(false),
            status => check(status, "ucp_worker_arm").map(|()| true),
        }
    }

    /// A handle that wakes the thread blocked on this worker's event descriptor, from any
    /// thread.
    pub fn signaller(&self) -> Signaller {
        Signaller { raw: self.raw }
    }

    /// Cancels `req` (it still has to complete, with `UCS_ERR_CANCELED`, through progress).
    pub fn cancel(&self, req: &Request) {
        if let Some(raw) = req.raw {
            // SAFETY: raw is an outstanding request of this worker.
            unsafe { sys::ucp_request_cancel(self.raw, raw) };
        }
    }
}

/// Wakes a thread blocked on a worker's event descriptor ([`Worker::signaller`]).
#[derive(Debug, Clone, Copy)]
pub struct Signaller {
    raw: sys::ucp_worker_h,
}

// SAFETY: ucp_worker_signal may be called from any thread, concurrently with the worker's own
// thread.
unsafe impl Send for Signaller {}
// SAFETY: as above.
unsafe impl Sync for Signaller {}

impl Signaller {
    /// Makes the worker's event descriptor readable (`ucp_worker_signal`).
    ///
    /// # Safety
    /// The worker must not have been destroyed.
    pub unsafe fn signal(&self) {
        // SAFETY: per this function's contract.
        let _ = unsafe { sys::ucp_worker_signal(self.raw) };
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: all endpoints and requests of this worker have been released first.
        unsafe { sys::ucp_worker_destroy(self.raw) };
    }
}

/// A UCP endpoint. Close it with [`Endpoint::close`]; dropping it without closing leaks it to
/// UCX until the worker is destroyed.
#[derive(Debug)]
pub struct Endpoint {
    raw: sys::ucp_ep_h,
}

impl Endpoint {
    /// Sends `buf[..len]` tagged `tag`.
    ///
    /// # Safety
    /// `buf` must stay valid for `len` bytes until the request completes.
    ///
    /// # Errors
    /// When UCP refuses the send.
    pub unsafe fn send(&self, buf: *const u8, len: usize, tag: u64) -> Result<Request, UcxError> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: per this function's contract.
        let ptr = unsafe { sys::ucp_tag_send_nbx(self.raw, buf.cast(), len, tag, &param) };
        Request::from_status_ptr(ptr, "ucp_tag_send_nbx")
    }

    /// Starts closing the endpoint (`force` cancels outstanding operations); the returned
    /// request completes through the worker's progress.
    pub fn close(self, force: bool) -> Request {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force {
                sys::ucp_ep_close_flags_t::UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: the endpoint is alive and closed once (self is consumed).
        let ptr = unsafe { sys::ucp_ep_close_nbx(self.raw, &param) };
        Request::from_status_ptr(ptr, "ucp_ep_close_nbx").unwrap_or(Request {
            raw: None,
            immediate: Ok(0),
        })
    }
}

/// An operation in flight (or already complete when `raw` is `None`, having received
/// `immediate` bytes or failed with that status).
#[derive(Debug)]
pub struct Request {
    raw: Option<*mut c_void>,
    immediate: Result<usize, sys::ucs_status_t::Type>,
}

/// The state of a [`Request`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll {
    /// Still in progress.
    Pending,
    /// Done; for receives, the received length.
    Done(Result<usize, sys::ucs_status_t::Type>),
}

impl Request {
    fn from_recv_ptr(
        ptr: sys::ucs_status_ptr_t,
        info: &sys::ucp_tag_recv_info_t,
        call: &'static str,
    ) -> Result<Self, UcxError> {
        let mut r = Self::from_status_ptr(ptr, call)?;
        if r.raw.is_none() {
            r.immediate = Ok(info.length);
        }
        Ok(r)
    }

    fn from_status_ptr(ptr: sys::ucs_status_ptr_t, call: &'static str) -> Result<Self, UcxError> {
        if ptr.is_null() {
            Ok(Request {
                raw: None,
                immediate: Ok(0),
            })
        } else if sys::ucs_ptr_is_err(ptr) {
            Err(UcxError {
                status: sys::ucs_ptr_raw_status(ptr),
                call,
            })
        } else {
            Ok(Request {
                raw: Some(ptr),
                immediate: Ok(0),
            })
        }
    }

    /// The state of a send or close request.
    pub fn poll(&self) -> Poll {
        let Some(raw) = self.raw else {
            return Poll::Done(self.immediate.map(|_| 0));
        };
        // SAFETY: raw is an outstanding request that has not been freed.
        match unsafe { sys::ucp_request_check_status(raw) } {
            sys::ucs_status_t::UCS_INPROGRESS => Poll::Pending,
            sys::ucs_status_t::UCS_OK => Poll::Done(Ok(0)),
            e => Poll::Done(Err(e)),
        }
    }

    /// The state of a receive request, with the received length.
    pub fn poll_recv(&self) -> Poll {
        let Some(raw) = self.raw else {
            return Poll::Done(self.immediate);
        };
        let mut info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: raw is an outstanding receive request that has not been freed.
        match unsafe { sys::ucp_tag_recv_request_test(raw, &mut info) } {
            sys::ucs_status_t::UCS_INPROGRESS => Poll::Pending,
            sys::ucs_status_t::UCS_OK => Poll::Done(Ok(info.length)),
            e => Poll::Done(Err(e)),
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(raw) = self.raw {
            // SAFETY: raw was returned by UCX and is released once. Freeing a request that is
            // still in progress is allowed: UCX releases it on completion. The transport keeps
            // the buffers of unfinished requests alive until they complete or the worker is
            // destroyed, so nothing UCX still writes to is freed.
            unsafe { sys::ucp_request_free(raw) };
        }
    }
}

/// A status code as text.
pub fn status_text(status: sys::ucs_status_t::Type) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::ucs_status_string(status)) }
        .to_string_lossy()
        .into_owned()
}
