//! `wire::FrameHeader::decode` on arbitrary 32 bytes (shorter inputs are zero-padded, longer
//! ones cut): it never panics, and what it accepts encodes back to the same bytes.
#![no_main]

use byzcoll_transport_kit::wire::FrameHeader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; 32];
    let n = data.len().min(32);
    b[..n].copy_from_slice(&data[..n]);
    if let Ok(h) = FrameHeader::decode(&b) {
        assert_eq!(h.encode(), b, "decode/encode round trip");
    }
});
