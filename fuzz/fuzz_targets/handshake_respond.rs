//! The responder's side of the handshake (`auth::respond`) reading an untrusted initiator:
//! the store's (no identity) and a TCP rank's (identity and roster checked).
#![no_main]

use byzcoll_runtime::bootstrap::auth::{respond, Purpose};
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let job = common::job();
    for purpose in [Purpose::Store, Purpose::Tcp] {
        let me = job.endpoint(purpose, 0, purpose == Purpose::Store);
        job.run(data, |mut s| async move {
            respond(&mut s, me, |_| Ok(())).await
        });
    }
});
