//! Rejoin: a restarted rank comes back into the communicator its job shrank to without it.
//!
//! The members choose when: at a collective boundary of theirs, every member calls [`admit`].
//! A restarted process calls [`rejoin`] with its job configuration (its rank, the job's
//! store and secret, its key under per-rank keys). It posts a knock under its name in the
//! store; at [`admit`] each member reads the knocks of the job's ranks that are not members,
//! and the members agree on whom to admit and on the new epoch with a robust all-reduce under
//! [`Agreement::Enforce`](crate::Agreement::Enforce), as [`Communicator::shrink`] agrees on
//! whom to keep: a rank is admitted when at least half of the members' inputs that entered
//! saw its knock, so `f` Byzantine members can neither keep a knocking rank out nor let a
//! silent one in. Each member then posts the new roster (the agreed epoch and a nonce that
//! names the new world's keys, the members' and admitted ranks, the knock each saw), and the
//! restarted rank takes the roster that `f + 1` ranks of the job posted alike with its own
//! knock in it (the job's `f` Byzantine ranks cannot make one up). Then all of them
//! connect a fresh transport, the one the configuration names, through the store's posts
//! ([`StoreClient::among`]): ranks renumbered in job-rank order, the job-wide parameters
//! compared as at setup, [`Communicator::job_ranks`] and [`Communicator::epoch`] saying who
//! is who; the members agree on the old communicator that all of them joined before any takes
//! the new one. The old communicator stays usable until the caller drops it.
//!
//! What the restarted rank's model state should be is the application's business (torchft
//! sends it from a healthy replica; a checkpoint does too): byzcoll admits the rank, it does
//! not vouch for its inputs, which the robust rules treat like any rank's.
//!
//! The store must outlive the restarted rank's death: the launcher hosts it
//! (`BYZCOLL_STORE_HOSTED=1`, what `byzcoll launch` does), or rank 0 does and did not die.
//!
//! Knocks and rosters are posted in the poster's authenticated name: under per-rank keys no
//! process can knock or post as another rank. Under the shared secret alone an insider can,
//! as it can register as another rank at setup. A rank ejected as a convicted shard owner
//! (`Communicator::shrink`) that knocks is admitted like any other: the members' fault memory
//! does not outlive the communicator, so an application that must keep it out does not admit
//! at all, or checks [`Admission::Admitted`]'s ranks.

use std::collections::HashMap;
use std::time::Duration;

use byzcoll_runtime::bootstrap::{JobSecret, LaunchEnv, StoreClient};
use tokio::time::Instant;

use crate::config::{Bootstrap, JobConfig};
use crate::{BootstrapError, Communicator, Error, Rank, Result};

/// The key of a restarted rank's knock.
const KNOCK: &str = "byzcoll/rejoin";
/// The key of a member's roster for the ranks it admits.
const ROSTER: &str = "byzcoll/admit";
const KNOCK_MAGIC: &[u8; 4] = b"BZKN";
const ROSTER_MAGIC: &[u8; 4] = b"BZAD";
/// How soon a restarted rank reads the members' rosters again while it waits, at first; the
/// pause doubles up to [`MAX_POLL`].
const POLL: Duration = Duration::from_millis(20);
const MAX_POLL: Duration = Duration::from_millis(500);

/// What [`admit`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum Admission {
    /// No rank that the members agree knocked: the communicator is as it was.
    Nobody,
    /// The job ranks `admitted` rejoined: `comm` is the communicator of the members and them
    /// at `epoch`, ranks in job-rank order ([`Communicator::job_ranks`]).
    Admitted {
        /// The new communicator; the old one stays usable until dropped.
        comm: Box<Communicator>,
        /// The job ranks admitted, ascending.
        admitted: Vec<Rank>,
        /// The new communicator's [`Communicator::epoch`].
        epoch: u64,
    },
}

/// Admits the restarted ranks that knocked ([`rejoin`]): every member of `comm` calls it at
/// the same point of its calls (a collective), with the job configuration it started with.
///
/// # Errors
/// [`Error::InvalidUsage`] for a configuration that is not this rank's store-joined job (an
/// all-gather join has no store to knock at); the store's errors; the agreement's (more than
/// `f` members gone); joining the new world's (an admitted rank that died again before it
/// connected: the members' connections time out, and `comm` is still theirs).
///
/// # Cancel safety
/// Not cancel safe: the other members count this rank missing.
pub async fn admit(comm: &mut Communicator, config: &JobConfig) -> Result<Admission> {
    let store = store_of(config)?;
    let (job, me) = (config.launch().size, config.launch().rank);
    if comm.job_ranks().get(comm.rank()) != Some(&me) {
        return Err(Error::InvalidUsage(format!(
            "admit: this communicator's rank {} is job rank {:?}, and the configuration is \
             job rank {me}'s",
            comm.rank(),
            comm.job_ranks().get(comm.rank())
        )));
    }
    let mut member = vec![false; job];
    for &r in comm.job_ranks() {
        if let Some(m) = member.get_mut(r) {
            *m = true;
        }
    }
    // What this member saw: a 1 for each job rank outside the communicator that knocks, then
    // its epoch (the same on every member) and a random number, whose agreed median names the
    // new world's keys in the store (a retry never meets a failed attempt's posts). A read
    // that fails votes no: every member takes part in the agreement whatever its store did.
    let mut seen = vec![0.0f64; job + 2];
    let mut knocks: HashMap<Rank, Vec<u8>> = HashMap::new();
    for r in (0..job).filter(|&r| !member[r]) {
        if let Some(knock) = read_knock(&store, r).await {
            seen[r] = 1.0;
            knocks.insert(r, knock);
        }
    }
    seen[job] = comm.epoch() as f64;
    let nonce = JobSecret::generate()?.to_bytes();
    seen[job + 1] = (u64::from_le_bytes(nonce[..8].try_into().unwrap_or_default()) >> 12) as f64;
    comm.agree(&mut seen).await?;
    let admitted: Vec<Rank> = (0..job).filter(|&r| !member[r] && seen[r] >= 0.5).collect();
    if admitted.is_empty() {
        return Ok(Admission::Nobody);
    }
    // A knock this member had not seen yet (it came while the members read): read it again,
    // so that the roster it posts names it as the others' do.
    for &r in &admitted {
        if let std::collections::hash_map::Entry::Vacant(entry) = knocks.entry(r) {
            if let Some(knock) = read_knock(&store, r).await {
                entry.insert(knock);
            }
        }
    }
    let roster = Roster {
        epoch: (seen[job].max(0.0).round() as u64).saturating_add(1),
        nonce: seen[job + 1].max(0.0).round() as u64,
        world: (0..job)
            .filter(|&r| member[r] || admitted.contains(&r))
            .collect(),
        knocks: admitted
            .iter()
            .filter_map(|r| Some((*r, knocks.get(r)?.clone())))
            .collect(),
    };
    let posted = store.post(ROSTER, &roster.encode()).await;
    tracing::info!(
        rank = me,
        ?admitted,
        epoch = roster.epoch,
        "admitting restarted ranks"
    );
    let joined = match posted {
        Ok(()) => join_world(config, &store, &roster).await,
        Err(e) => Err(e.into()),
    };
    // Whether every member joined, agreed on the old communicator: members never go on in
    // different communicators (one whose join failed while the others' succeeded, say).
    let mut ok = [f64::from(u8::from(joined.is_ok()))];
    comm.agree(&mut ok).await?;
    match (joined, ok[0] >= 0.5) {
        (Ok(mut grown), true) => {
            grown.keep_alive_of(comm);
            grown.carry_health_of(comm);
            Ok(Admission::Admitted {
                comm: Box::new(grown),
                admitted,
                epoch: roster.epoch,
            })
        }
        (Err(e), _) => Err(e),
        (Ok(_), false) => Err(BootstrapError::Store(format!(
            "admit: the members could not all join the world {:?} at epoch {}; they keep \
             this communicator",
            roster.world, roster.epoch
        ))
        .into()),
    }
}

/// Job rank `r`'s knock, if it has one posted (a failed read is none).
async fn read_knock(store: &StoreClient, r: Rank) -> Option<Vec<u8>> {
    match store.read(r, KNOCK).await {
        Ok(Some(k)) if k.len() == 4 + 32 && &k[..4] == KNOCK_MAGIC => Some(k.to_vec()),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(rank = r, error = %e, "admit: cannot read its knock");
            None
        }
    }
}

/// Rejoins the job `config` describes as its rank, after a restart: knocks in the store and
/// waits up to `wait` for the members to admit it ([`admit`]), then joins their new world.
///
/// # Errors
/// [`Error::InvalidUsage`] for a configuration that is not a store-joined job;
/// [`Error::Bootstrap`] when no roster that holds this rank's knock is posted by enough
/// members within `wait`, or the store's and the new world's errors.
///
/// # Cancel safety
/// Cancel safe until admitted (the knock stays posted, and a later call replaces it); not
/// after.
pub async fn rejoin(config: &JobConfig, wait: Duration) -> Result<Communicator> {
    let store = store_of(config)?;
    let (job, me) = (config.launch().size, config.launch().rank);
    let mut knock = KNOCK_MAGIC.to_vec();
    knock.extend_from_slice(&JobSecret::generate()?.to_bytes());
    store.post(KNOCK, &knock).await?;
    tracing::info!(rank = me, "knocking to rejoin");
    let deadline = Instant::now() + wait;
    // A roster that at least `f + 1` ranks of the job posted alike (the job's `f` Byzantine
    // ranks cannot make one up) with this rank's knock in it.
    let needed = (job - 1) / 3 + 1;
    let mut pause = POLL;
    let roster = loop {
        // The rosters posted with this rank's knock, by (epoch, nonce, world), and their posters.
        let mut votes: HashMap<(u64, u64, Vec<Rank>), (usize, Roster)> = HashMap::new();
        for r in (0..job).filter(|&r| r != me) {
            let Ok(Some(posted)) = store.read(r, ROSTER).await else {
                continue;
            };
            let Some(roster) = Roster::decode(&posted, job) else {
                continue;
            };
            let mine = roster.knocks.iter().any(|(k, n)| *k == me && *n == knock);
            if mine && roster.world.contains(&r) && roster.world.contains(&me) {
                let key = (roster.epoch, roster.nonce, roster.world.clone());
                votes.entry(key).or_insert((0, roster)).0 += 1;
            }
        }
        let enough = votes
            .into_values()
            .filter(|(voters, _)| *voters >= needed)
            .max_by_key(|(_, roster)| roster.epoch);
        if let Some((_, roster)) = enough {
            break roster;
        }
        if Instant::now() >= deadline {
            // Not admitted: withdraw the knock, so that no later boundary admits a rank that
            // is not waiting.
            let _ = store.post(KNOCK, &[]).await;
            return Err(BootstrapError::Store(format!(
                "rank {me}: no roster admitting it was posted by {needed} ranks within {wait:?} \
                 (the members admit at a boundary of theirs: byzcoll::admit)"
            ))
            .into());
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_POLL);
    };
    // Admitted: the knock is answered, so a later admit does not take this rank for a new one.
    store.post(KNOCK, &[]).await?;
    tracing::info!(rank = me, world = ?roster.world, epoch = roster.epoch, "rejoining");
    join_world(config, &store, &roster).await
}

/// This rank's client of the job's store, for a job joined through it.
fn store_of(config: &JobConfig) -> Result<StoreClient> {
    match config.store_client() {
        Some(client) if config.bootstrap() == Bootstrap::Store => Ok(client),
        _ => Err(Error::InvalidUsage(
            "a rejoin goes through the job's rendezvous store: a configuration of a job of \
             more than one rank joined with JobConfig::from_env or the builder"
                .into(),
        )),
    }
}

/// The communicator of the world `roster` names (job ranks ascending, this one among them) at
/// its epoch, over a fresh transport of the configuration's kind, connected through the
/// store's posts under keys of that epoch and nonce.
async fn join_world(
    config: &JobConfig,
    store: &StoreClient,
    roster: &Roster,
) -> Result<Communicator> {
    let (world, epoch) = (&roster.world[..], roster.epoch);
    let view = store.among(world, &format!("byzcoll/epoch{epoch}-{:x}", roster.nonce))?;
    let me = config.launch().rank;
    let rank = world.iter().position(|&r| r == me).ok_or_else(|| {
        Error::InvalidUsage(format!("job rank {me} is not in the world {world:?}"))
    })?;
    let records = view
        .all_gather("byzcoll/job", &config.comm().job_record())
        .await?;
    config.comm().check_job(&records)?;
    let launch = LaunchEnv {
        rank,
        size: world.len(),
        ..config.launch().clone()
    };
    let transport = config
        .chosen()
        .connect(&launch, config.comm(), Some(&view))
        .await?;
    let mut comm = Communicator::new(transport, config.comm().clone());
    comm.set_identity(view.auth().mode());
    comm.set_job_world(world.to_vec(), epoch)?;
    Ok(comm)
}

/// A member's roster for the ranks it admits: the epoch and the nonce (agreed), the new world
/// (job ranks, ascending) and the knock it saw of each admitted rank.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Roster {
    epoch: u64,
    nonce: u64,
    world: Vec<Rank>,
    knocks: Vec<(Rank, Vec<u8>)>,
}

impl Roster {
    fn encode(&self) -> Vec<u8> {
        let mut out = ROSTER_MAGIC.to_vec();
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.nonce.to_le_bytes());
        out.extend_from_slice(&(self.world.len() as u32).to_le_bytes());
        for &r in &self.world {
            out.extend_from_slice(&(r as u32).to_le_bytes());
        }
        out.extend_from_slice(&(self.knocks.len() as u32).to_le_bytes());
        for (r, knock) in &self.knocks {
            out.extend_from_slice(&(*r as u32).to_le_bytes());
            out.extend_from_slice(&(knock.len() as u32).to_le_bytes());
            out.extend_from_slice(knock);
        }
        out
    }

    /// The roster `bytes` hold, in a job of `job` ranks; `None` for anything else (a member's
    /// post is not trusted to be well formed).
    fn decode(bytes: &[u8], job: usize) -> Option<Roster> {
        let mut at = bytes.strip_prefix(ROSTER_MAGIC)?;
        let mut take = |n: usize| -> Option<&[u8]> {
            let (head, rest) = (at.get(..n)?, at.get(n..)?);
            at = rest;
            Some(head)
        };
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let epoch = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let nonce = u64::from_le_bytes(take(8)?.try_into().ok()?);
        let count = word(take(4)?);
        if count == 0 || count > job {
            return None;
        }
        let world = (0..count)
            .map(|_| take(4).map(word))
            .collect::<Option<Vec<Rank>>>()?;
        if world.windows(2).any(|w| w[0] >= w[1]) || world.last().is_some_and(|&r| r >= job) {
            return None;
        }
        let admitted = word(take(4)?);
        if admitted > count {
            return None;
        }
        let mut knocks = Vec::new();
        for _ in 0..admitted {
            let r = word(take(4)?);
            let len = word(take(4)?);
            knocks.push((r, take(len)?.to_vec()));
        }
        at.is_empty().then_some(Roster {
            epoch,
            nonce,
            world,
            knocks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rosters_round_trip_and_garbage_is_refused() {
        let roster = Roster {
            epoch: 3,
            nonce: 0xfeed,
            world: vec![0, 2, 5],
            knocks: vec![(5, b"BZKNxyz".to_vec())],
        };
        let bytes = roster.encode();
        assert_eq!(Roster::decode(&bytes, 6), Some(roster.clone()));
        // A rank outside the job, a truncation, a trailing byte, a world out of order.
        assert_eq!(Roster::decode(&bytes, 5), None);
        for cut in 0..bytes.len() {
            assert_eq!(Roster::decode(&bytes[..cut], 6), None, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Roster::decode(&longer, 6), None);
        let unordered = Roster {
            world: vec![2, 0, 5],
            ..roster
        };
        assert_eq!(Roster::decode(&unordered.encode(), 6), None);
        // A count no job holds is refused before anything is allocated for it.
        let mut huge = ROSTER_MAGIC.to_vec();
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Roster::decode(&huge, 6), None);
    }
}
