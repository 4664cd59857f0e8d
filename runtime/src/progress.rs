//! What transports whose progress thread owns the network (UCX, libfabric) share: the step
//! run through the thread's command queue, the send credit, the thread's blocking wait, and
//! [`driven`], which lets the task awaiting a step drive the network itself.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use crate::mailbox::{run_step, Mailbox};
use crate::{MsgKey, Rank, RecvOutcome, Step, TransportError};

/// The completion of one send, answered by the progress thread.
pub type SendDone = oneshot::Sender<Result<(), String>>;

/// Bytes per peer that a transport whose progress thread owns the network (UCX, libfabric)
/// may still have in flight after reporting their sends done. A send is reported done to its
/// step once the thread holds it (the payload is reference-counted, nothing is copied) and it
/// fits in this credit, or nothing else to that peer is in flight; so a sender streams its next
/// message while the network still moves the previous one, and a receiver that stops taking
/// messages holds back at most this much of the sender's memory before its sends wait again.
pub const SEND_CREDIT: usize = 64 << 20;

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

/// One send: `command` wraps the completion sender into the thread's command, which is queued
/// on `commands`; then the thread is woken with `wake` and its answer awaited.
///
/// # Errors
/// The thread's own error, or `the progress thread is gone` when it has ended.
async fn send_through_thread<C>(
    commands: &mpsc::Sender<C>,
    command: impl FnOnce(oneshot::Sender<Result<(), String>>) -> C,
    wake: impl Fn(),
) -> Result<(), String> {
    const GONE: &str = "the progress thread is gone";
    let (done, finished) = oneshot::channel();
    commands
        .send(command(done))
        .await
        .map_err(|_| GONE.to_string())?;
    wake();
    finished.await.map_err(|_| GONE.to_string())?
}

/// [`crate::Transport::exchange`] (after [`Step::validate`]) for a transport whose progress
/// thread owns the network: posts the step's receives on `mailbox` and wakes the thread with
/// `wake`, then queues each send on `commands` as `command(peer, key, payload, done)` and
/// awaits the thread's answer (see [`run_step`] for deadlines and failures).
///
/// # Errors
/// [`TransportError::Setup`] when the transport is shut down (`commands` is `None`).
pub async fn run_step_through_thread<C>(
    mailbox: &Mailbox,
    step: &Step,
    transport: &'static str,
    commands: Option<&mpsc::Sender<C>>,
    command: impl Fn(Rank, MsgKey, Bytes, SendDone) -> C,
    wake: impl Fn(),
) -> Result<Vec<RecvOutcome>, TransportError> {
    let commands = commands
        .ok_or_else(|| TransportError::Setup(format!("the {transport} transport is shut down")))?;
    let (command, wake) = (&command, &wake);
    let outcomes = run_step(mailbox, step, transport, wake, |s, key, payload| {
        let peer = s.peer;
        send_through_thread(
            commands,
            move |done| command(peer, key, payload, done),
            wake,
        )
    })
    .await;
    Ok(outcomes)
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
    /// The task stops driving; the progress thread takes over at once.
    fn end(&self);
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
            driving.stop();
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

#[repr(C)]
struct PollFd {
    fd: i32,
    events: i16,
    revents: i16,
}

const POLLIN: i16 = 1;

extern "C" {
    // From the C library, which std links.
    fn poll(fds: *mut PollFd, nfds: u64, timeout: i32) -> i32;
}

/// Blocks until one of `fds` is readable or `timeout_ms` passes (an interrupted or failed
/// `poll` returns early, which the progress loops treat as a spurious wakeup).
pub fn wait_readable(fds: &[i32], timeout_ms: i32) {
    let mut polls: Vec<PollFd> = fds
        .iter()
        .map(|&fd| PollFd {
            fd,
            events: POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `polls` holds `fds.len()` valid pollfd structs.
    let _ = unsafe { poll(polls.as_mut_ptr(), polls.len() as u64, timeout_ms) };
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
}
