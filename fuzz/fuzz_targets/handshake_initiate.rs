//! The initiator's side of the handshake (`auth::initiate`) reading an untrusted responder:
//! a rank calling the store, and rank 1 calling rank 0 over TCP.
#![no_main]

use byzcoll_runtime::bootstrap::auth::{initiate, Purpose, STORE};
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let job = common::job();
    for (purpose, to) in [(Purpose::Store, STORE), (Purpose::Tcp, 0)] {
        let me = job.endpoint(purpose, 1, false);
        job.run(data, |mut s| async move { initiate(&mut s, me, to).await });
    }
});
