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
//! is queued for its peer. A frame that would take a peer's queue over the budget finds the
//! peer either behind or gone:
//! - **Behind**: the peer read something within the last step timeout (the send's step's), so
//!   it is alive and only slower than this rank (a straggler the quorum rounds left behind, a
//!   pause). The frames queued for it and not yet started are dropped, and a *skip notice* for
//!   each stream they belonged to goes in their place ([`crate::wire::SKIP_MAGIC`]: every
//!   frame of that stream up to the notice's key that the peer has not had by then is
//!   dropped), then the new frame. The peer's receives for those keys end at once
//!   (`Missing`) when it reaches them, so it catches up with this rank instead of being cut
//!   off. The queue then holds the notices and the new frame, besides a frame being written:
//!   within the budget but for those.
//! - **Gone**: it read nothing for a whole step timeout (hung, stopped, or Byzantine). The
//!   peer fails: its queued frames are dropped, its connection is shut down, its mailbox slot
//!   is closed (its receives are `Missing`, so rounds name it), and every later send to it
//!   fails at once ("peer failed: it left N bytes unread, more than the budget of B").
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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use bytes::Bytes;
use byzcoll_runtime::{MsgKey, Rank, Step};
use byzcoll_transport_kit::mailbox::{Closed, Mailbox};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{oneshot, Notify};
use tokio::task::AbortHandle;
use tokio::time::{Duration, Instant};

use crate::wire::{skip_notice, HEADER_LEN};
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
    /// The peer fell behind: the frame was dropped unread, and the peer told to skip it.
    Skipped,
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
            SendError::Skipped => f.write_str("the peer fell behind: the frame was dropped unread"),
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
    /// Its key (a skip notice's: the last key it skips).
    key: MsgKey,
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
    /// This rank (the sender of its frames).
    me: Rank,
    peer: Rank,
    half: OwnedWriteHalf,
    state: Mutex<WriterState>,
    /// Wakes the writer task when a frame is queued.
    queued: Notify,
    /// The writer task, stopped when the peer fails.
    task: OnceLock<AbortHandle>,
    /// Closed for `peer` when it fails for its budget.
    mailbox: Arc<Mailbox>,
    /// When the writer was made: [`Writer::progress`] counts from here.
    born: Instant,
    /// When a write to the peer last made progress, in milliseconds since `born`: a peer
    /// over its budget that read nothing for a step timeout is gone, else behind.
    progress: AtomicU64,
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
    /// The last key of each stream that a skip notice told the peer to skip: a later send at
    /// or below it (a step sending its tags out of order) is skipped too, never delivered
    /// after the notice that covers it.
    skipped: Vec<MsgKey>,
}

impl Writer {
    pub(crate) fn new(
        me: Rank,
        peer: Rank,
        half: OwnedWriteHalf,
        mac: Option<FrameMac>,
        mailbox: Arc<Mailbox>,
    ) -> Self {
        Writer {
            me,
            peer,
            half,
            state: Mutex::new(WriterState {
                queue: VecDeque::new(),
                queued: 0,
                mac,
                failed: None,
                closing: false,
                skipped: Vec::new(),
            }),
            queued: Notify::new(),
            task: OnceLock::new(),
            mailbox,
            born: Instant::now(),
            progress: AtomicU64::new(0),
        }
    }

    /// Notes that a write to the peer made progress.
    fn progressed(&self) {
        let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.progress.fetch_max(ms, Ordering::Relaxed);
    }

    /// How long since a write to the peer last made progress (since the writer was made, if
    /// none has yet).
    fn idle(&self) -> Duration {
        let since = Duration::from_millis(self.progress.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(since)
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

    /// Sends the frame of `key` (`header`, `payload`): writes what the socket takes of it now
    /// if nothing is queued before it, and queues the rest for the writer task if the peer's
    /// queue stays within `budget` bytes (or is empty). Over the budget, a peer that read
    /// something within `patience` (the step's timeout) is behind: the frames queued for it
    /// are dropped for skip notices (module docs), and this one queues after them. `None`
    /// when the whole frame went, else the channel that reports the task's write.
    ///
    /// # Errors
    /// When the peer has failed, or fails now: it is over its budget and read nothing within
    /// `patience`, or the write failed.
    pub(crate) fn start(
        &self,
        key: MsgKey,
        header: [u8; HEADER_LEN],
        payload: Bytes,
        budget: usize,
        patience: Duration,
    ) -> Result<Option<oneshot::Receiver<Result<(), SendError>>>, SendError> {
        let mut state = self.lock();
        if let Some(why) = &state.failed {
            return Err(why.clone());
        }
        if skipped(&state, key) {
            return Err(SendError::Skipped);
        }
        let charge = charge(payload.len());
        if state.queued != 0 && state.queued.saturating_add(charge) > budget {
            if self.idle() > patience {
                let why = SendError::Stalled {
                    queued: state.queued,
                    budget,
                };
                let dropped = fail(&mut state, why.clone());
                drop(state);
                self.stalled(dropped, &why);
                return Err(why);
            }
            self.skip_backlog(&mut state);
            if skipped(&state, key) {
                return Err(SendError::Skipped);
            }
        }
        let head = seal(&mut state, &header, &payload);
        let mut offset = 0;
        if state.queued == 0 {
            match try_write_from(&self.half, [head.as_slice(), &payload], 0) {
                Ok(n) if n == head.len + payload.len() => {
                    self.progressed();
                    return Ok(None);
                }
                Ok(n) => {
                    self.progressed();
                    offset = n;
                }
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
            key,
            done,
        });
        state.queued += charge;
        drop(state);
        self.queued.notify_one();
        Ok(Some(finished))
    }

    /// Drops the frames queued for the peer that the writer task has not started, and queues
    /// in their place a skip notice for each stream they belonged to, naming the last key
    /// dropped. With frame MACs, the dropped frames were the last ones numbered: the count
    /// goes back by them, so the notices take their numbers.
    fn skip_backlog(&self, state: &mut WriterState) {
        // A frame partly written by a sender stays: the stream must not be cut mid-frame.
        let keep = usize::from(state.queue.front().is_some_and(|f| f.offset > 0));
        let dropped: Vec<Outgoing> = state.queue.drain(keep..).collect();
        if dropped.is_empty() {
            return;
        }
        let bytes: usize = dropped.iter().map(|f| charge(f.payload.len())).sum();
        state.queued -= bytes;
        if let Some(mac) = state.mac.as_mut() {
            mac.rewind(dropped.len() as u64);
        }
        let mut last: Vec<MsgKey> = Vec::new();
        for f in &dropped {
            raise_mark(&mut last, f.key);
        }
        tracing::warn!(
            peer = self.peer,
            frames = dropped.len(),
            bytes,
            up_to = ?last,
            "tcp transport: the peer fell behind; dropping the frames it has not read (it \
             skips them)"
        );
        for &key in &last {
            raise_mark(&mut state.skipped, key);
        }
        for key in last {
            let header = skip_notice(key, self.me);
            let head = seal(state, &header, &[]);
            let (done, _) = oneshot::channel();
            state.queue.push_back(Outgoing {
                head,
                payload: Bytes::new(),
                offset: 0,
                key,
                done,
            });
            state.queued += charge(0);
        }
        // Their senders learn that they were dropped (a quorum step has long stopped waiting).
        for f in dropped {
            let _ = f.done.send(Err(SendError::Skipped));
        }
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

/// Raises the mark of `key`'s stream in `marks` (one key per stream, the highest) to `key`.
fn raise_mark(marks: &mut Vec<MsgKey>, key: MsgKey) {
    match marks.iter_mut().find(|k| k.stream() == key.stream()) {
        Some(k) => *k = (*k).max(key),
        None => marks.push(key),
    }
}

/// Whether `key` is at or below the last key a skip notice named for its stream.
fn skipped(state: &WriterState, key: MsgKey) -> bool {
    state
        .skipped
        .iter()
        .any(|k| k.stream() == key.stream() && key <= *k)
}

/// `header` with its MAC behind it where frames carry one (over `header` and `payload`); under
/// the writer's lock, so frame numbers follow the order frames enter the stream.
fn seal(state: &mut WriterState, header: &[u8; HEADER_LEN], payload: &[u8]) -> Head {
    let mut head = Head {
        bytes: [0; HEADER_LEN + MAC_LEN],
        len: HEADER_LEN,
    };
    head.bytes[..HEADER_LEN].copy_from_slice(header);
    if let Some(mac) = state.mac.as_mut() {
        let mut h = mac.begin(header);
        h.update(payload);
        head.bytes[HEADER_LEN..].copy_from_slice(h.finalize().as_bytes());
        head.len = HEADER_LEN + MAC_LEN;
    }
    head
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
        let result = write_rest(&writer, [out.head.as_slice(), &out.payload], out.offset).await;
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

async fn write_rest(writer: &Writer, parts: [&[u8]; 2], mut offset: usize) -> io::Result<()> {
    let total = parts[0].len() + parts[1].len();
    while offset < total {
        writer.half.writable().await?;
        match try_write_from(&writer.half, parts, offset) {
            Ok(n) => {
                writer.progressed();
                offset += n;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
