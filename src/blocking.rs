//! A communicator for callers without an async runtime: the C ABI and the Python module are
//! thin shells over [`BlockingComm`], which owns the tokio runtime the transport's tasks run
//! on, runs each call to completion on it, aborts, and closes.
//!
//! A call runs in one of two ways: [`BlockingComm::run`] drives it on the calling thread (it
//! may borrow the caller's buffers), [`BlockingComm::run_task`] as a task that the calling
//! thread drives until it is done (the caller hands over what it needs; Python releases the
//! GIL meanwhile). Either way, one call at a time holds the communicator,
//! [`BlockingComm::abort`] from another thread ends a call in progress and every later one,
//! and a call that panicked closes the communicator (its numbering and mailboxes are
//! mid-round, so it cannot go on in step with the other ranks).
//!
//! The runtime is a current-thread one ([`Runtime`]): the thread that makes a call runs the
//! collective *and* the transport's reader and writer tasks, so no frame crosses a thread on
//! its way from the socket to the round. A thread of the runtime's own drives it while a
//! started call ([`BlockingComm::start`]) or a close in the background (after an abort, or of
//! a dropped communicator) runs and no call does. On tokio's multi-threaded
//! runtime every step of a small collective woke a worker thread for each frame and handed it
//! to the caller: a 4-byte `all_reduce` on 4 ranks took 113-176 us against 29 us on a
//! current-thread runtime (`docs/bench/PROFILE.md`, item 16).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use tokio::runtime::Handle;
use tokio::sync::Notify;

use crate::{Communicator, Error, Rank};

/// Device vectors the caller owns, lent to the communicator's device entry point (feature
/// `cuda`).
#[cfg(feature = "cuda")]
pub mod device;

/// A call's future, as [`BlockingComm::run_task`] and [`BlockingComm::start`] take it:
/// `|comm| Box::pin(async move { ... })`.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

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

/// The runtime of [`BlockingComm`]s: a current-thread tokio runtime that the thread making a
/// call drives while the call runs ([`Runtime::block_on`]), and a thread of its own, named
/// `byzcoll`, drives while it has work in the background ([`Runtime::background`]: a started
/// call, an all-gather join's connections) and no call drives it (see the module docs).
///
/// Between calls, with nothing in the background, nobody drives it: what peers send waits in
/// the sockets, and what a quorum step left queued for a straggler is written during the next
/// call. Handing the runtime over between threads at every call cost more than the call
/// itself on an oversubscribed machine (a 4-byte all-reduce from Python, 4 ranks on 2 cores:
/// 167 us against 79).
///
/// Dropping it stops its thread and then the runtime, which cancels the tasks still running
/// (started calls whose callbacks will not run, closes in the background) and waits for its
/// blocking threads, unless it is dropped inside a runtime's context (on one of its blocking
/// threads, say in a started call's callback), where it lets them finish on their own.
#[derive(Debug)]
pub struct Runtime {
    /// `None` only once dropped.
    tokio: Option<Arc<tokio::runtime::Runtime>>,
    control: Arc<Control>,
    driver: Option<std::thread::JoinHandle<()>>,
}

/// How the callers and the driving thread take turns at the runtime.
#[derive(Debug, Default)]
struct Control {
    /// Callers that drive the runtime now or wait to: the driving thread hands it over while
    /// there are any.
    wanted: AtomicUsize,
    /// Work in the background ([`Runtime::background`]): the driving thread drives the
    /// runtime while there is some and no caller wants it.
    background: AtomicUsize,
    stop: AtomicBool,
    /// Wakes the driving thread's future when it must hand the runtime over or stop.
    hand_over: Notify,
    /// Wakes the idle driving thread when it may have to drive again, or stop.
    idle: Mutex<()>,
    resume: Condvar,
}

impl Control {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Whether the driving thread should drive the runtime now.
    fn drives(&self) -> bool {
        self.background.load(Ordering::SeqCst) > 0 && self.wanted.load(Ordering::SeqCst) == 0
    }

    /// The driving thread: waits (off the runtime) until there is work in the background and
    /// no caller drives, drives the runtime until that changes, and again, until stopped.
    fn drive(&self, tokio: &tokio::runtime::Runtime) {
        loop {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            while !self.stopped() && !self.drives() {
                idle = self
                    .resume
                    .wait(idle)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            drop(idle);
            if self.stopped() {
                return;
            }
            tokio.block_on(async {
                loop {
                    let mut handed = pin!(self.hand_over.notified());
                    handed.as_mut().enable();
                    if self.stopped() || !self.drives() {
                        return;
                    }
                    handed.await;
                }
            });
        }
    }

    /// Wakes the driving thread wherever it is, to look again at what it should do.
    fn wake(&self) {
        self.hand_over.notify_one();
        let _idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        self.resume.notify_all();
    }
}

/// A caller's claim on the runtime ([`Runtime::block_on`]); dropping it, also by a panic,
/// lets the driving thread take the runtime back if there is work in the background.
struct Claim<'a>(&'a Control);

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let last = self.0.wanted.fetch_sub(1, Ordering::SeqCst) == 1;
        if last && self.0.background.load(Ordering::SeqCst) > 0 {
            self.0.wake();
        }
    }
}

/// Work in the background ([`Runtime::background`]); dropping it ends it.
#[derive(Debug)]
pub struct Background(Arc<Control>);

impl Background {
    fn new(control: Arc<Control>) -> Self {
        if control.background.fetch_add(1, Ordering::SeqCst) == 0 {
            control.wake();
        }
        Background(control)
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if self.0.background.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.wake();
        }
    }
}

impl Runtime {
    /// A runtime with its driving thread started.
    ///
    /// # Errors
    /// When the runtime or its thread cannot be started.
    pub fn new() -> std::io::Result<Self> {
        let tokio = Arc::new(
            tokio::runtime::Builder::new_current_thread()
                .thread_name("byzcoll")
                .enable_all()
                .build()?,
        );
        let control = Arc::new(Control::default());
        let driver = std::thread::Builder::new().name("byzcoll".into()).spawn({
            let (tokio, control) = (tokio.clone(), control.clone());
            move || control.drive(&tokio)
        })?;
        Ok(Runtime {
            tokio: Some(tokio),
            control,
            driver: Some(driver),
        })
    }

    /// Runs `future` to completion on the calling thread, which drives the runtime (its tasks
    /// included) meanwhile: it takes the runtime over from the driving thread or another
    /// caller as soon as they hand it over, and until then waits on `future` as a plain
    /// thread would.
    ///
    /// # Panics
    /// Inside an async context, as tokio's `block_on` does; and where `future` panics.
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.control.wanted.fetch_add(1, Ordering::SeqCst);
        let _claim = Claim(&self.control);
        if self.control.background.load(Ordering::SeqCst) > 0 {
            self.control.hand_over.notify_one();
        }
        self.tokio().block_on(future)
    }

    /// Work in the background until the returned value is dropped: meanwhile the runtime's
    /// own thread drives it whenever no call does, for tasks that no call awaits (a started
    /// call, the connections that `Handle::block_on` waits for while the caller's thread
    /// cannot drive the runtime).
    pub fn background(&self) -> Background {
        Background::new(self.control.clone())
    }

    /// [`crate::init_with_allgather`] on this runtime: its own thread drives the connections
    /// while the calling thread, which waits on them and runs `allgather`, cannot.
    ///
    /// # Errors
    /// As [`crate::init_with_allgather`].
    #[cfg(feature = "tcp")]
    pub fn init_with_allgather(
        &self,
        config: &crate::JobConfig,
        allgather: &mut crate::AllGather<'_>,
    ) -> crate::Result<Communicator> {
        let _background = self.background();
        crate::init_with_allgather(config, allgather, self.handle())
    }

    /// The runtime's handle (to spawn on it, or enter it).
    pub fn handle(&self) -> &Handle {
        self.tokio().handle()
    }

    fn tokio(&self) -> &tokio::runtime::Runtime {
        self.tokio
            .as_deref()
            .expect("the runtime is taken only when dropped")
    }

    /// What closes communicators in the background ([`Closer`]).
    fn closer(&self) -> Closer {
        Closer {
            handle: self.handle().clone(),
            control: self.control.clone(),
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.control.stop.store(true, Ordering::SeqCst);
        self.control.wake();
        if let Some(driver) = self.driver.take() {
            let _ = driver.join();
        }
        let Some(tokio) = self.tokio.take().and_then(|t| Arc::try_unwrap(t).ok()) else {
            return;
        };
        if Handle::try_current().is_ok() {
            // Inside a runtime's context: on one of this runtime's own blocking threads (a
            // started call's callback that dropped the last communicator), waiting for them
            // would wait for itself, and in an async context tokio refuses to wait at all.
            tokio.shutdown_background();
        }
    }
}

/// Closes communicators in the background ([`Communicator::close_at_once`]): the runtime's own thread
/// drives the close while no call does, so that a communicator dropped by an abort or with
/// its [`BlockingComm`] shuts its connections down (its peers then see this rank as missing
/// at once) and writes what its last calls left queued, for as long as the runtime lives.
#[derive(Debug, Clone)]
struct Closer {
    handle: Handle,
    control: Arc<Control>,
}

impl Closer {
    fn close(&self, comm: Communicator) {
        let background = Background::new(self.control.clone());
        self.handle.spawn(async move {
            comm.close_at_once().await;
            drop(background);
        });
    }
}

/// A [`Communicator`] with the runtime it runs on, for blocking callers (see the module docs).
#[derive(Debug)]
pub struct BlockingComm {
    /// Shared with the communicators made from this one (a shrink), whose transport's tasks
    /// run on it.
    runtime: Arc<Runtime>,
    shared: Arc<Shared>,
    rank: Rank,
    size: usize,
}

/// What a call's task shares with the [`BlockingComm`].
#[derive(Debug)]
struct Shared {
    /// The communicator while no call holds it; `None` once closed.
    comm: Mutex<Option<Communicator>>,
    /// Calls take turns in the order they were made: the next ticket to hand out, and the
    /// ticket whose turn it is.
    next: AtomicU64,
    serving: AtomicU64,
    turn: Notify,
    aborted: AtomicBool,
    abort: Notify,
    closer: Closer,
}

impl Shared {
    fn slot(&self) -> MutexGuard<'_, Option<Communicator>> {
        self.comm.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for `ticket`'s turn (or an abort), then takes the communicator; the returned
    /// turn gives it back and lets the next call go when dropped, also by a panic.
    async fn turn(&self, ticket: u64) -> Result<Turn<'_>, Refused> {
        loop {
            let mut next = pin!(self.turn.notified());
            next.as_mut().enable();
            if self.serving.load(Ordering::SeqCst) == ticket {
                break;
            }
            next.await;
        }
        let mut turn = Turn {
            shared: self,
            comm: None,
        };
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Refused::Aborted);
        }
        turn.comm = Some(self.slot().take().ok_or(Refused::Closed)?);
        Ok(turn)
    }

    /// Runs `op` on the communicator in `ticket`'s turn, unless it is or gets aborted.
    async fn call<T>(
        &self,
        ticket: u64,
        op: impl AsyncFnOnce(&mut Communicator) -> crate::Result<T>,
    ) -> Result<T, Refused> {
        let mut turn = self.turn(ticket).await?;
        let comm = turn.comm.as_mut().expect("a turn holds the communicator");
        let mut aborted = pin!(self.abort.notified());
        aborted.as_mut().enable();
        if self.aborted.load(Ordering::SeqCst) {
            return Err(Refused::Aborted);
        }
        tokio::select! {
            r = op(comm) => r.map_err(Refused::Failed),
            () = aborted => {
                // Ended mid-call: out of step with the other ranks, so it closes.
                if let Some(comm) = turn.comm.take() {
                    self.closer.close(comm);
                }
                Err(Refused::Aborted)
            }
        }
    }
}

/// A call's hold on the communicator: dropping it puts the communicator back (unless the call
/// lost it) and hands the turn to the next call.
struct Turn<'a> {
    shared: &'a Shared,
    comm: Option<Communicator>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(comm) = self.comm.take() {
            // A call that panicked or was aborted leaves the communicator mid-round: it closes.
            if std::thread::panicking() || self.shared.aborted.load(Ordering::SeqCst) {
                self.shared.closer.close(comm);
            } else {
                *self.shared.slot() = Some(comm);
            }
        }
        self.shared.serving.fetch_add(1, Ordering::SeqCst);
        self.shared.turn.notify_waiters();
    }
}

impl BlockingComm {
    /// `comm`, whose transport was set up on `runtime`.
    pub fn new(runtime: Arc<Runtime>, comm: Communicator) -> Self {
        BlockingComm {
            rank: comm.rank(),
            size: comm.size(),
            shared: Arc::new(Shared {
                comm: Mutex::new(Some(comm)),
                next: AtomicU64::new(0),
                serving: AtomicU64::new(0),
                turn: Notify::new(),
                aborted: AtomicBool::new(false),
                abort: Notify::new(),
                closer: runtime.closer(),
            }),
            runtime,
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

    /// A place in the order of calls, taken when the call is made.
    fn ticket(&self) -> u64 {
        self.shared.next.fetch_add(1, Ordering::SeqCst)
    }

    /// Runs `op` on the communicator on the calling thread, after the calls made before it,
    /// unless it is or gets aborted.
    ///
    /// # Errors
    /// [`Refused::Failed`] with the call's error; [`Refused::Closed`], [`Refused::Aborted`].
    pub fn run<T>(
        &self,
        op: impl AsyncFnOnce(&mut Communicator) -> crate::Result<T>,
    ) -> Result<T, Refused> {
        let ticket = self.ticket();
        let shared = &self.shared;
        match catch_unwind(AssertUnwindSafe(|| {
            self.runtime.block_on(shared.call(ticket, op))
        })) {
            Ok(result) => result,
            Err(panic) => Err(Refused::Panicked(panic_message(&*panic))),
        }
    }

    /// Runs a call as a task, after the calls made before it, and drives the runtime on the
    /// calling thread until it is done.
    ///
    /// # Errors
    /// As [`BlockingComm::run`]; [`Refused::Panicked`] for a call that panicked, which closes
    /// the communicator.
    pub fn run_task<T, F>(&self, op: F) -> Result<T, Refused>
    where
        T: Send + 'static,
        F: for<'a> FnOnce(&'a mut Communicator) -> BoxFuture<'a, crate::Result<T>> + Send + 'static,
    {
        // Spawned once this thread has claimed the runtime, so that the task usually runs on
        // it (unless the runtime's own thread, driving a started call, starts it before it
        // hands the runtime over).
        self.runtime.block_on(async { self.spawn_call(op).await })
    }

    /// Starts a call as a task, after the calls made before it, and returns at once (the
    /// runtime's own thread drives it while no call does); `done` gets its outcome on a
    /// thread of the runtime's blocking pool (where it may wait, say for an interpreter's
    /// lock, without holding up the transport).
    pub fn start<T, F>(&self, op: F, done: impl FnOnce(Result<T, Refused>) + Send + 'static)
    where
        T: Send + 'static,
        F: for<'a> FnOnce(&'a mut Communicator) -> BoxFuture<'a, crate::Result<T>> + Send + 'static,
    {
        let background = self.runtime.background();
        let call = self.spawn_call(op);
        let handle = self.runtime.handle().clone();
        self.runtime.handle().spawn(async move {
            let result = call.await;
            // Not awaited: nothing may need to drive the runtime once the call is done.
            drop(handle.spawn_blocking(move || done(result)));
            drop(background);
        });
    }

    /// Spawns `op` as a task that runs in its turn (its ticket taken now); the future is its
    /// outcome, a panic included.
    fn spawn_call<T, F>(&self, op: F) -> impl std::future::Future<Output = Result<T, Refused>>
    where
        T: Send + 'static,
        F: for<'a> FnOnce(&'a mut Communicator) -> BoxFuture<'a, crate::Result<T>> + Send + 'static,
    {
        let ticket = self.ticket();
        let shared = self.shared.clone();
        let call = self
            .runtime
            .handle()
            .spawn(async move { shared.call(ticket, async move |c| op(c).await).await });
        async move {
            match call.await {
                Ok(result) => result,
                Err(e) => Err(Refused::Panicked(e.to_string())),
            }
        }
    }

    /// `op` on the communicator (no collective: a setting, its health), after the calls made
    /// before it.
    ///
    /// # Errors
    /// [`Refused::Closed`] when it is closed, [`Refused::Aborted`].
    pub fn with_comm<T>(&self, op: impl FnOnce(&mut Communicator) -> T) -> Result<T, Refused> {
        let ticket = self.ticket();
        let shared = &self.shared;
        self.runtime.block_on(async {
            let mut turn = shared.turn(ticket).await?;
            Ok(op(turn
                .comm
                .as_mut()
                .expect("a turn holds the communicator")))
        })
    }

    /// Closes the communicator after the calls made before it, collectively
    /// ([`Communicator::close`]; bounded): where its calls ran quorum steps, first waits for
    /// the others to reach their close, then lets the transport finish what the last calls
    /// left in flight. Later calls are [`Refused::Closed`]. Dropping it instead closes at
    /// once, in the background ([`Communicator::close_at_once`]).
    pub fn close(&self) {
        let ticket = self.ticket();
        let shared = &self.shared;
        self.runtime.block_on(async {
            if let Ok(mut turn) = shared.turn(ticket).await {
                if let Some(comm) = turn.comm.take() {
                    comm.close().await;
                }
            }
        });
    }

    /// Aborts: a call in progress on another thread returns [`Refused::Aborted`], the
    /// connections are shut down at once in the background (peers see this rank as missing),
    /// and every later call, and every call waiting its turn, is refused the same way.
    pub fn abort(&self) {
        self.shared.aborted.store(true, Ordering::SeqCst);
        self.shared.abort.notify_waiters();
        let comm = self.shared.slot().take();
        if let Some(comm) = comm {
            self.shared.closer.close(comm);
        }
    }

    /// Whether [`BlockingComm::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.shared.aborted.load(Ordering::SeqCst)
    }
}

impl Drop for BlockingComm {
    /// A communicator not closed yet closes in the background ([`Communicator::close`], driven
    /// by the runtime's own thread) for as long as its runtime lives: dropping the last
    /// communicator of a runtime drops the runtime too, which cuts what is left.
    fn drop(&mut self) {
        let comm = self.shared.slot().take();
        if let Some(comm) = comm {
            self.shared.closer.close(comm);
        }
    }
}

/// What a panic said, where it said something.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transports::local::LocalTransport;
    use crate::ReduceOp;
    use std::time::Duration;

    /// Two ranks of an in-process job, each a blocking communicator on its own runtime.
    fn pair() -> Vec<BlockingComm> {
        LocalTransport::world(2)
            .into_iter()
            .map(|t| {
                let rt = Arc::new(Runtime::new().unwrap());
                let c = Communicator::new(Box::new(t), crate::Config::default());
                BlockingComm::new(rt, c)
            })
            .collect()
    }

    /// A sum of `x` over the ranks, as a task.
    fn sum(
        x: f32,
    ) -> impl for<'a> FnOnce(&'a mut Communicator) -> BoxFuture<'a, crate::Result<f32>> {
        move |comm| {
            Box::pin(async move {
                let mut v = [x];
                comm.all_reduce(&mut v, ReduceOp::Sum).await?;
                Ok(v[0])
            })
        }
    }

    /// `rank` run on every communicator, each on a thread of its own; their results in rank
    /// order.
    fn on_each<T: Send>(
        comms: &[BlockingComm],
        rank: impl Fn(&BlockingComm) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|s| {
            let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| rank(c))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Calls run in the order they are made, whichever way: three started (returning at once)
    /// then one on the caller's thread and one as a task; every rank's k-th call meets the
    /// other's. A closed communicator refuses calls and keeps its rank and size.
    #[test]
    fn calls_run_in_the_order_they_are_made_and_a_closed_communicator_refuses_them() {
        let comms = pair();
        let results = on_each(&comms, |c| {
            let (tx, rx) = std::sync::mpsc::channel();
            for k in 0..3 {
                let tx = tx.clone();
                let x = (10 * k + c.rank()) as f32;
                c.start(sum(x), move |r| tx.send((k, r.unwrap())).unwrap());
            }
            let mut v = [100.0 + c.rank() as f32];
            c.run(async |comm| comm.all_reduce(&mut v, ReduceOp::Sum).await)
                .unwrap();
            let last = c.run_task(sum(1000.0)).unwrap();
            let mut started: Vec<_> = rx.iter().take(3).collect();
            started.sort_by_key(|&(k, _)| k);
            (started, v[0], last)
        });
        for (started, v, last) in &results {
            assert_eq!(started, &vec![(0, 1.0), (1, 21.0), (2, 41.0)]);
            assert_eq!((*v, *last), (201.0, 2000.0));
        }
        for (me, c) in comms.iter().enumerate() {
            c.close();
            assert!(matches!(
                c.run(async |comm| comm.barrier().await),
                Err(Refused::Closed)
            ));
            assert!(matches!(c.run_task(sum(1.0)), Err(Refused::Closed)));
            assert_eq!((c.rank(), c.size()), (me, 2));
        }
    }

    /// A started call completes with no other call to drive the runtime: its own thread
    /// does, on every rank; and a call made meanwhile takes the runtime over and runs after it.
    #[test]
    fn started_calls_complete_on_the_runtime_s_own_thread() {
        let comms = pair();
        let results = on_each(&comms, |c| {
            let (tx, rx) = std::sync::mpsc::channel();
            let x = 1.0 + c.rank() as f32;
            c.start(sum(x), move |r| tx.send(r.unwrap()).unwrap());
            let started = rx.recv_timeout(Duration::from_secs(30)).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            c.start(sum(10.0 * x), move |r| tx.send(r.unwrap()).unwrap());
            let after = c.run_task(sum(100.0 * x)).unwrap();
            let second = rx.recv_timeout(Duration::from_secs(30)).unwrap();
            (started, second, after)
        });
        for r in &results {
            assert_eq!(*r, (3.0, 30.0, 300.0));
        }
    }

    /// A started call's callback may drop the last communicator of its runtime: the runtime
    /// then shuts down without waiting for the blocking thread the callback runs on.
    #[test]
    fn a_callback_may_drop_the_last_communicator() {
        let slots: Vec<_> = pair()
            .into_iter()
            .map(|c| Arc::new(Mutex::new(Some(c))))
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        for slot in &slots {
            let (mine, tx) = (slot.clone(), tx.clone());
            let guard = slot.lock().unwrap();
            let comm = guard.as_ref().unwrap();
            comm.start(sum(1.0), move |r| {
                let last = mine.lock().unwrap().take();
                drop(last);
                tx.send(r.unwrap()).unwrap();
            });
        }
        for _ in 0..2 {
            assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap(), 2.0);
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
                        alone.run_task(sum(1.0)).map(|_| ())
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
