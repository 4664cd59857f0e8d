//! `wire::FrameHeader::decode` on arbitrary `HEADER_LEN` bytes (shorter inputs are zero-padded,
//! longer ones cut): it never panics, and what it accepts encodes back to the same bytes.
#![no_main]

use byzcoll_transport_kit::wire::{FrameHeader, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; HEADER_LEN];
    let n = data.len().min(HEADER_LEN);
    b[..n].copy_from_slice(&data[..n]);
    if let Ok(h) = FrameHeader::decode(&b) {
        assert_eq!(h.encode(), b, "decode/encode round trip");
    }
});
