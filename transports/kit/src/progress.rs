//! What transports whose network moves in turns of an engine (UCX, libfabric) share: the step
//! run through the engine's command queue, the send credit, [`Progress`] (the engine behind a
//! mutex, a progress thread, and the task that awaits an exchange driving it itself), and the
//! thread's blocking wait.
//!
//! # Who runs the turns
//! - **The task awaiting an exchange** drives the engine ([`driven`]): it runs turns, yielding
//!   between them, until its step completes or nothing has happened for [`SPIN`]. A
//!   completion then reaches the waiting task on its own thread, with no wakeup from another
//!   thread in between, and the next receive is posted as soon as the task has taken the last
//!   one. Measured with the p2p bench over UCX shared memory: 8-byte one-way latency 2.4-4.5
//!   µs, from 4.5-37 µs when the thread handed every completion over.
//! - **The progress thread** does the rest: between exchanges (credited sends still moving,
//!   messages arriving early) and when the driving task stops. It runs turns while there is
//!   work, keeps polling (yielding the CPU between polls) for [`SPIN`] after the last
//!   activity, then sleeps as the engine says ([`Idle`]): in `poll` on the network's
//!   descriptors until it has events or a transport method signals it (only when the thread
//!   is asleep), or in short, growing naps. While a task drives, the thread parks (or stays
//!   blocked, if it already was); the drive's end wakes it only when the engine has work in
//!   flight or commands are waiting, otherwise the next exchange drives
//!   again (waking it after every step, or letting it check every 200 µs, cost a context
//!   switch on the 2-core machine each time: 8-byte latency doubled, 1-4 MiB over UCX TCP
//!   about 15 % slower). A drive that spins out while its step still waits
//!   ([`Drive::hand_over`]) always wakes it: what the step waits for now moves only with the
//!   thread's turns (left to [`DRIVE_LAPSE`], such steps stalled by up to 10 ms: a 256 KiB
//!   all-reduce of 4 ranks over UCX TCP took 21 ms instead of 1 in 5 runs of 9). After
//!   [`DRIVE_LAPSE`] without a turn it takes over anyway.
//!
//! Yielding matters on few cores: a thread that spun without yielding took the CPU from the
//! tokio threads and the peer's progress thread (yielding halved the 8-byte latency over
//! shared memory), and a tokio task that spun while the thread also spun made both slower.

use std::future::Future;
use std::io;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::Poll;
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use crate::mailbox::{run_step, Mailbox};
use byzcoll_runtime::{MsgKey, Rank, RecvOutcome, Step, TransportError};

/// The completion of one send, answered by the progress thread.
pub type SendDone = oneshot::Sender<Result<(), String>>;

/// One send queued for an engine by [`run_step_on_engine`]; `done` reports when its step may
/// count it sent (see [`SEND_CREDIT`]).
pub struct SendCommand {
    /// The receiving rank.
    pub peer: Rank,
    /// The message's key.
    pub key: MsgKey,
    /// The fingerprint of its collective call ([`byzcoll_runtime::Step::call`]).
    pub call: u64,
    /// The message.
    pub payload: Bytes,
    /// Answered by the engine.
    pub done: SendDone,
}

impl std::fmt::Debug for SendCommand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendCommand")
            .field("peer", &self.peer)
            .field("key", &self.key)
            .field("len", &self.payload.len())
            .finish()
    }
}

/// Bytes per peer that a transport whose progress thread owns the network (UCX, libfabric)
/// may still have in flight after reporting their sends done. A send is reported done to its
/// step once the thread holds it (the payload is reference-counted, nothing is copied) and it
/// fits in this credit, or nothing else to that peer is in flight; so a sender streams its next
/// message while the network still moves the previous one, and a receiver that stops taking
/// messages holds back at most this much of the sender's memory before its sends wait again.
pub const SEND_CREDIT: usize = 64 << 20;

/// The least a peer's send budget can be: bytes of sends in flight to one peer, done or not,
/// past which a transport whose network keeps every send until the receiver takes it (UCX's
/// and libfabric's rendezvous, a full socket under them) starts no more to that peer. A quorum
/// step goes on without its sends to a straggler, so a peer that stops reading (stalled, or
/// Byzantine) would otherwise make every other rank hold each round's messages to it for as
/// long as the job runs. A peer's budget is three of the largest message sent to it, at least
/// this (`tagged::Core::budget`), so that a round's small messages always fit beside its
/// vector in flight; a send past it fails at once (the receiver, if it ever catches up, finds
/// that message missing at its deadline), and a message larger than the budget still goes,
/// alone.
pub const SEND_BUDGET: usize = 2 * SEND_CREDIT;

/// Bytes of sends reported done while still in flight, per peer, against [`SEND_CREDIT`].
#[derive(Debug)]
pub struct SendCredit {
    in_flight: Vec<usize>,
}

impl SendCredit {
    /// No bytes in flight to any of `size` peers.
    pub fn new(size: usize) -> Self {
        SendCredit {
            in_flight: vec![0; size],
        }
    }

    /// Takes credit for `len` bytes to `peer` if they fit, or if nothing to `peer` is in flight
    /// (so a message larger than the credit still goes, alone).
    pub fn try_take(&mut self, peer: Rank, len: usize) -> bool {
        let in_flight = &mut self.in_flight[peer];
        if *in_flight != 0 && *in_flight + len > SEND_CREDIT {
            return false;
        }
        *in_flight += len;
        true
    }

    /// Gives back the credit of a send to `peer` that the network is done with.
    pub fn give_back(&mut self, peer: Rank, len: usize) {
        self.in_flight[peer] -= len;
    }
}

/// [`byzcoll_runtime::Transport::exchange`] (after [`Step::validate`]) for a transport whose network
/// moves in turns of `progress`'s engine: posts the step's receives on `mailbox`, queues each
/// send on `commands` as a [`SendCommand`] and awaits the engine's answers
/// (see [`run_step`] for deadlines and failures), driving the engine from this task meanwhile
/// ([`driven`], for [`SPIN`] without activity).
///
/// # Errors
/// [`TransportError::Setup`] when the transport is shut down (`commands` is `None`).
pub async fn run_step_on_engine<E: Engine>(
    progress: &Progress<E>,
    mailbox: &Mailbox,
    step: &Step,
    transport: &'static str,
    commands: Option<&mpsc::Sender<SendCommand>>,
) -> Result<Vec<RecvOutcome>, TransportError> {
    let commands = commands
        .ok_or_else(|| TransportError::Setup(format!("the {transport} transport is shut down")))?;
    let wake = || progress.wake();
    let run = run_step(mailbox, step, transport, wake, |s, key, call, payload| {
        const GONE: &str = "the progress thread is gone";
        let peer = s.peer;
        async move {
            let (done, finished) = oneshot::channel();
            let command = SendCommand {
                peer,
                key,
                call,
                payload,
                done,
            };
            commands.send(command).await.map_err(|_| GONE.to_string())?;
            wake();
            finished.await.map_err(|_| GONE.to_string())?
        }
    });
    Ok(driven(progress, SPIN, run).await)
}

/// A network whose progress a task may drive itself, in turns, while it awaits an exchange
/// (see [`driven`]); its progress thread stays out of the way meanwhile.
pub trait Drive {
    /// A task drives the network from now on: the progress thread steps aside (it takes over
    /// again after [`Drive::end`], or if no turn comes for a while).
    fn begin(&self);
    /// Runs one round of progress unless another thread is running one; whether anything
    /// happened. Must not block.
    fn turn(&self) -> bool;
    /// The task stops driving; the progress thread takes over (see [`Progress`]'s for when it
    /// is woken for that).
    fn end(&self);
    /// The task stops driving while it still waits for the network (its drive spun out): the
    /// progress thread takes over at once, since what the task waits for moves only with
    /// progress.
    fn hand_over(&self);
}

/// Awaits `fut` while driving `network` in turns from this task, until `fut` completes or
/// `spin` passes without anything happening; then the network's progress thread takes over
/// and `fut` is awaited as usual.
///
/// Why: with a progress thread alone, every completion is handed from that thread to the
/// waiting task through a wakeup, and the next receive cannot be posted until the task has
/// run. Driving the network from the waiting task completes the step on the task's own thread
/// (measured on the p2p bench: see the UCX transport's module docs). Between turns the task
/// yields, to tokio (other tasks on the thread run) and to the OS (on few cores the peer's
/// threads need the CPU); after `spin` of nothing it stops burning the core.
pub async fn driven<F: Future>(network: &impl Drive, spin: Duration, fut: F) -> F::Output {
    /// Ends the drive when the future is dropped midway.
    struct Driving<'a, D: Drive> {
        network: &'a D,
        active: bool,
    }
    impl<D: Drive> Driving<'_, D> {
        fn stop(&mut self) {
            if std::mem::take(&mut self.active) {
                self.network.end();
            }
        }
        fn hand_over(&mut self) {
            if std::mem::take(&mut self.active) {
                self.network.hand_over();
            }
        }
    }
    impl<D: Drive> Drop for Driving<'_, D> {
        fn drop(&mut self) {
            self.stop();
        }
    }

    network.begin();
    let mut driving = Driving {
        network,
        active: true,
    };
    let mut fut = pin!(fut);
    let mut last_activity = Instant::now();
    let out = std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = fut.as_mut().poll(cx) {
            return Poll::Ready(out);
        }
        if !driving.active {
            return Poll::Pending;
        }
        if network.turn() {
            last_activity = Instant::now();
            if let Poll::Ready(out) = fut.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
        } else if last_activity.elapsed() >= spin {
            driving.hand_over();
            // Whatever completes from now on wakes this task through `fut`'s own wakers.
            return fut.as_mut().poll(cx);
        } else {
            std::thread::yield_now();
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;
    driving.stop();
    out
}

/// Awaits `fut`, polling it eagerly for up to `spin`: between polls the task yields to tokio
/// (which polls the I/O driver before running it again when this worker holds the driver, so
/// a reader task whose socket became readable usually runs without a thread wakeup) and to the
/// OS (on few cores the peer needs the CPU). After `spin` it awaits `fut` as usual, woken by
/// its own wakers. For transports whose completions come from other tasks (TCP's reader
/// tasks): a waiting task asleep in the executor costs a thread wakeup per message, which on
/// the 2-core development machine is most of the TCP latency (measured there with the p2p
/// bench: 8-byte one-way latency 18-22 µs with a 500 µs spin, 46-53 µs without).
pub async fn spin_on<F: Future>(spin: Duration, fut: F) -> F::Output {
    let mut fut = pin!(fut);
    let start = Instant::now();
    loop {
        if let Poll::Ready(out) =
            std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await
        {
            return out;
        }
        if start.elapsed() >= spin {
            return fut.await;
        }
        thread::yield_now();
        tokio::task::yield_now().await;
    }
}

/// How long the progress thread keeps polling after the last activity before it sleeps, and
/// how long a driving task goes on without anything happening before it hands the engine
/// back and sleeps.
pub const SPIN: Duration = Duration::from_micros(500);
/// How long after a driving task's last turn the progress thread takes over anyway: the drive
/// ended without waking it and new work arrived, or the task is not being polled.
pub const DRIVE_LAPSE: Duration = Duration::from_millis(10);
/// Longest nap of an idle progress thread that has nothing to block on ([`Idle::Nap`]).
pub const MAX_NAP: Duration = Duration::from_micros(500);

/// A transport's network engine, moved forward in turns by [`Progress`]; every method runs
/// with the engine's lock held, on the progress thread or a driving task's thread.
pub trait Engine: Send + 'static {
    /// What [`Engine::shutdown`] hands back.
    type Remains: Send + 'static;
    /// One round of work (network progress, queued commands, completions): `Some(true)` if
    /// anything happened, `None` once the transport is gone (its command queue closed; the
    /// thread then shuts the engine down, as after [`Progress::finish`]).
    fn turn(&mut self) -> Option<bool>;
    /// Whether the network holds work of this engine that moves only with progress (sends or
    /// receives in flight).
    fn in_flight(&self) -> bool;
    /// How the idle progress thread may sleep now.
    fn idle(&mut self) -> Idle;
    /// Cancels and drains everything (within a bounded time) and releases the network.
    fn shutdown(self) -> Self::Remains;
}

/// How an idle progress thread sleeps ([`Engine::idle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Idle {
    /// In `poll` on these descriptors, at most `timeout_ms`; [`Signal::signal`] makes one of
    /// them readable.
    Block {
        /// Descriptors to wait on.
        fds: Vec<i32>,
        /// Longest wait.
        timeout_ms: i32,
    },
    /// Nothing to block on now: a short nap, doubling up to [`MAX_NAP`] while idle; transport
    /// methods cut it short.
    Nap,
    /// Work is ready: go round again.
    Busy,
}

/// Wakes a progress thread blocked in [`Idle::Block`], from any thread.
pub trait Signal: Send + Sync + 'static {
    /// Makes one of the descriptors the thread blocks on readable.
    fn signal(&self);
    /// Called by the thread after it woke.
    fn drain(&self) {}
}

/// How transport methods and driving tasks reach the progress thread.
struct Wake {
    /// New commands are queued.
    pending: AtomicBool,
    /// The thread is going to block in `poll` (so a signal is needed).
    sleeping: AtomicBool,
    signal: Box<dyn Signal>,
    thread: OnceLock<Thread>,
    /// Microseconds since `epoch` of the last turn of a driving task; 0 when none drives.
    driven_at: AtomicU64,
    /// After the last turn, the engine had work in flight.
    in_flight: AtomicBool,
    /// The transport is going: the thread shuts the engine down.
    stop: AtomicBool,
    epoch: Instant,
}

impl Wake {
    fn now_us(&self) -> u64 {
        // At least 1: 0 means nobody drives.
        (self.epoch.elapsed().as_micros() as u64).max(1)
    }

    /// How much longer the thread should stay parked for a driving task; `None` when no task
    /// drives, or the last one has not turned for [`DRIVE_LAPSE`].
    fn drive_left(&self) -> Option<Duration> {
        let at = self.driven_at.load(Ordering::SeqCst);
        if at == 0 {
            return None;
        }
        let since = Duration::from_micros(self.now_us().saturating_sub(at));
        DRIVE_LAPSE.checked_sub(since).filter(|d| !d.is_zero())
    }

    fn wake_thread(&self) {
        if self.sleeping.swap(false, Ordering::SeqCst) {
            self.signal.signal();
        }
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

struct Shared<E> {
    engine: Mutex<Option<E>>,
    wake: Wake,
}

impl<E: Engine> Shared<E> {
    fn lock(&self) -> MutexGuard<'_, Option<E>> {
        // A turn that panicked leaves every buffer still owned by the engine; going on is
        // safe, so poisoning is ignored.
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One turn of `engine`, keeping the flags the thread and the drives go by.
    fn turn(&self, engine: &mut E) -> Option<bool> {
        self.wake.pending.store(false, Ordering::SeqCst);
        let busy = engine.turn();
        self.wake
            .in_flight
            .store(engine.in_flight(), Ordering::SeqCst);
        busy
    }
}

/// An [`Engine`] behind a mutex, moved forward by its own progress thread and by the tasks
/// that await exchanges (see the module docs). Dropping it is [`Progress::finish`].
pub struct Progress<E: Engine> {
    shared: Arc<Shared<E>>,
    thread: Option<JoinHandle<Option<E::Remains>>>,
}

impl<E: Engine> std::fmt::Debug for Progress<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field(
                "thread",
                &self.shared.wake.thread.get().and_then(Thread::name),
            )
            .finish_non_exhaustive()
    }
}

impl<E: Engine> Progress<E> {
    /// Starts the thread `name` for `engine`; `signal` wakes it from [`Idle::Block`].
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn start(name: String, engine: E, signal: impl Signal) -> io::Result<Self> {
        let shared = Arc::new(Shared {
            engine: Mutex::new(Some(engine)),
            wake: Wake {
                pending: AtomicBool::new(false),
                sleeping: AtomicBool::new(false),
                signal: Box::new(signal),
                thread: OnceLock::new(),
                driven_at: AtomicU64::new(0),
                in_flight: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                epoch: Instant::now(),
            },
        });
        let for_thread = shared.clone();
        let thread = thread::Builder::new()
            .name(name)
            .spawn(move || progress_thread(&for_thread))?;
        let _ = shared.wake.thread.set(thread.thread().clone());
        Ok(Progress {
            shared,
            thread: Some(thread),
        })
    }

    /// Tells the thread that commands are queued. While a task drives, its turns take them, and
    /// the drive's end wakes the thread if none did.
    pub fn wake(&self) {
        let wake = &self.shared.wake;
        wake.pending.store(true, Ordering::SeqCst);
        if wake.drive_left().is_none() {
            wake.wake_thread();
        }
    }

    /// Stops the thread, which shuts the engine down (within the engine's own bounds), and
    /// returns what the shutdown left; `None` if it was already taken or the thread panicked.
    pub fn finish(&mut self) -> Option<E::Remains> {
        let thread = self.thread.take()?;
        let wake = &self.shared.wake;
        wake.stop.store(true, Ordering::SeqCst);
        wake.driven_at.store(0, Ordering::SeqCst);
        // `pending` keeps a thread that is about to block from sleeping through the stop.
        wake.pending.store(true, Ordering::SeqCst);
        wake.wake_thread();
        thread.join().ok().flatten()
    }
}

impl<E: Engine> Drop for Progress<E> {
    fn drop(&mut self) {
        drop(self.finish());
    }
}

impl<E: Engine> Drive for Progress<E> {
    fn begin(&self) {
        let wake = &self.shared.wake;
        wake.driven_at.store(wake.now_us(), Ordering::SeqCst);
    }

    fn turn(&self) -> bool {
        self.begin();
        // Never wait for the lock on a tokio thread: the progress thread holds it only for a
        // turn, and then this task simply tries again. (A turn that panicked poisoned it;
        // going on is safe, as in `Shared::lock`.)
        let mut guard = match self.shared.engine.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        guard
            .as_mut()
            .is_some_and(|engine| self.shared.turn(engine) == Some(true))
    }

    fn end(&self) {
        let wake = &self.shared.wake;
        wake.driven_at.store(0, Ordering::SeqCst);
        // `pending`: commands that another exchange queued while this one drove (its `wake`
        // left them to this drive's turns), which no turn may have taken yet. `wake` stores
        // `pending` before it reads `driven_at`, and this stores `driven_at` before it reads
        // `pending`, so one of the two always wakes the thread.
        if wake.in_flight.load(Ordering::SeqCst) || wake.pending.load(Ordering::SeqCst) {
            wake.wake_thread();
        }
    }

    fn hand_over(&self) {
        let wake = &self.shared.wake;
        wake.driven_at.store(0, Ordering::SeqCst);
        // Unconditionally: the task waits for receives that only the thread's turns (or its
        // wait on the network's descriptors) will now see arrive. Left parked until
        // `DRIVE_LAPSE`, it stalled each such wait by up to 10 ms (UCX over TCP, 4 ranks on
        // 2 cores: a 256 KiB all-reduce took 20 ms).
        wake.wake_thread();
    }
}

/// The progress thread; see the module docs. Shuts the engine down once a turn finds the
/// transport gone.
fn progress_thread<E: Engine>(shared: &Shared<E>) -> Option<E::Remains> {
    let wake = &shared.wake;
    let mut idle_since = Instant::now();
    let mut nap = Duration::from_micros(5);
    while !wake.stop.load(Ordering::SeqCst) {
        if let Some(left) = wake.drive_left() {
            thread::park_timeout(left);
            idle_since = Instant::now();
            continue;
        }
        let mut guard = shared.lock();
        let engine = guard.as_mut()?;
        match shared.turn(engine) {
            None => break,
            Some(true) => {
                idle_since = Instant::now();
                nap = Duration::from_micros(5);
            }
            Some(false) if idle_since.elapsed() < SPIN => {
                drop(guard);
                // Yielding, not spinning: on few cores the tokio threads and the peers'
                // progress threads need the CPU this thread would burn.
                thread::yield_now();
            }
            Some(false) => {
                wake.sleeping.store(true, Ordering::SeqCst);
                let idle = if wake.pending.load(Ordering::SeqCst) {
                    Idle::Busy
                } else {
                    engine.idle()
                };
                drop(guard);
                match idle {
                    Idle::Block { fds, timeout_ms } => {
                        wait_readable(&fds, timeout_ms);
                        idle_since = Instant::now();
                    }
                    Idle::Nap => {
                        thread::park_timeout(nap);
                        nap = (nap * 2).min(MAX_NAP);
                    }
                    // Work is ready (or the engine says so without finding any): poll again,
                    // yielding, for another spin before trying to sleep.
                    Idle::Busy => idle_since = Instant::now(),
                }
                wake.sleeping.store(false, Ordering::SeqCst);
                wake.signal.drain();
            }
        }
    }
    let engine = shared.lock().take()?;
    Some(engine.shutdown())
}

/// Blocks until one of `fds` is readable or `timeout_ms` passes (an interrupted or failed
/// `poll` returns early, which the progress loops treat as a spurious wakeup).
pub fn wait_readable(fds: &[i32], timeout_ms: i32) {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `polls` holds `fds.len()` valid pollfd structs.
    let _ = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, timeout_ms) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts the calls; its "network" completes a oneshot on the `ready_at`-th turn.
    #[derive(Default)]
    struct Counting {
        begins: AtomicUsize,
        turns: AtomicUsize,
        ends: AtomicUsize,
        ready_at: usize,
        done: std::sync::Mutex<Option<oneshot::Sender<u32>>>,
    }

    impl Drive for Counting {
        fn begin(&self) {
            self.begins.fetch_add(1, Ordering::SeqCst);
        }
        fn turn(&self) -> bool {
            let n = self.turns.fetch_add(1, Ordering::SeqCst) + 1;
            if n == self.ready_at {
                if let Some(tx) = self.done.lock().unwrap().take() {
                    let _ = tx.send(7);
                }
                return true;
            }
            false
        }
        fn end(&self) {
            self.ends.fetch_add(1, Ordering::SeqCst);
        }
        fn hand_over(&self) {
            self.end();
        }
    }

    /// An engine that counts its turns per thread, completes `done` on turn `finish_at`, and
    /// sleeps as `idle` says.
    struct TurnLog {
        commands: std::sync::mpsc::Receiver<()>,
        turns: Arc<Mutex<Vec<String>>>,
        finish_at: usize,
        done: Option<oneshot::Sender<()>>,
        idle: Idle,
    }

    impl Engine for TurnLog {
        type Remains = usize;
        fn turn(&mut self) -> Option<bool> {
            if let Err(std::sync::mpsc::TryRecvError::Disconnected) = self.commands.try_recv() {
                return None;
            }
            let mut turns = self.turns.lock().unwrap();
            turns.push(thread::current().name().unwrap_or("").to_string());
            if turns.len() == self.finish_at {
                if let Some(done) = self.done.take() {
                    let _ = done.send(());
                }
            }
            Some(false)
        }
        fn in_flight(&self) -> bool {
            false
        }
        fn idle(&mut self) -> Idle {
            self.idle.clone()
        }
        fn shutdown(self) -> usize {
            self.turns.lock().unwrap().len()
        }
    }

    /// Wakes a thread blocked on the read end of a socket pair.
    struct Pair(std::os::unix::net::UnixStream);

    impl Signal for Pair {
        fn signal(&self) {
            use std::io::Write;
            let _ = (&self.0).write(&[1]);
        }
    }

    /// The engine, its turns, and its command queue (dropping it shuts the engine down).
    fn counting(
        idle: Idle,
        finish_at: usize,
    ) -> (
        TurnLog,
        Arc<Mutex<Vec<String>>>,
        std::sync::mpsc::Sender<()>,
    ) {
        let turns = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let engine = TurnLog {
            commands: rx,
            turns: turns.clone(),
            finish_at,
            done: None,
            idle,
        };
        (engine, turns, tx)
    }

    #[tokio::test]
    async fn a_driving_task_runs_the_turns_while_the_thread_parks() {
        let (mut engine, turns, queue) = counting(Idle::Nap, usize::MAX);
        let (done, finished) = oneshot::channel();
        engine.done = Some(done);
        let progress =
            Progress::start("byzcoll-test-drive".into(), engine, Pair(pair().0)).expect("thread");
        // Idle: the thread naps between turns.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let before = turns.lock().unwrap().len();
        assert!(before > 0, "the thread ran turns");
        turns.lock().unwrap().clear();
        {
            let mut engine = progress.shared.lock();
            engine.as_mut().unwrap().finish_at = 200;
        }
        driven(&progress, Duration::from_secs(10), finished)
            .await
            .unwrap();
        let turns = turns.lock().unwrap().clone();
        let on_thread = turns.iter().filter(|t| *t == "byzcoll-test-drive").count();
        assert!(
            on_thread <= 2,
            "{on_thread} of {} turns ran on the progress thread during the drive",
            turns.len()
        );
        drop(queue);
        drop(progress); // joins the thread, which shuts the engine down
    }

    fn pair() -> (
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixStream,
    ) {
        std::os::unix::net::UnixStream::pair().expect("socket pair")
    }

    /// A started engine whose thread is blocked in `poll` on a socket (for up to a minute),
    /// with its log of turns, its command queue and the socket's read end.
    struct Blocked {
        progress: Progress<TurnLog>,
        turns: Arc<Mutex<Vec<String>>>,
        queue: std::sync::mpsc::Sender<()>,
        _read: std::os::unix::net::UnixStream,
    }

    impl Blocked {
        fn start(name: &str) -> Self {
            use std::os::fd::AsRawFd;
            let (write, read) = pair();
            read.set_nonblocking(true).unwrap();
            let idle = Idle::Block {
                fds: vec![read.as_raw_fd()],
                timeout_ms: 60_000,
            };
            let (engine, turns, queue) = counting(idle, usize::MAX);
            let progress = Progress::start(name.into(), engine, Pair(write)).expect("thread");
            // Past the spin, the thread blocks.
            thread::sleep(SPIN * 20);
            Blocked {
                progress,
                turns,
                queue,
                _read: read,
            }
        }

        fn turns(&self) -> usize {
            self.turns.lock().unwrap().len()
        }

        /// Whether the thread runs a turn after `asleep` turns, within 5 s.
        fn turns_after(&self, asleep: usize) -> bool {
            let start = Instant::now();
            while self.turns() == asleep && start.elapsed() < Duration::from_secs(5) {
                thread::sleep(Duration::from_millis(1));
            }
            self.turns() > asleep
        }
    }

    #[test]
    fn a_signal_wakes_the_blocked_thread_and_shutdown_hands_back_the_remains() {
        let mut t = Blocked::start("byzcoll-test-block");
        let asleep = t.turns();
        thread::sleep(Duration::from_millis(50));
        assert_eq!(t.turns(), asleep, "the thread is blocked");
        t.progress.wake();
        assert!(t.turns_after(asleep), "the signal woke it");
        drop(t.queue);
        let before = t.turns.lock().unwrap().len();
        let remains = t.progress.finish().expect("what the shutdown handed back");
        // Woken, the thread spins and may run more turns until the shutdown stops it (a
        // loaded machine saw one more): the count handed back is every turn it ran.
        assert!(
            remains >= before,
            "{remains} turns handed back, {before} seen before"
        );
        assert_eq!(
            remains,
            t.turns.lock().unwrap().len(),
            "the shutdown's count of turns"
        );
    }

    #[test]
    fn commands_queued_during_another_drive_wake_the_thread_when_it_ends() {
        let t = Blocked::start("byzcoll-test-end");
        let asleep = t.turns();
        // One exchange drives; another queues a command meanwhile (its wake is left to the
        // drive); the drive ends without a turn after that.
        t.progress.begin();
        t.progress.wake();
        t.progress.end();
        assert!(
            t.turns_after(asleep),
            "the queued command waited for the thread's minute-long sleep"
        );
        drop(t.queue);
    }

    #[test]
    fn a_drive_that_spins_out_while_its_step_waits_wakes_the_thread_at_once() {
        let t = Blocked::start("byzcoll-test-hand-over");
        let asleep = t.turns();
        // A drive spins out with nothing in flight and no commands queued, while its step
        // still waits for receives: only the thread's turns will see them arrive now. (A
        // plain `end` leaves the thread asleep; it once stalled such steps by `DRIVE_LAPSE`.)
        t.progress.begin();
        t.progress.hand_over();
        assert!(
            t.turns_after(asleep),
            "the waiting step was left to the thread's minute-long sleep"
        );
        drop(t.queue);
    }

    #[tokio::test]
    async fn a_driven_future_completes_through_the_tasks_own_turns() {
        let (tx, rx) = oneshot::channel();
        let network = Counting {
            ready_at: 5,
            done: std::sync::Mutex::new(Some(tx)),
            ..Counting::default()
        };
        let got = driven(&network, Duration::from_secs(10), rx).await;
        assert_eq!(got.unwrap(), 7);
        assert_eq!(network.turns.load(Ordering::SeqCst), 5);
        assert_eq!(network.begins.load(Ordering::SeqCst), 1);
        assert_eq!(network.ends.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_idle_drive_hands_over_and_the_future_still_completes() {
        let (tx, rx) = oneshot::channel::<u32>();
        let network = Counting::default(); // its turns never complete anything
        let completer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            tx.send(9).unwrap();
        });
        let got = driven(&network, Duration::from_millis(5), rx).await;
        assert_eq!(got.unwrap(), 9);
        completer.await.unwrap();
        assert_eq!(
            network.ends.load(Ordering::SeqCst),
            1,
            "ended once, when idle for the spin"
        );
        let turns = network.turns.load(Ordering::SeqCst);
        assert!(turns > 0, "it drove before handing over");
    }

    #[tokio::test]
    async fn dropping_a_driven_future_ends_the_drive() {
        let (_tx, rx) = oneshot::channel::<u32>();
        let network = Counting::default();
        let r = tokio::time::timeout(
            Duration::from_millis(20),
            driven(&network, Duration::from_secs(10), rx),
        )
        .await;
        assert!(r.is_err(), "nothing completes it");
        assert_eq!(network.begins.load(Ordering::SeqCst), 1);
        assert_eq!(network.ends.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn send_credit_admits_up_to_the_limit_per_peer_and_one_oversized_send_alone() {
        let mut credit = SendCredit::new(2);
        assert!(credit.try_take(0, SEND_CREDIT / 2));
        assert!(credit.try_take(0, SEND_CREDIT / 2));
        assert!(!credit.try_take(0, 1), "the credit of peer 0 is spent");
        assert!(credit.try_take(1, 1), "peer 1 has its own credit");
        credit.give_back(0, SEND_CREDIT / 2);
        assert!(credit.try_take(0, 1));
        credit.give_back(0, SEND_CREDIT / 2);
        credit.give_back(0, 1);
        assert!(
            credit.try_take(0, 2 * SEND_CREDIT),
            "alone, a larger send goes"
        );
        assert!(!credit.try_take(0, 1));
    }

    /// While spinning, the task yields: another task on the same single thread runs and
    /// completes the awaited future within the spin.
    #[tokio::test(flavor = "current_thread")]
    async fn spin_on_yields_to_the_task_that_completes_it() {
        let (tx, rx) = oneshot::channel::<u32>();
        tokio::spawn(async move {
            let _ = tx.send(7);
        });
        let start = Instant::now();
        let got =
            tokio::time::timeout(Duration::from_secs(10), spin_on(Duration::from_secs(5), rx))
                .await
                .expect("completed");
        assert_eq!(got.ok(), Some(7));
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }

    /// After the spin the future is no longer polled until woken, and completes when it is.
    #[tokio::test(flavor = "current_thread")]
    async fn spin_on_stops_polling_after_the_spin_and_awaits_the_wakeup() {
        use std::sync::atomic::AtomicUsize;
        let polls = Arc::new(AtomicUsize::new(0));
        let (tx, mut rx) = oneshot::channel::<u32>();
        let counted = {
            let polls = polls.clone();
            std::future::poll_fn(move |cx| {
                polls.fetch_add(1, Ordering::Relaxed);
                std::pin::Pin::new(&mut rx).poll(cx)
            })
        };
        let task = tokio::spawn(spin_on(Duration::from_micros(200), counted));
        tokio::time::sleep(Duration::from_millis(10)).await;
        let after_spin = polls.load(Ordering::Relaxed);
        assert!(after_spin >= 2, "polled {after_spin} times while spinning");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            polls.load(Ordering::Relaxed),
            after_spin,
            "polled while asleep"
        );
        let _ = tx.send(8);
        let got = tokio::time::timeout(Duration::from_secs(5), task).await;
        assert_eq!(got.expect("woken").expect("task").ok(), Some(8));
    }
}
