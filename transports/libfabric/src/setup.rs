//! Setting the libfabric transport up: the provider, the endpoint and the address vector,
//! the frame keys, and the [`LibfabricTransport`] around its engine.

use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use byzcoll_runtime::bootstrap::StoreClient;
use byzcoll_runtime::{Lookup, OptionError, Rank, TransportError};
use byzcoll_transport_kit::progress::Signal;
use byzcoll_transport_kit::tagged::{
    check_world, gather_addresses, local_memberships, Core, CoreConfig, Shell, TagLayout,
};
use byzcoll_transport_kit::wire::FrameKeys;

use crate::engine::{Engine, EngineConfig};
use crate::safe::{self, Domain, Endpoint, Fabric, FabricError, Info, Notifier};

#[cfg(doc)]
use byzcoll_transport_kit::wire::SEALED_LEN;

/// The tag layout, `0 (2 bits) | sender (24 bits) | kind (2 bits) | sequence (36 bits)`.
pub(crate) const TAGS: TagLayout = TagLayout::new(36);
pub use byzcoll_transport_kit::progress::MAX_NAP as MAX_PARK;
pub use byzcoll_transport_kit::tagged::{HEADER_WINDOW, MAX_RANKS, PAYLOAD_RETRIES};
/// Entries of the completion queue.
const CQ_SIZE: usize = 4096;
/// Largest payload message: a longer payload travels as several, so a receive never needs a
/// buffer sized by the sender, and a payload that is not wanted is drained into a fixed
/// scratch buffer without truncation. 1 MiB rather than 4: over `tcp;ofi_rxm` 4 MiB
/// messages ran at 1.8 GB/s and 1 MiB fragments of them (4 in flight) at 4 GB/s; over `shm`
/// it makes no difference beyond noise.
pub const FRAGMENT: usize = 1 << 20;

/// Settings of the libfabric transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibfabricOptions {
    /// Largest message accepted or sent (payloads travel in fragments of at most
    /// [`FRAGMENT`] bytes, so the provider's own `max_msg_size` does not limit it).
    pub max_message_bytes: u64,
    /// Register every buffer with the domain even when the provider does not ask for it
    /// (`FI_MR_LOCAL`). Registration costs a system call or two per message; this exists to
    /// exercise the registration path on providers that do not need it.
    pub always_register: bool,
    /// Most bytes of idle receive buffers kept for reuse (see [`BufferPool`](byzcoll_transport_kit::pool::BufferPool)).
    pub pool_bytes: usize,
    /// `FI_PROVIDER` as the job's configuration read it (libfabric reads it itself and picks
    /// the provider by it; the transport only names it when no provider is usable).
    pub fi_provider: Option<String>,
}

impl LibfabricOptions {
    /// The variables [`LibfabricOptions::from_lookup`] reads.
    pub const VARS: &'static [&'static str] = &["BYZCOLL_FRAME_MAC"];

    /// The default options, with what `get` sets: `BYZCOLL_FRAME_MAC` may only say `1`
    /// (frames over libfabric are always sealed). The provider is libfabric's own business:
    /// `FI_PROVIDER` is kept only to name it in errors ([`LibfabricOptions::fi_provider`]).
    ///
    /// # Errors
    /// [`OptionError::Unsupported`] for `BYZCOLL_FRAME_MAC=0`; [`OptionError::Invalid`] for
    /// a value that is not a flag.
    pub fn from_lookup(get: Lookup<'_>) -> Result<Self, OptionError> {
        byzcoll_transport_kit::wire::always_sealed(get, "libfabric")?;
        Ok(LibfabricOptions {
            fi_provider: get("FI_PROVIDER").filter(|p| !p.is_empty()),
            ..LibfabricOptions::default()
        })
    }
}

impl Default for LibfabricOptions {
    fn default() -> Self {
        LibfabricOptions {
            max_message_bytes: 1 << 40,
            always_register: false,
            pool_bytes: 256 << 20,
            fi_provider: None,
        }
    }
}

/// Endpoints that are closed together when the last transport holding this goes.
type Keeper = Arc<Mutex<Vec<Endpoint>>>;

/// The libfabric transport: an engine owns the endpoint (and with it the domain, the
/// completion queue and the address vector) and moves in turns (see Progress below); tokio
/// tasks talk to it through a bounded command queue and the shared [`Mailbox`](byzcoll_transport_kit::mailbox::Mailbox).
///
/// Payloads are received into buffers from a [`BufferPool`](byzcoll_transport_kit::pool::BufferPool) (at most
/// [`LibfabricOptions::pool_bytes`] idle): a fresh allocation per large message cost a page
/// fault per 4 KiB page, which limited `shm` to about 1.5 GB/s.
///
/// # Messages
/// Every message is a sealed frame header ([`SEALED_LEN`] bytes: header, payload tag,
/// MAC; see [`byzcoll_transport_kit::wire`]) (tag kind `Header`) followed by its payload in
/// fragments of at most [`FRAGMENT`] bytes (kind `Payload`; none for an empty payload), all
/// tagged messages on a reliable datagram endpoint carrying the same per-pair sequence number:
///
/// ```text
/// tag = 0 (2 bits) | sender (24 bits) | kind (2 bits) | sequence (36 bits)
/// ```
///
/// The progress thread keeps [`HEADER_WINDOW`] header receives posted per peer (fewer when the
/// provider's receive queue could not hold that many for every peer), for the exact tags of
/// the peer's next sequence numbers, restricted to the peer's address where the provider
/// supports `FI_DIRECTED_RECV`, into fixed [`SEALED_LEN`]-byte buffers. It opens each header
/// (MAC, sender, length limit) and claims the matching receive in the mailbox, in sequence
/// order (the kit's state machine, [`byzcoll_transport_kit::tagged`]; the `engine` module holds
/// only the libfabric calls). Only then does it receive the payload: into a buffer of the exact length the receiver expects, or, for a header of another
/// length or for a retired step, fragment by fragment into a fixed scratch buffer that is never
/// read. At most a few fragment receives per peer are posted at a time (over all of its
/// messages, oldest first), each for the exact fragment length the header implies, so no
/// allocation is ever sized by a peer's number, and an honest peer's message is never
/// truncated. A fragment of another length is a protocol violation: the receive is `Malformed`
/// and the peer is closed. Several messages per peer are in flight at once: their headers are
/// matched by the provider as they arrive, and the payloads of claimed messages are received
/// while later headers are checked. (With one header receive per peer, every message waited
/// for a pass of the thread between its header and its payload, and the next header receive
/// was posted only after the payload had arrived.)
///
/// # Authentication
/// Without `FI_DIRECTED_RECV` (and even with it, for a provider that resolves addresses
/// loosely) a receiver cannot tell which endpoint a message came from, so anyone who knows an
/// endpoint name can send messages with any rank's tags. Every frame is therefore sealed under
/// the key of its ordered pair (X25519 keys published with the endpoint names through the
/// authenticated store, mixed with the job secret). A header whose MAC does not verify, or of
/// the wrong length, cannot be attributed to the rank whose tags it used: it is dropped with a
/// warning and the receive is posted again for the same sequence number (the genuine header
/// still matches it); it never closes the peer. A payload whose bytes do not match the tag
/// sealed in its header is never delivered: a payload of one fragment is received again (at
/// most [`PAYLOAD_RETRIES`] times, since a stranger's fragment on the same tag may have
/// matched first), a longer one is `Malformed` (which of its fragments were genuine is not
/// known, and the genuine ones already taken do not come again). A stranger who keeps
/// injecting can still spoil a receive (forged fragments that match first make it
/// `Malformed`, one of the wrong length closes the peer as before): tag matching gives no way
/// to refuse its messages before they match, short of `FI_DIRECTED_RECV`.
///
/// Why not one payload message drained with a zero-length receive, as the UCX transport does
/// after probing? libfabric 1.17 (Debian 12) mishandles it: `ofi_rxm` loses its way on
/// truncated segmented and rendezvous messages (`FI_ETRUNC` on a payload over 16 KiB leaves
/// the next messages of that peer unmatched), and `shm` matches unexpected messages with a
/// stale ignore mask, so receives with an ignore mask may miss messages that already arrived.
/// Exact tags and fragments that always fit avoid both.
///
/// # Progress
/// The engine moves in turns under [`byzcoll_transport_kit::progress::Progress`]: it reads the
/// completion queue (`fi_cq_read`, which also drives providers with manual progress), starts
/// queued sends and moves every peer's receive side. The task awaiting an exchange runs the
/// turns itself while its step is open; a progress thread runs them otherwise, and when idle
/// blocks where the provider gives the queue a wait object (`FI_WAIT_FD`: `tcp;ofi_rxm` does,
/// `shm` in libfabric 1.17 does not), in `poll` on it and on an eventfd that transport methods
/// signal, after `fi_trywait` says nothing is ready; otherwise it naps for short, growing
/// intervals (at most [`MAX_PARK`]), and new commands cut the nap short. (It used to spin
/// without yielding for 50 µs and then park: on a 2-core machine the spinning took the CPU
/// from the tokio threads and the peer's progress thread, and a message that arrived while the
/// thread was parked waited for the timer, which made the one-way latency over `shm` about
/// 100 µs.) Each operation's context pointer is the address of an `fi_context2` that the
/// operation owns (so providers that want `FI_CONTEXT`/`FI_CONTEXT2` scratch space get it);
/// completions find their operation through it. Sends the provider cannot take yet
/// (`-FI_EAGAIN`) wait in order. Buffers (and memory registrations, where the provider asks
/// for `FI_MR_LOCAL`) of unfinished operations stay owned by the engine until the operation
/// completes, and at shutdown until it has been cancelled and completed; if the provider never
/// completes it, they are leaked rather than freed, so libfabric never writes into freed
/// memory.
///
/// # Failures
/// A send that completes with an error marks its peer failed: later sends to it fail at once,
/// and its receive slot is closed (`Missing`) once nothing more from it is pending. A silent
/// peer is `Missing` at the step's deadline.
#[derive(Debug)]
pub struct LibfabricTransport {
    shell: Shell<Engine>,
    keeper: Option<Keeper>,
    provider: String,
}

byzcoll_transport_kit::shell_transport!(LibfabricTransport);

/// Wakes the progress thread blocked on the completion queue's wait object (through the
/// eventfd it also polls); nothing without a wait object (the thread naps, and is unparked).
struct NotifierSignal(Option<Notifier>);

impl Signal for NotifierSignal {
    fn signal(&self) {
        if let Some(n) = &self.0 {
            n.signal();
        }
    }

    fn drain(&self) {
        if let Some(n) = &self.0 {
            n.drain();
        }
    }
}

fn setup(e: FabricError) -> TransportError {
    TransportError::Setup(format!("libfabric: {e}"))
}

/// Chooses the provider and checks that the tag layout fits it.
pub(crate) fn choose(options: &LibfabricOptions) -> Result<Info, TransportError> {
    let info = Info::rdm_tagged().map_err(|e| {
        let among = match &options.fi_provider {
            Some(p) => format!("provider {p:?} (FI_PROVIDER)"),
            None => "the installed providers".to_string(),
        };
        TransportError::Setup(format!("libfabric, {among}: {e}"))
    })?;
    if info.tag_bits() < TAGS.bits() {
        return Err(TransportError::Setup(format!(
            "libfabric provider {} matches {} tag bits; the transport needs {}",
            info.provider(),
            info.tag_bits(),
            TAGS.bits()
        )));
    }
    Ok(info)
}

/// Opens a fabric, domain and endpoint for a world of `size`.
pub(crate) fn open(info: &Info, size: usize) -> Result<Endpoint, TransportError> {
    let fabric = Fabric::open(info).map_err(setup)?;
    let domain = Domain::open(fabric, info).map_err(setup)?;
    Endpoint::open(domain, info, CQ_SIZE, size).map_err(setup)
}

impl LibfabricTransport {
    /// Opens an RDM endpoint on the provider `fi_getinfo` selects (honouring `FI_PROVIDER`,
    /// `FI_TCP_IFACE` and libfabric's other `FI_` variables), publishes its name through
    /// `store`, inserts every rank's name into the address vector and starts the progress
    /// thread.
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] for a rank outside the world or a world larger than
    /// [`MAX_RANKS`]; [`TransportError::Setup`] when no provider offers tagged RDM messaging
    /// (the message names what the selected one lacks), libfabric cannot open the endpoint,
    /// the store fails, or a rank publishes an unusable address.
    ///
    /// Ranks in one process should come from [`LibfabricTransport::local_world`] instead:
    /// `shm` shares an endpoint's memory region with endpoints of the same process, which
    /// that function keeps open until the whole world is gone.
    pub async fn from_store(
        store: &StoreClient,
        rank: Rank,
        size: usize,
        options: LibfabricOptions,
    ) -> Result<Self, TransportError> {
        check_world("libfabric", rank, size)?;
        let info = choose(&options)?;
        let endpoint = open(&info, size)?;
        // The frame key is published with the name (see Authentication above).
        let (names, keys, membership) = gather_addresses(
            store,
            "byzcoll/libfabric",
            "libfabric addresses",
            rank,
            size,
            endpoint.name(),
        )
        .await?;
        let mut t = Self::start(&info, endpoint, &names, keys, rank, size, options, None)?;
        t.shell.set_membership(Some(membership));
        Ok(t)
    }

    /// Builds a whole world in this process (for tests and threads-as-ranks): one fabric,
    /// domain and endpoint per rank, on the provider `fi_getinfo` selects.
    ///
    /// # Errors
    /// As [`LibfabricTransport::from_store`].
    pub fn local_world(
        size: usize,
        options: LibfabricOptions,
    ) -> Result<Vec<Self>, TransportError> {
        let keys = FrameKeys::local_world(size).map_err(TransportError::Setup)?;
        Self::local_world_with(keys, options).map(|(ranks, _)| ranks)
    }

    /// As [`LibfabricTransport::local_world`] under the given frame keys; also returns the
    /// endpoint names (the tests play strangers and insiders with them).
    pub(crate) fn local_world_with(
        keys: Vec<FrameKeys>,
        options: LibfabricOptions,
    ) -> Result<(Vec<Self>, Vec<Bytes>), TransportError> {
        let size = keys.len();
        if size > MAX_RANKS {
            return Err(TransportError::InvalidUsage(format!(
                "a world of {size}: the libfabric transport addresses at most {MAX_RANKS} ranks"
            )));
        }
        let info = choose(&options)?;
        let endpoints = (0..size)
            .map(|_| open(&info, size))
            .collect::<Result<Vec<_>, _>>()?;
        // shm hands a peer in the same process the owner's own mapping of an endpoint's
        // region, so closing one rank's endpoint while the others may still send to it would
        // leave them a dangling pointer: in-process shm worlds close their endpoints together,
        // once the last rank is gone.
        let keeper = info
            .provider()
            .split(';')
            .any(|p| p == "shm")
            .then(Keeper::default);
        let names: Vec<Bytes> = endpoints
            .iter()
            .map(|e| Bytes::copy_from_slice(e.name()))
            .collect();
        let ranks = endpoints
            .into_iter()
            .zip(keys)
            .zip(local_memberships(size))
            .enumerate()
            .map(|(rank, ((ep, keys), membership))| {
                let mut t = Self::start(
                    &info,
                    ep,
                    &names,
                    keys,
                    rank,
                    size,
                    options.clone(),
                    keeper.clone(),
                )?;
                t.shell.set_membership(membership);
                Ok(t)
            })
            .collect::<Result<Vec<_>, TransportError>>()?;
        Ok((ranks, names))
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        info: &Info,
        mut endpoint: Endpoint,
        names: &[Bytes],
        keys: FrameKeys,
        rank: Rank,
        size: usize,
        options: LibfabricOptions,
        keeper: Option<Keeper>,
    ) -> Result<Self, TransportError> {
        if names.len() != size {
            return Err(TransportError::Setup(format!(
                "{} libfabric addresses for a world of {size}",
                names.len()
            )));
        }
        let mut addresses = Vec::with_capacity(size);
        for (peer, name) in names.iter().enumerate() {
            let a = endpoint.insert_address(name).map_err(|e| {
                TransportError::Setup(format!("rank {peer}'s libfabric address: {e}"))
            })?;
            addresses.push(a);
        }
        let provider = info.provider();
        let fragment = match usize::try_from(info.max_msg_size()) {
            Ok(0) | Err(_) => FRAGMENT,
            Ok(m) => m.min(FRAGMENT),
        };
        let max = options.max_message_bytes;
        let config = EngineConfig {
            me: rank,
            fragment,
            directed: info.directed_recv(),
            register: info.needs_local_registration() || options.always_register,
        };
        let core = CoreConfig {
            name: "libfabric",
            me: rank,
            max_message_bytes: max,
            pool_bytes: options.pool_bytes,
            // Leave half the provider's receive queue for payload fragments.
            header_window: match info.rx_size() {
                0 => HEADER_WINDOW,
                n => (n / (2 * size.max(1))).clamp(1, HEADER_WINDOW),
            },
        };
        let notifier = endpoint.wait_fd().and_then(|_| Notifier::new());
        let notifier_fd = notifier.as_ref().map(Notifier::fd);
        let shell = Shell::start(
            "libfabric",
            rank,
            size,
            max,
            format!("byzcoll-fi-{rank}"),
            NotifierSignal(notifier),
            |mailbox, commands| {
                let core = Core::new(core, size, keys, mailbox, commands);
                Engine::new(endpoint, addresses, config, core, notifier_fd)
            },
        )?;
        tracing::debug!(
            rank,
            size,
            provider = %provider,
            fabric = %info.fabric_name(),
            version = %safe::version(),
            directed = config.directed,
            register = config.register,
            "libfabric transport started"
        );
        Ok(LibfabricTransport {
            shell,
            keeper,
            provider,
        })
    }

    /// The libfabric provider in use (`info->fabric_attr->prov_name`), e.g. `tcp;ofi_rxm`.
    pub fn provider(&self) -> &str {
        &self.provider
    }
}

impl Drop for LibfabricTransport {
    fn drop(&mut self) {
        // The engine cancels and drains its operations and closes the endpoint within a
        // bounded time, on the progress thread.
        let Some(endpoint) = self.shell.finish() else {
            return;
        };
        if let Some(keeper) = &self.keeper {
            keeper
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(endpoint);
        }
    }
}
