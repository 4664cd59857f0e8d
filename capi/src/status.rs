//! Status codes, their descriptions, and the messages of failed calls.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};

use byzcoll_rs::{Error, ErrorKind, PeerFault};

/// What a call returns.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum byzcoll_status_t {
    /// Success.
    BYZCOLL_OK = 0,
    /// A NULL or misaligned pointer, a count or enum value out of range, overlapping buffers,
    /// an unknown rule: fix the calling code.
    BYZCOLL_INVALID_ARGUMENT = 1,
    /// The rule's precondition does not hold for this world (e.g. median needs n > 2f).
    BYZCOLL_PRECONDITION = 2,
    /// More peers were at fault this round (missing, malformed, non-finite) than the rule
    /// tolerates: no result rather than an unprotected one.
    BYZCOLL_TOO_MANY_FAULTS = 3,
    /// The transport failed as a whole, or a peer sent something malformed to a non-robust
    /// collective.
    BYZCOLL_TRANSPORT = 4,
    /// A non-robust collective's peer did not answer before the step deadline.
    BYZCOLL_TIMEOUT = 5,
    /// The job secret is missing, or a peer or the store failed authentication.
    BYZCOLL_UNAUTHENTICATED = 6,
    /// A bug in byzcoll (a panic caught at the boundary).
    BYZCOLL_INTERNAL = 7,
    /// This rank's result is not the one the job holds (agreement detection): do not use it.
    BYZCOLL_DISAGREEMENT = 8,
    /// Not available in this build or with this transport; the message says how to get it.
    BYZCOLL_UNSUPPORTED = 9,
    /// The launcher environment is incomplete or invalid, or the rendezvous failed.
    BYZCOLL_BOOTSTRAP = 10,
    /// The communicator was aborted.
    BYZCOLL_ABORTED = 11,
    /// A CUDA call failed (device vectors).
    BYZCOLL_DEVICE = 12,
    /// The other ranks shrank the communicator without this rank (`byzcoll_comm_shrink`).
    BYZCOLL_EXCLUDED = 13,
    /// This rank fell behind its peers, which dropped this call's messages to it and went on:
    /// the call has no result here, and the peers are not at fault. Later calls take part as
    /// usual.
    BYZCOLL_FELL_BEHIND = 14,
}

use byzcoll_status_t::*;

/// A failed call: its status and message.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: byzcoll_status_t,
    pub(crate) message: String,
    /// The peers at fault, when the error names them.
    pub(crate) faults: Vec<PeerFault>,
}

impl Failure {
    pub(crate) fn new(status: byzcoll_status_t, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: message.into(),
            faults: Vec::new(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Failure::new(BYZCOLL_INVALID_ARGUMENT, message)
    }

    pub(crate) fn aborted() -> Self {
        Failure::new(BYZCOLL_ABORTED, "the communicator was aborted")
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let status = match e.kind() {
            ErrorKind::InvalidUsage => BYZCOLL_INVALID_ARGUMENT,
            ErrorKind::Precondition => BYZCOLL_PRECONDITION,
            ErrorKind::TooManyFaults => BYZCOLL_TOO_MANY_FAULTS,
            ErrorKind::Disagreement => BYZCOLL_DISAGREEMENT,
            ErrorKind::Excluded => BYZCOLL_EXCLUDED,
            ErrorKind::FellBehind => BYZCOLL_FELL_BEHIND,
            ErrorKind::Timeout => BYZCOLL_TIMEOUT,
            ErrorKind::Transport => BYZCOLL_TRANSPORT,
            ErrorKind::Unauthenticated => BYZCOLL_UNAUTHENTICATED,
            ErrorKind::Bootstrap => BYZCOLL_BOOTSTRAP,
            ErrorKind::Unsupported => BYZCOLL_UNSUPPORTED,
            ErrorKind::Device => BYZCOLL_DEVICE,
            _ => BYZCOLL_INTERNAL,
        };
        Failure {
            faults: e.faults().to_vec(),
            ..Failure::new(status, e.to_string())
        }
    }
}

/// A static description of a status value.
pub(crate) fn describe(status: c_int) -> &'static CStr {
    const ALL: [(byzcoll_status_t, &CStr); 15] = [
        (BYZCOLL_OK, c"success"),
        (BYZCOLL_INVALID_ARGUMENT, c"invalid argument"),
        (
            BYZCOLL_PRECONDITION,
            c"the rule's precondition does not hold",
        ),
        (
            BYZCOLL_TOO_MANY_FAULTS,
            c"too many faulty peers for the rule",
        ),
        (BYZCOLL_TRANSPORT, c"transport failure"),
        (BYZCOLL_TIMEOUT, c"a peer did not answer in time"),
        (
            BYZCOLL_UNAUTHENTICATED,
            c"authentication failed or no job secret",
        ),
        (BYZCOLL_INTERNAL, c"internal error"),
        (
            BYZCOLL_DISAGREEMENT,
            c"this rank's result disagrees with the job's",
        ),
        (
            BYZCOLL_UNSUPPORTED,
            c"not supported by this build or transport",
        ),
        (BYZCOLL_BOOTSTRAP, c"bootstrap failed"),
        (BYZCOLL_ABORTED, c"the communicator was aborted"),
        (BYZCOLL_DEVICE, c"a CUDA call failed"),
        (
            BYZCOLL_EXCLUDED,
            c"the other ranks shrank the communicator without this rank",
        ),
        (
            BYZCOLL_FELL_BEHIND,
            c"this rank fell behind its peers, which went on without it",
        ),
    ];
    ALL.iter()
        .find(|(s, _)| *s as c_int == status)
        .map_or(c"unknown status", |(_, text)| text)
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::default();
}

/// `message` as a C string (interior NULs replaced).
fn c_string(message: &str) -> CString {
    CString::new(message.replace('\0', "\\0")).unwrap_or_default()
}

pub(crate) fn set_thread_error(message: &str) {
    LAST_ERROR.with(|e| *e.borrow_mut() = c_string(message));
}

pub(crate) fn set_thread_error_c(message: CString) {
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

pub(crate) fn thread_error() -> CString {
    LAST_ERROR.with(|e| e.borrow().clone())
}

pub(crate) fn thread_error_ptr() -> *const c_char {
    // The CString lives in the thread-local until the next failing call on this thread.
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}
