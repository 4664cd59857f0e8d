//! Non-blocking collectives: [`Communicator::into_handle`] moves a communicator to a task of
//! its own, which runs the collectives started through the [`CommHandle`] one after another,
//! in the order they were started (the order every rank must agree on, as for the blocking
//! calls); each start returns a [`Pending`] future of its result. Starting waits only while
//! [`QUEUED`] collectives are already waiting their turn (backpressure, not an error).
//!
//! The caller can start several collectives (one per gradient bucket, say), go on computing,
//! and await the results later. Collectives of one communicator never overlap each other (the
//! transport runs one collective at a time); communicators made by [`Communicator::split`] have
//! handles of their own.
//!
//! # Cancel safety
//! Dropping a [`Pending`] does not cancel its collective: the other ranks expect this one to
//! take part, so it runs in its turn and its result is dropped. Dropping the [`CommHandle`]
//! lets the task finish every collective already started, then drops the communicator;
//! [`CommHandle::finish`] waits for that and gives the communicator back.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use byzcoll_aggregators::{Aggregator, Element};
use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::{Communicator, Error, Policy, Rank, ReduceOp, Result, RoundReport};

/// Collectives started and not yet running, beyond which starting another waits.
pub const QUEUED: usize = 256;

/// A collective queued on the communicator's task.
type Job = Box<dyn for<'a> FnOnce(&'a mut Communicator) -> BoxFuture<'a, ()> + Send>;

/// A communicator running on a task of its own ([`Communicator::into_handle`]): each call
/// queues a collective and returns a [`Pending`] future of its result. The collectives run
/// one after another in the order they were started, which every rank must agree on.
///
/// # Cancel safety
/// Dropping a [`Pending`] does not cancel its collective: the other ranks expect this one, so
/// it runs in its turn and its result is dropped. Dropping the handle lets the task finish
/// every collective already started, then drops the communicator;
/// [`CommHandle::finish`] waits for that and gives the communicator back.
#[derive(Debug)]
pub struct CommHandle {
    jobs: mpsc::Sender<Job>,
    task: JoinHandle<Communicator>,
    rank: Rank,
    size: usize,
}

/// The result of a collective started through a [`CommHandle`], once it has run.
///
/// Awaiting it yields the collective's own result, or [`Error::Background`] when the
/// communicator's task ended first (a panic in it).
#[derive(Debug)]
#[must_use = "the collective runs whether or not its result is awaited"]
pub struct Pending<R> {
    rx: oneshot::Receiver<R>,
}

impl<R> Future for Pending<R> {
    type Output = Result<R>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.rx).poll(cx).map(|r| {
            r.map_err(|_| {
                Error::Background("the communicator's task ended before this collective".into())
            })
        })
    }
}

impl Communicator {
    /// Moves the communicator to a task of its own (spawned on the current tokio runtime) that
    /// runs the collectives started through the returned handle in their order.
    ///
    /// # Panics
    /// Outside a tokio runtime, like `tokio::spawn`.
    pub fn into_handle(mut self) -> CommHandle {
        let (rank, size) = (self.rank(), self.size());
        let (jobs, mut queue) = mpsc::channel::<Job>(QUEUED);
        let task = tokio::spawn(async move {
            while let Some(job) = queue.recv().await {
                job(&mut self).await;
            }
            self
        });
        CommHandle {
            jobs,
            task,
            rank,
            size,
        }
    }
}

impl CommHandle {
    /// This process's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Starts `op` on the communicator after every collective started before it; any
    /// collective (or several, which then run back to back) can be started this way.
    pub async fn start<R, F>(&self, op: F) -> Pending<R>
    where
        R: Send + 'static,
        F: for<'a> FnOnce(&'a mut Communicator) -> BoxFuture<'a, R> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |comm| {
            Box::pin(async move {
                // The receiver may be gone (the caller dropped the `Pending`): the collective
                // ran all the same.
                let _ = tx.send(op(comm).await);
            })
        });
        // A closed queue means the task ended; the dropped sender then fails the `Pending`.
        let _ = self.jobs.send(job).await;
        Pending { rx }
    }

    /// [`Communicator::robust_all_reduce`] on an owned buffer, given back with the report.
    pub async fn robust_all_reduce<T: Element>(
        &self,
        mut buf: Vec<T>,
        rule: Arc<dyn Aggregator>,
        policy: Policy,
    ) -> Pending<Result<(Vec<T>, RoundReport)>> {
        self.start(move |comm| {
            Box::pin(async move {
                let report = comm
                    .robust_all_reduce(&mut buf, rule.as_ref(), policy)
                    .await?;
                Ok((buf, report))
            })
        })
        .await
    }

    /// [`Communicator::all_reduce`] on an owned buffer, given back.
    pub async fn all_reduce<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
    ) -> Pending<Result<Vec<T>>> {
        self.start(move |comm| {
            Box::pin(async move {
                comm.all_reduce(&mut buf, op).await?;
                Ok(buf)
            })
        })
        .await
    }

    /// [`Communicator::barrier`].
    pub async fn barrier(&self) -> Pending<Result<()>> {
        self.start(|comm| Box::pin(comm.barrier())).await
    }

    /// Waits for every collective started so far and gives the communicator back.
    ///
    /// # Errors
    /// [`Error::Background`] when the communicator's task panicked.
    pub async fn finish(self) -> Result<Communicator> {
        drop(self.jobs);
        self.task
            .await
            .map_err(|e| Error::Background(format!("the communicator's task failed: {e}")))
    }
}
