//! A safe layer over libfabric: results instead of negative return codes, RAII objects closed
//! with `fi_close` in the right order, and a checked choice of provider.
//!
//! Ownership is a tree, so the close order follows from Rust's drop order: an [`Endpoint`] owns
//! its completion queue and address vector, which own nothing; the endpoint also owns the
//! [`Domain`], which owns the [`Fabric`]. Dropping the endpoint closes the endpoint, then the
//! completion queue, the address vector, the domain and the fabric.
//!
//! The objects are `Send` but not `Sync`: the domain is opened with `FI_THREAD_DOMAIN`, so all
//! its objects must be used by one thread at a time. The transport moves them, whole, into its
//! progress thread.

use std::ffi::{c_void, CStr};
use std::fmt;
use std::ptr;

use byzcoll_libfabric_sys as sys;

/// Something libfabric could not do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FabricError {
    /// A libfabric call failed with this (positive) `fi_errno` code.
    Call {
        /// The call that failed.
        call: &'static str,
        /// The error code (`FI_E*`, positive).
        code: i32,
    },
    /// The selected provider cannot give what the transport needs; the text names what it
    /// lacks. Choose another provider with `FI_PROVIDER`.
    Unsupported(String),
}

impl fmt::Display for FabricError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricError::Call { call, code } => {
                write!(f, "{call} failed: {} ({code})", error_text(*code))
            }
            FabricError::Unsupported(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for FabricError {}

impl FabricError {
    /// The `fi_errno` code of a failed call.
    pub fn code(&self) -> Option<i32> {
        match self {
            FabricError::Call { code, .. } => Some(*code),
            FabricError::Unsupported(_) => None,
        }
    }
}

/// The text of a (positive) `fi_errno` code.
pub fn error_text(code: i32) -> String {
    // SAFETY: fi_strerror returns a pointer to a static NUL-terminated string for any code.
    unsafe { CStr::from_ptr(sys::fi_strerror(code)) }
        .to_string_lossy()
        .into_owned()
}

/// Turns a libfabric return value (negative: an error code) into a result.
fn check(ret: i64, call: &'static str) -> Result<u64, FabricError> {
    if ret < 0 {
        Err(FabricError::Call {
            call,
            code: i32::try_from(-ret).unwrap_or(i32::MAX),
        })
    } else {
        Ok(ret as u64)
    }
}

const EAGAIN: i64 = sys::FI_EAGAIN as i64;
const ENOMEM: i64 = sys::FI_ENOMEM as i64;
const EAVAIL: i64 = sys::FI_EAVAIL as i64;
const ENODATA: i64 = sys::FI_ENODATA as i64;
const ETOOSMALL: i64 = sys::FI_ETOOSMALL as i64;

/// `FI_ETRUNC`: a message was longer than the receive buffer.
pub const ETRUNC: i32 = sys::FI_ETRUNC as i32;
/// `FI_ECANCELED`: the operation was cancelled.
pub const ECANCELED: i32 = sys::FI_ECANCELED as i32;

/// The libfabric library version, e.g. `1.17`.
pub fn version() -> String {
    // SAFETY: fi_version has no preconditions.
    let v = unsafe { sys::fi_version() };
    format!("{}.{}", v >> 16, v & 0xffff)
}

/// Converts a C string owned by libfabric, possibly null, into a `String`.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string.
unsafe fn string(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: per this function's contract.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// What a set of `fi_getinfo` hints asks for.
#[derive(Debug, Clone, Copy)]
struct Want {
    rdm: bool,
    tagged: bool,
    ordered: bool,
    directed: bool,
    /// Only the modes and memory-registration modes the transport implements, and
    /// `FI_THREAD_DOMAIN`; otherwise anything (as `fi_info` asks), to diagnose.
    strict: bool,
}

impl Want {
    const TRANSPORT: Want = Want {
        rdm: true,
        tagged: true,
        ordered: true,
        directed: true,
        strict: true,
    };
}

/// A `struct fi_info` list from `fi_getinfo` (or hints from `fi_allocinfo`), freed on drop.
#[derive(Debug)]
pub struct Info {
    raw: *mut sys::fi_info,
}

// SAFETY: an fi_info list is plain heap memory owned by this value; libfabric keeps no
// reference to it and it has no thread affinity.
unsafe impl Send for Info {}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: raw came from fi_getinfo or fi_dupinfo and is freed once.
        unsafe { sys::fi_freeinfo(self.raw) };
    }
}

fn hints(want: Want) -> Result<Info, FabricError> {
    // SAFETY: fi_dupinfo(NULL) is fi_allocinfo: a zeroed fi_info with every attribute struct
    // allocated, or null when out of memory.
    let raw = unsafe { sys::fi_dupinfo(ptr::null()) };
    if raw.is_null() {
        return Err(FabricError::Call {
            call: "fi_allocinfo",
            code: sys::FI_ENOMEM as i32,
        });
    }
    let hints = Info { raw };
    // SAFETY: raw and its attribute structs were just allocated by fi_dupinfo and are only
    // written here.
    unsafe {
        let h = &mut *raw;
        if want.tagged {
            h.caps = sys::FI_TAGGED as u64 | sys::FI_SEND as u64 | sys::FI_RECV as u64;
        }
        if want.directed {
            h.caps |= sys::FI_DIRECTED_RECV;
        }
        if want.rdm {
            (*h.ep_attr).type_ = sys::fi_ep_type::FI_EP_RDM;
        }
        if want.ordered {
            (*h.tx_attr).msg_order = sys::FI_ORDER_SAS as u64;
            (*h.rx_attr).msg_order = sys::FI_ORDER_SAS as u64;
        }
        if want.strict {
            // Every operation's context points to an fi_context2 the transport owns until
            // the operation completes, so both context modes are fine.
            h.mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
            // FI_MR_LOCAL is honoured (buffers are registered when the provider asks); the
            // other bits only constrain remote access, which the transport never grants.
            (*h.domain_attr).mr_mode = (sys::FI_MR_LOCAL
                | sys::FI_MR_VIRT_ADDR
                | sys::FI_MR_ALLOCATED
                | sys::FI_MR_PROV_KEY) as i32;
            (*h.domain_attr).threading = sys::fi_threading::FI_THREAD_DOMAIN;
        } else {
            h.mode = u64::MAX;
            (*h.domain_attr).mode = u64::MAX;
            (*h.domain_attr).mr_mode =
                !((sys::fi_mr_mode::FI_MR_BASIC | sys::fi_mr_mode::FI_MR_SCALABLE) as i32);
        }
    }
    Ok(hints)
}

/// Runs `fi_getinfo` with `want`; `None` when no provider matches.
fn getinfo(want: Want) -> Result<Option<Info>, FabricError> {
    let hints = hints(want)?;
    let mut raw: *mut sys::fi_info = ptr::null_mut();
    // SAFETY: the hints are valid; raw is writable. No node or service: a local endpoint.
    let ret = unsafe {
        sys::fi_getinfo(
            sys::byzcoll_fi_version(),
            ptr::null(),
            ptr::null(),
            0,
            hints.raw,
            &mut raw,
        )
    };
    match ret as i64 {
        0 if !raw.is_null() => Ok(Some(Info { raw })),
        0 => Ok(None),
        r if r == -ENODATA => Ok(None),
        r => check(r, "fi_getinfo").map(|_| None),
    }
}

/// The providers that offer reliable datagram (`FI_EP_RDM`) endpoints with tagged messages as
/// the transport uses them, in `fi_getinfo`'s order of preference, each named once (layered
/// providers as `tcp;ofi_rxm`). `FI_PROVIDER` narrows the list.
pub fn providers() -> Vec<String> {
    let mut names = Vec::new();
    for directed in [true, false] {
        let Ok(Some(info)) = getinfo(Want {
            directed,
            ..Want::TRANSPORT
        }) else {
            continue;
        };
        let mut p = info.raw;
        while !p.is_null() {
            // SAFETY: p is an entry of the list owned by `info`; fabric_attr is set by
            // fi_getinfo and prov_name is a NUL-terminated string or null.
            let name = unsafe {
                let attr = (*p).fabric_attr;
                if attr.is_null() {
                    String::new()
                } else {
                    string((*attr).prov_name)
                }
            };
            if !name.is_empty() && !names.contains(&name) {
                names.push(name);
            }
            // SAFETY: as above; next is the following entry or null.
            p = unsafe { (*p).next };
        }
    }
    names
}

impl Info {
    /// Asks `fi_getinfo` for a reliable datagram endpoint (`FI_EP_RDM`) with tagged messages
    /// (`FI_TAGGED`), send-after-send ordering, and, where the provider has it, receives
    /// directed at one source (`FI_DIRECTED_RECV`). The provider is the first that
    /// `FI_PROVIDER` allows (`tcp;ofi_rxm`, `shm`, `net`, `verbs;ofi_rxm`, ...).
    ///
    /// # Errors
    /// [`FabricError::Unsupported`] naming what the provider lacks; [`FabricError::Call`] when
    /// `fi_getinfo` itself fails.
    pub fn rdm_tagged() -> Result<Self, FabricError> {
        if let Some(info) = getinfo(Want::TRANSPORT)? {
            return Ok(info);
        }
        if let Some(info) = getinfo(Want {
            directed: false,
            ..Want::TRANSPORT
        })? {
            tracing::warn!(
                provider = %info.provider(),
                "libfabric: no FI_DIRECTED_RECV; a peer's identity rests on the tags it sends"
            );
            return Ok(info);
        }
        let loose = Want {
            rdm: true,
            tagged: false,
            ordered: false,
            directed: false,
            strict: false,
        };
        let why = if getinfo(loose)?.is_none() {
            "no reliable datagram endpoints (FI_EP_RDM)"
        } else if getinfo(Want {
            tagged: true,
            ..loose
        })?
        .is_none()
        {
            "no tagged messaging (FI_TAGGED) on FI_EP_RDM endpoints"
        } else if getinfo(Want {
            tagged: true,
            ordered: true,
            ..loose
        })?
        .is_none()
        {
            "tagged FI_EP_RDM messages are not kept in order (no FI_ORDER_SAS)"
        } else {
            "tagged FI_EP_RDM endpoints only with modes the transport does not implement (it \
             handles FI_CONTEXT, FI_CONTEXT2 and FI_MR_LOCAL, and uses FI_THREAD_DOMAIN)"
        };
        let usable = providers();
        let hint = if usable.is_empty() {
            "none is usable under this FI_PROVIDER (`fi_info -t FI_EP_RDM -c FI_TAGGED` lists \
             the installed providers that might be)"
                .to_string()
        } else {
            format!("usable: {usable:?}")
        };
        Err(FabricError::Unsupported(format!("{why}; {hint}")))
    }

    fn first(&self) -> &sys::fi_info {
        // SAFETY: raw is a valid fi_info for as long as self lives.
        unsafe { &*self.raw }
    }

    /// The provider's name, e.g. `tcp;ofi_rxm` or `shm`.
    pub fn provider(&self) -> String {
        let attr = self.first().fabric_attr;
        if attr.is_null() {
            return String::new();
        }
        // SAFETY: fabric_attr points to fi_getinfo's attribute struct; prov_name is a
        // NUL-terminated string or null.
        unsafe { string((*attr).prov_name) }
    }

    /// The fabric's name, e.g. `127.0.0.1/32`.
    pub fn fabric_name(&self) -> String {
        let attr = self.first().fabric_attr;
        if attr.is_null() {
            return String::new();
        }
        // SAFETY: as in `provider`.
        unsafe { string((*attr).name) }
    }

    fn domain_attr(&self) -> Option<&sys::fi_domain_attr> {
        // SAFETY: domain_attr is null or points to fi_getinfo's attribute struct.
        unsafe { self.first().domain_attr.as_ref() }
    }

    /// Whether buffers must be registered before the provider may touch them (`FI_MR_LOCAL`
    /// in `domain_attr->mr_mode`).
    pub fn needs_local_registration(&self) -> bool {
        self.domain_attr()
            .is_some_and(|d| d.mr_mode & sys::FI_MR_LOCAL as i32 != 0)
    }

    /// Whether the provider chooses memory-registration keys (`FI_MR_PROV_KEY`).
    pub fn provider_keys(&self) -> bool {
        self.domain_attr()
            .is_some_and(|d| d.mr_mode & sys::FI_MR_PROV_KEY as i32 != 0)
    }

    /// Whether receives can be restricted to one source (`FI_DIRECTED_RECV`).
    pub fn directed_recv(&self) -> bool {
        self.first().caps & sys::FI_DIRECTED_RECV != 0
    }

    /// The endpoint address format (`FI_SOCKADDR_IN`, `FI_ADDR_STR`, ...).
    pub fn addr_format(&self) -> u32 {
        self.first().addr_format
    }

    /// How many receives can be posted at once (`rx_attr->size`; 0 when not given).
    pub fn rx_size(&self) -> usize {
        // SAFETY: rx_attr is null or points to fi_getinfo's attribute struct.
        unsafe { self.first().rx_attr.as_ref() }.map_or(0, |a| a.size)
    }

    /// Largest message the endpoint can carry.
    pub fn max_msg_size(&self) -> u64 {
        // SAFETY: ep_attr is null or points to fi_getinfo's attribute struct.
        unsafe { self.first().ep_attr.as_ref() }.map_or(0, |a| a.max_msg_size as u64)
    }

    /// How many low tag bits the provider matches (from `ep_attr->mem_tag_format`; all 64 when
    /// it gives no format).
    pub fn tag_bits(&self) -> u32 {
        // SAFETY: as in `max_msg_size`.
        let format = unsafe { self.first().ep_attr.as_ref() }.map_or(0, |a| a.mem_tag_format);
        if format == 0 {
            64
        } else {
            64 - format.leading_zeros()
        }
    }
}

/// A fabric (`fid_fabric`).
#[derive(Debug)]
pub struct Fabric {
    raw: *mut sys::fid_fabric,
}

// SAFETY: libfabric objects have no thread affinity; this one is used by one thread at a time
// (it is not Sync).
unsafe impl Send for Fabric {}

impl Fabric {
    /// Opens the fabric that `info` describes.
    ///
    /// # Errors
    /// When the provider cannot open it.
    pub fn open(info: &Info) -> Result<Self, FabricError> {
        let mut raw: *mut sys::fid_fabric = ptr::null_mut();
        // SAFETY: fabric_attr comes from fi_getinfo; raw is writable.
        let ret =
            unsafe { sys::byzcoll_fi_fabric(info.first().fabric_attr, &mut raw, ptr::null_mut()) };
        check(ret.into(), "fi_fabric")?;
        Ok(Fabric { raw })
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // SAFETY: raw is an open fabric, closed once, after every object opened from it (the
        // domain owns the fabric and closes itself first).
        let ret = unsafe { sys::byzcoll_fi_close(ptr::addr_of_mut!((*self.raw).fid)) };
        if ret != 0 {
            tracing::warn!(error = %error_text(-ret), "libfabric: fi_close(fabric) failed; leaked");
        }
    }
}

/// A domain (`fid_domain`) of a fabric, which it keeps open.
#[derive(Debug)]
pub struct Domain {
    raw: *mut sys::fid_domain,
    _fabric: Fabric,
}

// SAFETY: as for Fabric.
unsafe impl Send for Domain {}

impl Domain {
    /// Opens the domain that `info` describes on `fabric`.
    ///
    /// # Errors
    /// When the provider cannot open it.
    pub fn open(fabric: Fabric, info: &Info) -> Result<Self, FabricError> {
        let mut raw: *mut sys::fid_domain = ptr::null_mut();
        // SAFETY: the fabric is open; info comes from fi_getinfo (libfabric copies what it
        // keeps); raw is writable.
        let ret =
            unsafe { sys::byzcoll_fi_domain(fabric.raw, info.raw, &mut raw, ptr::null_mut()) };
        check(ret.into(), "fi_domain")?;
        Ok(Domain {
            raw,
            _fabric: fabric,
        })
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        // SAFETY: raw is an open domain, closed once, after its endpoint, queues and memory
        // regions (a region left open makes this fail with FI_EBUSY, and the domain leaks).
        let ret = unsafe { sys::byzcoll_fi_close(ptr::addr_of_mut!((*self.raw).fid)) };
        if ret != 0 {
            tracing::warn!(error = %error_text(-ret), "libfabric: fi_close(domain) failed; leaked");
        }
    }
}

/// A completion queue (`fid_cq`, `FI_CQ_FORMAT_TAGGED`), owned by its [`Endpoint`].
#[derive(Debug)]
pub struct CompletionQueue {
    raw: *mut sys::fid_cq,
    /// The queue's wait object (`FI_WAIT_FD`), where the provider has one.
    wait_fd: Option<i32>,
}

impl CompletionQueue {
    /// Opens a queue with a file-descriptor wait object (`FI_WAIT_FD`: `tcp;ofi_rxm` has
    /// one), or without one where the provider has none (`shm` in libfabric 1.17 answers
    /// `FI_ENOSYS`).
    fn open(domain: &Domain, size: usize) -> Result<Self, FabricError> {
        let open = |wait_obj| {
            let mut attr = sys::fi_cq_attr {
                size,
                format: sys::fi_cq_format::FI_CQ_FORMAT_TAGGED,
                wait_obj,
                ..Default::default()
            };
            let mut raw: *mut sys::fid_cq = ptr::null_mut();
            // SAFETY: the domain is open; attr is valid; raw is writable.
            let ret = unsafe {
                sys::byzcoll_fi_cq_open(domain.raw, &mut attr, &mut raw, ptr::null_mut())
            };
            check(ret.into(), "fi_cq_open").map(|_| raw)
        };
        if let Ok(raw) = open(sys::fi_wait_obj::FI_WAIT_FD) {
            let mut fd: i32 = -1;
            // SAFETY: the queue is open; FI_GETWAIT on an FI_WAIT_FD queue writes an int.
            let ret = unsafe {
                sys::byzcoll_fi_control(
                    ptr::addr_of_mut!((*raw).fid),
                    sys::FI_GETWAIT as i32,
                    ptr::addr_of_mut!(fd).cast(),
                )
            };
            let wait_fd = (ret == 0 && fd >= 0).then_some(fd);
            return Ok(CompletionQueue { raw, wait_fd });
        }
        let raw = open(sys::fi_wait_obj::FI_WAIT_NONE)?;
        Ok(CompletionQueue { raw, wait_fd: None })
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: raw is an open queue, closed once, after the endpoint bound to it.
        let ret = unsafe { sys::byzcoll_fi_close(ptr::addr_of_mut!((*self.raw).fid)) };
        if ret != 0 {
            tracing::warn!(error = %error_text(-ret), "libfabric: fi_close(cq) failed");
        }
    }
}

/// An address vector (`fid_av`, `FI_AV_TABLE`), owned by its [`Endpoint`].
#[derive(Debug)]
pub struct AddressVector {
    raw: *mut sys::fid_av,
}

impl AddressVector {
    fn open(domain: &Domain, count: usize) -> Result<Self, FabricError> {
        let mut attr = sys::fi_av_attr {
            type_: sys::fi_av_type::FI_AV_TABLE,
            count,
            ..Default::default()
        };
        let mut raw: *mut sys::fid_av = ptr::null_mut();
        // SAFETY: the domain is open; attr is valid; raw is writable.
        let ret =
            unsafe { sys::byzcoll_fi_av_open(domain.raw, &mut attr, &mut raw, ptr::null_mut()) };
        check(ret.into(), "fi_av_open")?;
        Ok(AddressVector { raw })
    }
}

impl Drop for AddressVector {
    fn drop(&mut self) {
        // SAFETY: raw is an open address vector, closed once, after the endpoint bound to it.
        let ret = unsafe { sys::byzcoll_fi_close(ptr::addr_of_mut!((*self.raw).fid)) };
        if ret != 0 {
            tracing::warn!(error = %error_text(-ret), "libfabric: fi_close(av) failed");
        }
    }
}

/// A registered memory region (`fid_mr`). Close it (drop it) before its endpoint.
#[derive(Debug)]
pub struct MemoryRegion {
    raw: *mut sys::fid_mr,
}

// SAFETY: as for Fabric.
unsafe impl Send for MemoryRegion {}

impl MemoryRegion {
    /// The local descriptor to pass with operations on the region's memory.
    pub fn desc(&self) -> *mut c_void {
        // SAFETY: raw is an open memory region.
        unsafe { sys::byzcoll_fi_mr_desc(self.raw) }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: raw is an open memory region, closed once, after the operations using it
        // completed.
        let ret = unsafe { sys::byzcoll_fi_close(ptr::addr_of_mut!((*self.raw).fid)) };
        if ret != 0 {
            tracing::warn!(error = %error_text(-ret), "libfabric: fi_close(mr) failed");
        }
    }
}

/// Whether an operation was accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Post {
    /// Posted: it will complete through the completion queue.
    Posted,
    /// The provider is out of resources (`-FI_EAGAIN`): read completions, then try again.
    Busy,
}

/// A failed operation, from `fi_cq_readerr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompletionError {
    /// The `fi_errno` code (positive), e.g. [`ETRUNC`].
    pub code: i32,
    /// For [`ETRUNC`]: how many bytes did not fit.
    pub overflow: usize,
    /// The provider's own code.
    pub prov_errno: i32,
}

impl fmt::Display for CompletionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (provider error {})",
            error_text(self.code),
            self.prov_errno
        )
    }
}

/// One completed operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The context pointer the operation was posted with.
    pub context: usize,
    /// For receives: the bytes received.
    pub len: usize,
    /// For receives: the message's tag.
    pub tag: u64,
    /// Why the operation failed, if it did.
    pub error: Option<CompletionError>,
}

/// A reliable datagram endpoint (`fid_ep`, `FI_EP_RDM`), bound to its own completion queue
/// (transmit and receive) and address vector, and keeping its domain and fabric open.
#[derive(Debug)]
pub struct Endpoint {
    raw: *mut sys::fid_ep,
    cq: CompletionQueue,
    av: AddressVector,
    domain: Domain,
    name: Vec<u8>,
    string_addresses: bool,
}

// SAFETY: libfabric objects have no thread affinity. The endpoint owns every object of its
// domain (queue, address vector, memory regions are opened through it) and is not Sync, so
// one thread at a time uses the domain, as FI_THREAD_DOMAIN requires.
unsafe impl Send for Endpoint {}

impl Endpoint {
    /// Opens an endpoint as `info` describes on `domain`, with a completion queue of
    /// `cq_size` entries and an address vector for `peers` addresses, binds them and enables
    /// the endpoint.
    ///
    /// # Errors
    /// When the provider refuses any of these steps.
    pub fn open(
        domain: Domain,
        info: &Info,
        cq_size: usize,
        peers: usize,
    ) -> Result<Self, FabricError> {
        let cq = CompletionQueue::open(&domain, cq_size)?;
        let av = AddressVector::open(&domain, peers)?;
        let mut raw: *mut sys::fid_ep = ptr::null_mut();
        // SAFETY: the domain is open; info comes from fi_getinfo; raw is writable.
        let ret =
            unsafe { sys::byzcoll_fi_endpoint(domain.raw, info.raw, &mut raw, ptr::null_mut()) };
        check(ret.into(), "fi_endpoint")?;
        let mut ep = Endpoint {
            raw,
            cq,
            av,
            domain,
            name: Vec::new(),
            string_addresses: info.addr_format() == sys::FI_ADDR_STR,
        };
        // SAFETY: the endpoint, address vector and queue are open and of the same domain.
        unsafe {
            check(
                sys::byzcoll_fi_ep_bind(ep.raw, ptr::addr_of_mut!((*ep.av.raw).fid), 0).into(),
                "fi_ep_bind(av)",
            )?;
            check(
                sys::byzcoll_fi_ep_bind(
                    ep.raw,
                    ptr::addr_of_mut!((*ep.cq.raw).fid),
                    sys::FI_TRANSMIT as u64 | sys::FI_RECV as u64,
                )
                .into(),
                "fi_ep_bind(cq)",
            )?;
            check(sys::byzcoll_fi_enable(ep.raw).into(), "fi_enable")?;
        }
        ep.name = ep.query_name()?;
        Ok(ep)
    }

    fn query_name(&self) -> Result<Vec<u8>, FabricError> {
        let mut buf = vec![0u8; 64];
        loop {
            let mut len = buf.len();
            // SAFETY: the endpoint is enabled; buf has `len` writable bytes; len is writable.
            let ret = unsafe {
                sys::byzcoll_fi_getname(
                    ptr::addr_of_mut!((*self.raw).fid),
                    buf.as_mut_ptr().cast(),
                    &mut len,
                )
            };
            if i64::from(ret) == -ETOOSMALL && len > buf.len() {
                buf.resize(len, 0);
                continue;
            }
            check(ret.into(), "fi_getname")?;
            buf.truncate(len);
            if self.string_addresses && !buf.contains(&0) {
                buf.push(0);
            }
            return Ok(buf);
        }
    }

    /// This endpoint's address (`fi_getname`), to be published for peers.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// Inserts a peer's address, as its [`Endpoint::name`] gave it, into the address vector.
    ///
    /// # Errors
    /// [`FabricError::Unsupported`] when `address` cannot be an address of this provider's
    /// format (the wrong length, or a string without its terminating NUL), so libfabric never
    /// reads past it; [`FabricError::Call`] when the provider rejects it.
    pub fn insert_address(&mut self, address: &[u8]) -> Result<sys::fi_addr_t, FabricError> {
        let fits = if self.string_addresses {
            address.contains(&0)
        } else {
            address.len() == self.name.len()
        };
        if !fits {
            return Err(FabricError::Unsupported(format!(
                "an address of {} bytes where this provider's take {}",
                address.len(),
                self.name.len()
            )));
        }
        let mut addr: sys::fi_addr_t = sys::FI_ADDR_NOTAVAIL;
        // SAFETY: the address vector is open; `address` holds a whole address of the
        // provider's format (checked above: as long as ours, or NUL-terminated for string
        // addresses); addr is writable.
        let ret = unsafe {
            sys::byzcoll_fi_av_insert(
                self.av.raw,
                address.as_ptr().cast(),
                1,
                &mut addr,
                0,
                ptr::null_mut(),
            )
        };
        match check(ret.into(), "fi_av_insert")? {
            1 => Ok(addr),
            _ => Err(FabricError::Call {
                call: "fi_av_insert",
                code: sys::FI_EINVAL as i32,
            }),
        }
    }

    /// Registers `buf[..len]` for local use by operations with `access` (`FI_SEND`,
    /// `FI_RECV`) under `key` (ignored when the provider chooses keys).
    ///
    /// # Safety
    /// `buf` must stay valid for `len` bytes until the region is dropped, and the region must
    /// be dropped before this endpoint.
    ///
    /// # Errors
    /// When the provider cannot register the memory.
    pub unsafe fn register(
        &self,
        buf: *const u8,
        len: usize,
        access: u64,
        key: u64,
    ) -> Result<MemoryRegion, FabricError> {
        let mut raw: *mut sys::fid_mr = ptr::null_mut();
        // SAFETY: the domain is open; buf is valid per this function's contract; raw is
        // writable.
        let ret = unsafe {
            sys::byzcoll_fi_mr_reg(
                self.domain.raw,
                buf.cast(),
                len,
                access,
                0,
                key,
                0,
                &mut raw,
                ptr::null_mut(),
            )
        };
        check(ret.into(), "fi_mr_reg")?;
        Ok(MemoryRegion { raw })
    }

    /// Sends `buf[..len]` to `dest` tagged `tag`.
    ///
    /// # Safety
    /// `buf` must stay valid for `len` bytes, and `context` must point to an `fi_context2`
    /// that stays valid and untouched, until the operation completes (or the endpoint is
    /// closed); `desc` must be null or the descriptor of a region covering `buf`.
    ///
    /// # Errors
    /// When the provider refuses the send (other than for lack of resources: [`Post::Busy`]).
    pub unsafe fn send(
        &self,
        buf: *const u8,
        len: usize,
        desc: *mut c_void,
        dest: sys::fi_addr_t,
        tag: u64,
        context: *mut c_void,
    ) -> Result<Post, FabricError> {
        // SAFETY: per this function's contract.
        let ret =
            unsafe { sys::byzcoll_fi_tsend(self.raw, buf.cast(), len, desc, dest, tag, context) };
        posted(ret as i64, "fi_tsend")
    }

    /// Receives into `buf[..len]` the next message from `src` (or anyone, with
    /// `FI_ADDR_UNSPEC`) whose tag equals `tag` in the bits not set in `ignore`. A longer
    /// message completes with [`ETRUNC`].
    ///
    /// # Safety
    /// As [`Endpoint::send`], with `buf` writable and unaliased.
    ///
    /// # Errors
    /// When the provider refuses the receive (other than for lack of resources).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn recv(
        &self,
        buf: *mut u8,
        len: usize,
        desc: *mut c_void,
        src: sys::fi_addr_t,
        tag: u64,
        ignore: u64,
        context: *mut c_void,
    ) -> Result<Post, FabricError> {
        // SAFETY: per this function's contract.
        let ret = unsafe {
            sys::byzcoll_fi_trecv(self.raw, buf.cast(), len, desc, src, tag, ignore, context)
        };
        posted(ret as i64, "fi_trecv")
    }

    /// Asks the provider to cancel the operation posted with the context pointer `context`
    /// (as an address); if it can, the operation completes with [`ECANCELED`].
    pub fn cancel(&self, context: usize) {
        // SAFETY: the endpoint is open; the provider only compares `context` with the
        // contexts of its outstanding operations, it does not dereference it.
        let _ = unsafe {
            sys::byzcoll_fi_cancel(ptr::addr_of_mut!((*self.raw).fid), context as *mut c_void)
        };
    }

    /// The completion queue's wait object, a file descriptor that becomes readable when
    /// completions may be ready; `None` when the provider has none (poll then).
    pub fn wait_fd(&self) -> Option<i32> {
        self.cq.wait_fd
    }

    /// Whether the thread may now block on [`Endpoint::wait_fd`] (`fi_trywait`): `false` when
    /// completions are (or may be) ready, or the queue has no wait object; read the queue
    /// then.
    pub fn try_wait(&self) -> bool {
        if self.cq.wait_fd.is_none() {
            return false;
        }
        // SAFETY: the queue is open and bound to this endpoint; fid points into it.
        let mut fid = unsafe { ptr::addr_of_mut!((*self.cq.raw).fid) };
        // SAFETY: the fabric is open; fids is one valid fid of it.
        let ret = unsafe { sys::byzcoll_fi_trywait(self.domain._fabric.raw, &mut fid, 1) };
        ret == 0
    }

    /// Reads up to `max` completions (successful or failed) into `out`, which drives the
    /// provider's progress; returns how many it read.
    ///
    /// # Errors
    /// When the completion queue itself fails.
    pub fn read_completions(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
    ) -> Result<usize, FabricError> {
        const BATCH: usize = 32;
        let mut entries = [sys::fi_cq_tagged_entry::default(); BATCH];
        let mut n = 0;
        while n < max {
            // SAFETY: the queue is open and of the tagged format; entries has BATCH slots.
            let ret =
                unsafe { sys::byzcoll_fi_cq_read(self.cq.raw, entries.as_mut_ptr().cast(), BATCH) }
                    as i64;
            if ret > 0 {
                for e in &entries[..ret as usize] {
                    out.push(Completion {
                        context: e.op_context as usize,
                        len: e.len,
                        tag: e.tag,
                        error: None,
                    });
                }
                n += ret as usize;
            } else if ret == -EAGAIN {
                break;
            } else if ret == -EAVAIL {
                let mut e = sys::fi_cq_err_entry::default();
                // SAFETY: the queue is open; e is writable; err_data_size 0 lets the provider
                // point err_data at its own buffer, which is not kept.
                let r = unsafe { sys::byzcoll_fi_cq_readerr(self.cq.raw, &mut e, 0) } as i64;
                if r == -EAGAIN {
                    break;
                }
                check(r, "fi_cq_readerr")?;
                out.push(Completion {
                    context: e.op_context as usize,
                    len: e.len,
                    tag: e.tag,
                    error: Some(CompletionError {
                        code: e.err.abs(),
                        overflow: e.olen,
                        prov_errno: e.prov_errno,
                    }),
                });
                n += 1;
            } else {
                check(ret, "fi_cq_read")?;
            }
        }
        Ok(n)
    }
}

/// What posting an operation returned. `-FI_EAGAIN` is the provider out of resources for the
/// moment: [`Post::Busy`]. The `shm` provider (libfabric 1.17) answers `-FI_ENOMEM` instead
/// when its pool of pending operations is used up for a moment (in the multi-process p2p
/// bench, 2 of 3 runs lost a receive to it), so that is busy too: the engine reads
/// completions and posts again next turn, and an operation that never gets posted ends at its
/// step's deadline, never in a hang.
fn posted(ret: i64, call: &'static str) -> Result<Post, FabricError> {
    if ret == -EAGAIN || ret == -ENOMEM {
        Ok(Post::Busy)
    } else {
        check(ret, call).map(|_| Post::Posted)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: raw is an open endpoint, closed once and before the queue, address vector,
        // domain and fabric, which are fields and so are dropped after this.
        let ret = unsafe { sys::byzcoll_fi_close(ptr::addr_of_mut!((*self.raw).fid)) };
        if ret != 0 {
            tracing::warn!(error = %error_text(-ret), "libfabric: fi_close(endpoint) failed");
        }
    }
}

/// An `eventfd` that other threads signal to wake a thread blocked in
/// [`byzcoll_transport_kit::progress::wait_readable`].
#[derive(Debug)]
pub struct Notifier {
    fd: i32,
}

impl Notifier {
    /// A new non-blocking eventfd; `None` if the system refuses one.
    pub fn new() -> Option<Self> {
        // SAFETY: eventfd has no memory preconditions.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        (fd >= 0).then_some(Notifier { fd })
    }

    /// Makes the descriptor readable (from any thread).
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: fd is an open eventfd; the buffer is 8 readable bytes. A full counter
        // (EAGAIN) is already readable.
        let _ = unsafe { libc::write(self.fd, ptr::addr_of!(one).cast(), 8) };
    }

    /// Makes it unreadable again.
    pub fn drain(&self) {
        let mut n: u64 = 0;
        // SAFETY: fd is an open non-blocking eventfd; the buffer is 8 writable bytes.
        let _ = unsafe { libc::read(self.fd, ptr::addr_of_mut!(n).cast(), 8) };
    }

    /// The descriptor.
    pub fn fd(&self) -> i32 {
        self.fd
    }
}

impl Drop for Notifier {
    fn drop(&mut self) {
        // SAFETY: fd is open and closed once.
        let _ = unsafe { libc::close(self.fd) };
    }
}
