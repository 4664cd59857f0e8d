//! The discrete-event core: ranks that post bulk-synchronous steps, NICs that serialize
//! messages, a binary-heap event queue in virtual time, deadlines and network faults.
//!
//! # Time axis
//! Every event is keyed by the time a message's head *leaves its sender* (plus any injected
//! delay), which is its head arrival minus the constant latency `α`. Ordering receptions by
//! that key is ordering them by head arrival, so a receiver NIC serves messages first come,
//! first served; and a message whose delay is zero is delivered the moment its sender's NIC
//! starts it, without a second event. Deadlines are keyed `α` early for the same reason, and
//! sort after receptions of equal key.
//!
//! A rank that completes a step at true time `T` (always at least the current key) posts its
//! next step right away, with its sends scheduled at `T` or later and its deadline counted from
//! `T`; messages that reach it meanwhile are matched to the new step, exactly as a transport's
//! mailbox would hold them until the receive is posted.
//!
//! # Quorum steps
//! A step posted with a [`Quorum`] ends as the transport kit's mailbox ends it: once that many
//! receives are in (at the time the last of them is delivered, or when the step is posted if
//! they were already there), a grace ([`Grace::after`] the time the quorum took) starts; the
//! step ends when every receive is in or the grace has passed, whichever is first, and never
//! after its deadline. Receives still open at the end of the grace are late ([`Cut::Quorum`]),
//! at the deadline missing. A quorum step does not wait for its sends to leave the NIC.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use byzcoll_proto::{Error, Quorum, Rank, Tag};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::model::{Compute, Network};
use crate::{Faults, SimError, Stats};

/// Computation a rank performs between two steps, charged at [`Compute`]'s throughputs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Work {
    /// Bytes of input read by the robust rule (or the median of owner versions).
    pub rule_bytes: f64,
    /// Bytes of input read by a SUM reduction.
    pub sum_bytes: f64,
}

impl Work {
    fn seconds(&self, compute: &Compute) -> f64 {
        let at = |bytes: f64, rate: Option<f64>| match rate {
            Some(rate) if bytes > 0.0 => bytes / rate,
            _ => 0.0,
        };
        at(self.rule_bytes, compute.rule_throughput) + at(self.sum_bytes, compute.sum_throughput)
    }
}

/// One message a step posts (12 bytes with `u32` payloads: a step may post millions).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Out<M> {
    to: u32,
    tag: Tag,
    msg: M,
}

impl<M> Out<M> {
    /// A message to `to` (worlds are limited to fewer than 2^30 ranks).
    pub(crate) fn new(to: Rank, tag: Tag, msg: M) -> Self {
        Out {
            to: to as u32,
            tag,
            msg,
        }
    }
}

/// What a program tells the engine about one posted step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Posted {
    /// Number of receive slots ([`Program::slot`] returns indices below this).
    pub slots: usize,
    /// Number of messages the step waits for.
    pub expected: usize,
    /// The step's deadline in units of the scenario's timeout (a robust round's cross-check
    /// waits as many timeouts as the round had steps).
    pub timeouts: f64,
    /// The step's deadline in virtual seconds after its post instead, where it has one of its
    /// own (a robust round's steps: their plan's timeout; the recovery step's is bounded by
    /// the round so far).
    pub seconds: Option<f64>,
    /// When the step may end before then, its grace in virtual seconds (see the module docs).
    pub quorum: Option<Quorum>,
}

impl Posted {
    /// A step with `slots` receive slots, waiting for `expected` messages for one timeout.
    pub(crate) fn new(slots: usize, expected: usize) -> Self {
        Posted {
            slots,
            expected,
            timeouts: 1.0,
            seconds: None,
            quorum: None,
        }
    }
}

/// How a step ended, for the receives still open then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Every receive arrived.
    Complete,
    /// The deadline passed: the open receives are missing.
    Deadline,
    /// The quorum's grace passed before the deadline: the open receives are late.
    Quorum,
}

/// Where a rank starts a run: when it posts its first step, when its NIC is free to send and
/// to receive (a run that follows another on the same NICs), and the step from which it
/// takes no part (injected crashes; `Some(0)`: none at all).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Start {
    pub at: f64,
    pub tx_free: f64,
    pub rx_free: f64,
    pub crash_at: Option<usize>,
}

/// A collective schedule as seen by the engine: what each rank sends and expects per step, and
/// what it does with what arrived. Implementations call `byzcoll_proto::schedule`.
pub(crate) trait Program {
    /// A message's payload handle (cheap to copy; the program owns the data).
    type Msg: Copy + PartialEq;

    /// The value of a receive slot whose message has not arrived (never a payload).
    const ABSENT: Self::Msg;

    /// Whether `rank` has no step `step` (it has run all of its steps).
    fn finished(&self, rank: Rank, step: usize) -> bool;

    /// Posts step `step` of `rank`: pushes its sends onto `sends`.
    fn post(&mut self, rank: Rank, step: usize, sends: &mut Vec<Out<Self::Msg>>) -> Posted;

    /// Size on the wire of a message `from` posted in `step`.
    fn bytes(&self, from: Rank, step: usize, tag: Tag, msg: Self::Msg) -> u64;

    /// The receive slot of a message `from` with `tag` in `rank`'s step `step`, or `None` when
    /// the schedule does not expect it.
    fn slot(&self, rank: Rank, step: usize, from: Rank, tag: Tag) -> Option<usize>;

    /// Whether a message `slot` does not place is one `rank`'s step deliberately does not
    /// wait for (a robust round does not wait again for a peer it erased): dropped as late,
    /// as a transport's mailbox drops it, instead of a schedule mismatch.
    fn ignores(&self, _rank: Rank, _step: usize, _from: Rank, _tag: Tag) -> bool {
        false
    }

    /// How long `rank`'s step `step` took, from the end of its step before (or its post, for
    /// its first) to its own end, in seconds of virtual time: told just before
    /// [`Program::complete`], as a driver tells a round (`Round::took`).
    fn took(&mut self, _rank: Rank, _step: usize, _seconds: f64) {}

    /// `rank`'s step `step` ended (every receive arrived, the deadline passed or the quorum's
    /// grace did, as `cut` says): `got[slot]` is [`Program::ABSENT`] for what did not arrive.
    /// Returns the local work before the next step, or the error that ends this rank's part in
    /// the collective.
    fn complete(
        &mut self,
        rank: Rank,
        step: usize,
        got: &[Self::Msg],
        cut: Cut,
    ) -> Result<Work, Error>;
}

/// How a rank's part in a run ended.
#[derive(Debug)]
pub(crate) enum End {
    /// Every step completed.
    Done,
    /// The program returned an error at some step.
    Failed(Error),
    /// The rank crashed (injected fault).
    Crashed,
}

/// Per-rank result of [`run`].
#[derive(Debug)]
pub(crate) struct RankEnd {
    pub end: End,
    /// Virtual time at which the rank finished, failed or crashed.
    pub at: f64,
    /// When its NIC has sent everything the run queued on it.
    pub tx_free: f64,
    /// When its NIC has received the last message delivered to it while it took part.
    pub rx_free: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    Finished,
}

/// The sends of one step, queued on the sender's NIC.
#[derive(Debug)]
struct Batch<M> {
    step: usize,
    /// When the step was posted: its first message starts no earlier.
    ready: f64,
    sends: Vec<Out<M>>,
    next: usize,
    /// The injected delay of each receiver's burst ([`crate::Faults::max_delay`]): the messages one
    /// step sends one peer leave back to back on one connection, which delivers them in
    /// order, so they share one draw (a step that sends each peer one message draws once
    /// per message).
    delays: std::collections::HashMap<u32, f64>,
}

#[derive(Debug)]
struct Early<M> {
    from: Rank,
    step: usize,
    tag: Tag,
    msg: M,
    done: f64,
}

#[derive(Debug)]
struct RankSim<M> {
    state: State,
    step: usize,
    deadline: f64,
    pending: usize,
    /// Receive slots of the current step ([`Program::ABSENT`] until filled).
    got: Vec<M>,
    last: f64,
    sends_done: f64,
    outbox: VecDeque<Batch<M>>,
    tx_busy: bool,
    tx_tail: f64,
    rx_free: f64,
    early: Vec<Early<M>>,
    crash_at: Option<usize>,
    crashed_at: Option<f64>,
    /// When the earliest [`Kind::Deadline`] of this rank still in the heap fires (a step's
    /// deadline can come before an earlier step's: a recovery step's is bounded by the
    /// round so far, `Round::took`).
    armed: Option<f64>,
    /// When the current step was posted.
    posted: f64,
    /// When the rank's last step ended (`None` before its first).
    since: Option<f64>,
    /// The current step's quorum, and what `pending` is once it has formed.
    quorum: Option<(Quorum, usize)>,
    /// When the current step ends if receives are still open: its deadline, or the end of
    /// its quorum's grace.
    cut: f64,
    /// Whether `cut` is the end of the quorum's grace (the open receives are then late).
    by_quorum: bool,
    end: Option<(End, f64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The NIC of this rank starts its next queued message.
    Tx(u32),
    /// A delayed message (index into the in-flight slab) reaches its receiver.
    Arrival(u32),
    /// A deadline of this rank: the current step's, or an earlier one (then it is re-armed
    /// for the current step), so that the heap holds at most one deadline per rank.
    Deadline(u32),
    /// The end of the grace of a quorum step of this rank (stale once that step has ended:
    /// at most one per step, and a step ends at the latest at its deadline).
    Quorum(u32),
}

impl Kind {
    /// Packs the kind into an order key for events at equal times: receptions before
    /// deadlines, then lower ranks first. Deterministic without a sequence number, which keeps
    /// events at 16 bytes.
    fn pack(self) -> u64 {
        match self {
            Kind::Tx(r) => u64::from(r),
            Kind::Arrival(i) => 1 << 61 | u64::from(i),
            Kind::Deadline(r) => 1 << 63 | 2 << 61 | u64::from(r),
            Kind::Quorum(r) => 1 << 63 | 3 << 61 | u64::from(r),
        }
    }

    fn unpack(code: u64) -> Kind {
        let low = (code & 0xffff_ffff) as u32;
        match (code >> 61) & 3 {
            0 => Kind::Tx(low),
            1 => Kind::Arrival(low),
            2 => Kind::Deadline(low),
            _ => Kind::Quorum(low),
        }
    }
}

/// An event: its key on the time axis and its packed [`Kind`].
#[derive(Debug, Clone, Copy)]
struct Event {
    key: f64,
    code: u64,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Event {}

impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Event {
    /// Reversed, so that [`BinaryHeap`] pops the earliest event first.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .key
            .total_cmp(&self.key)
            .then_with(|| other.code.cmp(&self.code))
    }
}

#[derive(Debug)]
struct InFlight<M> {
    from: Rank,
    to: Rank,
    step: usize,
    tag: Tag,
    msg: M,
    bytes: u64,
    /// When the sender's NIC finished the message, plus the injected delay.
    tx_end: f64,
}

/// Simulation parameters the engine needs besides the program.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params<'a> {
    pub network: &'a Network,
    pub compute: &'a Compute,
    pub faults: &'a Faults,
    /// Per-step deadline, virtual seconds from the step's start.
    pub timeout: f64,
    pub seed: u64,
}

struct Engine<'p, 'a, P: Program> {
    prog: &'p mut P,
    params: Params<'a>,
    n: usize,
    ranks: Vec<RankSim<P::Msg>>,
    heap: BinaryHeap<Event>,
    now: f64,
    inflight: Vec<Option<InFlight<P::Msg>>>,
    free: Vec<u32>,
    rng: StdRng,
    stats: Stats,
}

/// Runs `prog` on `n` ranks to completion, rank `r` starting as `starts[r]` says. Returns each
/// rank's end and the run's statistics.
///
/// # Errors
/// [`SimError::Schedule`] when a message arrives that the receiver's schedule does not expect,
/// or twice: the schedules disagree (a bug, never a fault of the simulated network).
/// [`SimError::Stuck`] when a rank waits for a message that never comes and has no deadline.
pub(crate) fn run<P: Program>(
    prog: &mut P,
    starts: &[Start],
    params: Params<'_>,
) -> Result<(Vec<RankEnd>, Stats), SimError> {
    let n = starts.len();
    let ranks = starts
        .iter()
        .map(|start| RankSim {
            state: State::Running,
            step: 0,
            deadline: f64::INFINITY,
            pending: 0,
            got: Vec::new(),
            last: 0.0,
            sends_done: 0.0,
            outbox: VecDeque::new(),
            tx_busy: false,
            tx_tail: start.tx_free,
            rx_free: start.rx_free,
            early: Vec::new(),
            crash_at: start.crash_at,
            crashed_at: None,
            armed: None,
            posted: 0.0,
            since: None,
            quorum: None,
            cut: f64::INFINITY,
            by_quorum: false,
            end: None,
        })
        .collect();
    let mut engine = Engine {
        prog,
        params,
        n,
        ranks,
        heap: BinaryHeap::with_capacity(4 * n),
        now: 0.0,
        inflight: Vec::new(),
        free: Vec::new(),
        rng: StdRng::seed_from_u64(params.seed),
        stats: Stats::default(),
    };
    for (r, start) in starts.iter().enumerate() {
        engine.post(r, start.at)?;
    }
    while let Some(ev) = engine.heap.pop() {
        debug_assert!(ev.key >= engine.now, "virtual time went backwards");
        engine.now = ev.key;
        match Kind::unpack(ev.code) {
            Kind::Tx(r) => engine.transmit(r as usize)?,
            Kind::Arrival(i) => {
                let m = engine.inflight[i as usize].take();
                engine.free.push(i);
                if let Some(m) = m {
                    engine.receive(m, ev.key)?;
                }
            }
            Kind::Deadline(r) => engine.deadline(r as usize)?,
            Kind::Quorum(r) => engine.quorum_over(r as usize)?,
        }
    }
    let mut ends = Vec::with_capacity(n);
    for (r, rs) in engine.ranks.into_iter().enumerate() {
        match rs.end {
            Some((end, at)) => ends.push(RankEnd {
                end,
                at,
                tx_free: rs.tx_tail,
                rx_free: rs.rx_free,
            }),
            None => {
                return Err(SimError::Stuck(format!(
                    "rank {r} waits forever in step {}: a message it expects never came and \
                     there is no deadline",
                    rs.step
                )))
            }
        }
    }
    Ok((ends, engine.stats))
}

impl<P: Program> Engine<'_, '_, P> {
    fn push(&mut self, key: f64, kind: Kind) {
        debug_assert_eq!(Kind::unpack(kind.pack()), kind);
        self.heap.push(Event {
            key,
            code: kind.pack(),
        });
    }

    fn finish(&mut self, rank: Rank, end: End, at: f64) {
        let rs = &mut self.ranks[rank];
        rs.state = State::Finished;
        if matches!(end, End::Crashed) {
            // Messages of earlier steps that are still queued at `at` die with the rank; those
            // that started before (even if their events are still pending) went out.
            rs.crashed_at = Some(at);
        }
        rs.got = Vec::new();
        rs.early = Vec::new();
        rs.end = Some((end, at));
    }

    /// Posts `rank`'s current step at true time `t`; steps that need no message complete on
    /// the spot, so this loops until a step waits or the rank is finished.
    fn post(&mut self, rank: Rank, mut t: f64) -> Result<(), SimError> {
        loop {
            let step = self.ranks[rank].step;
            if self.prog.finished(rank, step) {
                self.finish(rank, End::Done, t);
                return Ok(());
            }
            if self.ranks[rank].crash_at.is_some_and(|c| c <= step) {
                self.finish(rank, End::Crashed, t);
                return Ok(());
            }
            let mut sends = Vec::new();
            let posted = self.prog.post(rank, step, &mut sends);
            // Pairwise-exchange order: start with the first send to the nearest successor and
            // wrap around, so that n ranks posting to everyone do not all start with the same
            // receiver.
            let n = self.n;
            let distance = |o: &Out<P::Msg>| {
                let to = o.to as usize;
                if to > rank {
                    to - rank
                } else {
                    to + n - rank
                }
            };
            if let Some(first) = (0..sends.len()).min_by_key(|&i| distance(&sends[i])) {
                sends.rotate_left(first);
            }
            let nic = self.params.network.injection_bandwidth;
            let rs = &mut self.ranks[rank];
            let first_tx = t.max(rs.tx_tail);
            let mut tail = first_tx;
            for o in &sends {
                tail += self.prog.bytes(rank, step, o.tag, o.msg) as f64 / nic;
            }
            rs.sends_done = tail;
            rs.tx_tail = tail;
            let start_tx = !sends.is_empty() && !rs.tx_busy;
            if !sends.is_empty() {
                self.stats.messages += sends.len() as u64;
                rs.outbox.push_back(Batch {
                    step,
                    ready: t,
                    sends,
                    next: 0,
                    delays: std::collections::HashMap::new(),
                });
                rs.tx_busy = true;
            }
            rs.got.clear();
            rs.got.resize(posted.slots, P::ABSENT);
            rs.pending = posted.expected;
            rs.last = t;
            rs.posted = t;
            rs.deadline = t + posted
                .seconds
                .unwrap_or(self.params.timeout * posted.timeouts);
            rs.cut = rs.deadline;
            rs.by_quorum = false;
            rs.quorum = posted
                .quorum
                .map(|q| (q, posted.expected.saturating_sub(q.receives)));
            if start_tx {
                self.push(first_tx, Kind::Tx(rank as u32));
            }
            // A quorum of none forms when the step is posted.
            self.quorum_formed(rank, t);
            // Messages that reached this rank before it posted the step.
            let early: Vec<Early<P::Msg>> = {
                let rs = &mut self.ranks[rank];
                let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut rs.early)
                    .into_iter()
                    .partition(|e| e.step == step);
                rs.early = later;
                now
            };
            for e in early {
                self.accept(rank, e.from, e.tag, e.msg, e.done)?;
            }
            let rs = &mut self.ranks[rank];
            if rs.pending > 0 {
                let (deadline, alpha) = (rs.deadline, self.params.network.alpha);
                let key = (deadline - alpha).max(t);
                if deadline.is_finite() && rs.armed.is_none_or(|a| key < a) {
                    rs.armed = Some(key);
                    self.push(key, Kind::Deadline(rank as u32));
                }
                return Ok(());
            }
            let done = rs.all_in();
            match self.complete(rank, done, Cut::Complete) {
                Some(next) => t = next,
                None => return Ok(()),
            }
        }
    }

    /// Starts the grace of `rank`'s quorum step if its quorum has just formed, the last of
    /// its receives delivered at `at`: the step now ends at the end of the grace if that comes
    /// before the deadline.
    fn quorum_formed(&mut self, rank: Rank, at: f64) {
        let alpha = self.params.network.alpha;
        let rs = &mut self.ranks[rank];
        let Some((quorum, formed_at)) = rs.quorum else {
            return;
        };
        // Formed once `receives` are in, the first `core` of them among them.
        let core_open = rs.got[..quorum.core.min(rs.got.len())].contains(&P::ABSENT);
        if rs.pending > formed_at || core_open || rs.pending == 0 || rs.by_quorum {
            return;
        }
        let formed = at.max(rs.posted);
        let took = std::time::Duration::try_from_secs_f64(formed - rs.posted)
            .unwrap_or(std::time::Duration::MAX);
        // The grace waits for the awaited receives (all but the laggards'): when they are in
        // already, the step ends as the quorum forms.
        let end = match rs.awaited_in(quorum.awaited, P::ABSENT) {
            true => formed,
            false => formed + quorum.grace.after(took).as_secs_f64(),
        };
        if end < rs.deadline {
            rs.cut = end;
            rs.by_quorum = true;
            // Not before now: a quorum formed by messages that came before the post (their
            // times are earlier) ends as the step is posted.
            self.push((end - alpha).max(self.now), Kind::Quorum(rank as u32));
        }
    }

    /// A receive of `rank`'s quorum step came in at `at` during the grace: when the awaited
    /// receives are all in now, the step ends here rather than at the grace's end (the rest
    /// are laggards', `Quorum::awaited`).
    fn awaited_arrived(&mut self, rank: Rank, at: f64) {
        let alpha = self.params.network.alpha;
        let rs = &mut self.ranks[rank];
        let Some((quorum, _)) = rs.quorum else {
            return;
        };
        if !rs.by_quorum || rs.pending == 0 || at >= rs.cut {
            return;
        }
        if rs.awaited_in(quorum.awaited, P::ABSENT) {
            rs.cut = at;
            self.push((at - alpha).max(self.now), Kind::Quorum(rank as u32));
        }
    }

    /// The end of a quorum step's grace: the step ends there unless it already has.
    fn quorum_over(&mut self, rank: Rank) -> Result<(), SimError> {
        let alpha = self.params.network.alpha;
        let rs = &self.ranks[rank];
        if rs.state != State::Running || rs.pending == 0 || !rs.by_quorum {
            return Ok(());
        }
        if rs.cut - alpha > self.now {
            // Another step's: this step's own end is still in the heap.
            return Ok(());
        }
        let t = rs.cut;
        match self.complete(rank, t, Cut::Quorum) {
            Some(next) => self.post(rank, next),
            None => Ok(()),
        }
    }

    /// Completes `rank`'s current step at `t`; returns when the next step may start, or `None`
    /// when the rank failed.
    fn complete(&mut self, rank: Rank, t: f64, cut: Cut) -> Option<f64> {
        let rs = &mut self.ranks[rank];
        let step = rs.step;
        let missing = rs.pending;
        rs.pending = 0;
        rs.by_quorum = false;
        self.stats.erasures += missing as u64;
        let got = std::mem::take(&mut rs.got);
        // From the end of the step before (the round's start for the first), so that the
        // work between steps counts too, as a driver's clock would count it.
        let since = rs.since.unwrap_or(rs.posted);
        rs.since = Some(t);
        self.prog.took(rank, step, t - since);
        let result = self.prog.complete(rank, step, &got, cut);
        self.ranks[rank].got = got;
        match result {
            Ok(work) => {
                self.ranks[rank].step += 1;
                Some(t + work.seconds(self.params.compute))
            }
            Err(e) => {
                self.finish(rank, End::Failed(e), t);
                None
            }
        }
    }

    fn transmit(&mut self, rank: Rank) -> Result<(), SimError> {
        let t0 = self.now;
        let rs = &mut self.ranks[rank];
        if rs.crashed_at.is_some_and(|c| t0 >= c) {
            rs.outbox.clear();
        }
        let Some(batch) = rs.outbox.front_mut() else {
            rs.tx_busy = false;
            return Ok(());
        };
        if batch.ready > t0 {
            // The NIC went idle before this step was posted.
            let ready = batch.ready;
            self.push(ready, Kind::Tx(rank as u32));
            return Ok(());
        }
        let (step, out) = (batch.step, batch.sends[batch.next]);
        batch.next += 1;
        let burst = batch.delays.get(&out.to).copied();
        if batch.next == batch.sends.len() {
            rs.outbox.pop_front();
        }
        let more = !rs.outbox.is_empty();
        let bytes = self.prog.bytes(rank, step, out.tag, out.msg);
        let tx_end = t0 + bytes as f64 / self.params.network.injection_bandwidth;
        if more {
            self.push(tx_end, Kind::Tx(rank as u32));
        } else {
            self.ranks[rank].tx_busy = false;
        }
        self.stats.bytes = self.stats.bytes.saturating_add(bytes);
        let faults = self.params.faults;
        if faults.loss > 0.0 && self.rng.gen::<f64>() < faults.loss {
            self.stats.lost += 1;
            return Ok(());
        }
        let delay = match burst {
            Some(delay) => delay,
            None if faults.max_delay > 0.0 => {
                let delay = self.rng.gen::<f64>() * faults.max_delay;
                if let Some(batch) = self.ranks[rank]
                    .outbox
                    .front_mut()
                    .filter(|b| b.step == step)
                {
                    batch.delays.insert(out.to, delay);
                }
                delay
            }
            None => 0.0,
        };
        let m = InFlight {
            from: rank,
            to: out.to as usize,
            step,
            tag: out.tag,
            msg: out.msg,
            bytes,
            tx_end: tx_end + delay,
        };
        if delay == 0.0 {
            return self.receive(m, t0);
        }
        let slot = match self.free.pop() {
            Some(i) => {
                self.inflight[i as usize] = Some(m);
                i
            }
            None => {
                self.inflight.push(Some(m));
                (self.inflight.len() - 1) as u32
            }
        };
        self.push(t0 + delay, Kind::Arrival(slot));
        Ok(())
    }

    /// The head of `m` reaches its receiver at `key + α`; its NIC serves it after what it is
    /// already receiving, no faster than the link and the sender allow.
    fn receive(&mut self, m: InFlight<P::Msg>, key: f64) -> Result<(), SimError> {
        let net = self.params.network;
        let head = key + net.alpha;
        let bytes = m.bytes as f64;
        let rs = &mut self.ranks[m.to];
        if rs.state == State::Finished {
            return Ok(());
        }
        let done = (head.max(rs.rx_free) + bytes / net.injection_bandwidth)
            .max(head + bytes / net.link_bandwidth)
            .max(m.tx_end + net.alpha);
        rs.rx_free = done;
        match m.step.cmp(&rs.step) {
            Ordering::Less => {
                self.stats.late += 1;
                Ok(())
            }
            Ordering::Greater => {
                rs.early.push(Early {
                    from: m.from,
                    step: m.step,
                    tag: m.tag,
                    msg: m.msg,
                    done,
                });
                Ok(())
            }
            Ordering::Equal => {
                if self.accept(m.to, m.from, m.tag, m.msg, done)? {
                    let t = self.ranks[m.to].all_in();
                    if let Some(next) = self.complete(m.to, t, Cut::Complete) {
                        self.post(m.to, next)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Matches a message delivered at `done` to `rank`'s current step. Returns whether the step
    /// now has every receive.
    fn accept(
        &mut self,
        rank: Rank,
        from: Rank,
        tag: Tag,
        msg: P::Msg,
        done: f64,
    ) -> Result<bool, SimError> {
        let step = self.ranks[rank].step;
        let slot = self.prog.slot(rank, step, from, tag);
        let rs = &mut self.ranks[rank];
        let Some(slot) = slot.filter(|&s| s < rs.got.len()) else {
            if self.prog.ignores(rank, step, from, tag) {
                self.stats.late += 1;
                return Ok(false);
            }
            return Err(SimError::Schedule(format!(
                "rank {rank} step {step}: unexpected message from rank {from} with tag {tag}"
            )));
        };
        if rs.got[slot] != P::ABSENT {
            return Err(SimError::Schedule(format!(
                "rank {rank} step {step}: second message from rank {from} with tag {tag}"
            )));
        }
        if done > rs.cut {
            self.stats.late += 1;
            return Ok(false);
        }
        rs.got[slot] = msg;
        rs.pending -= 1;
        rs.last = rs.last.max(done);
        let all = rs.pending == 0;
        let formed_before = rs.by_quorum;
        self.quorum_formed(rank, done);
        if formed_before {
            self.awaited_arrived(rank, done);
        }
        Ok(all)
    }

    fn deadline(&mut self, rank: Rank) -> Result<(), SimError> {
        let alpha = self.params.network.alpha;
        let rs = &mut self.ranks[rank];
        if rs.armed != Some(self.now) {
            // A later one, armed before an earlier one was: that one has fired.
            return Ok(());
        }
        rs.armed = None;
        if rs.state != State::Running || rs.pending == 0 {
            return Ok(());
        }
        let (t, key) = (rs.deadline, (rs.deadline - alpha).max(rs.posted));
        if key > self.now {
            // Armed for an earlier step that completed in time: wait for this step's deadline.
            rs.armed = Some(key);
            self.push(key, Kind::Deadline(rank as u32));
            return Ok(());
        }
        match self.complete(rank, t, Cut::Deadline) {
            Some(next) => self.post(rank, next),
            None => Ok(()),
        }
    }
}

impl<M: PartialEq> RankSim<M> {
    /// Whether the first `awaited` receives of the current step are in (`absent`: a slot
    /// still empty).
    fn awaited_in(&self, awaited: usize, absent: M) -> bool {
        !self.got[..awaited.min(self.got.len())].contains(&absent)
    }
}

impl<M> RankSim<M> {
    /// When the current step ends now that every receive is in: when the last one was
    /// delivered and (outside quorum steps) the step's sends have left the NIC, at the latest
    /// at the deadline.
    fn all_in(&self) -> f64 {
        match self.quorum {
            Some(_) => self.last.min(self.cut),
            None => self.last.max(self.sends_done).min(self.deadline),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 0 sends two `B`-byte messages to rank 1 and waits for a 0-byte one from it; after
    /// computing for `c` it sends rank 1 one more 0-byte message.
    #[derive(Debug)]
    struct TwoSteps {
        big: u64,
        work: f64,
    }

    impl Program for TwoSteps {
        type Msg = u32;
        const ABSENT: u32 = u32::MAX;

        fn finished(&self, _rank: Rank, step: usize) -> bool {
            step >= 2
        }

        fn post(&mut self, rank: Rank, step: usize, sends: &mut Vec<Out<u32>>) -> Posted {
            match (rank, step) {
                (0, 0) => {
                    sends.push(Out::new(1, 0, 0));
                    sends.push(Out::new(1, 1, 0));
                    Posted::new(1, 1)
                }
                (1, 0) => {
                    sends.push(Out::new(0, 0, 0));
                    Posted::new(2, 2)
                }
                (0, _) => {
                    sends.push(Out::new(1, 2, 0));
                    Posted::new(0, 0)
                }
                _ => Posted::new(1, 1),
            }
        }

        fn bytes(&self, from: Rank, step: usize, _tag: Tag, _msg: u32) -> u64 {
            if from == 0 && step == 0 {
                self.big
            } else {
                0
            }
        }

        fn slot(&self, rank: Rank, step: usize, _from: Rank, tag: Tag) -> Option<usize> {
            match (rank, step) {
                (1, 0) => Some(tag as usize),
                _ => Some(0),
            }
        }

        fn complete(
            &mut self,
            rank: Rank,
            step: usize,
            got: &[u32],
            _cut: Cut,
        ) -> Result<Work, Error> {
            assert!(got.iter().all(|&g| g != u32::MAX));
            Ok(Work {
                rule_bytes: if rank == 0 && step == 0 {
                    self.work
                } else {
                    0.0
                },
                ..Work::default()
            })
        }
    }

    #[test]
    fn sends_of_a_step_wait_for_its_post() {
        let network = Network {
            alpha: 1e-6,
            link_bandwidth: 1e9,
            injection_bandwidth: 1e9,
        };
        let compute = Compute {
            rule_throughput: Some(1e9),
            sum_throughput: None,
        };
        let faults = Faults::default();
        let mut prog = TwoSteps {
            big: 1000,
            work: 5000.0,
        };
        let params = Params {
            network: &network,
            compute: &compute,
            faults: &faults,
            timeout: 1.0,
            seed: 0,
        };
        let (ends, stats) = run(&mut prog, &[Start::default(); 2], params).unwrap();
        assert_eq!(stats.messages, 4);
        // Rank 0 posts step 1 after its two sends (2 us) and its computation (5 us); rank 1
        // gets the last message one latency later.
        let want = 2e-6 + 5e-6 + 1e-6;
        assert!(
            (ends[1].at - want).abs() < 1e-15,
            "{} vs {want}",
            ends[1].at
        );
        assert!(matches!(ends[0].end, End::Done) && matches!(ends[1].end, End::Done));
    }

    /// Rank 0 waits for a 0-byte message from each of ranks 1..n in one step, with `quorum`;
    /// rank `r` sends its own when it starts.
    #[derive(Debug)]
    struct Gather {
        n: usize,
        quorum: Option<Quorum>,
        cut: Option<(Cut, Vec<bool>)>,
    }

    impl Program for Gather {
        type Msg = u32;
        const ABSENT: u32 = u32::MAX;

        fn finished(&self, _rank: Rank, step: usize) -> bool {
            step >= 1
        }

        fn post(&mut self, rank: Rank, _step: usize, sends: &mut Vec<Out<u32>>) -> Posted {
            if rank == 0 {
                let mut posted = Posted::new(self.n - 1, self.n - 1);
                posted.quorum = self.quorum;
                posted
            } else {
                sends.push(Out::new(0, 0, rank as u32));
                Posted::new(0, 0)
            }
        }

        fn bytes(&self, _from: Rank, _step: usize, _tag: Tag, _msg: u32) -> u64 {
            0
        }

        fn slot(&self, _rank: Rank, _step: usize, from: Rank, _tag: Tag) -> Option<usize> {
            Some(from - 1)
        }

        fn complete(
            &mut self,
            rank: Rank,
            _step: usize,
            got: &[u32],
            cut: Cut,
        ) -> Result<Work, Error> {
            if rank == 0 {
                self.cut = Some((cut, got.iter().map(|&g| g != u32::MAX).collect()));
            }
            Ok(Work::default())
        }
    }

    /// Runs [`Gather`] over 5 ranks (1 us latency); returns rank 0's end, how its step ended
    /// and which receives arrived.
    fn gather(quorum: Option<Quorum>, timeout: f64) -> (f64, Cut, Vec<bool>) {
        let network = Network {
            alpha: 1e-6,
            link_bandwidth: 1e9,
            injection_bandwidth: 1e9,
        };
        let compute = Compute::default();
        let faults = Faults::default();
        let mut prog = Gather {
            n: 5,
            quorum,
            cut: None,
        };
        let params = Params {
            network: &network,
            compute: &compute,
            faults: &faults,
            timeout,
            seed: 0,
        };
        let starts: Vec<Start> = (0..5)
            .map(|r| Start {
                at: r as f64 * 1e-6,
                ..Start::default()
            })
            .collect();
        let (ends, _) = run(&mut prog, &starts, params).unwrap();
        let (cut, got) = prog.cut.expect("rank 0 completed");
        (ends[0].at, cut, got)
    }

    fn quorum(receives: usize, min_us: u64, factor: u32) -> Option<Quorum> {
        Some(Quorum {
            receives,
            grace: byzcoll_proto::Grace {
                min: std::time::Duration::from_micros(min_us),
                factor,
            },
            awaited: usize::MAX,
            core: 0,
        })
    }

    #[test]
    fn a_quorum_step_ends_one_grace_after_its_quorum_and_the_rest_are_late() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        // Messages arrive at 2, 3, 4 and 5 us. Without a quorum: at the last one.
        let (at, cut, got) = gather(None, 1.0);
        assert!(
            close(at, 5e-6) && cut == Cut::Complete && got.iter().all(|&g| g),
            "{at}"
        );
        // A quorum of 2 forms at 3 us; the grace is as long again: the step would end at 6 us,
        // but everything is in at 5 us.
        let (at, cut, _) = gather(quorum(2, 0, 1), 1.0);
        assert!(close(at, 5e-6) && cut == Cut::Complete, "{at} {cut:?}");
        // With a floor of 1 us and no factor it ends at 4 us: rank 4's is late.
        let (at, cut, got) = gather(quorum(2, 1, 0), 1.0);
        assert!(close(at, 4e-6) && cut == Cut::Quorum, "{at} {cut:?}");
        assert_eq!(got, [true, true, true, false]);
        // A deadline before the end of the grace wins: the open receives are missing then.
        let (at, cut, got) = gather(quorum(2, 10, 0), 3.5e-6);
        assert!(close(at, 3.5e-6) && cut == Cut::Deadline, "{at} {cut:?}");
        assert_eq!(got, [true, true, false, false]);
        // A quorum of none forms when the step is posted.
        let (at, cut, got) = gather(quorum(0, 2, 0), 1.0);
        assert!(close(at, 2e-6) && cut == Cut::Quorum, "{at} {cut:?}");
        assert_eq!(got, [true, false, false, false]);
    }

    #[test]
    fn kinds_pack_and_unpack() {
        for k in [
            Kind::Tx(0),
            Kind::Tx(u32::MAX),
            Kind::Arrival(7),
            Kind::Deadline(1 << 29),
            Kind::Quorum(3),
        ] {
            assert_eq!(Kind::unpack(k.pack()), k);
        }
        assert!(Kind::Tx(5).pack() < Kind::Deadline(0).pack());
        assert!(Kind::Arrival(5).pack() < Kind::Deadline(0).pack());
        assert!(Kind::Deadline(5).pack() < Kind::Quorum(0).pack());
    }
}
