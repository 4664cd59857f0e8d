//! The frame header shared by byte-stream and message transports: 40 bytes, little-endian,
//! `b"BZF3"`, collective `u64`, step `u32`, sender `u32`, tag `u32`, payload length `u64`,
//! call fingerprint `u64` ([`byzcoll_runtime::Step::call`]).
//! Receivers check the sender against the connection and the length against the posted
//! receive ([`crate::mailbox`]) before they allocate anything.
//!
//! Sealed frames for the tag-matched transports (UCX, libfabric) are here too, with the
//! `sealed` feature (the default; the TCP and in-process transports go without it).

use byzcoll_runtime::{MsgKey, Rank};

#[cfg(feature = "sealed")]
mod sealed;
#[cfg(feature = "sealed")]
pub use sealed::*;

/// Magic of a data frame.
pub const FRAME_MAGIC: [u8; 4] = *b"BZF3";
/// Length of a frame header.
pub const HEADER_LEN: usize = 40;

/// The header in front of every payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Collective sequence number.
    pub collective: u64,
    /// Step within the collective.
    pub step: u32,
    /// The sender's rank (checked against the connection's peer).
    pub sender: u32,
    /// Message tag.
    pub tag: u32,
    /// Payload length in bytes (checked against the posted receive before any allocation).
    pub len: u64,
    /// The fingerprint of the sender's collective call (checked against the posted receive's:
    /// a message of another call is out of step, never delivered).
    pub call: u64,
}

impl FrameHeader {
    /// The header of a message from `sender` under `key` of the call with fingerprint `call`,
    /// with `len` payload bytes.
    pub fn new(key: MsgKey, call: u64, sender: Rank, len: usize) -> Self {
        FrameHeader {
            collective: key.collective,
            step: key.step,
            sender: sender as u32,
            tag: key.tag,
            len: len as u64,
            call,
        }
    }

    /// The message key.
    pub fn key(&self) -> MsgKey {
        MsgKey {
            collective: self.collective,
            step: self.step,
            tag: self.tag,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC);
        b[4..12].copy_from_slice(&self.collective.to_le_bytes());
        b[12..16].copy_from_slice(&self.step.to_le_bytes());
        b[16..20].copy_from_slice(&self.sender.to_le_bytes());
        b[20..24].copy_from_slice(&self.tag.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.call.to_le_bytes());
        b
    }

    /// Decodes a header. Only the magic is checked here; the reader checks the sender and the
    /// length against the connection and the posted receive.
    ///
    /// # Errors
    /// When the magic is wrong.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        if b[0..4] != FRAME_MAGIC {
            return Err(format!("bad frame magic {:02x?}", &b[0..4]));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        Ok(FrameHeader {
            collective: u64_at(4),
            step: u32_at(12),
            sender: u32_at(16),
            tag: u32_at(20),
            len: u64_at(24),
            call: u64_at(32),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_bad_magic() {
        let h = FrameHeader {
            collective: u64::MAX - 3,
            step: 7,
            sender: 12,
            tag: 9,
            len: 1 << 40,
            call: 0x0123_4567_89ab_cdef,
        };
        let mut b = h.encode();
        assert_eq!(FrameHeader::decode(&b), Ok(h));
        b[0] = b'X';
        assert!(FrameHeader::decode(&b).is_err());
    }
}
