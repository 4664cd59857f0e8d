//! The sending side of a connection, and the budget of frames a peer may leave unread.
//!
//! A send writes its frame itself, without blocking, when nothing is queued before it on that
//! connection (header and payload in one vectored write); whatever the socket does not take at
//! once goes to the connection's writer task, which finishes it even if the step that sent it
//! is dropped, so a frame is never cut short.
//!
//! # The queue's budget
//! Frames wait in this rank's memory only once the socket's kernel buffer is full, that is
//! while the peer does not read. A step waits for its own sends (until its deadline, or its
//! quorum: [`byzcoll_runtime::Step::quorum`]), which is the back-pressure on a sender; what a
//! step leaves queued when it ends stays queued for the writer task. So that a peer that stops
//! reading (Byzantine, or hung) cannot make this rank hold every frame it sends it, each peer
//! may leave at most this many bytes queued ([`queue_budget`](crate::TcpTransport::queue_budget)):
//!
//! `max(QUEUE_FLOOR, QUEUED_STEPS × the most bytes one step of this rank has sent to one peer)`
//!
//! counted from this rank's own sends only, never from anything a peer says, and each frame
//! charged with its header, a MAC's room and [`FRAME_COST`] of bookkeeping (so many small
//! frames are bounded as well as a few large ones). A frame is always admitted when nothing
//! is queued for its peer. A frame that would take a peer's queue over the budget fails the
//! peer instead: its queued frames are dropped, its connection is shut down, its mailbox slot
//! is closed (its receives are `Missing`, so rounds name it), and every later send to it fails
//! at once ("peer failed: it left N bytes unread, more than the budget of B").
//!
//! When the transport drops, the writer task goes on until it has written what is queued
//! (its `close`), then shuts its direction of the connection down: a rank that ends its
//! last step before the socket took its sends (a quorum step does not wait for them) and
//! drops its transport does not cut its last frames short. The transport bounds that by
//! [`TcpOptions::linger`](crate::TcpOptions::linger).
//!
//! Failing rather than waiting for room: the step already waits for its sends, so a frame
//! that finds the queue full belongs to a step after at least [`QUEUED_STEPS`] others that
//! ended without the peer reading their frames (beyond a full kernel buffer). Waiting longer
//! could only last until that step ends too; then the frame would be lost (a hole the peer
//! reads as our silence, while we never name it) and every later step would wait for room
//! again, each until its deadline.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use bytes::Bytes;
use byzcoll_runtime::{Rank, Step};
use byzcoll_transport_kit::mailbox::{Closed, Mailbox};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{oneshot, Notify};
use tokio::task::AbortHandle;

use crate::wire::HEADER_LEN;
use crate::{FrameMac, MAC_LEN};

/// How many steps' worth of frames (the most one step has sent to one peer) a peer may leave
/// queued: a step in flight and the one pipelined after it ([`byzcoll_runtime::PIPELINED_STEPS`])
/// with one to spare.
pub const QUEUED_STEPS: usize = 3;

/// The least budget of queued bytes per peer, whatever the steps send (1 MiB).
pub const QUEUE_FLOOR: usize = 1 << 20;

/// Bytes of bookkeeping charged for each queued frame on top of its own bytes.
pub const FRAME_COST: usize = 256;

/// What a frame of `len` payload bytes is charged against the budget.
fn charge(len: usize) -> usize {
    len.saturating_add(HEADER_LEN + MAC_LEN + FRAME_COST)
}

/// The budget of queued bytes per peer, from this rank's own sends (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Budget {
    /// The most bytes (charged as queued frames) one step has sent to one peer.
    largest_step: AtomicUsize,
}

impl Budget {
    /// Takes `step`'s sends into account; before they start, so a step always fits.
    pub(crate) fn note(&self, step: &Step) {
        let mut loads: Vec<(Rank, usize)> = step
            .sends
            .iter()
            .map(|s| (s.peer, charge(s.payload.len())))
            .collect();
        loads.sort_unstable_by_key(|&(peer, _)| peer);
        let largest = loads
            .chunk_by(|a, b| a.0 == b.0)
            .map(|sends| sends.iter().fold(0usize, |sum, s| sum.saturating_add(s.1)))
            .max()
            .unwrap_or(0);
        self.largest_step.fetch_max(largest, Ordering::Relaxed);
    }

    /// The most bytes a peer may leave queued now.
    pub(crate) fn bytes(&self) -> usize {
        QUEUED_STEPS
            .saturating_mul(self.largest_step.load(Ordering::Relaxed))
            .max(QUEUE_FLOOR)
    }
}

/// Why a send to a peer failed. Every later send to the peer fails the same way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SendError {
    /// The peer left more than its budget of this rank's frames unread: its connection is
    /// shut down and its receives are `Missing`.
    Stalled {
        /// Bytes queued for it when it failed.
        queued: usize,
        /// Its budget then.
        budget: usize,
    },
    /// Writing to the connection failed (the OS's words).
    Broken(String),
    /// There is no connection to the peer (it is this rank, or out of range).
    NoConnection,
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Stalled { queued, budget } => write!(
                f,
                "peer failed: it left {queued} bytes unread, more than the budget of {budget}"
            ),
            SendError::Broken(why) => write!(f, "peer failed: the connection broke: {why}"),
            SendError::NoConnection => f.write_str("no connection"),
        }
    }
}

/// What goes in front of a payload: its header, then (frame MACs on) its MAC.
#[derive(Clone, Copy)]
struct Head {
    bytes: [u8; HEADER_LEN + MAC_LEN],
    len: usize,
}

impl Head {
    fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// A frame for the writer task: written from byte `offset` of head and payload on.
struct Outgoing {
    head: Head,
    payload: Bytes,
    offset: usize,
    done: oneshot::Sender<Result<(), SendError>>,
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("head", &self.head.as_slice())
            .field("len", &self.payload.len())
            .finish()
    }
}

/// The sending side of one connection, to `peer`.
#[derive(Debug)]
pub(crate) struct Writer {
    peer: Rank,
    half: OwnedWriteHalf,
    state: Mutex<WriterState>,
    /// Wakes the writer task when a frame is queued.
    queued: Notify,
    /// The writer task, stopped when the peer fails.
    task: OnceLock<AbortHandle>,
    /// Closed for `peer` when it fails for its budget.
    mailbox: Arc<Mailbox>,
}

#[derive(Debug)]
struct WriterState {
    /// Frames for the writer task, in order (the one it is writing is taken out).
    queue: VecDeque<Outgoing>,
    /// Charges of the frames queued or being written by the writer task: a new frame must
    /// queue behind them while this is not zero.
    queued: usize,
    /// Set when frames carry MACs.
    mac: Option<FrameMac>,
    /// Set once sends to the peer fail.
    failed: Option<SendError>,
    /// Set when the transport drops: the writer task ends once the queue is empty.
    closing: bool,
}

impl Writer {
    pub(crate) fn new(
        peer: Rank,
        half: OwnedWriteHalf,
        mac: Option<FrameMac>,
        mailbox: Arc<Mailbox>,
    ) -> Self {
        Writer {
            peer,
            half,
            state: Mutex::new(WriterState {
                queue: VecDeque::new(),
                queued: 0,
                mac,
                failed: None,
                closing: false,
            }),
            queued: Notify::new(),
            task: OnceLock::new(),
            mailbox,
        }
    }

    /// Starts the writer task on the current runtime; the caller keeps its handle.
    pub(crate) fn spawn(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let task = tokio::spawn(write_loop(self.clone()));
        let _ = self.task.set(task.abort_handle());
        task
    }

    fn lock(&self) -> MutexGuard<'_, WriterState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes charged for the frames queued for (or being written by) the writer task.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.lock().queued
    }

    /// Sends a frame: writes what the socket takes of it now if nothing is queued before it,
    /// and queues the rest for the writer task if the peer's queue stays within `budget` bytes
    /// (or is empty). `None` when the whole frame went, else the channel that reports the
    /// task's write.
    ///
    /// # Errors
    /// When the peer has failed, or fails now: it is over its budget, or the write failed.
    pub(crate) fn start(
        &self,
        header: [u8; HEADER_LEN],
        payload: Bytes,
        budget: usize,
    ) -> Result<Option<oneshot::Receiver<Result<(), SendError>>>, SendError> {
        let mut state = self.lock();
        if let Some(why) = &state.failed {
            return Err(why.clone());
        }
        let charge = charge(payload.len());
        if state.queued != 0 && state.queued.saturating_add(charge) > budget {
            let why = SendError::Stalled {
                queued: state.queued,
                budget,
            };
            let dropped = fail(&mut state, why.clone());
            drop(state);
            self.stalled(dropped, &why);
            return Err(why);
        }
        let mut head = Head {
            bytes: [0; HEADER_LEN + MAC_LEN],
            len: HEADER_LEN,
        };
        head.bytes[..HEADER_LEN].copy_from_slice(&header);
        // Under the lock, so frame numbers follow the order frames enter the stream.
        if let Some(mac) = state.mac.as_mut() {
            let mut h = mac.begin(&header);
            h.update(&payload);
            head.bytes[HEADER_LEN..].copy_from_slice(h.finalize().as_bytes());
            head.len = HEADER_LEN + MAC_LEN;
        }
        let mut offset = 0;
        if state.queued == 0 {
            match try_write_from(&self.half, [head.as_slice(), &payload], 0) {
                Ok(n) if n == head.len + payload.len() => return Ok(None),
                Ok(n) => offset = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    let why = SendError::Broken(e.to_string());
                    let dropped = fail(&mut state, why.clone());
                    drop(state);
                    drop(dropped);
                    return Err(why);
                }
            }
        }
        let (done, finished) = oneshot::channel();
        state.queue.push_back(Outgoing {
            head,
            payload,
            offset,
            done,
        });
        state.queued += charge;
        drop(state);
        self.queued.notify_one();
        Ok(Some(finished))
    }

    /// Lets the writer task finish what is queued, then shut this direction of the connection
    /// down and end (the transport is dropping; nothing is sent after this).
    pub(crate) fn close(&self) {
        self.lock().closing = true;
        self.queued.notify_one();
    }

    /// Why sends to the peer fail, if they do.
    pub(crate) fn failure(&self) -> Option<SendError> {
        self.lock().failed.clone()
    }

    /// The rest of failing a peer for its budget, outside the lock: frees its frames, stops
    /// the writer task (and the frame it holds), shuts the connection down (the peer reads
    /// the end after what it was sent; the reader task sees it too), and closes the peer's
    /// mailbox slot so its receives are `Missing`.
    fn stalled(&self, dropped: VecDeque<Outgoing>, why: &SendError) {
        tracing::warn!(peer = self.peer, %why, "tcp transport: closing the connection");
        drop(dropped);
        if let Some(task) = self.task.get() {
            task.abort();
        }
        shut_down(&self.half, std::net::Shutdown::Both);
        self.mailbox.close(self.peer, Closed::Gone);
    }
}

/// Marks the peer failed with `why` (unless it already is) and takes its queued frames, for
/// the caller to drop outside the lock (dropping a frame's channel tells its sender).
fn fail(state: &mut WriterState, why: SendError) -> VecDeque<Outgoing> {
    state.failed.get_or_insert(why);
    state.queued = 0;
    std::mem::take(&mut state.queue)
}

/// Shuts the connection down (`how`: one direction or both); the socket is closed when both
/// of its halves are dropped. Where the platform offers no way to do it through a shared
/// handle, the connection stays open and idle.
fn shut_down(half: &OwnedWriteHalf, how: std::net::Shutdown) {
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        // A duplicate of the descriptor: shutting it down shuts the socket down.
        match half.as_ref().as_fd().try_clone_to_owned() {
            Ok(fd) => {
                let _ = std::net::TcpStream::from(fd).shutdown(how);
            }
            Err(e) => tracing::debug!(error = %e, "tcp transport: no shutdown"),
        }
    }
    #[cfg(not(unix))]
    let _ = (half, how);
}

/// One non-blocking write of `parts` (header, payload) from byte `offset` on.
fn try_write_from(wr: &OwnedWriteHalf, parts: [&[u8]; 2], offset: usize) -> io::Result<usize> {
    let [header, payload] = parts;
    let n = if offset < header.len() {
        wr.try_write_vectored(&[IoSlice::new(&header[offset..]), IoSlice::new(payload)])?
    } else {
        wr.try_write(&payload[offset - header.len()..])?
    };
    if n == 0 {
        return Err(io::ErrorKind::WriteZero.into());
    }
    Ok(n)
}

/// Writes the frames that senders could not write at once, in order; a frame's charge is
/// given back once it is written, so the connection is idle again when nothing is queued.
/// Once the writer is closing and nothing is queued, shuts its direction down and ends.
async fn write_loop(writer: Arc<Writer>) {
    loop {
        let (next, closing) = {
            let mut state = writer.lock();
            if state.failed.is_some() {
                return;
            }
            (state.queue.pop_front(), state.closing)
        };
        let Some(out) = next else {
            if closing {
                shut_down(&writer.half, std::net::Shutdown::Write);
                return;
            }
            writer.queued.notified().await;
            continue;
        };
        let result = write_rest(
            &writer.half,
            [out.head.as_slice(), &out.payload],
            out.offset,
        )
        .await;
        let mut state = writer.lock();
        if state.failed.is_some() {
            // Failed meanwhile: its charge and the queue are gone already.
            return;
        }
        match result {
            Ok(()) => {
                state.queued -= charge(out.payload.len());
                drop(state);
                let _ = out.done.send(Ok(()));
            }
            Err(e) => {
                let why = SendError::Broken(e.to_string());
                let dropped = fail(&mut state, why.clone());
                drop(state);
                drop(dropped);
                let _ = out.done.send(Err(why));
                return;
            }
        }
    }
}

async fn write_rest(wr: &OwnedWriteHalf, parts: [&[u8]; 2], mut offset: usize) -> io::Result<()> {
    let total = parts[0].len() + parts[1].len();
    while offset < total {
        wr.writable().await?;
        match try_write_from(wr, parts, offset) {
            Ok(n) => offset += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
