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
//! is never cut short. A peer may leave only a budget of frames queued, in bytes, sized from
//! this rank's own sends ([`send`]: three steps' worth, at least 1 MiB); a peer that stops
//! reading for longer fails: its frames are dropped, its connection is shut down, and its
//! receives are `Missing`. The reader
//! decodes 32-byte [`wire::FrameHeader`]s and checks each against the connection's peer and
//! the posted receive ([`byzcoll_transport_kit::mailbox`]) *before* allocating: a frame of the wrong
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

pub mod send;
mod settings;
pub mod wire;

pub use settings::{TcpSettings, MAX_SPIN};

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use byzcoll_runtime::bootstrap::auth::{self, Endpoint, HandshakeError, Purpose};
use byzcoll_runtime::bootstrap::gate::{self, Gate};
use byzcoll_runtime::bootstrap::{connect_with_retry, Membership, StoreClient};
use byzcoll_runtime::{
    Capabilities, MemoryKind, Payload, Rank, RecvOutcome, Step, Transport, TransportError,
};
use byzcoll_transport_kit::mailbox::{run_step, Claim, Closed, Mailbox};
use byzcoll_transport_kit::pool::BufferPool;
use byzcoll_transport_kit::progress::spin_on;
use futures::future::BoxFuture;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{timeout_at, Instant};

use crate::send::{Budget, SendError, Writer};
use crate::wire::{FrameHeader, HEADER_LEN};

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
    /// it sleeps until woken ([`byzcoll_transport_kit::progress::spin_on`]): a shorter wait for each
    /// message (8-byte one-way latency halved on the 2-core development machine) for up to
    /// this much CPU per step. Zero: never spin (for ranks oversubscribing their cores).
    pub spin: Duration,
    /// Every data frame carries a keyed-BLAKE3 MAC (under a key of its connection's
    /// handshake, per direction, numbered), checked before the payload is delivered; a
    /// mismatch is `Malformed` and closes the connection. Off by default: the connection is
    /// authenticated already, and forging inside it takes injecting into an established TCP
    /// stream; MACs cost a hash of every payload at both ends. All ranks must agree (the
    /// handshake refuses a peer that differs).
    pub frame_mac: bool,
    /// How long a dropped transport goes on writing the frames its steps left queued (a step
    /// ends at its deadline or quorum, not when its sends are written), and then reading and
    /// discarding what its peers still send until they close, so that closing never resets a
    /// connection whose peer has not yet read all it was sent. Beyond it, the connections
    /// are closed at once; a peer that reads everything and closes ends it sooner.
    pub linger: Duration,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            setup_timeout: Duration::from_secs(60),
            max_message_bytes: 1 << 40,
            pool_bytes: 256 << 20,
            spin: byzcoll_transport_kit::progress::SPIN,
            frame_mac: false,
            linger: Duration::from_secs(10),
        }
    }
}

/// Length of a frame's MAC ([`TcpOptions::frame_mac`]).
pub const MAC_LEN: usize = 32;

/// Frame authentication on one direction of a connection: the key, and the number of the
/// next frame (TCP keeps order, so both ends count alike). `Debug` shows no key.
struct FrameMac {
    key: [u8; 32],
    seq: u64,
}

impl std::fmt::Debug for FrameMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameMac")
            .field("key", &"(hidden)")
            .field("seq", &self.seq)
            .finish()
    }
}

impl FrameMac {
    /// The key of frames from `from` to `to` on the connection whose handshake gave
    /// `session`.
    fn new(session: &[u8; 32], from: Rank, to: Rank) -> Self {
        let mut h = blake3::Hasher::new_keyed(session);
        h.update(b"byzcoll-v2 tcp frame key");
        h.update(&(from as u32).to_le_bytes());
        h.update(&(to as u32).to_le_bytes());
        FrameMac {
            key: *h.finalize().as_bytes(),
            seq: 0,
        }
    }

    /// A hasher for the next frame, its header already in.
    fn begin(&mut self, header: &[u8; HEADER_LEN]) -> blake3::Hasher {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(b"byzcoll-v2 tcp frame");
        h.update(&self.seq.to_le_bytes());
        h.update(header);
        self.seq += 1;
        h
    }

    /// Takes back the numbers of the last `frames` frames begun, which were dropped unsent.
    fn rewind(&mut self, frames: u64) {
        self.seq -= frames;
    }
}

/// The TCP transport; see the crate docs.
#[derive(Debug)]
pub struct TcpTransport {
    rank: Rank,
    size: usize,
    mailbox: Arc<Mailbox>,
    writers: Vec<Option<Arc<Writer>>>,
    budget: Budget,
    /// The connections' reader and writer tasks (taken by [`Transport::close`] or the drop).
    tasks: std::sync::Mutex<Vec<JoinHandle<()>>>,
    /// The runtime the tasks run on, where dropping the transport lets them finish.
    runtime: tokio::runtime::Handle,
    options: TcpOptions,
    listening: Option<SocketAddr>,
    /// The membership the connections were authenticated with (audited rounds sign with it).
    membership: Arc<Membership>,
}

impl TcpTransport {
    /// The options this transport was started with.
    pub fn options(&self) -> &TcpOptions {
        &self.options
    }

    /// The address this rank listened on for its peers.
    pub fn listening(&self) -> Option<SocketAddr> {
        self.listening
    }

    /// Bytes of frames to `peer` that wait in this rank's memory for the socket to take them,
    /// each charged with its header and bookkeeping ([`send`]); 0 for this rank, a rank out
    /// of range, and a peer that failed (its frames are dropped).
    pub fn queued_bytes(&self, peer: Rank) -> usize {
        match self.writers.get(peer) {
            Some(Some(w)) => w.queued_bytes(),
            _ => 0,
        }
    }

    /// The most bytes [`queued_bytes`](Self::queued_bytes) may reach for a peer now: beyond,
    /// the peer fails ([`send`]). It grows with the largest step this rank has sent.
    pub fn queue_budget(&self) -> usize {
        self.budget.bytes()
    }

    /// Sends one frame to `peer` under `key` and the call fingerprint `call`, and waits until
    /// the socket took all of it.
    ///
    /// # Errors
    /// When the peer has failed or fails now, for its budget of queued bytes or a broken
    /// connection ([`send`]).
    ///
    /// # Cancel safety
    /// Dropping the future leaves a queued frame to the writer task.
    async fn send(
        &self,
        peer: Rank,
        key: byzcoll_runtime::MsgKey,
        call: u64,
        payload: Bytes,
        patience: Duration,
    ) -> Result<(), SendError> {
        let header = FrameHeader::new(key, call, self.rank, payload.len()).encode();
        let Some(Some(writer)) = self.writers.get(peer) else {
            return Err(SendError::NoConnection);
        };
        let budget = self.budget.bytes();
        let Some(finished) = writer.start(key, header, payload, budget, patience)? else {
            return Ok(());
        };
        // Dropped unwritten: the peer failed meanwhile.
        finished
            .await
            .unwrap_or_else(|_| Err(writer.failure().unwrap_or(SendError::NoConnection)))
    }

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
        let identity = store.auth().identity().map_err(setup)?;
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
        let membership = Membership::new(store.auth().clone(), identity, &keys).map_err(setup)?;
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
        let listening = listener.local_addr().ok();
        let deadline = Instant::now() + options.setup_timeout;
        let macs = options.frame_mac;
        let connects = (0..rank)
            .map(|peer| connect_peer(addrs[peer], rank, size, peer, membership, macs, deadline));
        let (accepted, connected) = tokio::join!(
            accept_peers(listener, rank, size, membership, macs, deadline),
            futures::future::join_all(connects)
        );
        let mut streams: Vec<Option<(TcpStream, [u8; 32])>> = (0..size).map(|_| None).collect();
        for (peer, stream, key) in accepted? {
            streams[peer] = Some((stream, key));
        }
        for (peer, connected) in connected.into_iter().enumerate() {
            streams[peer] = Some(connected?);
        }

        let mailbox = Arc::new(Mailbox::new(size));
        let pool = BufferPool::new(options.pool_bytes);
        let mut writers = Vec::with_capacity(size);
        let mut tasks = Vec::with_capacity(2 * size);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some((stream, session)) = stream else {
                writers.push(None);
                continue;
            };
            let (send_mac, recv_mac) = if macs {
                (
                    Some(FrameMac::new(&session, rank, peer)),
                    Some(FrameMac::new(&session, peer, rank)),
                )
            } else {
                (None, None)
            };
            stream.set_nodelay(true)?;
            let (rd, wr) = stream.into_split();
            let writer = Arc::new(Writer::new(rank, peer, wr, send_mac, mailbox.clone()));
            tasks.push(writer.spawn());
            writers.push(Some(writer));
            tasks.push(tokio::spawn(read_loop(
                peer,
                rd,
                recv_mac,
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
            budget: Budget::default(),
            tasks: std::sync::Mutex::new(tasks),
            runtime: tokio::runtime::Handle::current(),
            options,
            listening,
            membership: Arc::new(membership.clone()),
        })
    }
}

impl TcpTransport {
    /// Ends sending and delivering, and hands back the connections' tasks to wait for: each
    /// writer writes what is queued and shuts its direction down, each reader discards what
    /// its peer still sends until the peer closes ([`drain`]).
    fn finish(&self) -> Vec<JoinHandle<()>> {
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(PoisonError::into_inner));
        for writer in self.writers.iter().flatten() {
            writer.close();
        }
        for peer in (0..self.size).filter(|&p| p != self.rank) {
            self.mailbox.close(peer, Closed::Gone);
        }
        tasks
    }
}

/// Waits for the connections' tasks for at most `linger`, then stops those still running
/// (which closes their sockets).
async fn linger_then_stop(mut tasks: Vec<JoinHandle<()>>, linger: Duration) {
    let all = futures::future::join_all(tasks.iter_mut());
    if tokio::time::timeout(linger, all).await.is_err() {
        for t in &tasks {
            t.abort();
        }
    }
}

/// Dropping the transport without [`Transport::close`] finishes the connections in the
/// background, for at most [`TcpOptions::linger`], while the runtime runs its tasks (a
/// current-thread runtime runs them only while something awaits on it).
impl Drop for TcpTransport {
    fn drop(&mut self) {
        let tasks = self.finish();
        if !tasks.is_empty() {
            self.runtime
                .spawn(linger_then_stop(tasks, self.options.linger));
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

fn endpoint(membership: &Membership, size: usize, rank: Rank, macs: bool) -> Endpoint<'_> {
    Endpoint {
        auth: &membership.auth,
        purpose: Purpose::Tcp,
        world: size as u32,
        rank: rank as u32,
        identity: Some((&membership.identity, &membership.roster)),
        frame_macs: macs,
    }
}

async fn connect_peer(
    addr: SocketAddr,
    me: Rank,
    size: usize,
    peer: Rank,
    membership: &Membership,
    macs: bool,
    deadline: Instant,
) -> Result<(TcpStream, [u8; 32]), TransportError> {
    let setup =
        |what: String| TransportError::Setup(format!("rank {me} to rank {peer} at {addr}: {what}"));
    let attempt = async {
        let mut stream = connect_with_retry(&addr.to_string(), deadline).await?;
        let session = auth::initiate(
            &mut stream,
            endpoint(membership, size, me, macs),
            peer as u32,
        )
        .await?;
        Ok::<_, HandshakeError>((stream, session.key()))
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
    macs: bool,
    deadline: Instant,
) -> Result<Vec<(Rank, TcpStream, [u8; 32])>, TransportError> {
    let expected = size - me - 1;
    if expected == 0 {
        return Ok(Vec::new());
    }
    let (tx, mut rx) = mpsc::channel::<(Rank, TcpStream, [u8; 32])>(expected);
    let membership = Arc::new(membership.clone());
    let acceptor =
        tokio::spawn(async move {
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
                    let me_ep = endpoint(&membership, size, me, macs);
                    match auth::respond(&mut stream, me_ep, accept).await {
                        Ok(session) => Some((session.peer as Rank, stream, session.key())),
                        Err(HandshakeError::Rejected { why, .. }) => {
                            byzcoll_runtime::warn_limited!(
                                from,
                                "tcp transport (rank {me}): refused a connection: {why}"
                            );
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
    let mut accepted: Vec<(Rank, TcpStream, [u8; 32])> = Vec::with_capacity(expected);
    while accepted.len() < expected {
        match timeout_at(deadline, rx.recv()).await {
            Ok(Some((peer, stream, key))) => {
                if accepted.iter().any(|(p, _, _)| *p == peer) {
                    tracing::warn!(
                        peer,
                        "tcp transport: rank connected twice; keeping the first"
                    );
                } else {
                    accepted.push((peer, stream, key));
                }
            }
            Ok(None) | Err(_) => {
                acceptor.abort();
                let missing: Vec<Rank> = (me + 1..size)
                    .filter(|r| !accepted.iter().any(|(p, _, _)| p == r))
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

/// Reads frames from `peer` until the connection ends or breaks the protocol, then closes the
/// peer's mailbox slot with the reason.
async fn read_loop(
    peer: Rank,
    mut rd: OwnedReadHalf,
    mut mac: Option<FrameMac>,
    mailbox: Arc<Mailbox>,
    pool: BufferPool,
    max: u64,
) {
    let why = loop {
        match read_frame(peer, &mut rd, mac.as_mut(), &mailbox, &pool, max).await {
            Ok(true) => continue,
            Ok(false) => return drain(&mut rd).await,
            Err(why) => break why,
        }
    };
    match &why {
        Closed::Gone => tracing::debug!(peer, "connection closed"),
        Closed::Violation(v) => tracing::warn!(peer, violation = %v, "closing connection"),
    }
    mailbox.close(peer, why);
}

/// Reads and discards what the peer sends until it closes (or the transport's linger stops
/// the task): a connection closed with bytes unread is reset, and a reset can throw away
/// what the peer has not read yet of this rank's last frames.
async fn drain(rd: &mut OwnedReadHalf) {
    let mut sink = vec![0u8; 64 << 10];
    while matches!(rd.read(&mut sink).await, Ok(n) if n > 0) {}
}

/// Reads one frame. `Ok(false)`: the mailbox is closed, stop delivering (and
/// [`drain`]). With frame MACs, the
/// payload is delivered only once its MAC matches; a frame that is skipped (stale, wrong
/// length) is hashed as it is skipped, so a mismatch anywhere closes the connection.
async fn read_frame(
    peer: Rank,
    rd: &mut OwnedReadHalf,
    mac: Option<&mut FrameMac>,
    mailbox: &Mailbox,
    pool: &BufferPool,
    max: u64,
) -> Result<bool, Closed> {
    let mut raw = [0u8; HEADER_LEN];
    rd.read_exact(&mut raw).await.map_err(|_| Closed::Gone)?;
    let mut check = match mac {
        Some(m) => {
            let mut tag = [0u8; MAC_LEN];
            rd.read_exact(&mut tag).await.map_err(|_| Closed::Gone)?;
            Some((m.begin(&raw), blake3::Hash::from_bytes(tag)))
        }
        None => None,
    };
    if let Some(notice) = wire::decode_skip(&raw) {
        let notice = notice.map_err(Closed::Violation)?;
        if notice.sender as usize != peer {
            return Err(Closed::Violation(format!(
                "skip notice claims sender {} on the connection of rank {peer}",
                notice.sender
            )));
        }
        skip(rd, 0, check).await?;
        tracing::debug!(peer, up_to = ?notice.key(), "the peer dropped frames this rank had not read");
        mailbox.skip_through(peer, notice.key());
        return Ok(true);
    }
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
    let delivery = match mailbox.claim(peer, header.key(), header.call).await {
        Claim::Closed => return Ok(false),
        Claim::Stale => {
            tracing::debug!(peer, key = ?header.key(), "dropping a frame for a retired step");
            skip(rd, header.len, check).await?;
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
        skip(rd, header.len, check).await?;
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
    if let Some((mut h, tag)) = check.take() {
        h.update(&buf.as_mut_slice()[..len]);
        if h.finalize() != tag {
            delivery.complete(RecvOutcome::Malformed(
                "the frame's MAC does not match its content".into(),
            ));
            return Err(mac_mismatch());
        }
    }
    delivery.complete(RecvOutcome::Received(Payload::Host(buf.freeze())));
    Ok(true)
}

fn mac_mismatch() -> Closed {
    Closed::Violation("a frame's MAC does not match: the stream was altered".into())
}

/// Reads and drops `len` payload bytes, checking them against the frame's MAC if there is one.
async fn skip(
    rd: &mut OwnedReadHalf,
    len: u64,
    check: Option<(blake3::Hasher, blake3::Hash)>,
) -> Result<(), Closed> {
    let Some((mut h, tag)) = check else {
        let copied = tokio::io::copy(&mut rd.take(len), &mut tokio::io::sink())
            .await
            .map_err(|_| Closed::Gone)?;
        return if copied == len {
            Ok(())
        } else {
            Err(Closed::Gone)
        };
    };
    let mut chunk = vec![0u8; len.min(1 << 16) as usize];
    let mut left = len;
    while left > 0 {
        let want = left.min(chunk.len() as u64) as usize;
        rd.read_exact(&mut chunk[..want])
            .await
            .map_err(|_| Closed::Gone)?;
        h.update(&chunk[..want]);
        left -= want as u64;
    }
    if h.finalize() == tag {
        Ok(())
    } else {
        Err(mac_mismatch())
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn membership(&self) -> Option<Arc<Membership>> {
        Some(self.membership.clone())
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
            quorum: true,
            max_message_bytes: self.options.max_message_bytes,
            steps_in_flight: byzcoll_runtime::PIPELINED_STEPS,
        }
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    /// Writes out what the steps left queued, shuts each connection's sending direction down,
    /// and reads until every peer has closed its own, for at most [`TcpOptions::linger`]:
    /// closing a socket with bytes unread resets the connection, and a reset can throw away
    /// what the peer has not read yet.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(linger_then_stop(self.finish(), self.options.linger))
    }

    fn exchange(&self, step: Step) -> BoxFuture<'_, Result<Vec<RecvOutcome>, TransportError>> {
        Box::pin(async move {
            step.validate(self.rank, self.size, &self.capabilities())?;
            self.budget.note(&step);
            // A peer over its budget that read nothing for this long is gone (`send`).
            let patience = step
                .deadline
                .saturating_duration_since(tokio::time::Instant::now());
            let step_done = run_step(
                &self.mailbox,
                &step,
                "tcp",
                || {},
                |s, key, call, payload| {
                    let sending = self.send(s.peer, key, call, payload, patience);
                    async move { sending.await.map_err(|e| e.to_string()) }
                },
            );
            Ok(spin_on(self.options.spin, step_done).await)
        })
    }
}

#[cfg(test)]
mod tests;
