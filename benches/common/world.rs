//! A job of several ranks in one bench process: TCP on 127.0.0.1, a store port drawn from
//! the kernel, a fresh job secret, and the tokio runtime that drives them.

use std::time::Duration;

use byzcoll::bootstrap::{JobAuth, JobSecret};
use byzcoll::{JobConfig, JobConfigBuilder};

/// The configurations of the `n` ranks of one job over TCP on 127.0.0.1, with step deadline
/// `timeout`; callers add what else they need before `build`.
pub(crate) fn tcp_job(n: usize, timeout: Duration) -> Result<Vec<JobConfigBuilder>, String> {
    let store = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        format!(
            "127.0.0.1:{}",
            l.local_addr().map_err(|e| e.to_string())?.port()
        )
    };
    let secret = JobSecret::generate().map_err(|e| e.to_string())?;
    Ok((0..n)
        .map(|rank| {
            JobConfig::builder(rank, n)
                .store(store.clone())
                .auth(JobAuth::Secret(secret.clone()))
                .tcp_listen([127, 0, 0, 1].into())
                .step_timeout(timeout)
        })
        .collect())
}

/// A multi-thread tokio runtime, or why not.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start tokio: {e}"))
}
