//! Wire format of the TCP transport (little-endian).
//!
//! Every connection starts with the handshake of [`byzcoll_runtime::bootstrap::auth`]
//! (purpose TCP, identity signatures, roster digest); then data frames follow: a 32-byte
//! [`FrameHeader`] and `len` payload bytes.

pub use byzcoll_transport_kit::wire::{FrameHeader, FRAME_MAGIC, HEADER_LEN};
