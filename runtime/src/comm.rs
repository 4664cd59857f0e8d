//! The async driver: executes schedules from [`crate::schedule`] over a [`Transport`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex, PoisonError};

use bytemuck::Pod;
use bytes::Bytes;
use byzcoll_aggregators::Element;
use tokio::time::Instant;

mod members;

use crate::schedule::{self, chunk_range};
use crate::types::{cast_payload, fill_bytes, host_bytes, to_bytes};
use crate::{
    Config, Error, Fault, MsgKey, Payload, PeerFault, Rank, RecvOp, RecvOutcome, Result,
    RoundStats, SendOp, Step, Transport,
};

/// Element-wise reduction of the non-robust [`Communicator::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum (in the element type, like MPI and NCCL).
    Sum,
    /// Minimum (IEEE `min`: a NaN loses to a number).
    Min,
    /// Maximum (IEEE `max`: a NaN loses to a number).
    Max,
}

/// A group of ranks running collectives over one transport.
///
/// Every rank must call the same collectives in the same order (SPMD); each call is numbered
/// and messages are matched by that number, so a late message from an earlier call is never
/// mistaken for a current one.
///
/// [`Communicator::split`] makes communicators of subsets of the ranks over the same
/// transport, each with its own stream of collective numbers ([`crate::MsgKey::stream`]).
/// The communicators over one transport take turns: a collective holds the transport from its
/// first step to its last, so only its own steps are in flight (one at a time, or a few in
/// order where the transport allows: [`crate::Capabilities::steps_in_flight`]). As with MPI,
/// ranks that share two communicators must call their collectives on them in the same
/// relative order.
pub struct Communicator {
    transport: Arc<dyn Transport>,
    config: Config,
    /// This communicator's stream: the top bits of its collective numbers.
    stream: u64,
    /// Calls made so far in this communicator's stream.
    next_collective: u64,
    /// Whether the robust call under way is this communicator's first collective (its
    /// sub-rounds then all wait for every input under `Detect`).
    pub(crate) first_call: bool,
    /// What the communicators over one transport share: the turn lock and the highest stream
    /// in use.
    shared: Arc<Shared>,
    pub(crate) owner_tamper: Option<crate::round::host::Tamper>,
    /// Rewrites the bytes this rank sends in robust steps of one name (a test double's
    /// Byzantine rank: feature `fault-injection`).
    pub(crate) step_tamper: Option<(&'static str, crate::round::host::Tamper)>,
    identity: crate::IdentityMode,
    /// The caller's step id ([`Communicator::set_step`]), part of every call's fingerprint.
    step_id: Option<u64>,
    /// What this rank has seen of each peer in its robust rounds.
    pub(crate) health: byzcoll_proto::Health,
    /// What the steps since the last [`Communicator::take_stats`] moved and took.
    stats: RoundStats,
    /// Each rank's rank in the job ([`Communicator::job_ranks`]).
    job_ranks: Arc<[Rank]>,
    /// The job's membership epoch ([`Communicator::epoch`]).
    epoch: u64,
}

/// What every communicator over one transport shares.
#[derive(Default)]
struct Shared {
    /// Held by a collective from its first step to its last.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// The highest stream any communicator over the transport uses.
    streams: AtomicU64,
    /// Bootstrap resources (such as a rendezvous store hosted by this rank), kept as long as
    /// any communicator over the transport lives.
    keep_alive: StdMutex<Vec<Arc<dyn std::any::Any + Send + Sync>>>,
    /// Whether a call of any communicator over the transport ran a quorum step: a rank can
    /// then still be behind the others when one closes ([`Communicator::close`]).
    quorum_steps: AtomicBool,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("transport", &self.transport)
            .field("config", &self.config)
            .field("stream", &self.stream)
            .field("next_collective", &self.next_collective)
            .field("owner_tamper", &self.owner_tamper.is_some())
            .finish_non_exhaustive()
    }
}

impl Communicator {
    /// A communicator over `transport`.
    pub fn new(transport: Box<dyn Transport>, config: Config) -> Self {
        let health = byzcoll_proto::Health::new(transport.size());
        let job_ranks = (0..transport.size()).collect();
        Communicator {
            transport: Arc::from(transport),
            config,
            stream: 0,
            next_collective: 0,
            first_call: false,
            shared: Arc::default(),
            owner_tamper: None,
            step_tamper: None,
            identity: crate::IdentityMode::Local,
            step_id: None,
            health,
            stats: RoundStats::default(),
            job_ranks,
            epoch: 0,
        }
    }

    /// Each rank's rank in the job, in this communicator's rank order: `0..n` for the
    /// communicator a job starts with; a split or shrink keeps its members' job ranks, and a
    /// world a restarted rank rejoined (`byzcoll::admit`) gives them too.
    pub fn job_ranks(&self) -> &[Rank] {
        &self.job_ranks
    }

    /// The job's membership epoch: 0 for the communicator a job starts with, and one more for
    /// each world a rejoin made (`byzcoll::admit`); splits and shrinks keep it.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Sets [`Communicator::job_ranks`] and [`Communicator::epoch`], for a communicator that a
    /// rejoin built over a fresh transport (`byzcoll::admit` and `byzcoll::rejoin` call it).
    ///
    /// # Errors
    /// [`Error::InvalidUsage`] when `job_ranks` does not hold one rank per member.
    pub fn set_job_world(&mut self, job_ranks: Vec<Rank>, epoch: u64) -> Result<()> {
        if job_ranks.len() != self.size() {
            return Err(Error::InvalidUsage(format!(
                "{} job ranks for a communicator of {}",
                job_ranks.len(),
                self.size()
            )));
        }
        self.job_ranks = job_ranks.into();
        self.epoch = epoch;
        Ok(())
    }

    /// What this rank has seen of each other rank in its robust rounds, in rank order: how
    /// many rounds in a row it has been late, missing, malformed or disagreeing, and how
    /// often since the communicator was made. This rank's own observations only (see
    /// [`PeerHealth`](crate::PeerHealth)): evidence for the application, never an accusation
    /// the library acts on by itself.
    pub fn health(&self) -> Vec<crate::PeerHealth> {
        self.health.of_peers(self.rank())
    }

    /// Sets [`Config::agreement`], a job-wide parameter: every rank must choose alike. For
    /// worlds built by hand; a job joined through `byzcoll::init_with` takes it from its
    /// configuration, where the ranks compare it at setup.
    pub fn set_agreement(&mut self, agreement: crate::Agreement) {
        self.config.agreement = agreement;
    }

    /// Sets [`Config::sub_round_bytes`], a job-wide parameter (as
    /// [`Communicator::set_agreement`] says).
    pub fn set_sub_round_bytes(&mut self, bytes: usize) {
        self.config.sub_round_bytes = bytes;
    }

    /// Sets [`Config::ring_part_bytes`], a job-wide parameter (as
    /// [`Communicator::set_agreement`] says): up to [`RING_PARTS`] parts per chunk.
    pub fn set_ring_part_bytes(&mut self, bytes: usize) {
        self.config.ring_part_bytes = bytes;
    }

    /// Sets [`Config::attribution`]: whether this rank's robust rounds measure each input
    /// against the aggregate (on by default; off leaves
    /// [`RoundReport::attribution`](crate::RoundReport::attribution) `None`).
    pub fn set_attribution(&mut self, on: bool) {
        self.config.attribution = on;
    }

    /// Sets [`Config::doubling_max_bytes`]: up to how many bytes per rank
    /// [`Communicator::all_reduce`] uses recursive doubling (0: always the ring). Every rank
    /// must choose alike; a rank that does not is out of step in the calls where the choice
    /// differs.
    pub fn set_doubling_max_bytes(&mut self, bytes: usize) {
        self.config.doubling_max_bytes = bytes;
    }

    /// Sets [`Config::stragglers`], a job-wide parameter (as [`Communicator::set_agreement`]
    /// says).
    pub fn set_stragglers(&mut self, stragglers: crate::Stragglers) {
        self.config.stragglers = stragglers;
    }

    /// The agreement policy of robust rounds.
    pub fn agreement(&self) -> crate::Agreement {
        self.config.agreement
    }

    /// Records how the job's ranks proved who they are (the bootstrap sets it: per-rank keys,
    /// the shared secret, or `BYZCOLL_ALLOW_UNAUTHENTICATED=1`); every
    /// [`RoundReport`](crate::RoundReport) then says so. In-process worlds and worlds of one
    /// are [`IdentityMode::Local`](crate::IdentityMode::Local).
    pub fn set_identity(&mut self, mode: crate::IdentityMode) {
        self.identity = mode;
    }

    /// How the job's ranks proved who they are.
    pub fn identity(&self) -> crate::IdentityMode {
        self.identity
    }

    /// Sets the step id every later collective call carries in its fingerprint (until it is
    /// set again; `None`: no step id), e.g. the training step.
    ///
    /// Every collective call carries a fingerprint of what the caller asked for (the
    /// operation, lengths, element type, rule and its parameters, policy) and of this step
    /// id; a rank whose call does not match is [`Fault::OutOfStep`](crate::Fault::OutOfStep)
    /// on the ranks that receive from it, never a message of another call taken as this
    /// one's. Without a step id, a rank that skips one call and makes the next one with
    /// identical arguments cannot be told apart by its fingerprint: calls are matched by count,
    /// so its inputs go to the others' previous call. A step id that differs per call (or per
    /// training step, with the same calls in each) makes that an `OutOfStep` fault too.
    /// Framed transports (TCP, UCX, libfabric, in-process) check fingerprints; NCCL matches
    /// messages by order and does not.
    pub fn set_step(&mut self, step: Option<u64>) {
        self.step_id = step;
    }

    /// The step id set by [`Communicator::set_step`].
    pub fn step(&self) -> Option<u64> {
        self.step_id
    }

    /// Whether the job's membership is authenticated (in-process worlds and worlds of one
    /// need no authentication and count as authenticated).
    pub fn is_authenticated(&self) -> bool {
        self.identity != crate::IdentityMode::Unauthenticated
    }

    /// Ties the lifetime of `resource` (a hosted rendezvous store, say) to the communicator.
    pub fn keep_alive(&mut self, resource: impl std::any::Any + Send + Sync) {
        self.shared
            .keep_alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::new(resource));
    }

    /// Takes what this rank had seen of its peers in `other` ([`Communicator::health`]) for
    /// the same job ranks here ([`Communicator::job_ranks`]): for a communicator that replaces
    /// `other` over a new transport (a rejoin), so that a laggard among the members is still
    /// one. A rank that `other` does not have (one admitted after a restart) starts healthy.
    pub fn carry_health_of(&mut self, other: &Communicator) {
        let old: Vec<Option<Rank>> = self
            .job_ranks
            .iter()
            .map(|j| other.job_ranks.iter().position(|o| o == j))
            .collect();
        self.health = other.health.renumbered(&old);
    }

    /// Ties what keeps `other` alive ([`Communicator::keep_alive`]) to this communicator too:
    /// for a communicator that replaces `other` over a new transport (a rejoin), so that a
    /// store this rank hosts outlives the old one.
    pub fn keep_alive_of(&mut self, other: &Communicator) {
        if Arc::ptr_eq(&self.shared, &other.shared) {
            return;
        }
        let theirs = other
            .shared
            .keep_alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        self.shared
            .keep_alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(theirs);
    }

    /// Closes the communicator, collectively: every member calls it, in the same order as
    /// its other collectives.
    ///
    /// Where a call ran a quorum step (stragglers allowed, [`Config::stragglers`]), a rank
    /// can still be rounds behind the others, and needs their messages for those rounds: this
    /// rank first waits, up to the step timeout, until every peer not missing in its last
    /// round has reached its close too (a *farewell*, one empty message each way), so that a
    /// fast rank that finishes never cuts a straggler off. Then, when no other communicator
    /// shares its transport (those split or shrunk from it do), it lets the transport finish
    /// what the last calls left in flight ([`Transport::close`]: over TCP, frames still
    /// queued for a slower peer, for at most `TcpOptions::linger`).
    ///
    /// Call it before the process exits: a call can return before its last sends have reached
    /// every peer (a quorum step does not wait for them), and exiting would cut them. Dropping
    /// the communicator instead is [`Communicator::close_at_once`] in the background while
    /// the async runtime runs its tasks (a current-thread runtime runs them only while
    /// something awaits on it).
    pub async fn close(mut self) {
        if self.shared.quorum_steps.load(Ordering::Relaxed) && self.size() > 1 {
            self.farewell().await;
        }
        self.close_at_once().await;
    }

    /// Closes the communicator without waiting for the others to reach their close (an
    /// abort, or a rank leaving a job the others go on with): only lets the transport finish
    /// what the last calls left in flight, as [`Communicator::close`] does last.
    pub async fn close_at_once(self) {
        if Arc::strong_count(&self.transport) == 1 {
            self.transport.close().await;
        }
    }

    /// Notes that a call ran a quorum step ([`Communicator::close`] then says farewell).
    pub(crate) fn ran_quorum_steps(&self) {
        self.shared.quorum_steps.store(true, Ordering::Relaxed);
    }

    /// [`Communicator::close`]'s farewell: an empty message to every peer, and one awaited
    /// from each peer not missing in this rank's last round, until the step timeout. Its
    /// outcomes decide nothing: a peer that never comes is one this rank can no longer help.
    /// A quorum step that waits for all its receives: its sends never hold it (a rendezvous
    /// transport would hold a send to a peer that never posts until the deadline).
    async fn farewell(&mut self) {
        let (me, n) = (self.rank(), self.size());
        let gone: Vec<Rank> = self
            .health()
            .iter()
            .filter(|p| matches!(p.streak, Some((crate::Symptom::Missing, _))))
            .map(|p| p.rank)
            .collect();
        let timeout = self.config.step_timeout;
        let mut seq = self.begin("farewell", crate::calls::farewell());
        let (sends, recvs) = empty_exchange(me, n, |p| !gone.contains(&p));
        let all = Some(crate::Quorum::every(recvs.len()));
        let farewell = seq.run_as("farewell", timeout, all, sends, recvs);
        if let Err(e) = farewell.await {
            tracing::debug!(rank = me, error = %e, "farewell failed");
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> Rank {
        self.transport.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.transport.size()
    }

    /// The transport underneath.
    pub fn transport(&self) -> &dyn Transport {
        self.transport.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Replaces the configuration for the collectives that follow (every rank must choose
    /// alike, as for [`Communicator::set_agreement`]).
    pub fn set_config(&mut self, config: Config) {
        self.config = config;
    }

    /// Starts collective call `op` with fingerprint `call` ([`crate::calls`]): its number.
    /// How many collectives this communicator has begun (alike on every rank).
    pub(crate) fn collectives_begun(&self) -> u64 {
        self.next_collective
    }

    pub(crate) fn begin(&mut self, op: &'static str, call: u64) -> Sequence<'_> {
        // 2^48 calls per communicator: at a million calls a second, nine years.
        let collective = MsgKey::stream_start(self.stream).collective | self.next_collective;
        self.next_collective += 1;
        Sequence {
            call,
            op,
            rank: self.transport.rank(),
            transport: self.transport.as_ref(),
            turn: Turn::Waiting(self.shared.turn.clone()),
            timeout: self.config.step_timeout,
            quorum: None,
            collective,
            step: 0,
            stats: &mut self.stats,
        }
    }

    /// Takes the next collective number for a collective run outside the runtime's schedules
    /// (the device-vector path over NCCL), so that its messages are numbered in this
    /// communicator's sequence like every other call's. Every rank must call it at the same
    /// point of its sequence.
    pub fn reserve_collective(&mut self) -> u64 {
        self.begin("external", 0).collective
    }

    /// What the steps run since the last call moved and took (every collective adds to it;
    /// the robust collectives return theirs in [`RoundReport::stats`](crate::RoundReport)).
    pub fn take_stats(&mut self) -> RoundStats {
        std::mem::take(&mut self.stats)
    }

    /// Blocks until every rank has entered the barrier.
    ///
    /// # Errors
    /// [`Error::PeerFaults`] naming the ranks that did not arrive before the step timeout.
    ///
    /// # Cancel safety
    /// Not cancel safe: a dropped call leaves the other ranks waiting until their timeout.
    pub async fn barrier(&mut self) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let mut seq = self.begin("barrier", crate::calls::barrier(self.step_id));
        let (sends, recvs) = empty_exchange(me, n, |_| true);
        seq.run_strict("barrier", sends, recvs).await.map(drop)
    }

    /// Copies `root`'s `buf` into every other rank's `buf`. Every rank passes a buffer of the
    /// same length; non-root contents are overwritten. The root sends directly to each rank.
    ///
    /// # Errors
    /// [`Error::InvalidUsage`] for a root out of range; [`Error::PeerFaults`] when the root's
    /// message is missing or has another length.
    ///
    /// # Cancel safety
    /// Not cancel safe: other ranks wait for this one until their timeout.
    pub async fn broadcast_into<T: Pod>(&mut self, root: Rank, buf: &mut [T]) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let call = crate::calls::broadcast(root, byte_len(buf), self.step_id);
        let mut seq = self.begin("broadcast", call);
        if root >= n {
            return Err(Error::InvalidUsage(format!(
                "broadcast root {root} in a world of {n}"
            )));
        }
        if me == root {
            let payload = Payload::Host(to_bytes(buf));
            let sends = schedule::direct_peers(me, n).map(|p| send(p, payload.clone()));
            seq.run_strict("broadcast", sends.collect(), Vec::new())
                .await?;
        } else {
            let got = seq
                .run_strict("broadcast", Vec::new(), vec![recv(root, byte_len(buf))])
                .await?;
            copy_payload(&got[0], buf);
        }
        Ok(())
    }

    /// Gathers every rank's `send` into `recv`, ordered by rank: rank `r`'s block lands at
    /// `recv[r * send.len()..(r + 1) * send.len()]`.
    ///
    /// # Errors
    /// [`Error::InvalidUsage`] when `recv.len() != size * send.len()`; [`Error::PeerFaults`]
    /// naming the ranks whose block was missing or malformed.
    ///
    /// # Cancel safety
    /// Not cancel safe: other ranks wait for this one until their timeout.
    pub async fn all_gather_into<T: Pod>(
        &mut self,
        send_buf: &[T],
        recv_buf: &mut [T],
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let call = crate::calls::all_gather(byte_len(send_buf), byte_len(recv_buf), self.step_id);
        let mut seq = self.begin("all_gather", call);
        let block = send_buf.len();
        if recv_buf.len() != block * n {
            return Err(Error::InvalidUsage(format!(
                "all_gather: receive buffer holds {} elements, expected {n} x {block}",
                recv_buf.len()
            )));
        }
        let payload = Payload::Host(to_bytes(send_buf));
        let sends = schedule::direct_peers(me, n).map(|p| send(p, payload.clone()));
        let recvs = schedule::direct_peers(me, n).map(|p| recv(p, byte_len(send_buf)));
        let got = seq
            .run_strict("all_gather", sends.collect(), recvs.collect())
            .await?;
        for (p, payload) in schedule::direct_peers(me, n).zip(&got) {
            copy_payload(payload, &mut recv_buf[p * block..(p + 1) * block]);
        }
        recv_buf[me * block..(me + 1) * block].copy_from_slice(send_buf);
        Ok(())
    }

    /// Personalised exchange: block `p` of `send` (blocks of `send.len() / size` elements) goes
    /// to rank `p`, and block `p` of `recv` comes from rank `p`.
    ///
    /// # Errors
    /// [`Error::InvalidUsage`] when the lengths differ or are not a multiple of `size`;
    /// [`Error::PeerFaults`] naming the ranks whose block was missing or malformed.
    ///
    /// # Cancel safety
    /// Not cancel safe: other ranks wait for this one until their timeout.
    pub async fn all_to_all_into<T: Pod>(
        &mut self,
        send_buf: &[T],
        recv_buf: &mut [T],
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let call = crate::calls::all_to_all(byte_len(send_buf), byte_len(recv_buf), self.step_id);
        let mut seq = self.begin("all_to_all", call);
        if send_buf.len() != recv_buf.len() || !send_buf.len().is_multiple_of(n) {
            return Err(Error::InvalidUsage(format!(
                "all_to_all: send ({}) and receive ({}) lengths must be equal multiples of {n}",
                send_buf.len(),
                recv_buf.len()
            )));
        }
        let block = send_buf.len() / n;
        let range = |p: Rank| p * block..(p + 1) * block;
        let sends = schedule::direct_peers(me, n)
            .map(|p| send(p, Payload::Host(to_bytes(&send_buf[range(p)]))));
        let recvs = schedule::direct_peers(me, n).map(|p| recv(p, block * size_of::<T>()));
        let got = seq
            .run_strict("all_to_all", sends.collect(), recvs.collect())
            .await?;
        for (p, payload) in schedule::direct_peers(me, n).zip(&got) {
            copy_payload(payload, &mut recv_buf[range(p)]);
        }
        recv_buf[range(me)].copy_from_slice(&send_buf[range(me)]);
        Ok(())
    }

    /// Non-robust all-reduce: every rank's `buf` becomes the element-wise `op` of all ranks'
    /// `buf`s; every rank ends with bitwise the same result. Up to
    /// [`Config::doubling_max_bytes`] ([`DOUBLING_MAX_BYTES`] by default),
    /// recursive doubling (`⌈log2 n⌉` steps, two more when `n` is not a power of two: the
    /// latency-optimal schedule MPI uses for small vectors); above, ring reduce-scatter then ring
    /// all-gather (the bandwidth-optimal schedule NCCL and MPI use). This is the baseline that robust
    /// rules are compared with: one faulty rank corrupts every result, silently.
    ///
    /// Each ring step's chunk goes in parts of at least [`RING_PART_BYTES`] (up to
    /// [`RING_PARTS`]; [`Communicator::set_ring_part_bytes`]), each its own step, with up to [`Capabilities::steps_in_flight`] steps
    /// in flight: while one part travels, the one before it is summed (and the steps in flight
    /// are polled between pieces of that work), so a rank does not wait for a whole chunk
    /// before it starts on it. Each partial sum is computed straight into the buffer that
    /// carries it to the next rank, and each part of the all-gather is passed on in the buffer
    /// it arrived in: a part is copied only into `buf`, once, where it ends.
    ///
    /// [`Capabilities::steps_in_flight`]: crate::Capabilities::steps_in_flight
    ///
    /// # Errors
    /// [`Error::PeerFaults`] when a neighbour's part is missing or malformed.
    ///
    /// # Cancel safety
    /// Not cancel safe: `buf` holds partial sums when the call is dropped.
    pub async fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let in_flight = self.transport.capabilities().steps_in_flight.max(1);
        let part_bytes = self.config.ring_part_bytes;
        let doubling = byte_len(buf) <= self.config.doubling_max_bytes;
        let schedule = if doubling { "doubling" } else { "ring" };
        let call =
            crate::calls::all_reduce::<T>(&format!("{op:?} {schedule}"), buf.len(), self.step_id);
        let mut seq = self.begin("all_reduce", call);
        if n == 1 {
            return Ok(());
        }
        if doubling {
            return recursive_doubling(&mut seq, me, n, buf, op).await;
        }
        let d = buf.len();
        let ring = Ring::new(me, n, d, size_of::<T>(), part_bytes, in_flight);
        // The parts whose sends are ready, in the order of their items: the reduce-scatter's
        // first parts are this rank's own; every other is made from the part received
        // `ring.parts` items before it.
        let mut ready: std::collections::VecDeque<Payload> = (0..ring.parts)
            .map(|i| Payload::Host(to_bytes(&buf[ring.send_range(i)])))
            .collect();
        let mut flight = std::collections::VecDeque::with_capacity(ring.in_flight);
        let mut posted = 0;
        for i in 0..ring.items() {
            while flight.len() < ring.in_flight {
                let Some(out) = ready.pop_front() else { break };
                let st = ring.step(posted);
                let len = ring.recv_range(posted).len() * size_of::<T>();
                let mut step = seq
                    .post(vec![send(st.send_to, out)], vec![recv(st.recv_from, len)])
                    .await;
                // Its first poll posts its receive and queues its send, before the next
                // step's: steps are posted in order.
                std::future::poll_fn(|cx| {
                    step.poll_step(cx);
                    std::task::Poll::Ready(())
                })
                .await;
                flight.push_back(step);
                posted += 1;
            }
            std::future::poll_fn(|cx| match poll_all(&mut flight, cx) {
                true => std::task::Poll::Ready(()),
                false => std::task::Poll::Pending,
            })
            .await;
            let done = flight.pop_front().expect("a step is in flight");
            let got = seq.finish_strict("all_reduce", done)?.swap_remove(0);
            let dst = ring.recv_range(i);
            let forward = i + ring.parts < ring.items();
            let next = std::future::poll_fn(|cx| {
                let mut poll = || {
                    poll_all(&mut flight, cx);
                };
                let next = if ring.reducing(i) {
                    let theirs = cast_payload::<T>(&got);
                    let mine = &buf[dst.clone()];
                    let sum = Payload::Host(fill_bytes(dst.len(), |o: &mut [T]| {
                        for p in pieces::<T>(o.len()) {
                            combine_into(op, &mine[p.clone()], &theirs[p.clone()], &mut o[p]);
                            poll();
                        }
                    }));
                    if ring.reduced(i) {
                        copy_payload_polling(&sum, &mut buf[dst.clone()], &mut poll);
                    }
                    sum
                } else {
                    copy_payload_polling(&got, &mut buf[dst.clone()], &mut poll);
                    got.clone()
                };
                std::task::Poll::Ready(next)
            })
            .await;
            if forward {
                ready.push_back(next);
            }
        }
        Ok(())
    }
}

/// The largest vector (bytes per rank) [`Communicator::all_reduce`] reduces by recursive
/// doubling rather than the ring: the crossover measured in `docs/bench/PROFILE.md`. Every rank
/// passes the same length (the call's fingerprint holds it), so every rank picks alike.
pub const DOUBLING_MAX_BYTES: usize = 64 << 10;

/// Recursive doubling: with `p` the largest power of two up to `n`, rank `p + i` first hands
/// its vector to rank `i`; the `p` ranks then exchange with the partner at distance 1, 2, 4, ...
/// and combine; rank `i` finally hands the result back to rank `p + i`. Each combination takes
/// the lower block's value first, so both partners compute bitwise the same value and every
/// rank ends with the same bits.
async fn recursive_doubling<T: Element>(
    seq: &mut Sequence<'_>,
    me: Rank,
    n: usize,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let len = byte_len(buf);
    let combine = |buf: &mut [T], theirs: &Payload, mine_first: bool| {
        let theirs = cast_payload::<T>(theirs);
        let mine = buf.to_vec();
        let (a, b) = if mine_first {
            (&mine[..], &theirs[..])
        } else {
            (&theirs[..], &mine[..])
        };
        combine_into(op, a, b, buf);
    };
    // Fold the ranks beyond the power of two into the first ones.
    if n > p {
        let (sends, recvs) = if me >= p {
            (vec![send(me - p, Payload::Host(to_bytes(buf)))], vec![])
        } else if me < n - p {
            (vec![], vec![recv(me + p, len)])
        } else {
            (vec![], vec![])
        };
        let got = seq.run_strict("all_reduce", sends, recvs).await?;
        if let Some(theirs) = got.first() {
            combine(buf, theirs, true);
        }
    }
    if me < p {
        let mut mask = 1;
        while mask < p {
            let partner = me ^ mask;
            let got = seq
                .run_strict(
                    "all_reduce",
                    vec![send(partner, Payload::Host(to_bytes(buf)))],
                    vec![recv(partner, len)],
                )
                .await?;
            combine(buf, &got[0], me < partner);
            mask <<= 1;
        }
    } else {
        // Idle while the first `p` ranks double: one empty step per doubling round keeps
        // every rank's step numbers alike.
        let mut mask = 1;
        while mask < p {
            seq.run_strict("all_reduce", vec![], vec![]).await?;
            mask <<= 1;
        }
    }
    if n > p {
        let (sends, recvs) = if me >= p {
            (vec![], vec![recv(me - p, len)])
        } else if me < n - p {
            (vec![send(me + p, Payload::Host(to_bytes(buf)))], vec![])
        } else {
            (vec![], vec![])
        };
        let got = seq.run_strict("all_reduce", sends, recvs).await?;
        if let Some(result) = got.first() {
            buf.copy_from_slice(&cast_payload::<T>(result));
        }
    }
    Ok(())
}

/// The smallest part of a ring step's chunk sent as a step of its own by default
/// ([`Communicator::set_ring_part_bytes`]).
pub const RING_PART_BYTES: usize = 1 << 20;

/// The most parts a ring step's chunk is sent in ([`Communicator::all_reduce`]).
pub const RING_PARTS: usize = 4;

/// Bytes of work (summed or copied) between two polls of the steps in flight.
const PIECE_BYTES: usize = 256 << 10;

/// The items of a pipelined ring all-reduce: item `i` is part `i % parts` of ring step
/// `i / parts`, the reduce-scatter's `n - 1` steps, then the all-gather's.
struct Ring {
    me: Rank,
    n: usize,
    d: usize,
    parts: usize,
    in_flight: usize,
}

impl Ring {
    /// Every rank computes the same parts: they depend only on `n`, `d`, the element size and
    /// the transport.
    fn new(me: Rank, n: usize, d: usize, elem: usize, part_bytes: usize, in_flight: usize) -> Ring {
        let chunk_bytes = chunk_range(d, n, 0).len() * elem;
        let parts = match in_flight {
            1 => 1,
            _ => (chunk_bytes / part_bytes.max(elem)).clamp(1, RING_PARTS),
        };
        Ring {
            me,
            n,
            d,
            parts,
            in_flight: in_flight.min(parts),
        }
    }

    fn items(&self) -> usize {
        2 * (self.n - 1) * self.parts
    }

    /// Whether item `i` belongs to the reduce-scatter.
    fn reducing(&self, i: usize) -> bool {
        i / self.parts < self.n - 1
    }

    /// Whether item `i` is a part of this rank's fully reduced chunk.
    fn reduced(&self, i: usize) -> bool {
        i / self.parts == self.n - 2
    }

    fn step(&self, i: usize) -> schedule::RingStep {
        let s = i / self.parts;
        match self.reducing(i) {
            true => schedule::ring_reduce_scatter_step(self.me, self.n, s),
            false => schedule::ring_all_gather_step(self.me, self.n, s - (self.n - 1)),
        }
    }

    fn part(&self, chunk: usize, i: usize) -> std::ops::Range<usize> {
        let c = chunk_range(self.d, self.n, chunk);
        let p = chunk_range(c.len(), self.parts, i % self.parts);
        c.start + p.start..c.start + p.end
    }

    fn send_range(&self, i: usize) -> std::ops::Range<usize> {
        self.part(self.step(i).send_chunk, i)
    }

    fn recv_range(&self, i: usize) -> std::ops::Range<usize> {
        self.part(self.step(i).recv_chunk, i)
    }
}

/// Polls every step in flight; whether the first has completed.
fn poll_all(
    flight: &mut std::collections::VecDeque<Posted<'_>>,
    cx: &mut std::task::Context<'_>,
) -> bool {
    let mut first = true;
    let mut done = false;
    for step in flight.iter_mut() {
        let ready = step.poll_step(cx);
        done |= first && ready;
        first = false;
    }
    done
}

/// The ranges of `len` elements of `T` worked on between two polls ([`PIECE_BYTES`]).
fn pieces<T>(len: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let step = (PIECE_BYTES / size_of::<T>().max(1)).max(1);
    (0..len).step_by(step).map(move |s| s..(s + step).min(len))
}

/// [`copy_payload`] in pieces, calling `poll` after each.
fn copy_payload_polling<T: Pod>(payload: &Payload, dst: &mut [T], poll: &mut impl FnMut()) {
    let src = host_bytes(payload);
    let dst = bytemuck::cast_slice_mut::<T, u8>(dst);
    for p in pieces::<u8>(dst.len()) {
        dst[p.clone()].copy_from_slice(&src[p]);
        poll();
    }
}

/// The steps of one collective call.
pub(crate) struct Sequence<'a> {
    /// The collective's name, for the step spans.
    op: &'static str,
    rank: Rank,
    transport: &'a dyn Transport,
    /// The transport's turn, taken at the first step and held until the call ends.
    turn: Turn,
    timeout: std::time::Duration,
    /// The next step's quorum ([`Step::quorum`]); each step takes it.
    quorum: Option<crate::Quorum>,
    pub(crate) collective: u64,
    /// The call's fingerprint ([`Step::call`]).
    call: u64,
    step: u32,
    stats: &'a mut RoundStats,
}

impl<'a> Sequence<'a> {
    /// Runs a step named `op` that may take `timeout` and may end at `quorum` (a robust
    /// round's steps: the round names them and says how long each may take).
    pub(crate) async fn run_as(
        &mut self,
        op: &'static str,
        timeout: std::time::Duration,
        quorum: Option<crate::Quorum>,
        sends: Vec<SendOp>,
        recvs: Vec<RecvOp>,
    ) -> Result<Vec<RecvOutcome>> {
        self.op = op;
        self.timeout = timeout;
        self.quorum = quorum;
        self.run(sends, recvs).await
    }

    pub(crate) async fn run(
        &mut self,
        sends: Vec<SendOp>,
        recvs: Vec<RecvOp>,
    ) -> Result<Vec<RecvOutcome>> {
        let mut posted = self.post(sends, recvs).await;
        let outcomes = (&mut posted.exchange).await;
        self.finish(posted, outcomes)
    }

    /// Makes the next step without polling it: [`Posted::poll_step`] posts it. Takes the
    /// transport's turn at the collective's first step.
    async fn post(&mut self, sends: Vec<SendOp>, recvs: Vec<RecvOp>) -> Posted<'a> {
        use tracing::Instrument;
        if let Turn::Waiting(lock) = &self.turn {
            self.turn = Turn::Held(lock.clone().lock_owned().await);
        }
        let sent: u64 = sends.iter().map(|s| s.payload.len() as u64).sum();
        let span = tracing::debug_span!(
            "step",
            op = self.op,
            rank = self.rank,
            collective = self.collective,
            step = self.step,
            sends = sends.len(),
            recvs = recvs.len(),
        );
        let peers: Vec<Rank> = recvs.iter().map(|r| r.peer).collect();
        let started = Instant::now();
        let step = Step {
            collective: self.collective,
            step: self.step,
            call: self.call,
            sends,
            recvs,
            deadline: started + self.timeout,
            quorum: self.quorum.take(),
        };
        let number = self.step;
        self.step += 1;
        let exchange = Box::pin(self.transport.exchange(step).instrument(span.clone()));
        Posted {
            number,
            peers,
            sent,
            started,
            span,
            exchange,
            outcome: None,
        }
    }

    /// Records a finished step's counters and events; its outcomes.
    fn finish(
        &mut self,
        posted: Posted<'_>,
        outcomes: std::result::Result<Vec<RecvOutcome>, crate::TransportError>,
    ) -> Result<Vec<RecvOutcome>> {
        let outcomes = outcomes?;
        let received: u64 = outcomes
            .iter()
            .map(|o| match o {
                RecvOutcome::Received(p) => p.len() as u64,
                _ => 0,
            })
            .sum();
        let took = posted.started.elapsed();
        posted.span.in_scope(|| {
            if tracing::enabled!(tracing::Level::DEBUG) {
                for (&peer, outcome) in posted.peers.iter().zip(&outcomes) {
                    match outcome {
                        RecvOutcome::Received(p) => {
                            tracing::debug!(peer, bytes = p.len(), "received")
                        }
                        RecvOutcome::Missing => tracing::debug!(peer, "missing"),
                        RecvOutcome::Late => tracing::debug!(peer, "late"),
                        RecvOutcome::Malformed(why) => tracing::debug!(peer, why, "malformed"),
                        RecvOutcome::OutOfStep => tracing::debug!(peer, "out of step"),
                        RecvOutcome::Skipped => {
                            tracing::debug!(peer, "skipped: this rank is behind")
                        }
                    }
                }
            }
            tracing::debug!(
                bytes_sent = posted.sent,
                bytes_received = received,
                micros = took.as_micros() as u64,
                "step done"
            );
        });
        self.stats.bytes_sent += posted.sent;
        self.stats.bytes_received += received;
        self.stats.step_times.push(took);
        Ok(outcomes)
    }

    /// A finished step's payloads, one per receive, or the faults of the peers whose receive
    /// failed.
    fn finish_strict(
        &mut self,
        collective: &'static str,
        mut posted: Posted<'_>,
    ) -> Result<Vec<Payload>> {
        let outcome = posted
            .outcome
            .take()
            .expect("finish_strict of an unfinished step");
        let (step, peers) = (posted.number, posted.peers.clone());
        let outcomes = self.finish(posted, outcome)?;
        strict(collective, step, peers, outcomes)
    }

    /// Runs a step whose every receive must succeed.
    async fn run_strict(
        &mut self,
        collective: &'static str,
        sends: Vec<SendOp>,
        recvs: Vec<RecvOp>,
    ) -> Result<Vec<Payload>> {
        let mut posted = self.post(sends, recvs).await;
        posted.outcome = Some((&mut posted.exchange).await);
        self.finish_strict(collective, posted)
    }
}

/// The payloads of a step whose every receive must succeed, or the faults of the peers whose
/// receive failed.
fn strict(
    collective: &'static str,
    step: u32,
    peers: Vec<Rank>,
    outcomes: Vec<RecvOutcome>,
) -> Result<Vec<Payload>> {
    // A skip notice here is a missing peer's: plain collectives never leave a rank behind
    // (no quorum steps), so only a faulty peer sends one that covers their messages.
    let mut faults = Vec::new();
    let mut payloads = Vec::with_capacity(outcomes.len());
    for (p, outcome) in peers.into_iter().zip(outcomes) {
        match outcome {
            RecvOutcome::Received(payload) => payloads.push(payload),
            other => faults.push(fault(p, other)),
        }
    }
    if faults.is_empty() {
        Ok(payloads)
    } else {
        Err(Error::PeerFaults {
            collective,
            step,
            faults,
        })
    }
}

/// A step made by [`Sequence::post`], in flight until its exchange completes.
struct Posted<'a> {
    number: u32,
    /// The peers of its receives, in order.
    peers: Vec<Rank>,
    sent: u64,
    started: Instant,
    span: tracing::Span,
    exchange: futures::future::BoxFuture<
        'a,
        std::result::Result<Vec<RecvOutcome>, crate::TransportError>,
    >,
    /// The exchange's result once it completed.
    outcome: Option<std::result::Result<Vec<RecvOutcome>, crate::TransportError>>,
}

impl Posted<'_> {
    /// Polls the exchange unless it completed; whether it has.
    fn poll_step(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        if self.outcome.is_none() {
            if let std::task::Poll::Ready(outcome) = self.exchange.as_mut().poll(cx) {
                self.outcome = Some(outcome);
            }
        }
        self.outcome.is_some()
    }
}

/// A collective's turn on the transport ([`Communicator`]).
enum Turn {
    Waiting(Arc<tokio::sync::Mutex<()>>),
    Held(#[allow(dead_code)] tokio::sync::OwnedMutexGuard<()>),
}

pub(crate) fn send(peer: Rank, payload: Payload) -> SendOp {
    SendOp {
        peer,
        tag: 0,
        payload,
    }
}

pub(crate) fn recv(peer: Rank, len: usize) -> RecvOp {
    RecvOp { peer, tag: 0, len }
}

/// An empty message to every peer of rank `me` among `n`, and a receive of one from each
/// peer `hear` names: the one step of a barrier, of shrink's liveness exchange and of close's
/// farewell.
pub(crate) fn empty_exchange(
    me: Rank,
    n: usize,
    hear: impl Fn(Rank) -> bool,
) -> (Vec<SendOp>, Vec<RecvOp>) {
    let empty = Payload::Host(Bytes::new());
    let sends = schedule::direct_peers(me, n)
        .map(|p| send(p, empty.clone()))
        .collect();
    let recvs = schedule::direct_peers(me, n)
        .filter(|&p| hear(p))
        .map(|p| recv(p, 0))
        .collect();
    (sends, recvs)
}

pub(crate) fn fault(rank: Rank, outcome: RecvOutcome) -> PeerFault {
    let fault = match outcome {
        RecvOutcome::Received(_) | RecvOutcome::Missing | RecvOutcome::Skipped => Fault::Missing,
        RecvOutcome::Late => Fault::Late,
        RecvOutcome::Malformed(why) => Fault::Malformed(why),
        RecvOutcome::OutOfStep => Fault::OutOfStep,
    };
    PeerFault { rank, fault }
}

pub(crate) fn byte_len<T>(buf: &[T]) -> usize {
    std::mem::size_of_val(buf)
}

fn copy_payload<T: Pod>(payload: &Payload, dst: &mut [T]) {
    bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(host_bytes(payload));
}

/// `out[i] = op(a[i], b[i])`.
fn combine_into<T: Element>(op: ReduceOp, a: &[T], b: &[T], out: &mut [T]) {
    // One loop per operation, so that each compiles to a plain vector loop. Summing through
    // f64 and rounding once is the correctly rounded sum: the native one for f32 and f64, and
    // for bf16 and f16 too (f64 has more than twice their significand bits plus two, so
    // rounding first to f64 never changes the rounding to them).
    fn each<T: Element>(a: &[T], b: &[T], out: &mut [T], f: impl Fn(f64, f64) -> f64) {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = T::from_f64(f(x.to_f64(), y.to_f64()));
        }
    }
    debug_assert!(a.len() == out.len() && b.len() == out.len());
    match op {
        ReduceOp::Sum => each(a, b, out, |x, y| x + y),
        ReduceOp::Min => each(a, b, out, f64::min),
        ReduceOp::Max => each(a, b, out, f64::max),
    }
}
