//! Admission control for listeners that strangers can reach (the store, the TCP transport's
//! listener during setup).
//!
//! Each accepted connection is authenticated in a task of its own, concurrently with the
//! others and under a deadline ([`AUTH_DEADLINE`]), so an idle or slow client never delays a
//! real peer. At most [`MAX_PENDING`] connections may be unauthenticated at once; when another
//! arrives, the oldest pending one is closed (never an authenticated one), so holding
//! connections open costs an attacker more than it costs the job. [`accept`] backs off instead
//! of spinning when the process is out of file descriptors.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// How long a connection may take to authenticate.
pub const AUTH_DEADLINE: Duration = Duration::from_secs(10);
/// Most connections authenticating at once.
pub const MAX_PENDING: usize = 256;
/// Pause after a failed `accept` (`EMFILE`, `ENFILE`, `ENOBUFS`, ...).
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// How often one source may write a line to the log about what it did to a listener.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Sources a [`LogLimit`] remembers; past them, every other source shares one budget.
const LOG_SOURCES: usize = 1024;

/// A rate limit for the log lines a stranger (or a member) can trigger: one line per source
/// address per interval, the next one saying how many were held back. A flood of refused
/// connections writes a line every [`LOG_INTERVAL`] per address, not one per connection.
#[derive(Debug)]
pub struct LogLimit {
    interval: Duration,
    sources: Mutex<HashMap<Option<IpAddr>, (Instant, u64)>>,
}

/// The limit on refusal lines of every listener of this process.
pub static REFUSALS: LazyLock<LogLimit> = LazyLock::new(|| LogLimit::new(LOG_INTERVAL));

impl LogLimit {
    /// At most one line per source every `interval`.
    pub fn new(interval: Duration) -> Self {
        LogLimit {
            interval,
            sources: Mutex::default(),
        }
    }

    /// Whether a line about `source` may be written now: `Some(held_back)`, the lines held
    /// back since the last one written, or `None` to hold this one back too.
    pub fn allow(&self, source: IpAddr) -> Option<u64> {
        let now = Instant::now();
        let mut sources = self.sources.lock().unwrap_or_else(PoisonError::into_inner);
        if sources.len() >= LOG_SOURCES {
            sources.retain(|_, (at, _)| now.duration_since(*at) < self.interval);
        }
        // Beyond the sources remembered, the rest share one entry: memory stays bounded
        // whatever the number of addresses a flood comes from.
        let key = match sources.len() < LOG_SOURCES || sources.contains_key(&Some(source)) {
            true => Some(source),
            false => None,
        };
        match sources.get_mut(&key) {
            Some((at, held)) if now.duration_since(*at) < self.interval => {
                *held += 1;
                None
            }
            Some((at, held)) => {
                *at = now;
                Some(std::mem::take(held))
            }
            None => {
                sources.insert(key, (now, 0));
                Some(0)
            }
        }
    }
}

/// Writes a warning about `from` through [`REFUSALS`]: at most one line per address per
/// [`LOG_INTERVAL`], saying how many were held back.
#[macro_export]
macro_rules! warn_limited {
    ($from:expr, $($arg:tt)+) => {{
        let from: ::std::net::SocketAddr = $from;
        if let Some(held_back) = $crate::bootstrap::gate::REFUSALS.allow(from.ip()) {
            ::tracing::warn!(%from, held_back, $($arg)+);
        }
    }};
}

#[derive(Debug, Default)]
struct Pending {
    next: u64,
    /// Oldest first; the handle is set once the task is spawned.
    tasks: VecDeque<(u64, Option<AbortHandle>)>,
}

/// Runs authentications concurrently, bounded and under a deadline; see the module docs.
#[derive(Debug, Clone)]
pub struct Gate {
    pending: Arc<Mutex<Pending>>,
    cap: usize,
    deadline: Duration,
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new(MAX_PENDING, AUTH_DEADLINE)
    }
}

impl Gate {
    /// A gate admitting at most `cap` (at least 1) pending connections, each for `deadline`.
    pub fn new(cap: usize, deadline: Duration) -> Self {
        Gate {
            pending: Arc::default(),
            cap: cap.max(1),
            deadline,
        }
    }

    /// Connections authenticating now.
    pub fn pending(&self) -> usize {
        self.lock().tasks.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spawns `authenticate`; once it yields `Some(peer)` within the deadline the connection
    /// leaves the pending set and `then(peer)` runs in the same task. A connection still
    /// pending when the gate is full and another arrives, or at its deadline, is dropped
    /// (`from` is logged).
    pub fn admit<A, T, F, C>(&self, from: SocketAddr, authenticate: A, then: C)
    where
        A: Future<Output = Option<T>> + Send + 'static,
        T: Send + 'static,
        C: FnOnce(T) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let id = {
            let mut p = self.lock();
            if p.tasks.len() >= self.cap {
                if let Some((_, Some(oldest))) = p.tasks.pop_front() {
                    oldest.abort();
                    crate::warn_limited!(
                        from,
                        "too many unauthenticated connections: closed the oldest"
                    );
                }
            }
            let id = p.next;
            p.next += 1;
            p.tasks.push_back((id, None));
            id
        };
        let gate = self.clone();
        let deadline = self.deadline;
        let task = tokio::spawn(async move {
            let outcome = tokio::time::timeout(deadline, authenticate).await;
            gate.lock().tasks.retain(|(i, _)| *i != id);
            match outcome {
                Ok(Some(peer)) => then(peer).await,
                Ok(None) => {}
                Err(_) => {
                    crate::warn_limited!(
                        from,
                        "closed a connection that did not authenticate in time"
                    )
                }
            }
        });
        if let Some(slot) = self.lock().tasks.iter_mut().find(|(i, _)| *i == id) {
            slot.1 = Some(task.abort_handle());
        }
    }
}

/// Accepts the next connection, pausing [`ACCEPT_BACKOFF`] after each failure (out of file
/// descriptors, or a connection reset before it was accepted) instead of retrying at once.
pub async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed; pausing");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One line per source per interval, the next saying how many were held back; other
    /// sources are not held back by one that floods; memory stays bounded past the sources
    /// remembered.
    #[test]
    fn log_lines_are_limited_per_source() {
        let limit = LogLimit::new(Duration::from_millis(200));
        let a: IpAddr = [127, 0, 0, 7].into();
        let b: IpAddr = [127, 0, 0, 8].into();
        assert_eq!(limit.allow(a), Some(0));
        for _ in 0..1000 {
            assert_eq!(limit.allow(a), None);
        }
        assert_eq!(limit.allow(b), Some(0), "another source has its own budget");
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(limit.allow(a), Some(1000));
        assert_eq!(limit.allow(a), None);
        // A flood from many addresses: bounded memory, and the ones past the bound share one
        // budget.
        let mut written = 0;
        for i in 0..(3 * LOG_SOURCES as u32) {
            let ip: IpAddr = std::net::Ipv4Addr::from(0x7f01_0000 + i).into();
            written += usize::from(limit.allow(ip).is_some());
        }
        assert!(limit.sources.lock().unwrap().len() <= LOG_SOURCES + 1);
        assert!(written <= LOG_SOURCES + 1, "{written} lines for a flood");
    }
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(start_paused = true)]
    async fn the_oldest_pending_connection_is_evicted_and_deadlines_hold() {
        let gate = Gate::new(2, Duration::from_secs(10));
        let done = Arc::new(AtomicUsize::new(0));
        let from: SocketAddr = ([127, 0, 0, 1], 1).into();
        for _ in 0..3 {
            let done = done.clone();
            gate.admit(
                from,
                std::future::pending::<Option<()>>(),
                move |_| async move {
                    done.fetch_add(1, Ordering::SeqCst);
                },
            );
        }
        tokio::task::yield_now().await;
        assert_eq!(gate.pending(), 2, "the third evicted the first");
        let ok = done.clone();
        gate.admit(from, async { Some(()) }, move |_| async move {
            ok.fetch_add(1, Ordering::SeqCst);
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(
            done.load(Ordering::SeqCst),
            1,
            "an authenticated one runs on"
        );
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(gate.pending(), 0, "the idle ones timed out");
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }
}
