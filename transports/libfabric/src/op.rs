//! The state of one libfabric operation ([`Op`]) and of one payload received in fragments
//! ([`Fragments`]).

use std::ptr;

use bytes::Bytes;
use byzcoll_libfabric_sys as sys;
use byzcoll_runtime::Rank;
use byzcoll_transport_kit::wire::SEALED_LEN;

use crate::safe::MemoryRegion;

/// What an operation is. Sends and header receives own their buffer; fragment receives write
/// into the buffer of their payload receive or into the engine's scratch buffer.
pub(crate) enum OpKind {
    SendHeader {
        out: u64,
        peer: Rank,
        tag: u64,
        buf: Box<[u8; SEALED_LEN]>,
    },
    SendFragment {
        out: u64,
        peer: Rank,
        tag: u64,
        data: Bytes,
    },
    RecvHeader {
        peer: Rank,
        seq: u64,
        tag: u64,
        buf: Box<[u8; SEALED_LEN]>,
    },
    RecvFragment {
        peer: Rank,
        seq: u64,
        tag: u64,
        len: usize,
    },
}

/// An operation: posted (in `Net::ops`) or waiting to be.
pub(crate) struct Op {
    /// Declared first so that it is closed before the buffer it covers is freed.
    pub(crate) mr: Option<MemoryRegion>,
    pub(crate) kind: OpKind,
    /// Scratch space the provider may use while the operation is in flight (`FI_CONTEXT2`).
    /// Its address is the operation's context pointer and its key in `Net::ops`.
    pub(crate) context: Box<sys::fi_context2>,
}

impl Op {
    pub(crate) fn new(kind: OpKind) -> Self {
        Op {
            mr: None,
            kind,
            context: Box::default(),
        }
    }

    pub(crate) fn id(&self) -> usize {
        ptr::from_ref::<sys::fi_context2>(&self.context) as usize
    }

    /// The send this operation is part of.
    pub(crate) fn send(&self) -> Option<(u64, Rank)> {
        match self.kind {
            OpKind::SendHeader { out, peer, .. } | OpKind::SendFragment { out, peer, .. } => {
                Some((out, peer))
            }
            _ => None,
        }
    }
}

/// A payload being received, fragment by fragment, into the kit's buffer (or drained into
/// the engine's scratch buffer).
pub(crate) struct Fragments {
    /// Payload bytes, as the header announced.
    pub(crate) total: usize,
    /// Where the next fragment receive starts.
    pub(crate) next: usize,
    /// Bytes received so far.
    pub(crate) received: usize,
    /// Contexts of the fragment receives in flight.
    pub(crate) in_flight: Vec<usize>,
    /// Start of the buffer; null while draining into scratch.
    pub(crate) base: *mut u8,
    /// Cancelled (the peer closed): nothing more is posted.
    pub(crate) cancelled: bool,
}
