//! A deterministic harness for the protocol core, in the manner of quinn-proto's tests: every
//! rank's [`Round`] in one thread under a virtual clock, messages with per-link delays, drops
//! and rewrites, and bounded stepping (a round that neither ends nor waits for time is a
//! livelock, and fails the test). No sockets, no tokio: what the rounds decide is exactly what
//! the protocol decides.

#![allow(dead_code, unreachable_pub, missing_docs, clippy::unwrap_used)]

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use byzcoll_aggregators::{
    aggregate_into, AggError, AggReport, Aggregator, DistanceMixing, DistanceSelection, Median,
};
use byzcoll_proto::round::{
    commitment, input_digest, result_digest, Arrival, Dest, Digest, Msg, Plane, Round, Shape, Spec,
    Src,
};
use byzcoll_proto::schedule::chunk_range;
use byzcoll_proto::{Agreement, Error, Grace, Rank, RoundReport};

/// One rank's data: its input, its result (all-reduce), its owned shards' results. Coordinate-
/// wise rules only (the statistic rounds of global rules are the host plane's, tested through
/// the transports).
pub struct TestPlane {
    me: Rank,
    n: usize,
    input: Vec<f32>,
    output: Vec<f32>,
    results: Vec<Vec<f32>>,
    /// An owner that lies: it adds this to every element of its results.
    lie: Option<f32>,
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bytes_of(v: &[f32]) -> Bytes {
    v.iter()
        .flat_map(|x| x.to_le_bytes())
        .collect::<Vec<u8>>()
        .into()
}

impl TestPlane {
    pub fn new(me: Rank, n: usize, input: Vec<f32>) -> Self {
        TestPlane {
            me,
            n,
            output: input.clone(),
            input,
            results: Vec::new(),
            lie: None,
        }
    }

    /// This rank, as an owner, adds `by` to every element of its results.
    pub fn lying(mut self, by: f32) -> Self {
        self.lie = Some(by);
        self
    }

    /// The bytes of `msg` (what a driver makes where its data lives).
    pub fn payload(&self, msg: &Msg) -> Bytes {
        let d = self.input.len();
        match msg {
            Msg::Input => bytes_of(&self.input),
            Msg::Piece(s) => bytes_of(&self.input[chunk_range(d, self.n, *s)]),
            Msg::Result(s) => self.owned(*s).map(bytes_of).unwrap_or_default(),
            Msg::ResultDigest(s) => {
                let r = self.owned(*s).map(|r| r.to_vec()).unwrap_or_default();
                Bytes::copy_from_slice(&commitment::<f32>(&r))
            }
            Msg::Empty => Bytes::new(),
            Msg::Bytes(b) => b.clone(),
            Msg::Forward(j) => panic!("slot {j} is the round's to forward"),
        }
    }

    fn owned(&self, s: usize) -> Option<&[f32]> {
        let i = (self.me + self.n - s) % self.n;
        self.results.get(i).map(|r| &r[..])
    }

    fn view<'b>(&'b self, src: &Src<'b, Bytes>) -> Cow<'b, [f32]> {
        match src {
            Src::Mine(range) => Cow::Borrowed(&self.input[range.clone()]),
            Src::Got(b) => Cow::Owned(floats(b)),
            Src::Owned(i) => Cow::Borrowed(&self.results[*i]),
        }
    }

    pub fn output(&self) -> &[f32] {
        &self.output
    }
}

impl Plane for TestPlane {
    type Buf = Bytes;

    fn host<'b>(&'b self, buf: &'b Bytes) -> Cow<'b, [u8]> {
        Cow::Borrowed(&buf[..])
    }

    fn digest(&mut self, src: Src<'_, Bytes>) -> Digest {
        input_digest::<f32>(&self.view(&src))
    }

    fn commitment(&mut self, src: Src<'_, Bytes>) -> Digest {
        commitment::<f32>(&self.view(&src))
    }

    fn finite(&mut self, src: Src<'_, Bytes>) -> bool {
        self.view(&src).iter().all(|x| x.is_finite())
    }

    fn aggregate(
        &mut self,
        rule: &dyn Aggregator,
        inputs: &[Src<'_, Bytes>],
        to: Dest,
    ) -> Result<AggReport, AggError> {
        let views: Vec<Vec<f32>> = inputs.iter().map(|s| self.view(s).into_owned()).collect();
        let refs: Vec<&[f32]> = views.iter().map(|v| &v[..]).collect();
        let mut out = vec![0f32; refs.first().map_or(0, |v| v.len())];
        let report = aggregate_into(rule, &refs, &mut out)?;
        match to {
            Dest::Output => self.output = out,
            Dest::Owned(i) => {
                if self.results.len() <= i {
                    self.results.resize(i + 1, Vec::new());
                }
                let lie = self.lie.unwrap_or(0.0);
                self.results[i] = out.into_iter().map(|x| x + lie).collect();
            }
        }
        Ok(report)
    }

    fn combine(
        &mut self,
        _s: usize,
        range: Range<usize>,
        versions: &[Src<'_, Bytes>],
    ) -> Result<(), AggError> {
        let views: Vec<Vec<f32>> = versions.iter().map(|s| self.view(s).into_owned()).collect();
        let refs: Vec<&[f32]> = views.iter().map(|v| &v[..]).collect();
        let median = Median::new(views.len().saturating_sub(1) / 2);
        aggregate_into(&median, &refs, &mut self.output[range]).map(|_| ())
    }

    fn distance_table(&mut self, _: &[Option<Src<'_, Bytes>>]) -> Vec<f64> {
        unreachable!("the harness runs coordinate-wise rules")
    }

    fn finish_selected(
        &mut self,
        _: &dyn DistanceSelection,
        _: &[Option<Src<'_, Bytes>>],
        _: &[usize],
        _: usize,
    ) -> Result<(), AggError> {
        unreachable!("the harness runs coordinate-wise rules")
    }

    fn estimate_start(&mut self, _: usize, _: &[Option<Src<'_, Bytes>>]) -> Result<(), AggError> {
        unreachable!("the harness runs coordinate-wise rules")
    }

    fn estimate_distances(&mut self, _: usize, _: &[Option<Src<'_, Bytes>>]) -> Vec<f64> {
        unreachable!("the harness runs coordinate-wise rules")
    }

    fn estimate_step(
        &mut self,
        _: usize,
        _: &[Option<Src<'_, Bytes>>],
        _: f64,
        _: &[f64],
    ) -> (f64, f64) {
        unreachable!("the harness runs coordinate-wise rules")
    }

    fn estimate_finish(&mut self, _: usize) -> Result<(), String> {
        unreachable!("the harness runs coordinate-wise rules")
    }

    fn mix(
        &mut self,
        _: &dyn DistanceMixing,
        _: &[Src<'_, Bytes>],
        _: &[Option<Vec<usize>>],
        _: usize,
    ) -> Result<(), AggError> {
        unreachable!("the harness runs coordinate-wise rules")
    }

    fn keeps_input(&self) -> bool {
        true
    }

    fn host_bytes(&mut self, src: Src<'_, Bytes>) -> Option<Vec<u8>> {
        Some(bytes_of(&self.view(&src)).to_vec())
    }

    fn write_output(&mut self, at: usize, bytes: &[u8]) -> bool {
        let v = floats(bytes);
        self.output[at..at + v.len()].copy_from_slice(&v);
        true
    }

    fn result_digest(&mut self) -> Digest {
        result_digest::<f32>(&self.output)
    }

    fn output_digest(&mut self, _s: usize, range: Range<usize>) -> Digest {
        commitment::<f32>(&self.output[range])
    }
}

/// What the network does to one message.
pub enum Fate {
    /// Arrives after this delay.
    After(Duration),
    /// Never arrives.
    Dropped,
    /// Arrives after this delay with these bytes instead (a Byzantine sender).
    Rewritten(Duration, Bytes),
    /// The sender's connection is gone: the receive is `Missing` at once (a closed
    /// connection, which counts towards a quorum as soon as the receive is posted).
    Closed,
}

/// The network: `fate(from, to, step, tag, bytes)` says what happens to each message.
pub type Network<'a> = dyn Fn(Rank, Rank, u32, u32, &Bytes) -> Fate + 'a;

/// A message in flight: when it arrives, and what.
struct InFlight {
    at: Duration,
    bytes: Bytes,
    /// [`Fate::Closed`]: the receive's outcome is `Missing`, from `at` on.
    closed: bool,
}

/// Every rank's outcome: its report or error, its output, and when its round ended.
pub struct Ended {
    pub result: Result<RoundReport, Error>,
    pub output: Vec<f32>,
    pub at: Duration,
}

/// Runs one round of `rule` on `n` ranks (rank `r`'s input `inputs[r]`, starting at
/// `starts[r]`) over `net`, under virtual time. Panics on a livelock (more than `max_events`
/// events) or a round that waits forever.
#[allow(clippy::too_many_arguments)]
pub fn run(
    spec: impl Fn(Rank) -> Spec,
    rule: &dyn Aggregator,
    inputs: &[Vec<f32>],
    starts: &[Duration],
    net: &Network<'_>,
) -> Vec<Ended> {
    let n = inputs.len();
    let planes = (0..n)
        .map(|r| TestPlane::new(r, n, inputs[r].clone()))
        .collect();
    run_rounds(|r| Round::new(spec(r), rule), planes, starts, net)
}

/// [`run`] of the rounds `round(r)` makes, over `planes`.
pub fn run_rounds<'a>(
    round: impl Fn(Rank) -> Round<'a, Bytes>,
    mut planes: Vec<TestPlane>,
    starts: &[Duration],
    net: &Network<'_>,
) -> Vec<Ended> {
    let n = planes.len();
    let mut rounds: Vec<Round<'a, Bytes>> = (0..n).map(&round).collect();
    // (from, to, step, tag) -> message.
    let mut wire: HashMap<(Rank, Rank, u32, u32), InFlight> = HashMap::new();
    // Each rank's posted step: when it was posted (`None`: not started or done).
    let mut posted: Vec<Option<Duration>> = vec![None; n];
    let mut ended: Vec<Option<Duration>> = vec![None; n];
    let mut started = vec![false; n];
    let max_events = 64 * n * n + 1024;
    let mut now = Duration::ZERO;
    for _ in 0..max_events {
        // The next event: a rank starting, or a posted step completing.
        let mut next: Option<(Duration, Rank)> = None;
        for r in 0..n {
            let t = if !started[r] {
                starts[r]
            } else if let (Some(at), Some(plan)) = (posted[r], rounds[r].step()) {
                completes_at(r, at, plan, &wire)
            } else {
                continue;
            };
            if next.is_none_or(|(best, _)| t < best) {
                next = Some((t, r));
            }
        }
        let Some((t, r)) = next else {
            return (0..n)
                .map(|r| {
                    let round = std::mem::replace(&mut rounds[r], round(r));
                    Ended {
                        result: round.finish(),
                        output: planes[r].output().to_vec(),
                        at: ended[r].unwrap(),
                    }
                })
                .collect();
        };
        now = now.max(t);
        if started[r] {
            let plan = rounds[r].step().unwrap().clone();
            let at = posted[r].unwrap();
            let cut = quorum_cut(&plan, at, &wire, r);
            let outcomes: Vec<Arrival<Bytes>> = plan
                .recvs
                .iter()
                .map(|op| match wire.get(&(op.peer, r, plan.index, op.tag)) {
                    Some(m) if m.at <= now && m.closed => Arrival::Missing,
                    Some(m) if m.at <= now && m.bytes.len() == op.len => {
                        Arrival::Received(m.bytes.clone())
                    }
                    Some(m) if m.at <= now => {
                        Arrival::Malformed(format!("{} bytes, expected {}", m.bytes.len(), op.len))
                    }
                    _ if cut.is_some_and(|c| c < at + plan.timeout) => Arrival::Late,
                    _ => Arrival::Missing,
                })
                .collect();
            rounds[r].took(now.saturating_sub(at));
            rounds[r].handle(&mut planes[r], outcomes);
        }
        started[r] = true;
        match rounds[r].step() {
            Some(plan) => {
                for s in &plan.sends {
                    let bytes = match &s.msg {
                        Msg::Forward(j) => rounds[r].held(*j).unwrap().clone(),
                        msg => planes[r].payload(msg),
                    };
                    let key = (r, s.peer, plan.index, s.tag);
                    match net(r, s.peer, plan.index, s.tag, &bytes) {
                        Fate::After(delay) => {
                            wire.insert(
                                key,
                                InFlight {
                                    at: now + delay,
                                    bytes,
                                    closed: false,
                                },
                            );
                        }
                        Fate::Dropped => {}
                        Fate::Rewritten(delay, other) => {
                            wire.insert(
                                key,
                                InFlight {
                                    at: now + delay,
                                    bytes: other,
                                    closed: false,
                                },
                            );
                        }
                        Fate::Closed => {
                            wire.insert(
                                key,
                                InFlight {
                                    at: now,
                                    bytes: Bytes::new(),
                                    closed: true,
                                },
                            );
                        }
                    }
                }
                posted[r] = Some(now);
            }
            None => {
                posted[r] = None;
                ended[r] = Some(now);
            }
        }
    }
    panic!("no end after {max_events} events: a livelock");
}

/// When rank `me`'s step posted at `at` completes: every receive in, or its quorum and grace,
/// or its deadline.
fn completes_at(
    me: Rank,
    at: Duration,
    plan: &byzcoll_proto::round::StepPlan,
    wire: &HashMap<(Rank, Rank, u32, u32), InFlight>,
) -> Duration {
    let deadline = at + plan.timeout;
    let arrivals: Vec<Option<Duration>> = plan
        .recvs
        .iter()
        .map(|op| {
            wire.get(&(op.peer, me, plan.index, op.tag))
                .map(|m| m.at.max(at))
        })
        .collect();
    let all = arrivals
        .iter()
        .try_fold(at, |t, a| a.map(|a| t.max(a)))
        .unwrap_or(deadline)
        .min(deadline);
    match quorum_cut(plan, at, wire, me) {
        Some(cut) => all.min(cut),
        None => all,
    }
}

/// When the step's quorum and grace end it, or its quorum and the last of its awaited
/// receives (`None` without a quorum, or before it forms).
fn quorum_cut(
    plan: &byzcoll_proto::round::StepPlan,
    at: Duration,
    wire: &HashMap<(Rank, Rank, u32, u32), InFlight>,
    me: Rank,
) -> Option<Duration> {
    let q = plan.quorum?;
    let mut times: Vec<Duration> = plan
        .recvs
        .iter()
        .filter_map(|op| {
            wire.get(&(op.peer, me, plan.index, op.tag))
                .map(|m| m.at.max(at))
        })
        .collect();
    times.sort_unstable();
    let kth = match q.receives {
        0 => at,
        k => *times.get(k - 1)?,
    };
    // The first `core` receives must be in as well.
    let core = plan.recvs[..q.core.min(plan.recvs.len())]
        .iter()
        .map(|op| {
            wire.get(&(op.peer, me, plan.index, op.tag))
                .map(|m| m.at.max(at))
        })
        .try_fold(at, |t, a| a.map(|a| t.max(a)))?;
    let formed = kth.max(core);
    let mut cut = formed + q.grace.after(formed - at);
    let awaited_in = plan.recvs[..q.awaited.min(plan.recvs.len())]
        .iter()
        .map(|op| {
            wire.get(&(op.peer, me, plan.index, op.tag))
                .map(|m| m.at.max(at))
        })
        .try_fold(at, |t, a| a.map(|a| t.max(a)));
    if let Some(all) = awaited_in {
        cut = cut.min(all.max(formed));
    }
    (cut < at + plan.timeout).then_some(cut)
}

/// A spec for rank `me` of `n`, `d` elements, every other field as the runtime sets it.
pub fn spec(me: Rank, n: usize, d: usize, shape: Shape, agreement: Agreement) -> Spec {
    Spec {
        me,
        n,
        d,
        elem: 4,
        shape,
        agreement,
        timeout: Duration::from_secs(1),
        stragglers: 0,
        grace: Grace::DEFAULT,
    }
}

/// Rank `r`'s input: `d` values that differ between ranks and coordinates.
pub fn input(r: Rank, d: usize) -> Vec<f32> {
    (0..d)
        .map(|i| ((r * 31 + i * 7) % 97) as f32 - 40.0)
        .collect()
}

/// The world sizes that break naive code.
pub const WORLD_SIZES: [usize; 6] = [1, 2, 3, 7, 8, 11];
