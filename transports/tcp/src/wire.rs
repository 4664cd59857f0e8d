//! Wire format of the TCP transport (little-endian).
//!
//! Every connection starts with the handshake of [`byzcoll_runtime::bootstrap::auth`]
//! (purpose TCP, identity signatures, roster digest); then data frames follow: a 40-byte
//! [`FrameHeader`] and `len` payload bytes, or a skip notice ([`SKIP_MAGIC`]).

use byzcoll_runtime::{MsgKey, Rank};
pub use byzcoll_transport_kit::wire::{FrameHeader, FRAME_MAGIC, HEADER_LEN};

/// Magic of a *skip notice*: a header laid out as a data frame's, with no payload, whose key
/// is the last of its stream that the sender dropped unsent because the receiver fell behind
/// (`send`'s module docs). Every frame of that stream up to that key which the receiver has
/// not had before the notice will never come.
pub const SKIP_MAGIC: [u8; 4] = *b"BZS3";

/// The skip notice of `sender` for every frame up to `last` of its stream.
pub fn skip_notice(last: MsgKey, sender: Rank) -> [u8; HEADER_LEN] {
    let mut b = FrameHeader::new(last, 0, sender, 0).encode();
    b[..4].copy_from_slice(&SKIP_MAGIC);
    b
}

/// The header of a skip notice (`raw` starts with [`SKIP_MAGIC`]), or `None` for a data
/// frame.
///
/// # Errors
/// A notice that carries a payload.
pub fn decode_skip(raw: &[u8; HEADER_LEN]) -> Option<Result<FrameHeader, String>> {
    if raw[..4] != SKIP_MAGIC {
        return None;
    }
    let mut b = *raw;
    b[..4].copy_from_slice(&FRAME_MAGIC);
    Some(FrameHeader::decode(&b).and_then(|h| {
        if h.len == 0 {
            Ok(h)
        } else {
            Err(format!("a skip notice with {} payload bytes", h.len))
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_notice_round_trips_and_is_no_data_frame() {
        let last = MsgKey {
            collective: (3 << 48) | 41,
            step: 2,
            tag: 5,
        };
        let raw = skip_notice(last, 6);
        let h = decode_skip(&raw).expect("a notice").unwrap();
        assert_eq!((h.key(), h.sender, h.len), (last, 6, 0));
        assert!(FrameHeader::decode(&raw).is_err(), "not a data frame");
        let data = FrameHeader::new(last, 9, 6, 0).encode();
        assert!(decode_skip(&data).is_none());
        let mut long = FrameHeader::new(last, 0, 6, 8).encode();
        long[..4].copy_from_slice(&SKIP_MAGIC);
        assert!(decode_skip(&long).expect("a notice").is_err());
    }
}
