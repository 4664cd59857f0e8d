//! What transports whose progress thread owns the network (UCX, libfabric) share: the step
//! run through the thread's command queue, the send credit, and the thread's blocking wait.

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
