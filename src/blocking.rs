//! A communicator for callers without an async runtime: the C ABI and the Python module are
//! thin shells over [`BlockingComm`], which owns the tokio runtime the transport's tasks run
//! on, runs each call to completion on it, aborts, and closes.
//!
//! A call runs in one of two ways: [`BlockingComm::run`] drives it on the calling thread (it
//! may borrow the caller's buffers), [`BlockingComm::run_task`] as a task on the runtime's
//! worker threads while the calling thread sleeps once until it is done (the caller hands
//! over what it needs; Python releases the GIL meanwhile). Either way, one call at a time
//! holds the communicator, [`BlockingComm::abort`] from another thread ends a call in
//! progress and every later one, and a call that panicked closes the communicator (its
//! numbering and mailboxes are mid-round, so it cannot go on in step with the other ranks).

use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::runtime::Runtime;
use tokio::sync::Notify;

use crate::{Communicator, Error, Rank};

/// Why a call on a [`BlockingComm`] returned no result.
#[derive(Debug)]
pub enum Refused {
    /// The collective itself failed.
    Failed(Error),
    /// The communicator was closed ([`BlockingComm::close`], or after a panic).
    Closed,
    /// The communicator was aborted ([`BlockingComm::abort`]).
    Aborted,
    /// The call panicked (a bug): the communicator is closed.
    Panicked(String),
}

impl From<Error> for Refused {
    fn from(e: Error) -> Self {
        Refused::Failed(e)
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Failed(e) => e.fmt(f),
            Refused::Closed => f.write_str("the communicator is closed"),
            Refused::Aborted => f.write_str("the communicator was aborted"),
            Refused::Panicked(what) => write!(
                f,
                "the call panicked ({what}), a bug; the communicator is closed"
            ),
        }
    }
}

/// A tokio runtime for [`BlockingComm`]s: `worker_threads` threads named `byzcoll`.
///
/// # Errors
/// When the threads cannot be started.
pub fn runtime(worker_threads: usize) -> std::io::Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads.max(1))
        .thread_name("byzcoll")
        .enable_all()
        .build()
}

/// A [`Communicator`] with the runtime it runs on, for blocking callers (see the module docs).
#[derive(Debug)]
pub struct BlockingComm {
    /// Shared with the communicators made from this one (a shrink), whose transport's tasks
    /// run on it.
    runtime: Arc<Runtime>,
    comm: Mutex<Option<Communicator>>,
    rank: Rank,
    size: usize,
    aborted: AtomicBool,
    abort: Notify,
}

impl BlockingComm {
    /// `comm`, whose transport was set up on `runtime`.
    pub fn new(runtime: Arc<Runtime>, comm: Communicator) -> Self {
        BlockingComm {
            rank: comm.rank(),
            size: comm.size(),
            runtime,
            comm: Mutex::new(Some(comm)),
            aborted: AtomicBool::new(false),
            abort: Notify::new(),
        }
    }

    /// The runtime the communicator runs on (for the communicators made from it).
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// This rank (kept after closing).
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The number of ranks (kept after closing).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The communicator's slot, closing it if a call panicked while holding it.
    fn slot(&self) -> Result<MutexGuard<'_, Option<Communicator>>, Refused> {
        match self.comm.lock() {
            Ok(slot) => Ok(slot),
            Err(poisoned) => {
                let mut slot = poisoned.into_inner();
                let broken = slot.take();
                let _entered = self.runtime.enter();
                drop(broken);
                Err(Refused::Panicked(
                    "an earlier call on this communicator".into(),
                ))
            }
        }
    }

    /// Runs `op` on the communicator on the calling thread, unless it is or gets aborted.
    ///
    /// # Errors
    /// [`Refused::Failed`] with the call's error; [`Refused::Closed`], [`Refused::Aborted`];
    /// [`Refused::Panicked`] when an earlier call panicked.
    pub fn run<T>(
        &self,
        op: impl AsyncFnOnce(&mut Communicator) -> crate::Result<T>,
    ) -> Result<T, Refused> {
        let mut slot = self.slot()?;
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Refused::Aborted);
        }
        let comm = slot.as_mut().ok_or(Refused::Closed)?;
        self.runtime.block_on(async {
            let mut aborted = pin!(self.abort.notified());
            aborted.as_mut().enable();
            if self.aborted.load(Ordering::SeqCst) {
                return Err(Refused::Aborted);
            }
            tokio::select! {
                r = op(comm) => r.map_err(Refused::Failed),
                () = aborted => Err(Refused::Aborted),
            }
        })
    }

    /// Runs a call as a task on the runtime's worker threads, as a Rust caller's would run:
    /// the calling thread sleeps once until it is done, rather than being woken at every step.
    /// `op` gets the communicator and gives it back with its result.
    ///
    /// # Errors
    /// As [`BlockingComm::run`]; a call that panicked closes the communicator.
    pub fn run_task<T, F>(&self, op: impl FnOnce(Communicator) -> F) -> Result<T, Refused>
    where
        T: Send + 'static,
        F: std::future::Future<Output = (Communicator, crate::Result<T>)> + Send + 'static,
    {
        let mut slot = self.slot()?;
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Refused::Aborted);
        }
        let comm = slot.take().ok_or(Refused::Closed)?;
        let mut task = self.runtime.spawn(op(comm));
        let joined = self.runtime.block_on(async {
            let mut aborted = pin!(self.abort.notified());
            aborted.as_mut().enable();
            if self.aborted.load(Ordering::SeqCst) {
                task.abort();
            }
            tokio::select! {
                joined = &mut task => joined,
                () = aborted => {
                    // The call's task drops the communicator (and so its connections).
                    task.abort();
                    task.await
                }
            }
        });
        match joined {
            Ok((comm, result)) => {
                *slot = Some(comm);
                result.map_err(Refused::Failed)
            }
            Err(e) if e.is_cancelled() => Err(Refused::Aborted),
            // The communicator went down with the task: later calls find it closed.
            Err(e) => Err(Refused::Panicked(e.to_string())),
        }
    }

    /// `op` on the communicator, here and now (no collective).
    ///
    /// # Errors
    /// [`Refused::Closed`] (or [`Refused::Panicked`]) when there is none.
    pub fn with_comm<T>(&self, op: impl FnOnce(&mut Communicator) -> T) -> Result<T, Refused> {
        let mut slot = self.slot()?;
        slot.as_mut().map(op).ok_or(Refused::Closed)
    }

    /// Closes the communicator once a call in progress has returned: first lets the transport
    /// finish what the last calls left in flight ([`Communicator::close`]; bounded). Later
    /// calls are [`Refused::Closed`].
    pub fn close(&self) {
        let comm = self
            .comm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(comm) = comm {
            self.runtime.block_on(comm.close());
        }
    }

    /// Aborts: a call in progress on another thread returns [`Refused::Aborted`] (this waits
    /// for it), the connections close at once (peers see this rank as missing), and every
    /// later call is refused the same way.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.abort.notify_waiters();
        let comm = self
            .comm
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let _entered = self.runtime.enter();
        drop(comm);
    }

    /// Whether [`BlockingComm::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transports::local::LocalTransport;
    use std::time::Duration;

    /// Two ranks of an in-process job, each a blocking communicator on its own runtime.
    fn pair() -> Vec<BlockingComm> {
        LocalTransport::world(2)
            .into_iter()
            .map(|t| {
                let rt = Arc::new(runtime(1).unwrap());
                let c = Communicator::new(Box::new(t), crate::Config::default());
                BlockingComm::new(rt, c)
            })
            .collect()
    }

    /// Calls run on both threads' communicators, by the caller's thread and as a task alike;
    /// a closed communicator refuses calls and keeps its rank and size.
    #[test]
    fn calls_run_both_ways_and_a_closed_communicator_refuses_them() {
        let comms = pair();
        let sums: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let mut v = [c.rank() as f32 + 1.0];
                        c.run(async |comm| comm.all_reduce(&mut v, crate::ReduceOp::Sum).await)
                            .unwrap();
                        let w = c
                            .run_task(|mut comm| async move {
                                let mut w = [10.0f32];
                                let r = comm.all_reduce(&mut w, crate::ReduceOp::Sum).await;
                                (comm, r.map(|()| w[0]))
                            })
                            .unwrap();
                        (v[0], w)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![(3.0, 20.0), (3.0, 20.0)]);
        for c in &comms {
            c.close();
            assert!(matches!(
                c.run(async |comm| comm.barrier().await),
                Err(Refused::Closed)
            ));
            assert!(matches!(
                c.run_task(|mut comm| async move {
                    let r = comm.barrier().await;
                    (comm, r)
                }),
                Err(Refused::Closed)
            ));
            assert_eq!(
                (c.rank(), c.size()),
                (comms.iter().position(|x| std::ptr::eq(x, c)).unwrap(), 2)
            );
        }
    }

    /// An abort from another thread ends a call waiting for a peer that never comes, long
    /// before its deadline, and refuses every later call; run as a task too.
    #[test]
    fn an_abort_ends_a_call_in_progress_and_refuses_the_rest() {
        for as_task in [false, true] {
            let comms = pair();
            let alone = &comms[0];
            alone
                .with_comm(|c| {
                    c.set_config(crate::Config::with_step_timeout(Duration::from_secs(60)))
                })
                .unwrap();
            let started = std::time::Instant::now();
            let outcome = std::thread::scope(|s| {
                let call = s.spawn(|| {
                    if as_task {
                        alone
                            .run_task(|mut comm| async move {
                                let r = comm.barrier().await;
                                (comm, r)
                            })
                            .map(|_| ())
                    } else {
                        alone.run(async |comm| comm.barrier().await)
                    }
                });
                std::thread::sleep(Duration::from_millis(200));
                alone.abort();
                call.join().unwrap()
            });
            assert!(matches!(outcome, Err(Refused::Aborted)), "{outcome:?}");
            assert!(started.elapsed() < Duration::from_secs(10));
            assert!(alone.is_aborted());
            assert!(matches!(
                alone.run(async |comm| comm.barrier().await),
                Err(Refused::Aborted)
            ));
        }
    }
}
