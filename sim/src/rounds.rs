//! Rounds in a row: each rank starts a round when it has finished the one before (plus its
//! delay when it is slow), on NICs still busy with what earlier rounds queued; ranks die and
//! rejoin between rounds. Each round is one collective call of the runtime: a fresh
//! [`Round`](byzcoll_proto::round::Round), so that a dead peer costs every round it is dead
//! in what the core makes it cost (one deadline, or the quorum's grace with `s` stragglers
//! allowed).

use std::fmt;

use byzcoll_aggregators::Aggregator;
use byzcoll_proto::{Agreement, Error, Fault, Grace, Health, Rank, RoundReport};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::data::Plane;
use crate::engine::Start;
use crate::{
    bitwise_cmp, mix, Algorithm, DataSet, RankResult, Role, Run, Scenario, SimError, Stats,
};

/// The most rounds one series runs.
pub const MAX_ROUNDS: usize = 10_000;

/// How much longer than the healthy round a round may take, as a fraction of the healthy
/// round, before [`Rounds::check`] counts it slow: ranks start a round when each finished the
/// one before, not all at once as in the healthy round, and a round is timed from the first
/// start to the last finish.
pub const TIME_TOLERANCE: f64 = 0.1;

/// Ranks listed by name in a [`Named`].
const NAMED: usize = 8;

/// Salt of the slow ranks' delays: the same draws whatever the algorithm.
const SLOW_SALT: u64 = 0x736c_6f77;

/// A count of ranks with the lowest few of them (at most 8), for reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Named {
    /// How many ranks.
    pub count: usize,
    /// The lowest of them, ascending.
    pub first: Vec<Rank>,
}

impl Named {
    fn of(ranks: impl Iterator<Item = Rank>) -> Named {
        let mut named = Named::default();
        for r in ranks {
            named.count += 1;
            if named.first.len() < NAMED {
                named.first.push(r);
            }
        }
        named
    }
}

impl fmt::Display for Named {
    /// `0`, `2[997,998]`, `12[0,1,2,3,4,5,6,7,...]`: one word, for tables.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.count)?;
        if self.count > 0 {
            let list: Vec<String> = self.first.iter().map(ToString::to_string).collect();
            let more = if self.count > self.first.len() {
                ",..."
            } else {
                ""
            };
            write!(f, "[{}{more}]", list.join(","))?;
        }
        Ok(())
    }
}

/// What one round of [`Scenario::run_rounds`] took and gave. Times are virtual seconds; a
/// round's ranks are the ones alive in it.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundOutcome {
    /// The round, from 0.
    pub round: usize,
    /// When the first rank alive in it started it, since round 0's start.
    pub start: f64,
    /// How long it took the ranks that set its pace: from `start` to when the last honest
    /// rank that is neither slow nor dead finished it (all honest ranks if every one is slow).
    pub time: f64,
    /// From `start` to when the last rank alive in it finished it (a slow one, typically).
    pub slowest: f64,
    /// From `start` to when the last rank alive in it started it: a slow rank's delay, and
    /// how far it had fallen behind in the rounds before.
    pub lag: f64,
    /// Ranks some honest rank erased as late (after its quorum's grace).
    pub late: Named,
    /// Ranks some honest rank erased as missing (at a deadline) or malformed.
    pub missing: Named,
    /// Ranks that take no part in this round: dead ([`Faults::deaths`](crate::Faults::deaths)),
    /// or crashed in an earlier one.
    pub dead: usize,
    /// The fewest inputs an honest rank that sets the pace counted: `n` less the peers it
    /// erased.
    pub inputs: usize,
    /// Honest ranks off the pace (slow ones) whose round failed and said so: out of step,
    /// typically ([`byzcoll_proto::Error::Disagreement`] under [`Agreement::Detect`]).
    pub out_of_step: Named,
    /// Honest ranks that had inputs late to them passed on by others and took them
    /// ([`AgreementReport::recovered`](byzcoll_proto::AgreementReport::recovered)): the round
    /// had one more step with data in it.
    pub recovered: Named,
    /// Honest ranks that set the pace and did not complete the round, with the first one's
    /// error. `None`: every one of them completed.
    pub incomplete: Option<String>,
    /// Honest ranks that completed with different results and did not say so (under
    /// [`Agreement::Enforce`]: that completed with different results). `None`: every honest
    /// rank that completed holds the same result, or named the difference.
    pub split: Option<String>,
    /// The round's counters.
    pub stats: Stats,
}

/// Several rounds of one algorithm ([`Scenario::run_rounds`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Rounds {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// `s`, the inputs each round was allowed to go without for their lateness.
    pub stragglers: usize,
    /// The quorum steps' grace.
    pub grace: Grace,
    /// The step deadline, in seconds.
    pub timeout: f64,
    /// How many ranks are slow.
    pub slow: usize,
    /// Every round, in order.
    pub rounds: Vec<RoundOutcome>,
}

impl Rounds {
    /// Whether the quorum covers every rank that is slow or dead in `round`: at most `s` of
    /// them, so the round need not wait for any.
    pub fn covered(&self, round: &RoundOutcome) -> bool {
        self.slow + round.dead <= self.stragglers
    }

    /// The longest `round` may take when the healthy round (no slow rank, no death) takes
    /// `healthy` seconds: `healthy` (with [`TIME_TOLERANCE`]) plus, when the quorum covers
    /// the slow and dead ranks ([`Rounds::covered`]), the grace after a quorum that took
    /// `healthy`: none of them is waited for. Otherwise the round waits for them, at most
    /// until the last one started ([`RoundOutcome::lag`]) plus one step deadline: a rank
    /// waits for a silent one until its own input step's deadline, counted from its own
    /// start, and the cross-check does not wait for a rank the round erased. A round in which
    /// late inputs were passed on ([`RoundOutcome::recovered`]) may take one more step with
    /// data and its grace: counted as a healthy round and the grace after it. So may a sharded
    /// round with a late owner: a taker whose version came from it asks another owner in the
    /// steps after the versions (counted as a healthy round), and an owner waits for the late
    /// rank's sync and request up to the grace's floor ([`Grace::min`]) each.
    pub fn bound(&self, round: &RoundOutcome, healthy: f64) -> f64 {
        let grace = std::time::Duration::try_from_secs_f64(healthy)
            .map_or(f64::INFINITY, |h| self.grace.after(h).as_secs_f64());
        let extra = if self.covered(round) {
            grace
        } else {
            round.lag + self.timeout
        };
        let recovery = match round.recovered.count {
            0 => 0.0,
            _ => healthy * (1.0 + TIME_TOLERANCE) + grace,
        };
        let resend = match self.algorithm {
            Algorithm::Sharded { .. } if self.stragglers > 0 && self.slow + round.dead > 0 => {
                healthy * (1.0 + TIME_TOLERANCE) + 2.0 * self.grace.min.as_secs_f64()
            }
            _ => 0.0,
        };
        healthy * (1.0 + TIME_TOLERANCE) + extra + recovery + resend
    }

    /// Whether in every round the honest ranks that set the pace completed, no honest ranks
    /// ended with different results silently, and the round's time followed the quorum
    /// ([`Rounds::bound`]), given the healthy round's time.
    ///
    /// # Errors
    /// Every problem, one line each, naming the round.
    pub fn check(&self, healthy: f64) -> Result<(), Vec<String>> {
        let mut problems = Vec::new();
        for round in &self.rounds {
            for why in round.incomplete.iter().chain(&round.split) {
                problems.push(format!("{} round {}: {why}", self.algorithm, round.round));
            }
            let bound = self.bound(round, healthy);
            if round.time > bound {
                let why = if self.covered(round) {
                    format!(
                        "the healthy round's {} plus the grace",
                        crate::format_time(healthy)
                    )
                } else {
                    format!(
                        "the healthy round's {} plus the last start's lag of {} plus one step \
                         deadline, with {} slow or dead ranks and s = {}",
                        crate::format_time(healthy),
                        crate::format_time(round.lag),
                        self.slow + round.dead,
                        self.stragglers
                    )
                };
                problems.push(format!(
                    "{} round {}: took {}, more than {} ({why})",
                    self.algorithm,
                    round.round,
                    crate::format_time(round.time),
                    crate::format_time(bound),
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }
}

impl Scenario {
    /// Runs `rounds` rounds of `algorithm` on `data`'s vectors (the same inputs every round)
    /// with the real aggregators: [`Faults::slow`](crate::Faults::slow) ranks start each
    /// round a fresh delay late, [`Faults::deaths`](crate::Faults::deaths) ranks take no part
    /// from their round until they rejoin, crashed ranks stay crashed after round 0 and stalls
    /// delay round 0 only. Each round's full [`Run`] is summarized and dropped.
    ///
    /// # Errors
    /// As [`Scenario::run_data`], and [`SimError::InvalidConfig`] for `rounds` outside
    /// `1..=`[`MAX_ROUNDS`] or deaths (or a rejoin) at a round past the last.
    pub fn run_rounds(
        &self,
        algorithm: Algorithm,
        rounds: usize,
        data: &DataSet,
        rule: &dyn Aggregator,
    ) -> Result<Rounds, SimError> {
        self.check_data(data)?;
        let stragglers = self.stragglers_in(algorithm, rule)?;
        let mut outcomes = Vec::new();
        let slow = self.slow_ranks();
        self.rounds(
            algorithm,
            rounds,
            data.d(),
            Some(rule),
            Some(data),
            |starts, run| {
                outcomes.push(self.summarize(outcomes.len(), &run, starts, &slow));
            },
        )?;
        Ok(Rounds {
            algorithm,
            stragglers,
            grace: self.grace,
            timeout: self.timeout,
            slow: slow.len(),
            rounds: outcomes,
        })
    }

    /// Checks that `count` rounds can run: 1 to [`MAX_ROUNDS`], with the deaths (and the
    /// rejoin) at one of them.
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`] saying which.
    pub fn check_rounds(&self, count: usize) -> Result<(), SimError> {
        if count == 0 || count > MAX_ROUNDS {
            return Err(SimError::InvalidConfig(format!(
                "{count} rounds: need 1 to {MAX_ROUNDS}"
            )));
        }
        if let Some(deaths) = self.faults.deaths {
            let last = count - 1;
            if deaths.at > last || deaths.rejoin.is_some_and(|back| back > last) {
                return Err(SimError::InvalidConfig(format!(
                    "ranks die at round {}{} but the run has rounds 0 to {last} only",
                    deaths.at,
                    deaths
                        .rejoin
                        .map_or(String::new(), |back| format!(" and rejoin at round {back}"))
                )));
            }
        }
        Ok(())
    }

    /// Runs `count` rounds, handing each round's starts and run to `each`.
    pub(crate) fn rounds(
        &self,
        algorithm: Algorithm,
        count: usize,
        d: usize,
        rule: Option<&dyn Aggregator>,
        data: Option<&DataSet>,
        mut each: impl FnMut(&[Start], Run),
    ) -> Result<(), SimError> {
        self.validate()?;
        self.check_rounds(count)?;
        let n = self.ranks;
        let slow = self.slow_ranks();
        let dying = self.dying_ranks();
        let dead_in = |round: usize, r: Rank| {
            dying.contains(&r) && self.faults.deaths.is_some_and(|d| d.dead_in(round))
        };
        let mut delays = StdRng::seed_from_u64(mix(self.seed, SLOW_SALT));
        let mut health: Vec<Health> = (0..n).map(|_| Health::new(n)).collect();
        let mut starts: Vec<Start> = (0..n)
            .map(|r| Start {
                at: self
                    .faults
                    .stalls
                    .iter()
                    .filter(|s| s.rank == r)
                    .map(|s| s.delay)
                    .fold(0.0, |a, b| a + b),
                crash_at: self
                    .faults
                    .crashes
                    .iter()
                    .filter(|c| c.rank == r)
                    .map(|c| c.from_step)
                    .min(),
                ..Start::default()
            })
            .collect();
        for round in 0..count {
            if round > 0 {
                // Ranks that rejoin are there when the first live rank starts the round.
                let first = (0..n)
                    .filter(|&r| !dead_in(round - 1, r) && starts[r].crash_at.is_none())
                    .map(|r| starts[r].at)
                    .reduce(f64::min)
                    .unwrap_or(0.0);
                for (r, start) in starts.iter_mut().enumerate() {
                    if dead_in(round - 1, r) && !dead_in(round, r) {
                        start.at = first;
                    }
                    if self.faults.crashed(r) {
                        start.crash_at = Some(0);
                    }
                }
            }
            for (r, start) in starts.iter_mut().enumerate() {
                if dead_in(round, r) {
                    start.crash_at = Some(0);
                } else if !self.faults.crashed(r) {
                    start.crash_at = None;
                }
            }
            if let Some(s) = self.faults.slow {
                for r in slow.clone() {
                    starts[r].at += s.delay.sample(&mut delays);
                }
            }
            let plane = data.map(Plane::new);
            let laggards: Vec<Vec<Rank>> = health.iter().map(Health::laggards).collect();
            let (run, next) =
                self.run_round(algorithm, d, rule, plane, &starts, round, &laggards)?;
            // Each rank's fault memory, as the host communicator keeps it: a peer late round
            // after round is waited for only up to the quorum.
            for (h, o) in health.iter_mut().zip(&run.ranks) {
                let report = RoundReport {
                    faults: o.faults.clone(),
                    agreement: o.agreement.clone(),
                    ..RoundReport::default()
                };
                match &o.result {
                    // A round failed for its peers' faults teaches what they were; one failed
                    // for this rank's own reasons teaches nothing (as `Health::record`).
                    RankResult::Done(_)
                    | RankResult::Failed(Error::TooManyFaults { .. } | Error::ShardLost { .. }) => {
                        h.record(&Ok(report));
                    }
                    RankResult::Failed(_) | RankResult::Crashed => {}
                }
            }
            each(&starts, run);
            for (start, next) in starts.iter_mut().zip(next) {
                *start = Start {
                    crash_at: start.crash_at,
                    ..next
                };
            }
        }
        Ok(())
    }

    /// One round's [`RoundOutcome`].
    fn summarize(
        &self,
        round: usize,
        run: &Run,
        starts: &[Start],
        slow: &std::ops::Range<Rank>,
    ) -> RoundOutcome {
        let n = self.ranks;
        let alive = |r: Rank| starts[r].crash_at != Some(0);
        let honest = |r: Rank| run.ranks[r].role == Role::Honest;
        let pace = |r: Rank| honest(r) && !slow.contains(&r);
        let start = (0..n)
            .filter(|&r| alive(r))
            .map(|r| starts[r].at)
            .reduce(f64::min)
            .unwrap_or(0.0);
        let finish_of = |keep: &dyn Fn(Rank) -> bool| {
            (0..n)
                .filter(|&r| keep(r))
                .map(|r| run.ranks[r].finish)
                .reduce(f64::max)
        };
        let time = finish_of(&pace)
            .or_else(|| finish_of(&honest))
            .map_or(0.0, |t| t - start);
        let slowest = finish_of(&alive).map_or(0.0, |t| t - start);
        let lag = (0..n)
            .filter(|&r| alive(r))
            .map(|r| starts[r].at - start)
            .fold(0.0, f64::max);
        // 0: fine, 1: late, 2: missing or malformed.
        let mut erased = vec![0u8; n];
        for o in run.ranks.iter().filter(|o| o.role == Role::Honest) {
            for f in &o.faults {
                let kind = if f.fault == Fault::Late { 1 } else { 2 };
                erased[f.rank] = erased[f.rank].max(kind);
            }
        }
        let named = |kind: u8| Named::of((0..n).filter(|&r| erased[r] == kind));
        let inputs = (0..n)
            .filter(|&r| pace(r))
            .map(|r| n - run.ranks[r].faults.len())
            .min()
            .unwrap_or(0);
        let failed = |r: Rank| matches!(run.ranks[r].result, RankResult::Failed(_));
        let out_of_step = Named::of((0..n).filter(|&r| honest(r) && !pace(r) && failed(r)));
        let dead = (0..n).filter(|&r| !alive(r)).count();
        let recovered = Named::of((0..n).filter(|&r| {
            honest(r)
                && run.ranks[r]
                    .agreement
                    .as_ref()
                    .is_some_and(|a| !a.recovered.is_empty())
        }));
        RoundOutcome {
            round,
            start,
            time,
            slowest,
            lag,
            late: named(1),
            missing: named(2),
            dead,
            inputs,
            out_of_step,
            recovered,
            incomplete: incomplete(run, &pace),
            split: self.split(run),
            stats: run.stats,
        }
    }

    /// [`RoundOutcome::split`] of `run`.
    fn split(&self, run: &Run) -> Option<String> {
        if self.agreement != Agreement::Enforce {
            return run.silent_split();
        }
        let mut first: Option<(Rank, &[f32])> = None;
        for (r, o) in run.ranks.iter().enumerate() {
            let RankResult::Done(Some(v)) = &o.result else {
                continue;
            };
            if o.role != Role::Honest {
                continue;
            }
            match first {
                None => first = Some((r, v)),
                Some((q, w)) if bitwise_cmp(w, v) != std::cmp::Ordering::Equal => {
                    return Some(format!(
                        "honest ranks {q} and {r} completed with different results"
                    ))
                }
                Some(_) => {}
            }
        }
        None
    }
}

/// [`RoundOutcome::incomplete`] of `run`.
fn incomplete(run: &Run, pace: &dyn Fn(Rank) -> bool) -> Option<String> {
    let mut stuck = run
        .ranks
        .iter()
        .enumerate()
        .filter(|&(r, _)| pace(r))
        .filter_map(|(r, o)| match &o.result {
            RankResult::Failed(e) => Some((r, e.to_string())),
            RankResult::Crashed => Some((r, "crashed".into())),
            RankResult::Done(_) => None,
        });
    let (r, why) = stuck.next()?;
    Some(format!(
        "{} honest ranks that set the pace did not complete; rank {r}: {why}",
        1 + stuck.count()
    ))
}
