//! Audited rounds (issue #40; `PROTOCOL.md`, "Audited sharding") with the real evidence:
//! every sender signs its pieces and every owner its claim with an Ed25519 key of its own,
//! honest ranks audit with their own randomness after the claims are out, and accusations are
//! checked with [`Accusation::verify`] from their wire form. The network and time are not
//! modelled here: one audited round is the data of one sharded `r = 1` round of a
//! coordinate-wise rule over `n` ranks, with owners that lie (everywhere, on a few
//! sub-chunks, in some rounds only, or where their auditors did not look the round before)
//! and ranks that try to frame honest owners.
//!
//! It scales to thousands of ranks: a round costs what the protocol costs all ranks together
//! (`n²` signed pieces, `n²·m` leaves, `n` claims), spread over the machine's cores, and holds
//! one owner's evidence per core at a time ([`AuditSim::memory`]). Owners are simulated
//! independently, each from a seed of its own, so a run is the same on any number of cores.
//!
//! [`AuditRun::check`] asks what the issue asks: every liar convicted within the rounds the
//! odds predict ([`Audit::escape_probability`] at most [`AUDIT_TARGET`]), no honest owner ever
//! convicted, every framing attempt refuted, and the honest ranks that check the proofs
//! reaching the same verdicts. Every honest rank gets the same bytes here (the network is not
//! modelled) and a verdict is a function of those bytes and the job's public keys, so in
//! worlds of more than [`ALL_CHECK`] ranks each proof is checked [`CHECKERS`] times, each
//! check on its own as one honest rank makes it, rather than once per honest rank (a check
//! verifies `n + 1` signatures).

use std::thread;

use byzcoll_aggregators::{by_name, Aggregator, DType, Structure};
use byzcoll_proto::audit::{
    replay, sub_range, Accusation, Audit, CallId, Expect, OwnerClaim, Signature, SignedPiece,
    Signer, Verifier, AUDIT_TARGET,
};
use byzcoll_proto::Rank;
use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};

use crate::{Lie, SimError};

/// Worlds of at most this many ranks have every honest rank check every proof.
pub const ALL_CHECK: usize = 16;
/// In larger worlds, how many times every proof is checked (as that many honest ranks would).
pub const CHECKERS: usize = 2;

/// How a lying owner lies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Lying {
    /// On every sub-chunk of its shard, every round.
    Everywhere,
    /// On this many sub-chunks of its shard, chosen at random each round.
    SubChunks(usize),
    /// On every sub-chunk, in each round with this probability.
    Sometimes(f64),
    /// On this many sub-chunks each round, first those that none of its auditors asked it
    /// for in the round before (an owner sees which sub-chunks it is asked for): a liar that
    /// bets on audits looking where they looked before. Audits are drawn afresh every round,
    /// so it is caught as often as [`Lying::SubChunks`] of the same count.
    Unwatched(usize),
}

impl Lying {
    /// The probability that it escapes `rounds` rounds of `audit` among `n` ranks with `f`
    /// Byzantine ones.
    pub fn escape(&self, audit: &Audit, n: usize, f: usize, rounds: u32) -> f64 {
        match *self {
            Lying::Everywhere => audit.escape_probability(n, f, 1.0, rounds),
            Lying::SubChunks(l) | Lying::Unwatched(l) => {
                let p = l as f64 / audit.sub_chunks.max(1) as f64;
                audit.escape_probability(n, f, p, rounds)
            }
            Lying::Sometimes(q) => {
                let once = audit.escape_probability(n, f, 1.0, 1);
                (1.0 - q * (1.0 - once)).powf(f64::from(rounds))
            }
        }
    }

    /// The rounds by which it is caught with probability at least `1 − AUDIT_TARGET`
    /// (`None` past `limit`).
    pub fn predicted(&self, audit: &Audit, n: usize, f: usize, limit: u32) -> Option<u32> {
        (1..=limit).find(|&r| self.escape(audit, n, f, r) <= AUDIT_TARGET)
    }

    /// Whether it makes sense with `m` sub-chunks per shard.
    fn check(&self, m: usize) -> Result<(), String> {
        match *self {
            Lying::Everywhere => Ok(()),
            Lying::SubChunks(l) | Lying::Unwatched(l) if (1..=m).contains(&l) => Ok(()),
            Lying::SubChunks(l) | Lying::Unwatched(l) => Err(format!(
                "a liar lies on 1 to {m} sub-chunks (the shard's), not {l}"
            )),
            Lying::Sometimes(q) if (0.0..=1.0).contains(&q) => Ok(()),
            Lying::Sometimes(q) => Err(format!("a probability of lying is 0 to 1, not {q}")),
        }
    }
}

/// A simulation of audited rounds.
#[derive(Debug, Clone)]
pub struct AuditSim {
    /// The world size.
    pub n: usize,
    /// The rule's `f` (the odds count `n − f` honest auditors).
    pub f: usize,
    /// The coordinate-wise rule the owners run (`median`, `trimmed-mean`, `mean`).
    pub rule: String,
    /// Elements per shard, at least [`Audit::sub_chunks`].
    pub shard: usize,
    /// How the ranks audit.
    pub audit: Audit,
    /// Rounds to run.
    pub rounds: u32,
    /// The seed of everything random.
    pub seed: u64,
    /// The lying owners.
    pub liars: Vec<(Rank, Lying)>,
    /// What a liar puts in the sub-chunks it lies on: the negated values ([`Lie::SignFlip`])
    /// or NaN ([`Lie::Nan`]). An owner signs one claim, so [`Lie::Equivocate`] is refused.
    pub lie: Lie,
    /// Ranks that send a forged accusation against a random honest owner every round.
    pub framers: Vec<Rank>,
}

/// What one round saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuditRound {
    /// Owners that lied this round.
    pub lying: usize,
    /// Audits run by honest ranks (one per owner and sub-chunk replayed).
    pub audits: u64,
    /// Audits whose replay differed from the owner's result.
    pub accusations: u64,
    /// Distinct proofs sent (auditors that catch the same lie send the same bytes), forged
    /// ones included.
    pub proofs: usize,
    /// The liars convicted this round.
    pub convicted: Vec<Rank>,
    /// Forged accusations refuted this round.
    pub framings_refuted: u64,
    /// Honest ranks that checked every proof.
    pub checkers: usize,
    /// Whether two of them reached different verdicts.
    pub split: bool,
}

/// What a simulation saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AuditRun {
    /// Each liar and the round (from 1) it was convicted in, `None`: never.
    pub convicted: Vec<(Rank, Option<u32>)>,
    /// Each liar's predicted rounds ([`Lying::predicted`]).
    pub predicted: Vec<(Rank, Option<u32>)>,
    /// Honest owners some honest rank convicted (must stay empty).
    pub honest_convicted: Vec<Rank>,
    /// Forged accusations every honest rank refuted.
    pub framings_refuted: u64,
    /// Forged accusations some honest rank did not refute (must stay 0).
    pub framings_standing: u64,
    /// Rounds in which two honest ranks reached different verdicts (must stay 0).
    pub split_rounds: u64,
    /// Audits run by honest ranks.
    pub audits: u64,
    /// Accusations made by honest auditors.
    pub accusations: u64,
    /// Each round, in order.
    pub rounds: Vec<AuditRound>,
}

impl AuditRun {
    /// Whether the run meets the guarantees: every liar convicted within its predicted rounds
    /// (a liar with no prediction within the run only needs conviction if it ran long
    /// enough), no honest owner convicted, every framing refuted, no split verdict.
    ///
    /// # Errors
    /// The first guarantee that does not hold.
    pub fn check(&self) -> Result<(), String> {
        for ((rank, got), (_, want)) in self.convicted.iter().zip(&self.predicted) {
            if let Some(want) = want {
                match got {
                    Some(r) if r <= want => {}
                    _ => {
                        return Err(format!(
                            "liar {rank} convicted in round {got:?}, predicted by {want}"
                        ))
                    }
                }
            }
        }
        if !self.honest_convicted.is_empty() {
            return Err(format!(
                "honest owners convicted: {:?}",
                self.honest_convicted
            ));
        }
        if self.framings_standing > 0 {
            return Err(format!(
                "{} forged accusations not refuted",
                self.framings_standing
            ));
        }
        if self.split_rounds > 0 {
            return Err(format!("{} rounds with split verdicts", self.split_rounds));
        }
        Ok(())
    }
}

struct Key(SigningKey);

impl Signer for Key {
    fn sign(&self, message: &[u8]) -> Signature {
        self.0.sign(message).to_bytes()
    }
}

struct Keys(Vec<VerifyingKey>);

impl Verifier for Keys {
    fn verify(&self, rank: Rank, message: &[u8], signature: &Signature) -> bool {
        self.0.get(rank).is_some_and(|k| {
            k.verify_strict(message, &ed25519_dalek::Signature::from_bytes(signature))
                .is_ok()
        })
    }
}

/// How a framer forges its accusation against an honest owner.
#[derive(Debug, Clone, Copy)]
enum Forgery {
    /// The owner's result bytes, altered.
    Result,
    /// An input's bytes, altered.
    Input,
    /// A claim over an altered result, signed with the framer's own key.
    Claim,
}

/// One owner's part of a round: what its auditors and its framers send.
#[derive(Default)]
struct OwnerRound {
    audits: u64,
    accusations: u64,
    /// Distinct proofs by honest auditors (one per sub-chunk caught).
    proofs: Vec<Vec<u8>>,
    /// Forged accusations against it.
    forged: Vec<Vec<u8>>,
}

/// The round's view every owner's simulation shares.
struct RoundCtx<'a> {
    sim: &'a AuditSim,
    rule: &'a dyn Aggregator,
    keys: &'a [Key],
    call: CallId,
    expect: Expect,
}

/// Runs `job(0..jobs)` on up to `threads` threads; the results in order.
fn parallel<T: Send>(jobs: usize, threads: usize, job: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let mut slots: Vec<Option<T>> = (0..jobs).map(|_| None).collect();
    let per = jobs.div_ceil(threads.max(1)).max(1);
    thread::scope(|s| {
        for (c, chunk) in slots.chunks_mut(per).enumerate() {
            let job = &job;
            s.spawn(move || {
                for (i, slot) in chunk.iter_mut().enumerate() {
                    *slot = Some(job(c * per + i));
                }
            });
        }
    });
    slots.into_iter().flatten().collect()
}

/// A seed of its own for owner `o` in `round`, so that owners are simulated independently.
fn owner_seed(seed: u64, round: u32, o: Rank) -> u64 {
    let mut x = seed ^ (u64::from(round) << 40) ^ (o as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // splitmix64's finaliser.
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn replayed(rule: &dyn Aggregator, inputs: &[&[u8]]) -> Result<Vec<u8>, SimError> {
    replay(rule, DType::F32, inputs).map_err(SimError::Unsupported)
}

impl RoundCtx<'_> {
    fn sub_chunk(&self, bytes: &[u8], j: usize) -> Vec<u8> {
        let r = sub_range(self.sim.shard, self.sim.audit.sub_chunks, j);
        bytes[r.start * 4..r.end * 4].to_vec()
    }

    /// Owner `o`'s shard this round: every rank's signed piece, the owner's result with its
    /// lies on sub-chunks `lies`, its signed claim; then the audits of it (`(auditor,
    /// sub-chunk)`) and the forgeries against it (`(framer, sub-chunk, how)`).
    fn owner(
        &self,
        o: Rank,
        round: u32,
        lies: &[usize],
        audits: &[(Rank, usize)],
        framings: &[(Rank, usize, Forgery)],
    ) -> Result<OwnerRound, SimError> {
        let (sim, m) = (self.sim, self.sim.audit.sub_chunks);
        let mut rng = StdRng::seed_from_u64(owner_seed(sim.seed, round, o));
        let pieces: Vec<Vec<u8>> = (0..sim.n)
            .map(|_| {
                let v: Vec<f32> = (0..sim.shard).map(|_| rng.gen_range(-1.0..1.0)).collect();
                bytemuck::cast_slice(&v).to_vec()
            })
            .collect();
        let inputs: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
        let mut result = replayed(self.rule, &inputs)?;
        for &j in lies {
            let r = sub_range(sim.shard, m, j);
            for value in result[r.start * 4..r.end * 4].chunks_exact_mut(4) {
                match sim.lie {
                    Lie::Nan => value.copy_from_slice(&f32::NAN.to_le_bytes()),
                    _ => value[3] ^= 0x80, // the sign bit
                }
            }
        }
        let signed = (0..sim.n)
            .map(|p| SignedPiece::sign(&self.keys[p], &self.call, p, o, &pieces[p], 4, m))
            .collect();
        let claim = OwnerClaim::sign(&self.keys[o], &self.call, o, o, &result, 4, m, signed);
        let accusation = |claim: &OwnerClaim, j: usize, result: &[u8]| Accusation {
            claim: claim.clone(),
            sub: j,
            result: self.sub_chunk(result, j),
            inputs: pieces.iter().map(|p| self.sub_chunk(p, j)).collect(),
        };
        let mut out = OwnerRound::default();
        let mut proven: Vec<usize> = Vec::new();
        for &(_, j) in audits {
            out.audits += 1;
            let r = sub_range(sim.shard, m, j);
            let bytes = r.start * 4..r.end * 4;
            let inputs: Vec<&[u8]> = pieces.iter().map(|p| &p[bytes.clone()]).collect();
            if replayed(self.rule, &inputs)? != result[bytes] {
                out.accusations += 1;
                if !proven.contains(&j) {
                    proven.push(j);
                    out.proofs
                        .push(accusation(&claim, j, &result).encode(&self.expect));
                }
            }
        }
        for &(framer, j, how) in framings {
            let mut acc = accusation(&claim, j, &result);
            match how {
                Forgery::Result => acc.result[0] ^= 0x40,
                Forgery::Input => acc.inputs[0][0] ^= 0x40,
                Forgery::Claim => {
                    let mut forged = result.clone();
                    forged[3] ^= 0x40;
                    acc.claim = OwnerClaim::sign(
                        &self.keys[framer],
                        &self.call,
                        o,
                        o,
                        &forged,
                        4,
                        m,
                        claim.inputs.clone(),
                    );
                    acc.result = self.sub_chunk(&forged, j);
                }
            }
            out.forged.push(acc.encode(&self.expect));
        }
        Ok(out)
    }

    /// A checker's verdict on a proof's wire form: the owner it convicts, if any.
    fn verdict(&self, keys: &Keys, wire: &[u8]) -> Option<Rank> {
        Accusation::decode(wire, &self.expect)
            .and_then(|acc| {
                acc.verify(keys, &self.call, &self.expect, |inputs| {
                    replay(self.rule, DType::F32, inputs)
                })
            })
            .ok()
            .map(|lie| lie.owner)
    }
}

impl AuditSim {
    /// Checks the set-up before anything runs: a world of at least 2, a coordinate-wise rule
    /// whose precondition holds, shards of at least one element per sub-chunk, liars and
    /// framers that are ranks of the world, at most `f` of them in all (the odds count
    /// `n − f` honest auditors).
    ///
    /// # Errors
    /// [`SimError::InvalidConfig`], [`SimError::Precondition`] or [`SimError::Unsupported`],
    /// naming what does not hold.
    pub fn validate(&self) -> Result<Box<dyn Aggregator>, SimError> {
        let (n, m) = (self.n, self.audit.sub_chunks);
        let invalid = |why: String| Err(SimError::InvalidConfig(why));
        if n < 2 {
            return invalid(format!("audited rounds need at least 2 ranks, not {n}"));
        }
        let rule = by_name(&self.rule, self.f).map_err(SimError::Precondition)?;
        rule.check(n).map_err(SimError::Precondition)?;
        if rule.structure() != Structure::CoordinateWise {
            return Err(SimError::Unsupported(format!(
                "audits replay sub-chunks, which only a coordinate-wise rule allows, not {}",
                self.rule
            )));
        }
        if self.lie == Lie::Equivocate {
            return Err(SimError::Unsupported(
                "an audited owner signs one claim, which its takers check: it lies with \
                 signflip or nan, it cannot equivocate"
                    .into(),
            ));
        }
        if m == 0 || self.audit.samples == 0 {
            return invalid("an audit needs at least 1 sub-chunk and 1 sample".into());
        }
        if self.shard < m {
            return invalid(format!(
                "shards of {} elements cannot be cut into {m} sub-chunks",
                self.shard
            ));
        }
        let mut byzantine: Vec<Rank> = self.liars.iter().map(|(r, _)| *r).collect();
        if byzantine.len() > 1 && {
            let mut sorted = byzantine.clone();
            sorted.sort_unstable();
            sorted.windows(2).any(|w| w[0] == w[1])
        } {
            return invalid("a liar is listed twice".into());
        }
        for (_, how) in &self.liars {
            how.check(m).map_err(SimError::InvalidConfig)?;
        }
        byzantine.extend(&self.framers);
        byzantine.sort_unstable();
        byzantine.dedup();
        if let Some(r) = byzantine.iter().find(|&&r| r >= n) {
            return invalid(format!("rank {r} is not one of {n}"));
        }
        if byzantine.len() > self.f {
            return invalid(format!(
                "{} Byzantine ranks (liars and framers) but f = {}: the odds count n - f honest \
                 auditors",
                byzantine.len(),
                self.f
            ));
        }
        Ok(rule)
    }

    /// The most memory a run holds at a time, in bytes, with `threads` threads: each owner
    /// simulated holds every rank's piece and signed piece (`n·(4·shard + 96 + 32·m)`, twice
    /// over for copies), the round's proofs (at most `m` per lying owner, one per framer)
    /// hold `n` signed pieces each, and the audit schedule holds `k·s` entries per rank. The part that weighs most is
    /// [`Footprint::Evidence`](crate::Footprint::Evidence).
    pub fn memory(&self, threads: usize) -> u64 {
        let (n, m) = (self.n as u64, self.audit.sub_chunks as u64);
        let per_owner = 2 * n * (4 * self.shard as u64 + 96 + 32 * m);
        let proof = n * (1 + 64 + 32 * m + 4 * self.shard as u64) + 32 * m + 4096;
        let proofs = self.liars.len() as u64 * m + self.framers.len() as u64;
        // The round's audit schedule (auditor, sub-chunk: 16 bytes each) and what each owner
        // was asked for.
        let k = self.audit.owners_per_rank(self.n, self.f) as u64;
        let schedule = n * k * self.audit.samples.min(self.audit.sub_chunks) as u64 * 16 + n * m;
        per_owner * threads.max(1) as u64 + proofs * proof + schedule
    }

    /// Runs the rounds on the machine's cores.
    ///
    /// # Errors
    /// What [`AuditSim::validate`] finds.
    pub fn run(&self) -> Result<AuditRun, SimError> {
        let threads = thread::available_parallelism().map_or(1, |p| p.get());
        self.run_on(threads)
    }

    /// Runs the rounds on up to `threads` threads (the result does not depend on how many).
    ///
    /// # Errors
    /// What [`AuditSim::validate`] finds.
    pub fn run_on(&self, threads: usize) -> Result<AuditRun, SimError> {
        let rule = self.validate()?;
        let (n, m) = (self.n, self.audit.sub_chunks);
        let mut rng = StdRng::seed_from_u64(self.seed);
        let keys: Vec<Key> = (0..n)
            .map(|_| Key(SigningKey::from_bytes(&rng.gen())))
            .collect();
        let public = Keys(keys.iter().map(|k| k.0.verifying_key()).collect());
        let is_byzantine =
            |r: Rank| self.liars.iter().any(|(l, _)| *l == r) || self.framers.contains(&r);
        let honest: Vec<Rank> = (0..n).filter(|&r| !is_byzantine(r)).collect();
        let k = self.audit.owners_per_rank(n, self.f);
        let samples = self.audit.samples.min(m);
        let mut out = AuditRun {
            convicted: self.liars.iter().map(|(r, _)| (*r, None)).collect(),
            predicted: self
                .liars
                .iter()
                .map(|(r, l)| (*r, l.predicted(&self.audit, n, self.f, self.rounds)))
                .collect(),
            ..AuditRun::default()
        };
        let mut ejected: Vec<Rank> = Vec::new();
        // The sub-chunks each owner was asked for in the round before.
        let mut asked: Vec<Vec<bool>> = vec![Vec::new(); n];
        for round in 1..=self.rounds {
            let ctx = RoundCtx {
                sim: self,
                rule: &*rule,
                keys: &keys,
                call: CallId {
                    job: [3; 32],
                    collective: u64::from(round),
                },
                expect: Expect {
                    n,
                    d: self.shard * n,
                    elem: 4,
                    m,
                },
            };
            // Where the liars lie, decided before any audit is drawn.
            let mut lies: Vec<Vec<usize>> = vec![Vec::new(); n];
            for &(liar, how) in &self.liars {
                if ejected.contains(&liar) {
                    continue;
                }
                lies[liar] = match how {
                    Lying::Everywhere => (0..m).collect(),
                    Lying::SubChunks(l) => sample(&mut rng, m, l).into_vec(),
                    Lying::Sometimes(q) if rng.gen_bool(q) => (0..m).collect(),
                    Lying::Sometimes(_) => Vec::new(),
                    Lying::Unwatched(l) => {
                        let was_asked = |j: usize| asked[liar].get(j).copied().unwrap_or(false);
                        let mut order: Vec<usize> = sample(&mut rng, m, m).into_vec();
                        order.sort_by_key(|&j| was_asked(j));
                        order.truncate(l);
                        order
                    }
                };
            }
            // Honest audits: `k` other owners, `samples` sub-chunks each, fresh each round.
            let mut audits: Vec<Vec<(Rank, usize)>> = vec![Vec::new(); n];
            for &a in &honest {
                for other in sample(&mut rng, n - 1, k) {
                    let o = if other >= a { other + 1 } else { other };
                    for j in sample(&mut rng, m, samples) {
                        audits[o].push((a, j));
                    }
                }
            }
            // Framing attempts against honest owners, one of three forgeries in turn.
            let mut framings: Vec<Vec<(Rank, usize, Forgery)>> = vec![Vec::new(); n];
            for (i, &framer) in self.framers.iter().enumerate() {
                let victim = honest[rng.gen_range(0..honest.len())];
                let how =
                    [Forgery::Result, Forgery::Input, Forgery::Claim][(round as usize + i) % 3];
                framings[victim].push((framer, rng.gen_range(0..m), how));
            }
            let owners = parallel(n, threads, |o| {
                ctx.owner(o, round, &lies[o], &audits[o], &framings[o])
            })
            .into_iter()
            .collect::<Result<Vec<OwnerRound>, SimError>>()?;
            for (o, a) in audits.iter().enumerate() {
                asked[o] = vec![false; m];
                a.iter().for_each(|&(_, j)| asked[o][j] = true);
            }
            // The proofs, honest then forged, and who checks them.
            let mut this = AuditRound {
                lying: lies.iter().filter(|l| !l.is_empty()).count(),
                ..AuditRound::default()
            };
            let mut proofs: Vec<(&[u8], bool)> = Vec::new();
            for owner in &owners {
                this.audits += owner.audits;
                this.accusations += owner.accusations;
                proofs.extend(owner.proofs.iter().map(|w| (w.as_slice(), false)));
            }
            proofs.extend(
                owners
                    .iter()
                    .flat_map(|o| &o.forged)
                    .map(|w| (w.as_slice(), true)),
            );
            this.proofs = proofs.len();
            this.checkers = if honest.len() <= ALL_CHECK {
                honest.len()
            } else {
                CHECKERS
            };
            let verdicts: Vec<Option<Rank>> =
                parallel(this.checkers * proofs.len(), threads, |i| {
                    ctx.verdict(&public, proofs[i % proofs.len().max(1)].0)
                });
            let by_checker: Vec<&[Option<Rank>]> = verdicts.chunks(proofs.len().max(1)).collect();
            this.split = by_checker.windows(2).any(|w| w[0] != w[1]);
            for (v, (_, forged)) in by_checker
                .first()
                .into_iter()
                .copied()
                .flatten()
                .zip(&proofs)
            {
                match (v, forged) {
                    (None, true) => this.framings_refuted += 1,
                    (Some(_), true) => out.framings_standing += 1,
                    (None, false) => {}
                    (Some(o), false) => {
                        if honest.contains(o) && !out.honest_convicted.contains(o) {
                            out.honest_convicted.push(*o);
                        }
                        for (liar, when) in &mut out.convicted {
                            if liar == o && when.is_none() {
                                *when = Some(round);
                                ejected.push(*o);
                                this.convicted.push(*o);
                            }
                        }
                    }
                }
            }
            out.audits += this.audits;
            out.accusations += this.accusations;
            out.framings_refuted += this.framings_refuted;
            out.split_rounds += u64::from(this.split);
            out.rounds.push(this);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sim(liars: Vec<(Rank, Lying)>, rounds: u32, seed: u64) -> AuditSim {
        AuditSim {
            n: 8,
            f: 3,
            rule: "median".into(),
            shard: 64,
            audit: Audit {
                samples: 8,
                ..Audit::default()
            },
            rounds,
            seed,
            liars,
            lie: Lie::SignFlip,
            framers: vec![3],
        }
    }

    #[test]
    fn liars_are_convicted_within_the_predicted_rounds_and_no_honest_owner_ever() {
        for seed in 0..2 {
            let run = sim(
                vec![(0, Lying::Everywhere), (5, Lying::SubChunks(8))],
                25,
                seed,
            )
            .run()
            .unwrap();
            run.check().unwrap();
            // The total liar in its first round; the others by their prediction.
            assert_eq!(run.convicted[0], (0, Some(1)), "{run:?}");
            assert!(run.predicted.iter().all(|(_, p)| p.is_some()), "{run:?}");
            assert_eq!(run.framings_refuted, 25, "{run:?}");
            assert!(run.rounds.iter().all(|r| r.checkers == 5), "{run:?}");
        }
    }

    #[test]
    fn an_owner_that_lies_in_some_rounds_only_is_convicted_in_one_of_them() {
        let run = sim(vec![(2, Lying::Sometimes(0.5))], 25, 11).run().unwrap();
        run.check().unwrap();
        assert!(run.convicted[0].1.is_some(), "{run:?}");
    }

    #[test]
    fn an_owner_that_lies_where_nobody_looked_is_caught_all_the_same() {
        // Four of 64 sub-chunks, those not asked for the round before: the audits are
        // drawn afresh, so the odds are those of four random sub-chunks.
        let run = sim(vec![(6, Lying::Unwatched(4))], 40, 5).run().unwrap();
        run.check().unwrap();
        assert!(run.convicted[0].1.is_some(), "{run:?}");
        assert_eq!(
            Lying::Unwatched(4).predicted(&sim(vec![], 1, 0).audit, 8, 3, 40),
            Lying::SubChunks(4).predicted(&sim(vec![], 1, 0).audit, 8, 3, 40),
        );
    }

    #[test]
    fn a_world_of_honest_owners_makes_no_accusation() {
        let run = sim(Vec::new(), 5, 7).run().unwrap();
        run.check().unwrap();
        assert_eq!(run.accusations, 0);
        assert!(run.audits > 0);
        assert_eq!(run.framings_refuted, 5);
    }

    #[test]
    fn a_run_is_the_same_on_any_number_of_threads() {
        let s = sim(vec![(1, Lying::SubChunks(2))], 4, 9);
        assert_eq!(s.run_on(1).unwrap(), s.run_on(3).unwrap());
    }

    #[test]
    fn a_thousand_ranks_convict_a_total_liar_in_its_first_round_and_refute_framers() {
        // n = 1024 with the default audit (21 owners per rank, one sub-chunk each); a million
        // signed pieces per round.
        let run = AuditSim {
            n: 1024,
            f: 341,
            rule: "median".into(),
            shard: 64,
            audit: Audit::default(),
            rounds: 2,
            seed: 3,
            liars: vec![(17, Lying::Everywhere), (900, Lying::Unwatched(32))],
            lie: Lie::Nan,
            framers: vec![18],
        }
        .run()
        .unwrap();
        run.check().unwrap();
        assert_eq!(run.convicted[0], (17, Some(1)), "{run:?}");
        assert_eq!(run.predicted, vec![(17, Some(1)), (900, Some(2))]);
        assert_eq!(run.framings_refuted, 2, "{run:?}");
        assert_eq!(run.rounds[0].checkers, CHECKERS);
        // Every honest rank (all but the three Byzantine ones) audits 21 owners a round.
        assert_eq!(run.audits, 2 * 1021 * 21, "{run:?}");
    }

    #[test]
    fn check_names_the_first_guarantee_that_does_not_hold() {
        let late = AuditRun {
            convicted: vec![(4, Some(3)), (5, None)],
            predicted: vec![(4, Some(2)), (5, None)],
            ..AuditRun::default()
        };
        assert!(late
            .check()
            .unwrap_err()
            .contains("liar 4 convicted in round Some(3)"));
        let framed = AuditRun {
            honest_convicted: vec![2],
            ..AuditRun::default()
        };
        assert!(framed
            .check()
            .unwrap_err()
            .contains("honest owners convicted: [2]"));
        let standing = AuditRun {
            framings_standing: 1,
            ..AuditRun::default()
        };
        assert!(standing.check().unwrap_err().contains("not refuted"));
        let split = AuditRun {
            split_rounds: 1,
            ..AuditRun::default()
        };
        assert!(split.check().unwrap_err().contains("split verdicts"));
        assert_eq!(AuditRun::default().check(), Ok(()));
    }

    #[test]
    fn set_ups_the_odds_do_not_cover_are_refused() {
        let bad = |s: AuditSim| s.run().unwrap_err().to_string();
        let mut s = sim(vec![(0, Lying::Everywhere)], 1, 0);
        s.framers = vec![1, 2, 3];
        assert!(bad(s.clone()).contains("4 Byzantine ranks"), "{}", bad(s));
        let mut s = sim(vec![(8, Lying::Everywhere)], 1, 0);
        assert!(bad(s.clone()).contains("rank 8"), "{}", bad(s.clone()));
        s.liars = vec![(0, Lying::SubChunks(65))];
        assert!(bad(s.clone()).contains("1 to 64"), "{}", bad(s.clone()));
        s.liars = vec![(0, Lying::Sometimes(1.5))];
        assert!(bad(s.clone()).contains("0 to 1"), "{}", bad(s.clone()));
        s.liars = vec![];
        s.shard = 63;
        assert!(bad(s.clone()).contains("63 elements"), "{}", bad(s.clone()));
        s.shard = 64;
        s.f = 1;
        s.framers = vec![];
        s.rule = "krum".into();
        assert!(
            bad(s.clone()).contains("coordinate-wise"),
            "{}",
            bad(s.clone())
        );
        s.rule = "median".into();
        s.f = 4;
        s.framers = vec![];
        assert!(matches!(s.run(), Err(SimError::Precondition(_))));
        s.f = 1;
        s.lie = Lie::Equivocate;
        assert!(
            bad(s.clone()).contains("cannot equivocate"),
            "{}",
            bad(s.clone())
        );
        s.n = 1;
        s.f = 0;
        assert!(bad(s.clone()).contains("at least 2"), "{}", bad(s));
    }
}
