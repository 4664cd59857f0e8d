//! `npy::from_bytes` on arbitrary bytes: an error, never a panic, and never an allocation
//! sized by an untrusted header (run with `-rss_limit_mb=512 -malloc_limit_mb=256`). What it
//! accepts has as many elements as its shape says and writes back to bytes it reads again.
#![no_main]

use byzcoll_cli::npy::{self, Array};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(a) = npy::from_bytes(data) else {
        return;
    };
    let elements = match &a {
        Array::F32 { data, .. } => data.len(),
        Array::F64 { data, .. } => data.len(),
        Array::F16 { data, .. } => data.len(),
        Array::U16 { data, .. } => data.len(),
    };
    assert_eq!(
        Some(elements),
        a.shape().iter().try_fold(1usize, |p, &d| p.checked_mul(d))
    );
    let mut out = Vec::new();
    a.write_to(&mut out).expect("an array read writes back");
    let b = npy::from_bytes(&out).expect("what was written reads back");
    assert_eq!(a.shape(), b.shape());
    assert_eq!(a.dtype_name(), b.dtype_name());
});
