//! TCP transport for byzcoll: the embedded default, needing nothing but tokio.
//!
//! One connection per pair of ranks (the higher rank connects to the lower), with a handshake
//! that names both ends. Each connection has a reader task and a writer task. A send writes
//! its frame itself, without blocking, when nothing is queued before it on that connection
//! (header and payload in one vectored write); whatever the socket does not take at once goes
//! to the writer task, which finishes it even if the step that sent it is dropped, so a frame
//! is never cut short. The reader
//! decodes 32-byte [`wire::FrameHeader`]s and checks each against the connection's peer and
//! the posted receive ([`byzcoll_runtime::mailbox`]) *before* allocating: a frame of the wrong
//! length is `Malformed`, a frame that claims another sender or is longer than
//! [`TcpOptions::max_message_bytes`] closes the connection as a protocol violation, and a
//! truncated frame is `Malformed`. Payloads have 64-bit lengths, so vectors of gigabytes work.
//!
//! The task awaiting an exchange polls it eagerly for [`TcpOptions::spin`] (500 µs by default)
//! before it sleeps, so a frame that arrives meanwhile usually reaches it without a thread
//! wakeup (8-byte one-way latency 18-22 µs on the 2-core development machine, 46-53 µs
//! without).
//!
//! Addresses are exchanged through the rendezvous store ([`TcpTransport::from_store`]) or
//! given directly ([`TcpTransport::connect_mesh`]).

pub mod wire;

use std::io::{self, IoSlice};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use byzcoll_runtime::bootstrap::{connect_with_retry, StoreClient};
use byzcoll_runtime::mailbox::{run_step, Claim, Closed, Mailbox};
use byzcoll_runtime::pool::BufferPool;
use byzcoll_runtime::progress::spin_on;
use byzcoll_runtime::{
    Capabilities, MemoryKind, Payload, Rank, RecvOutcome, Step, Transport, TransportError,
};
use futures::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{timeout_at, Instant};

use crate::wire::{FrameHeader, Hello, HEADER_LEN, HELLO_LEN};

/// Frames queued per peer for its writer task before senders wait.
const SEND_QUEUE: usize = 64;
/// How long an accepted connection may take to say who it is.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Settings of the TCP transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpOptions {
    /// How long establishing all connections may take.
    pub setup_timeout: Duration,
    /// Largest frame accepted or sent; a peer announcing more breaks the protocol.
    pub max_message_bytes: u64,
    /// Most bytes of idle receive buffers kept for reuse (see `runtime::pool`): a fresh large
    /// buffer costs a page fault per page when the frame is read into it.
    pub pool_bytes: usize,
    /// How long the task awaiting an exchange polls it eagerly, yielding between polls, before
    /// it sleeps until woken ([`byzcoll_runtime::progress::spin_on`]): a shorter wait for each
    /// message (8-byte one-way latency halved on the 2-core development machine) for up to
    /// this much CPU per step. Zero: never spin (for ranks oversubscribing their cores).
    pub spin: Duration,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            setup_timeout: Duration::from_secs(60),
            max_message_bytes: 1 << 40,
            pool_bytes: 256 << 20,
            spin: byzcoll_runtime::progress::SPIN,
        }
    }
}

/// A frame for the writer task: written from byte `offset` of header and payload on.
struct Outgoing {
    header: [u8; HEADER_LEN],
    payload: Bytes,
    offset: usize,
    done: oneshot::Sender<io::Result<()>>,
}

/// The sending side of one connection.
#[derive(Debug)]
struct Writer {
    half: OwnedWriteHalf,
    /// Frames are queued for (or being written by) the writer task: a new frame must queue
    /// behind them.
    busy: Mutex<bool>,
    queue: mpsc::Sender<Outgoing>,
}

impl Writer {
    /// Writes what the socket takes of the frame now if nothing is queued before it, and
    /// queues the rest for the writer task in the place `slot` holds: `None` when the whole
    /// frame went, else the channel that reports the task's write.
    fn start(
        &self,
        header: [u8; HEADER_LEN],
        payload: Bytes,
        slot: mpsc::Permit<'_, Outgoing>,
    ) -> io::Result<Option<oneshot::Receiver<io::Result<()>>>> {
        let mut busy = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        let mut offset = 0;
        if !*busy {
            match try_write_from(&self.half, [&header, &payload], 0) {
                Ok(n) if n == HEADER_LEN + payload.len() => return Ok(None),
                Ok(n) => offset = n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        *busy = true;
        let (done, finished) = oneshot::channel();
        slot.send(Outgoing {
            header,
            payload,
            offset,
            done,
        });
        Ok(Some(finished))
    }
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

/// The TCP transport; see the crate docs.
#[derive(Debug)]
pub struct TcpTransport {
    rank: Rank,
    size: usize,
    mailbox: Arc<Mailbox>,
    writers: Vec<Option<Arc<Writer>>>,
    tasks: Vec<JoinHandle<()>>,
    max_message_bytes: u64,
    spin: Duration,
}

impl std::fmt::Debug for Outgoing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outgoing")
            .field("header", &self.header)
            .finish()
    }
}

impl TcpTransport {
    /// Binds a listener on `ip` (port chosen by the OS), publishes its address through
    /// `store`, and connects to every other rank. `ip` defaults to the local address that
    /// routes to the store (`127.0.0.1` for a store on loopback).
    ///
    /// # Errors
    /// [`TransportError::Setup`] when the store fails, a rank publishes an unusable address,
    /// or not every peer connects within [`TcpOptions::setup_timeout`].
    pub async fn from_store(
        store: &StoreClient,
        rank: Rank,
        size: usize,
        ip: Option<IpAddr>,
        options: TcpOptions,
    ) -> Result<Self, TransportError> {
        let ip = match ip {
            Some(ip) => ip,
            None => local_ip_towards(store.addr()).await?,
        };
        let listener = TcpListener::bind((ip, 0)).await?;
        let me = listener.local_addr()?;
        let published = store
            .all_gather("byzcoll/tcp", me.to_string().as_bytes())
            .await
            .map_err(|e| TransportError::Setup(e.to_string()))?;
        let addrs = published
            .iter()
            .enumerate()
            .map(|(r, a)| {
                std::str::from_utf8(a)
                    .ok()
                    .and_then(|s| s.parse::<SocketAddr>().ok())
                    .ok_or_else(|| {
                        TransportError::Setup(format!("rank {r} published an invalid address"))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::connect_mesh(rank, size, listener, &addrs, options).await
    }

    /// Connects rank `rank` of `size` to every other rank: it accepts the higher ranks on
    /// `listener` and connects to the lower ranks at `addrs[r]`.
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] when `addrs` does not have `size` entries or `rank` is
    /// out of range; [`TransportError::Setup`] naming the ranks that did not connect in time.
    pub async fn connect_mesh(
        rank: Rank,
        size: usize,
        listener: TcpListener,
        addrs: &[SocketAddr],
        options: TcpOptions,
    ) -> Result<Self, TransportError> {
        if addrs.len() != size || rank >= size || size > u32::MAX as usize {
            return Err(TransportError::InvalidUsage(format!(
                "rank {rank} with {} addresses for a world of {size}",
                addrs.len()
            )));
        }
        let deadline = Instant::now() + options.setup_timeout;
        let connects = (0..rank).map(|peer| connect_peer(addrs[peer], rank, size, peer, deadline));
        let (accepted, connected) = tokio::join!(
            accept_peers(&listener, rank, size, deadline),
            futures::future::join_all(connects)
        );
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        for (peer, stream) in accepted? {
            streams[peer] = Some(stream);
        }
        for (peer, stream) in connected.into_iter().enumerate() {
            streams[peer] = Some(stream?);
        }

        let mailbox = Arc::new(Mailbox::new(size));
        let pool = BufferPool::new(options.pool_bytes);
        let mut writers = Vec::with_capacity(size);
        let mut tasks = Vec::with_capacity(2 * size);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                writers.push(None);
                continue;
            };
            stream.set_nodelay(true)?;
            let (rd, wr) = stream.into_split();
            let (tx, rx) = mpsc::channel(SEND_QUEUE);
            let writer = Arc::new(Writer {
                half: wr,
                busy: Mutex::new(false),
                queue: tx,
            });
            writers.push(Some(writer.clone()));
            tasks.push(tokio::spawn(write_loop(writer, rx)));
            tasks.push(tokio::spawn(read_loop(
                peer,
                rd,
                mailbox.clone(),
                pool.clone(),
                options.max_message_bytes,
            )));
        }
        tracing::debug!(rank, size, "tcp transport connected");
        Ok(TcpTransport {
            rank,
            size,
            mailbox,
            writers,
            tasks,
            max_message_bytes: options.max_message_bytes,
            spin: options.spin,
        })
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The local address the OS would use to reach `addr` (`host:port`). No packet is sent.
///
/// # Errors
/// When `addr` does not resolve or no route exists.
pub async fn local_ip_towards(addr: &str) -> Result<IpAddr, TransportError> {
    let target = tokio::net::lookup_host(addr)
        .await?
        .next()
        .ok_or_else(|| TransportError::Setup(format!("{addr} does not resolve")))?;
    let unspecified: SocketAddr = if target.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let probe = tokio::net::UdpSocket::bind(unspecified).await?;
    probe.connect(target).await?;
    Ok(probe.local_addr()?.ip())
}

async fn connect_peer(
    addr: SocketAddr,
    me: Rank,
    size: usize,
    peer: Rank,
    deadline: Instant,
) -> Result<TcpStream, TransportError> {
    let setup =
        |what: String| TransportError::Setup(format!("rank {me} to rank {peer} at {addr}: {what}"));
    let attempt = async {
        let mut stream = connect_with_retry(&addr.to_string(), deadline).await?;
        stream
            .write_all(
                &Hello {
                    world: size as u32,
                    rank: me as u32,
                }
                .encode(),
            )
            .await?;
        let mut reply = [0u8; HELLO_LEN];
        stream.read_exact(&mut reply).await?;
        Ok::<_, io::Error>((stream, Hello::decode(&reply)))
    };
    let (stream, reply) = timeout_at(deadline, attempt)
        .await
        .map_err(|_| setup("no handshake before the setup timeout".into()))?
        .map_err(|e| setup(e.to_string()))?;
    match reply {
        Ok(h) if h.rank as usize == peer && h.world as usize == size => Ok(stream),
        Ok(h) => Err(setup(format!(
            "the listener is rank {} of {}",
            h.rank, h.world
        ))),
        Err(e) => Err(setup(e)),
    }
}

async fn accept_peers(
    listener: &TcpListener,
    me: Rank,
    size: usize,
    deadline: Instant,
) -> Result<Vec<(Rank, TcpStream)>, TransportError> {
    let mut accepted: Vec<(Rank, TcpStream)> = Vec::new();
    while accepted.len() < size - me - 1 {
        let Ok(accept) = timeout_at(deadline, listener.accept()).await else {
            let missing: Vec<Rank> = (me + 1..size)
                .filter(|r| !accepted.iter().any(|(p, _)| p == r))
                .collect();
            return Err(TransportError::Setup(format!(
                "rank {me}: ranks {missing:?} did not connect before the setup timeout"
            )));
        };
        let (mut stream, from) = accept?;
        let mut hello = [0u8; HELLO_LEN];
        let read = tokio::time::timeout(HELLO_TIMEOUT, stream.read_exact(&mut hello)).await;
        let peer = match read.map(|r| r.map(|_| Hello::decode(&hello))) {
            Ok(Ok(Ok(h))) if h.world as usize == size => h.rank as usize,
            Ok(Ok(Ok(h))) => {
                tracing::warn!(%from, world = h.world, "rejecting a peer from another world size");
                continue;
            }
            _ => {
                tracing::warn!(%from, "rejecting a connection without a valid handshake");
                continue;
            }
        };
        if peer <= me || peer >= size || accepted.iter().any(|(p, _)| *p == peer) {
            tracing::warn!(%from, peer, "rejecting an unexpected or duplicate rank");
            continue;
        }
        stream
            .write_all(
                &Hello {
                    world: size as u32,
                    rank: me as u32,
                }
                .encode(),
            )
            .await?;
        accepted.push((peer, stream));
    }
    Ok(accepted)
}

/// Writes the frames that senders could not write at once, in order; after each, marks the
/// connection idle if nothing else is queued.
async fn write_loop(writer: Arc<Writer>, mut rx: mpsc::Receiver<Outgoing>) {
    while let Some(out) = rx.recv().await {
        let result = write_rest(&writer.half, [&out.header, &out.payload], out.offset).await;
        let failed = result.is_err();
        let _ = out.done.send(result);
        if failed {
            break;
        }
        // Senders queue only while holding the lock (their place is reserved before), so an
        // empty queue here stays empty until a sender has seen the connection idle.
        let mut busy = writer.busy.lock().unwrap_or_else(PoisonError::into_inner);
        if rx.is_empty() {
            *busy = false;
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

/// Reads frames from `peer` until the connection ends or breaks the protocol, then closes the
/// peer's mailbox slot with the reason.
async fn read_loop(
    peer: Rank,
    mut rd: OwnedReadHalf,
    mailbox: Arc<Mailbox>,
    pool: BufferPool,
    max: u64,
) {
    let why = loop {
        match read_frame(peer, &mut rd, &mailbox, &pool, max).await {
            Ok(true) => continue,
            Ok(false) => return,
            Err(why) => break why,
        }
    };
    match &why {
        Closed::Gone => tracing::debug!(peer, "connection closed"),
        Closed::Violation(v) => tracing::warn!(peer, violation = %v, "closing connection"),
    }
    mailbox.close(peer, why);
}

/// Reads one frame. `Ok(false)`: the mailbox is closed, stop quietly.
async fn read_frame(
    peer: Rank,
    rd: &mut OwnedReadHalf,
    mailbox: &Mailbox,
    pool: &BufferPool,
    max: u64,
) -> Result<bool, Closed> {
    let mut raw = [0u8; HEADER_LEN];
    rd.read_exact(&mut raw).await.map_err(|_| Closed::Gone)?;
    let header = FrameHeader::decode(&raw).map_err(Closed::Violation)?;
    if header.sender as usize != peer {
        return Err(Closed::Violation(format!(
            "frame claims sender {} on the connection of rank {peer}",
            header.sender
        )));
    }
    if header.len > max {
        return Err(Closed::Violation(format!(
            "frame of {} bytes exceeds the limit of {max}",
            header.len
        )));
    }
    let delivery = match mailbox.claim(peer, header.key()).await {
        Claim::Closed => return Ok(false),
        Claim::Stale => {
            tracing::debug!(peer, key = ?header.key(), "dropping a frame for a retired step");
            skip(rd, header.len).await?;
            return Ok(true);
        }
        Claim::Posted(d) => d,
    };
    let len = delivery.expected_len();
    if header.len != len as u64 {
        delivery.complete(RecvOutcome::Malformed(format!(
            "frame of {} bytes, expected {len}",
            header.len
        )));
        skip(rd, header.len).await?;
        return Ok(true);
    }
    // Sized by our own posted receive (checked equal to the header above), from the pool.
    let mut buf = pool.take(len);
    let mut filled = 0;
    while filled < len {
        match rd.read(&mut buf.as_mut_slice()[filled..len]).await {
            Ok(0) | Err(_) => {
                delivery.complete(RecvOutcome::Malformed(format!(
                    "truncated frame: {filled} of {len} bytes before the connection closed"
                )));
                return Err(Closed::Gone);
            }
            Ok(n) => filled += n,
        }
    }
    buf.set_len(len);
    delivery.complete(RecvOutcome::Received(Payload::Host(buf.freeze())));
    Ok(true)
}

async fn skip(rd: &mut OwnedReadHalf, len: u64) -> Result<(), Closed> {
    let copied = tokio::io::copy(&mut rd.take(len), &mut tokio::io::sink())
        .await
        .map_err(|_| Closed::Gone)?;
    if copied == len {
        Ok(())
    } else {
        Err(Closed::Gone)
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory: vec![MemoryKind::Host],
            per_peer_timeout: true,
            max_message_bytes: self.max_message_bytes,
        }
    }

    fn exchange(&self, step: Step) -> BoxFuture<'_, Result<Vec<RecvOutcome>, TransportError>> {
        Box::pin(async move {
            step.validate(self.rank, self.size, &self.capabilities())?;
            let step_done = run_step(
                &self.mailbox,
                &step,
                "tcp",
                || {},
                |s, key, payload| {
                    let header = FrameHeader::new(key, self.rank, payload.len()).encode();
                    let writer = self.writers[s.peer].as_ref();
                    async move {
                        const GONE: &str = "the connection's writer is gone";
                        let writer = writer.ok_or("no connection")?;
                        // A place in the queue first (at once unless 64 frames wait), so that
                        // the frame can be queued without waiting once its writing started.
                        let slot = writer.queue.reserve().await.map_err(|_| GONE)?;
                        let started = writer.start(header, payload, slot);
                        let Some(finished) = started.map_err(|e| e.to_string())? else {
                            return Ok(());
                        };
                        finished.await.map_err(|_| GONE)?.map_err(|e| e.to_string())
                    }
                },
            );
            Ok(spin_on(self.spin, step_done).await)
        })
    }
}

#[cfg(test)]
mod tests;
