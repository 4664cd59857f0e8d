//! TCP transport for byzcoll: the embedded default, needing nothing but tokio.
//!
//! One connection per pair of ranks (the higher rank connects to the lower). Each starts with
//! the authenticated handshake of [`byzcoll_runtime::bootstrap::auth`]: both ends prove the job
//! secret and sign with their identity keys, and compare the digests of their membership
//! tables, so no stranger gets a connection and no rank connects as another. The listener
//! authenticates connections concurrently, each under a deadline and at most 256 at once
//! ([`byzcoll_runtime::bootstrap::gate`]), so idle connections never delay real peers. Each connection has a reader task and a writer task. A send writes
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
use byzcoll_runtime::bootstrap::auth::{self, Endpoint, HandshakeError, Purpose};
use byzcoll_runtime::bootstrap::gate::{self, Gate};
use byzcoll_runtime::bootstrap::{connect_with_retry, Identity, Membership, Roster, StoreClient};
use byzcoll_runtime::mailbox::{run_step, Claim, Closed, Mailbox};
use byzcoll_runtime::pool::BufferPool;
use byzcoll_runtime::progress::spin_on;
use byzcoll_runtime::{
    Capabilities, MemoryKind, Payload, Rank, RecvOutcome, Step, Transport, TransportError,
};
use futures::future::BoxFuture;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{timeout_at, Instant};

use crate::wire::{FrameHeader, HEADER_LEN};

/// Frames queued per peer for its writer task before senders wait.
const SEND_QUEUE: usize = 64;

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
    /// Binds a listener on `ip` (port chosen by the OS), publishes its address and a fresh
    /// identity key through `store`, and connects to every other rank, authenticating each
    /// connection with the store's [`JobAuth`](byzcoll_runtime::bootstrap::JobAuth). `ip`
    /// defaults to the local address that routes to the store (`127.0.0.1` for a store on
    /// loopback).
    ///
    /// # Errors
    /// [`TransportError::Setup`] when the store fails, a rank publishes an unusable address or
    /// key, a peer fails authentication, or not every peer connects within
    /// [`TcpOptions::setup_timeout`].
    pub async fn from_store(
        store: &StoreClient,
        rank: Rank,
        size: usize,
        ip: Option<IpAddr>,
        options: TcpOptions,
    ) -> Result<Self, TransportError> {
        let setup = |e: byzcoll_runtime::BootstrapError| TransportError::Setup(e.to_string());
        let ip = match ip {
            Some(ip) => ip,
            None => local_ip_towards(store.addr()).await?,
        };
        let listener = TcpListener::bind((ip, 0)).await?;
        let me = listener.local_addr()?;
        let identity = Identity::generate().map_err(setup)?;
        let mut entry = identity.public().to_vec();
        entry.extend_from_slice(me.to_string().as_bytes());
        let published = store
            .all_gather("byzcoll/tcp", &entry)
            .await
            .map_err(setup)?;
        let mut keys = Vec::with_capacity(size);
        let mut addrs = Vec::with_capacity(size);
        for (r, entry) in published.iter().enumerate() {
            let invalid = || TransportError::Setup(format!("rank {r} published an invalid entry"));
            let (key, addr) = entry.split_at_checked(32).ok_or_else(invalid)?;
            let key: [u8; 32] = key.try_into().map_err(|_| invalid())?;
            let addr = std::str::from_utf8(addr)
                .ok()
                .and_then(|s| s.parse::<SocketAddr>().ok())
                .ok_or_else(invalid)?;
            keys.push((key, &entry[32..]));
            addrs.push(addr);
        }
        let membership = Membership {
            auth: store.auth().clone(),
            identity,
            roster: Roster::new(&keys).map_err(setup)?,
        };
        Self::connect_mesh(rank, size, listener, &addrs, &membership, options).await
    }

    /// Connects rank `rank` of `size` to every other rank: it accepts the higher ranks on
    /// `listener` and connects to the lower ranks at `addrs[r]`, authenticating every
    /// connection with `membership` (whose roster must cover `size` ranks).
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] when `addrs` or the roster do not have `size` entries
    /// or `rank` is out of range; [`TransportError::Setup`] naming a peer that failed
    /// authentication, or the ranks that did not connect in time.
    pub async fn connect_mesh(
        rank: Rank,
        size: usize,
        listener: TcpListener,
        addrs: &[SocketAddr],
        membership: &Membership,
        options: TcpOptions,
    ) -> Result<Self, TransportError> {
        if addrs.len() != size
            || membership.size() != size
            || rank >= size
            || size > u32::MAX as usize
        {
            return Err(TransportError::InvalidUsage(format!(
                "rank {rank} with {} addresses and {} identities for a world of {size}",
                addrs.len(),
                membership.size()
            )));
        }
        if !membership.auth.is_authenticated() && size > 1 {
            tracing::warn!(
                rank,
                "tcp transport: connections are UNAUTHENTICATED (BYZCOLL_ALLOW_UNAUTHENTICATED=1)"
            );
        }
        let deadline = Instant::now() + options.setup_timeout;
        let connects =
            (0..rank).map(|peer| connect_peer(addrs[peer], rank, size, peer, membership, deadline));
        let (accepted, connected) = tokio::join!(
            accept_peers(listener, rank, size, membership, deadline),
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

fn endpoint(membership: &Membership, size: usize, rank: Rank) -> Endpoint<'_> {
    Endpoint {
        auth: &membership.auth,
        purpose: Purpose::Tcp,
        world: size as u32,
        rank: rank as u32,
        identity: Some((&membership.identity, &membership.roster)),
    }
}

async fn connect_peer(
    addr: SocketAddr,
    me: Rank,
    size: usize,
    peer: Rank,
    membership: &Membership,
    deadline: Instant,
) -> Result<TcpStream, TransportError> {
    let setup =
        |what: String| TransportError::Setup(format!("rank {me} to rank {peer} at {addr}: {what}"));
    let attempt = async {
        let mut stream = connect_with_retry(&addr.to_string(), deadline).await?;
        auth::initiate(&mut stream, endpoint(membership, size, me), peer as u32).await?;
        Ok::<_, HandshakeError>(stream)
    };
    timeout_at(deadline, attempt)
        .await
        .map_err(|_| setup("no handshake before the setup timeout".into()))?
        .map_err(|e| setup(e.to_string()))
}

/// Accepts the ranks above `me`, each connection authenticated in a task of its own through a
/// [`Gate`]; connections that fail are refused and logged with their address.
async fn accept_peers(
    listener: TcpListener,
    me: Rank,
    size: usize,
    membership: &Membership,
    deadline: Instant,
) -> Result<Vec<(Rank, TcpStream)>, TransportError> {
    let expected = size - me - 1;
    if expected == 0 {
        return Ok(Vec::new());
    }
    let (tx, mut rx) = mpsc::channel::<(Rank, TcpStream)>(expected);
    let membership = Arc::new(membership.clone());
    let acceptor = tokio::spawn(async move {
        let gate = Gate::default();
        loop {
            let (mut stream, from) = gate::accept(&listener).await;
            let (membership, tx) = (membership.clone(), tx.clone());
            gate.admit(
                from,
                async move {
                    let accept = |r: u32| {
                        if (r as usize) > me {
                            Ok(())
                        } else {
                            Err(format!("rank {r} must be connected to by rank {me}, not connect"))
                        }
                    };
                    match auth::respond(&mut stream, endpoint(&membership, size, me), accept).await {
                        Ok(session) => Some((session.peer as Rank, stream)),
                        Err(HandshakeError::Rejected { why, .. }) => {
                            tracing::warn!(%from, rank = me, "tcp transport: refused a connection: {why}");
                            None
                        }
                        Err(e) => {
                            tracing::debug!(%from, error = %e, "tcp transport: handshake failed");
                            None
                        }
                    }
                },
                move |peer| async move {
                    let _ = tx.send(peer).await;
                },
            );
        }
    });
    let mut accepted: Vec<(Rank, TcpStream)> = Vec::with_capacity(expected);
    while accepted.len() < expected {
        match timeout_at(deadline, rx.recv()).await {
            Ok(Some((peer, stream))) => {
                if accepted.iter().any(|(p, _)| *p == peer) {
                    tracing::warn!(
                        peer,
                        "tcp transport: rank connected twice; keeping the first"
                    );
                } else {
                    accepted.push((peer, stream));
                }
            }
            Ok(None) | Err(_) => {
                acceptor.abort();
                let missing: Vec<Rank> = (me + 1..size)
                    .filter(|r| !accepted.iter().any(|(p, _)| p == r))
                    .collect();
                return Err(TransportError::Setup(format!(
                    "rank {me}: ranks {missing:?} did not connect before the setup timeout"
                )));
            }
        }
    }
    acceptor.abort();
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
