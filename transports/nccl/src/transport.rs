//! The NCCL transport: one non-blocking NCCL communicator and one CUDA stream per rank.
//!
//! A step is posted as one NCCL group: the host payloads are copied into one device buffer,
//! every send and receive is posted between `ncclGroupStart` and `ncclGroupEnd` on the
//! transport's stream, then an event recorded after the group is polled from the async
//! executor (yielding for [`SPIN`], then sleeping [`POLL`] at a time) until it completes or
//! the step's deadline passes. `ncclCommGetAsyncError` is polled alongside, so a peer that
//! NCCL sees fail (`ncclRemoteError`) ends the step before the deadline.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex as StdMutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use byzcoll_runtime::bootstrap::StoreClient;
use byzcoll_runtime::{
    Capabilities, MemoryKind, Payload, Rank, RecvOp, RecvOutcome, SendOp, Step, Tag, Transport,
    TransportError,
};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tokio::time::Instant;

use crate::failure::{AbortCause, NcclFailure};
use crate::ffi::{self, Comm, State};
use crate::plan::{Op, Plan};
use crate::setup::{self, Contribution, ID_BYTES, MIN_VERSION, STORE_KEY};

/// How long a wait keeps yielding between polls before it sleeps between them.
pub const SPIN: Duration = Duration::from_micros(200);
/// Sleep between polls after [`SPIN`] (tokio's timer resolution).
pub const POLL: Duration = Duration::from_millis(1);

/// Settings of the NCCL transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclOptions {
    /// CUDA device ordinal to use (among those `CUDA_VISIBLE_DEVICES` leaves visible).
    /// Default: `local_rank` (or the rank, without one) modulo the number of visible devices.
    pub device: Option<usize>,
    /// This process's rank on its node, as the launcher reports it (`LOCAL_RANK`,
    /// `SLURM_LOCALID`, ...), for the default device.
    pub local_rank: Option<usize>,
    /// How long joining the communicator may take (every rank must join).
    pub init_timeout: Duration,
    /// Largest message accepted or sent.
    pub max_message_bytes: u64,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            device: None,
            local_rank: None,
            init_timeout: Duration::from_secs(120),
            max_message_bytes: 1 << 40,
        }
    }
}

/// Why this machine cannot run the NCCL transport, or `None` when it can: the CUDA driver
/// library, NCCL ≥ 2.14 (`libnccl.so` on the loader path) and at least one visible device
/// are needed. Never panics (cudarc panics when a library is missing; this checks first).
pub fn unavailable_reason() -> Option<String> {
    check_machine().err()
}

/// Returns the number of visible devices.
fn check_machine() -> Result<usize, String> {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) was not found: \
                    this machine has no NVIDIA driver"
            .into());
    }
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(
            "the NCCL library was not found (cudarc loads libnccl.so: install the \
                    NCCL development package, or put a libnccl.so link to libnccl.so.2 on \
                    LD_LIBRARY_PATH)"
                .into(),
        );
    }
    let version = setup::decode_version(ffi::version()?);
    if version < MIN_VERSION {
        let (a, b, c) = version;
        return Err(format!(
            "NCCL {a}.{b}.{c} is too old: non-blocking communicators need 2.14 or later"
        ));
    }
    let count = CudaContext::device_count()
        .map_err(|e| format!("the CUDA driver cannot list devices: {e}"))?;
    match usize::try_from(count) {
        Ok(0) | Err(_) => Err("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".into()),
        Ok(n) => Ok(n),
    }
}

/// Device buffers of a step whose operations may still be running.
#[derive(Debug)]
struct Buffers {
    send: Option<CudaSlice<u8>>,
    recv: Option<CudaSlice<u8>>,
}

/// Buffers of a step whose exchange was cancelled, kept until the stream is past them.
#[derive(Debug)]
struct Orphan {
    _buffers: Buffers,
    peers: Vec<Rank>,
}

#[derive(Debug)]
struct Inner {
    /// `None` once aborted.
    comm: Option<Comm>,
    /// Set when the communicator was aborted.
    broken: Option<NcclFailure>,
    stream: Arc<CudaStream>,
}

/// The NCCL transport; see the crate docs.
#[derive(Debug)]
pub struct NcclTransport {
    rank: Rank,
    size: usize,
    device: usize,
    max_message_bytes: u64,
    /// Held for a whole exchange: steps are serialized, NCCL calls never overlap.
    inner: tokio::sync::Mutex<Inner>,
    /// Written by a cancelled exchange's drop, so it is a plain lock.
    orphans: StdMutex<Vec<Orphan>>,
}

/// Writes one send's payload into its range of the step's send buffer.
type Fill<'a> = dyn Fn(&Arc<CudaStream>, &mut CudaSlice<u8>, &Op) -> Result<(), String> + Sync + 'a;

/// A send of [`NcclTransport::exchange_device`]: `len` bytes at device address `ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSend {
    /// Destination rank.
    pub peer: Rank,
    /// Message tag (orders a pair's messages, as in [`Transport::exchange`]).
    pub tag: Tag,
    /// Device address of the payload.
    pub ptr: u64,
    /// Payload bytes.
    pub len: usize,
}

/// The receives of [`NcclTransport::exchange_device`], left on the device.
#[derive(Debug)]
pub struct DeviceReceived {
    /// One buffer holding every receive (`None` when there was none).
    pub buffer: Option<CudaSlice<u8>>,
    /// For each receive, in the caller's order, its byte range in `buffer`.
    pub ranges: Vec<std::ops::Range<usize>>,
}

/// A device-to-device step exchange: what the GPU schedules of `byzcoll-cuda`
/// (`robust_all_reduce_nccl`) run over. [`NcclTransport`] is the implementation; the trait
/// lets those schedules run over another one, such as the in-process exchange between ranks
/// sharing one GPU that their multi-rank tests use (NCCL refuses two ranks on one device).
pub trait DeviceExchange: Sync {
    /// This rank and the world size.
    fn world(&self) -> (Rank, usize);

    /// The CUDA device ordinal the exchange reads from and writes to.
    fn device_ordinal(&self) -> usize;

    /// Sends device payloads and receives into one device buffer, as
    /// [`NcclTransport::exchange_device`] documents (every rank calls it at the same point of
    /// its step sequence; a pair's messages match in tag order).
    ///
    /// # Safety
    /// As [`NcclTransport::exchange_device`]: each send's `ptr` addresses `len` readable bytes
    /// on the exchange's device, fully written, for as long as the future is alive.
    unsafe fn exchange_device(
        &self,
        collective: u64,
        step: u32,
        sends: &[DeviceSend],
        recvs: &[RecvOp],
        deadline: Instant,
    ) -> impl Future<Output = Result<DeviceReceived, TransportError>> + Send;
}

impl DeviceExchange for NcclTransport {
    fn world(&self) -> (Rank, usize) {
        (self.rank, self.size)
    }

    fn device_ordinal(&self) -> usize {
        self.device
    }

    unsafe fn exchange_device(
        &self,
        collective: u64,
        step: u32,
        sends: &[DeviceSend],
        recvs: &[RecvOp],
        deadline: Instant,
    ) -> impl Future<Output = Result<DeviceReceived, TransportError>> + Send {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { NcclTransport::exchange_device(self, collective, step, sends, recvs, deadline) }
    }
}

/// The buffers of the step being exchanged; if the exchange is dropped before they are
/// released, they become an [`Orphan`] (NCCL may still be writing into them).
struct InFlight<'a> {
    buffers: Option<Buffers>,
    peers: Vec<Rank>,
    orphans: &'a StdMutex<Vec<Orphan>>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(buffers) = self.buffers.take() {
            self.orphans
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Orphan {
                    _buffers: buffers,
                    peers: std::mem::take(&mut self.peers),
                });
        }
    }
}

fn setup_err(why: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(format!("NCCL: {why}"))
}

impl NcclTransport {
    /// Joins an NCCL communicator of `size` ranks as `rank`: rank 0 creates the unique id,
    /// the bootstrap store's all-gather shares it, and every rank initializes its
    /// communicator on its device (see [`NcclOptions::device`]). Every rank takes part in the
    /// all-gather even when it cannot run NCCL, so all of them fail together with a message
    /// naming the ranks that cannot, instead of waiting for them.
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] for `rank >= size`; [`TransportError::Setup`] when
    /// the CUDA driver, NCCL (≥ 2.14) or a device is missing on any rank (the message says
    /// which and what), when the store fails, or when the communicator is not complete
    /// within [`NcclOptions::init_timeout`] (NCCL also refuses two ranks on one GPU).
    ///
    /// # Cancel safety
    /// Not cancel safe: the store contribution may be recorded, and the other ranks wait
    /// for this one until their init timeout.
    ///
    /// # Example
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use byzcoll_runtime::bootstrap::{JobAuth, JobSecret, StoreClient};
    /// use byzcoll_runtime::{Communicator, Config};
    /// use byzcoll_transport_nccl::{NcclOptions, NcclTransport};
    ///
    /// let (rank, size, local_rank) = (1, 4, 1); // from the launcher
    /// # let secret_hex = "00".repeat(32);
    /// // The job's secret (64 hex digits), shared by every rank of the job.
    /// let auth = JobAuth::Secret(JobSecret::from_hex(&secret_hex)?);
    /// let store = StoreClient::new("node0:29500", rank, size, Duration::from_secs(60), auth);
    /// let options = NcclOptions { local_rank: Some(local_rank), ..NcclOptions::default() };
    /// let transport = NcclTransport::from_store(&store, rank, size, options).await?;
    /// let mut comm = Communicator::new(Box::new(transport), Config::default());
    /// comm.barrier().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn from_store(
        store: &StoreClient,
        rank: Rank,
        size: usize,
        options: NcclOptions,
    ) -> Result<Self, TransportError> {
        if rank >= size {
            return Err(TransportError::InvalidUsage(format!(
                "rank {rank} in a world of {size}"
            )));
        }
        let (explicit, local) = (options.device, options.local_rank);
        let local_setup = tokio::task::spawn_blocking(move || {
            let count = check_machine()?;
            let device = setup::pick_device(explicit, local, rank, count)?;
            let id = if rank == 0 {
                Some(ffi::unique_id()?)
            } else {
                None
            };
            Ok::<_, String>((device, id))
        })
        .await
        .unwrap_or_else(|e| Err(format!("setup task failed: {e}")));
        let contribution = match &local_setup {
            Ok((_, id)) => Contribution::Ready(*id),
            Err(why) => Contribution::Unable(why.clone()),
        };
        let values = store
            .all_gather(STORE_KEY, &contribution.encode())
            .await
            .map_err(|e| setup_err(format!("sharing the unique id: {e}")))?;
        let id = setup::root_id(&values).map_err(setup_err)?;
        let (device, _) = local_setup.map_err(setup_err)?;
        Self::connect(id, rank, size, device, &options).await
    }

    /// A world of one rank (NCCL on a one-GPU machine): no peers, but a real communicator.
    ///
    /// # Errors
    /// [`TransportError::Setup`] as for [`NcclTransport::from_store`].
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call aborts the half-made communicator.
    pub async fn single(options: NcclOptions) -> Result<Self, TransportError> {
        let (explicit, local) = (options.device, options.local_rank);
        let (device, id) = tokio::task::spawn_blocking(move || {
            let count = check_machine()?;
            let device = setup::pick_device(explicit, local, 0, count)?;
            Ok::<_, String>((device, ffi::unique_id()?))
        })
        .await
        .unwrap_or_else(|e| Err(format!("setup task failed: {e}")))
        .map_err(setup_err)?;
        Self::connect(id, 0, 1, device, &options).await
    }

    async fn connect(
        id: [u8; ID_BYTES],
        rank: Rank,
        size: usize,
        device: usize,
        options: &NcclOptions,
    ) -> Result<Self, TransportError> {
        let (stream, comm) = tokio::task::spawn_blocking(move || {
            let ctx = CudaContext::new(device).map_err(|e| format!("CUDA device {device}: {e}"))?;
            // SAFETY: the transport uses its buffers on this one stream only, so cudarc's
            // cross-stream event tracking is not needed (and would put event records on
            // the stream while an NCCL group is in progress, which NCCL forbids).
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx
                .new_stream()
                .map_err(|e| format!("creating a stream on device {device}: {e}"))?;
            ctx.bind_to_thread()
                .map_err(|e| format!("CUDA device {device}: {e}"))?;
            let comm = Comm::start(size, &id, rank)
                .map_err(|e| format!("ncclCommInitRankConfig on device {device}: {e}"))?;
            Ok::<_, String>((stream, comm))
        })
        .await
        .unwrap_or_else(|e| Err(format!("setup task failed: {e}")))
        .map_err(setup_err)?;
        let deadline = Instant::now() + options.init_timeout;
        let joined = poll_until(deadline, || Ok(comm.state()? == State::Ready)).await;
        if let Err(cause) = joined {
            abort_blocking(comm, stream.context().clone()).await;
            return Err(setup_err(match cause {
                AbortCause::Deadline => format!(
                    "the communicator of {size} ranks was not complete within {:?}: are all \
                     ranks running, each on its own GPU?",
                    options.init_timeout
                ),
                AbortCause::Failed(why) => format!("joining the communicator failed: {why}"),
            }));
        }
        tracing::debug!(rank, size, device, "NCCL communicator ready");
        Ok(NcclTransport {
            rank,
            size,
            device,
            max_message_bytes: options.max_message_bytes,
            inner: tokio::sync::Mutex::new(Inner {
                comm: Some(comm),
                broken: None,
                stream,
            }),
            orphans: StdMutex::new(Vec::new()),
        })
    }

    /// The CUDA device ordinal this rank uses.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Posts sends to and receives from this rank itself through NCCL (which allows it; the
    /// [`Transport`] contract does not), so a one-GPU machine can check the whole device path
    /// — copies, grouped send/recv, completion polling, deadline and abort — at world size 1.
    /// `sends` are `(tag, payload)`, `recvs` are `(tag, len)`; outcomes follow `recvs`.
    ///
    /// # Errors
    /// As [`Transport::exchange`].
    ///
    /// # Cancel safety
    /// As [`Transport::exchange`] on this transport (see the crate docs).
    #[doc(hidden)]
    pub async fn loopback(
        &self,
        collective: u64,
        sends: Vec<(Tag, Bytes)>,
        recvs: Vec<(Tag, usize)>,
        deadline: Instant,
    ) -> Result<Vec<RecvOutcome>, TransportError> {
        let me = self.rank;
        let step = Step {
            collective,
            step: 0,
            call: 0,
            sends: sends
                .into_iter()
                .map(|(tag, payload)| SendOp {
                    peer: me,
                    tag,
                    payload: Payload::Host(payload),
                })
                .collect(),
            recvs: recvs
                .into_iter()
                .map(|(tag, len)| RecvOp { peer: me, tag, len })
                .collect(),
            deadline,
            quorum: None,
        };
        self.run_checked(step).await
    }

    async fn run(&self, step: Step) -> Result<Vec<RecvOutcome>, TransportError> {
        step.validate(self.rank, self.size, &self.capabilities())?;
        self.run_checked(step).await
    }

    async fn run_checked(&self, step: Step) -> Result<Vec<RecvOutcome>, TransportError> {
        let plan = Plan::new(&step)?;
        let at = (step.collective, step.step);
        let fill = |stream: &Arc<CudaStream>, buf: &mut CudaSlice<u8>, op: &Op| {
            let Payload::Host(bytes) = &step.sends[op.index].payload else {
                return Err("payload in a memory kind this transport does not support".into());
            };
            let mut dst = buf.slice_mut(op.offset..op.offset + op.len);
            stream
                .memcpy_htod(&bytes[..], &mut dst)
                .map_err(|e| format!("copying a payload to the device: {e}"))
        };
        let Some((inner, recv)) = self
            .exchange_planned(at, step.deadline, &plan, &fill, false)
            .await?
        else {
            return Ok(Vec::new());
        };
        let received = match recv {
            None => Bytes::new(),
            Some(recv) => match inner.stream.clone_dtoh(&recv) {
                Ok(v) => Bytes::from(v),
                Err(e) => {
                    let mut inner = inner;
                    let why = format!("copying received bytes to the host: {e}");
                    return Err(self
                        .abort(&mut inner, at, Vec::new(), AbortCause::Failed(why))
                        .await);
                }
            },
        };
        let mut outcomes = vec![RecvOutcome::Missing; step.recvs.len()];
        for op in &plan.recvs {
            let bytes = received.slice(op.offset..op.offset + op.len);
            outcomes[op.index] = RecvOutcome::Received(Payload::Host(bytes));
        }
        Ok(outcomes)
    }

    /// Posts `plan` as one group (send payloads written into the send buffer by `fill`) and
    /// waits for it; returns the transport's lock and the receive buffer, or `None` for an
    /// empty plan. With `wait_for_sources`, the stream is synchronized after `fill`, so the
    /// memory `fill` read from is no longer needed once this is first polled.
    async fn exchange_planned(
        &self,
        at: (u64, u32),
        deadline: Instant,
        plan: &Plan,
        fill: &Fill<'_>,
        wait_for_sources: bool,
    ) -> Result<Option<(tokio::sync::MutexGuard<'_, Inner>, Option<CudaSlice<u8>>)>, TransportError>
    {
        let mut inner = self.inner.lock().await;
        if let Some(broken) = &inner.broken {
            return Err(broken.clone().into());
        }
        if plan.is_empty() {
            return Ok(None);
        }
        if let Err((cause, peers)) = self.settle(&inner, deadline).await {
            return Err(self.abort(&mut inner, at, peers, cause).await);
        }
        let peers = plan.peers();
        let (mut flight, state) = match self.post(&inner, plan, &peers, fill, wait_for_sources) {
            Ok(posted) => posted,
            Err(why) => {
                return Err(self
                    .abort(&mut inner, at, peers, AbortCause::Failed(why))
                    .await)
            }
        };
        let done = self
            .complete(&inner, deadline, state == State::InProgress)
            .await;
        if let Err(cause) = done {
            drop(flight);
            return Err(self.abort(&mut inner, at, peers, cause).await);
        }
        let buffers = flight.buffers.take();
        drop(flight);
        Ok(Some((inner, buffers.and_then(|b| b.recv))))
    }

    /// Exchanges one step whose send payloads are in device memory, leaving the received
    /// bytes on the device: no host copy either way (the GPU aggregation path). Each send
    /// is copied into the transport's own send buffer before anything is posted, and the
    /// receives land in one buffer the caller then owns, so a cancelled exchange never leaves
    /// NCCL reading or writing the caller's memory. Matching, deadlines and aborts are those
    /// of [`Transport::exchange`]; every rank must call this at the same point of its step
    /// sequence.
    ///
    /// # Safety
    /// Each send's `ptr` must address `len` readable bytes on this transport's device, with
    /// every write to them already complete (synchronize the stream that wrote them), for as
    /// long as the returned future is alive.
    ///
    /// # Errors
    /// [`TransportError::InvalidUsage`] for peers out of range or this rank;
    /// [`TransportError::Aborted`] when the step did not complete (see the crate docs).
    pub async unsafe fn exchange_device(
        &self,
        collective: u64,
        step: u32,
        sends: &[DeviceSend],
        recvs: &[RecvOp],
        deadline: Instant,
    ) -> Result<DeviceReceived, TransportError> {
        let peer_ok = |p: Rank| p < self.size && p != self.rank;
        if let Some(bad) = sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer))
            .find(|&p| !peer_ok(p))
        {
            return Err(TransportError::InvalidUsage(format!(
                "device exchange with rank {bad} from rank {} in a world of {}",
                self.rank, self.size
            )));
        }
        let plan = Plan::from_ops(
            sends.iter().map(|s| (s.peer, s.tag, s.len)),
            recvs.iter().map(|r| (r.peer, r.tag, r.len)),
        )?;
        let fill = |stream: &Arc<CudaStream>, buf: &mut CudaSlice<u8>, op: &Op| {
            let src = sends[op.index].ptr;
            let (dst, _record) = buf.device_ptr_mut(stream);
            // SAFETY: the caller guarantees `len` readable bytes at `src` on this device;
            // the destination range lies inside the send buffer (the plan's layout).
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst + op.offset as u64,
                    src,
                    op.len,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| format!("copying a device payload: {e}"))
        };
        let at = (collective, step);
        let planned = self
            .exchange_planned(at, deadline, &plan, &fill, true)
            .await?;
        let mut ranges = vec![0..0; recvs.len()];
        for op in &plan.recvs {
            ranges[op.index] = op.offset..op.offset + op.len;
        }
        Ok(DeviceReceived {
            buffer: planned.and_then(|(_, recv)| recv),
            ranges,
        })
    }

    /// Waits until the stream has finished the work of cancelled exchanges (so new copies
    /// on it do not block) and checks that NCCL reports no error.
    async fn settle(
        &self,
        inner: &Inner,
        deadline: Instant,
    ) -> Result<(), (AbortCause, Vec<Rank>)> {
        let orphan_peers = {
            let orphans = self.orphans.lock().unwrap_or_else(PoisonError::into_inner);
            let mut peers: Vec<Rank> = orphans.iter().flat_map(|o| o.peers.clone()).collect();
            peers.sort_unstable();
            peers.dedup();
            (!orphans.is_empty()).then_some(peers)
        };
        let Some(comm) = inner.comm.as_ref() else {
            return Err((AbortCause::Failed("no communicator".into()), Vec::new()));
        };
        let Some(peers) = orphan_peers else {
            return match comm.state() {
                Ok(State::Ready) => Ok(()),
                Ok(State::InProgress) => Err((
                    AbortCause::Failed("an NCCL call is in progress between steps".into()),
                    Vec::new(),
                )),
                Err(why) => Err((AbortCause::Failed(why), Vec::new())),
            };
        };
        let fail = |cause| (cause, peers.clone());
        poll_until(deadline, || Ok(comm.state()? == State::Ready))
            .await
            .map_err(fail)?;
        let fence = inner
            .stream
            .record_event(None)
            .map_err(|e| fail(AbortCause::Failed(format!("recording an event: {e}"))))?;
        let ctx = inner.stream.context();
        poll_until(deadline, || {
            ctx.bind_to_thread().map_err(|e| format!("CUDA: {e}"))?;
            fence.try_is_complete().map_err(|e| format!("CUDA: {e}"))
        })
        .await
        .map_err(fail)?;
        self.orphans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        Ok(())
    }

    /// Fills the send buffer with `fill` and posts every operation of the plan in one group.
    /// No await: NCCL's group state is per thread.
    fn post(
        &self,
        inner: &Inner,
        plan: &Plan,
        peers: &[Rank],
        fill: &Fill<'_>,
        wait_for_sources: bool,
    ) -> Result<(InFlight<'_>, State), String> {
        let comm = inner.comm.as_ref().ok_or("no communicator")?;
        let stream = &inner.stream;
        let cuda = |what: &str, e: cudarc::driver::DriverError| format!("{what}: {e}");
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| cuda("binding the CUDA context", e))?;
        let alloc = |bytes: usize| {
            // SAFETY: only the ranges NCCL writes (whole receives, all completed before
            // they are read) or that `fill` writes are ever read.
            unsafe { stream.alloc::<u8>(bytes) }
                .map_err(|e| cuda(&format!("allocating {bytes} device bytes"), e))
        };
        let mut send = if plan.sends.is_empty() {
            None
        } else {
            Some(alloc(plan.send_bytes)?)
        };
        let recv = if plan.recvs.is_empty() {
            None
        } else {
            Some(alloc(plan.recv_bytes)?)
        };
        if let Some(buf) = send.as_mut() {
            for op in plan.sends.iter().filter(|o| o.len > 0) {
                fill(stream, buf, op)?;
            }
            if wait_for_sources {
                stream
                    .synchronize()
                    .map_err(|e| cuda("waiting for the payload copies", e))?;
            }
        }
        let flight = InFlight {
            buffers: Some(Buffers { send, recv }),
            peers: peers.to_vec(),
            orphans: &self.orphans,
        };
        let buffers = flight.buffers.as_ref().ok_or("buffers vanished")?;
        let send_ptr = buffers.send.as_ref().map(|b| b.device_ptr(stream).0);
        let recv_ptr = buffers.recv.as_ref().map(|b| b.device_ptr(stream).0);
        let cu_stream = stream.cu_stream();
        let ((), state) = ffi::group(|| {
            for op in &plan.sends {
                let base = send_ptr.ok_or("no send buffer")?;
                // SAFETY: the range lies in the send buffer, which `flight` keeps alive (as
                // an orphan if the exchange is dropped) until the stream is past this step
                // or the communicator is aborted.
                unsafe { comm.send(base + op.offset as u64, op.wire, op.peer, cu_stream) }
                    .map_err(|e| format!("ncclSend to rank {}: {e}", op.peer))?;
            }
            for op in &plan.recvs {
                let base = recv_ptr.ok_or("no receive buffer")?;
                // SAFETY: as above for the receive buffer; receive ranges do not overlap.
                unsafe { comm.recv(base + op.offset as u64, op.wire, op.peer, cu_stream) }
                    .map_err(|e| format!("ncclRecv from rank {}: {e}", op.peer))?;
            }
            Ok(())
        })?;
        Ok((flight, state))
    }

    /// Waits for the posted group: first until NCCL has enqueued it (non-blocking group end),
    /// then until the stream has run it.
    async fn complete(
        &self,
        inner: &Inner,
        deadline: Instant,
        in_progress: bool,
    ) -> Result<(), AbortCause> {
        let comm = inner
            .comm
            .as_ref()
            .ok_or_else(|| AbortCause::Failed("no communicator".into()))?;
        if in_progress {
            poll_until(deadline, || Ok(comm.state()? == State::Ready)).await?;
        }
        let event = inner
            .stream
            .record_event(None)
            .map_err(|e| AbortCause::Failed(format!("recording an event: {e}")))?;
        let ctx = inner.stream.context();
        poll_until(deadline, || {
            ctx.bind_to_thread().map_err(|e| format!("CUDA: {e}"))?;
            let done = event.try_is_complete().map_err(|e| format!("CUDA: {e}"))?;
            // Surfaces peer failures NCCL detects before the deadline.
            comm.state()?;
            Ok(done)
        })
        .await
    }

    /// Aborts the communicator and marks the transport broken; returns the step's error.
    async fn abort(
        &self,
        inner: &mut Inner,
        (collective, step): (u64, u32),
        mut peers: Vec<Rank>,
        cause: AbortCause,
    ) -> TransportError {
        {
            let orphans = self.orphans.lock().unwrap_or_else(PoisonError::into_inner);
            peers.extend(orphans.iter().flat_map(|o| o.peers.iter().copied()));
        }
        peers.sort_unstable();
        peers.dedup();
        let failure = NcclFailure::StepAborted {
            collective,
            step,
            ranks: peers,
            cause,
        };
        tracing::error!(rank = self.rank, %failure, "aborting the NCCL communicator");
        inner.broken = Some(NcclFailure::Broken {
            at: Some((collective, step)),
        });
        if let Some(comm) = inner.comm.take() {
            abort_blocking(comm, inner.stream.context().clone()).await;
        }
        failure.into()
    }
}

/// Aborts `comm` on a blocking thread (it joins NCCL's threads), logging a failure.
async fn abort_blocking(comm: Comm, ctx: Arc<CudaContext>) {
    let aborted = tokio::task::spawn_blocking(move || {
        if let Err(e) = ctx.bind_to_thread() {
            tracing::warn!(error = %e, "binding the CUDA context before ncclCommAbort");
        }
        comm.abort()
    })
    .await;
    match aborted {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "ncclCommAbort failed"),
        Err(e) => tracing::warn!(error = %e, "the ncclCommAbort task failed"),
    }
}

/// Polls `ready` until it says `true`, fails, or `deadline` passes, without blocking the
/// executor: it yields between polls for [`SPIN`], then sleeps [`POLL`] between them.
async fn poll_until(
    deadline: Instant,
    mut ready: impl FnMut() -> Result<bool, String>,
) -> Result<(), AbortCause> {
    let spin_until = std::time::Instant::now() + SPIN;
    loop {
        if ready().map_err(AbortCause::Failed)? {
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(AbortCause::Deadline);
        }
        if std::time::Instant::now() < spin_until {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep_until(deadline.min(now + POLL)).await;
        }
    }
}

impl Drop for NcclTransport {
    fn drop(&mut self) {
        // Abort before the orphaned buffers are freed (after this body): NCCL may still be
        // writing into them.
        let inner = self.inner.get_mut();
        if let Some(comm) = inner.comm.take() {
            if let Err(e) = inner.stream.context().bind_to_thread() {
                tracing::warn!(error = %e, "binding the CUDA context before ncclCommAbort");
            }
            drop(comm);
        }
    }
}

impl Transport for NcclTransport {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory: vec![MemoryKind::Host],
            // NCCL cannot withdraw one peer's operation: a step that does not complete by
            // its deadline aborts the whole communicator.
            per_peer_timeout: false,
            quorum: false,
            max_message_bytes: self.max_message_bytes,
            // Its steps are group calls on one stream, run one at a time.
            steps_in_flight: 1,
        }
    }

    fn exchange(
        &self,
        step: Step,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<RecvOutcome>, TransportError>> + Send + '_>> {
        Box::pin(self.run(step))
    }
}
