//! Who is in a communicator: [`Communicator::split`] and [`Communicator::shrink`], and the
//! transport of the communicators they make over their parent's.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{empty_exchange, Communicator};
use crate::{Error, Rank, RecvOutcome, Result, RoundReport, RoundStats, Step, Transport};

impl Communicator {
    /// Splits the ranks into communicators by `color`, MPI's `MPI_Comm_split`: every rank
    /// calls it; the ranks with the same color form one communicator, ordered by `key`, then
    /// by their rank here; a rank with color `None` joins none and gets `None`. The new
    /// communicators run over the same transport, with this one's configuration and
    /// agreement policy, and their own stream of collective numbers.
    ///
    /// The colors, keys and streams are gathered from every rank, then the digest of what
    /// each rank gathered is compared, so a rank that told different ranks different colors
    /// cannot split the others into communicators that disagree on their members: that is
    /// [`Error::Disagreement`] on every rank that sees it.
    ///
    /// # Errors
    /// [`Error::PeerFaults`] when a rank's record is missing or malformed (every rank must
    /// take part); [`Error::Disagreement`] naming the ranks whose gathered table differs from
    /// this rank's; [`Error::Unsupported`] when the transport's streams are used up (2^16
    /// communicators).
    ///
    /// # Cancel safety
    /// Not cancel safe: the other ranks count this rank missing.
    pub async fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<Communicator>> {
        let n = self.size();
        let mine = [
            color.map_or(0, |c| u64::from(c) + 1),
            u64::from(key),
            self.shared.streams.load(Ordering::Relaxed),
        ];
        let mut table = vec![0u64; 3 * n];
        self.all_gather_into(&mine, &mut table).await?;
        let digest: [u8; 32] = blake3::hash(bytemuck::cast_slice(&table)).into();
        let mut digests = vec![[0u8; 32]; n];
        self.all_gather_into(&[digest], &mut digests).await?;
        let (agreeing, disagreeing): (Vec<Rank>, Vec<Rank>) =
            (0..n).partition(|&r| digests[r] == digest);
        if !disagreeing.is_empty() {
            return Err(Error::Disagreement {
                agreeing,
                disagreeing,
                unconfirmed: Vec::new(),
                differing_inputs: Vec::new(),
            });
        }
        let highest = table.chunks_exact(3).map(|r| r[2]).max().unwrap_or(0);
        let stream = highest + 1;
        if stream >= 1 << crate::STREAM_BITS {
            return Err(Error::Unsupported(format!(
                "split: the transport's {} communicator streams are used up",
                1u64 << crate::STREAM_BITS
            )));
        }
        self.shared.streams.fetch_max(stream, Ordering::Relaxed);
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<Rank> = (0..n)
            .filter(|&r| table[3 * r] == u64::from(color) + 1)
            .collect();
        members.sort_by_key(|&r| (table[3 * r + 1], r));
        Ok(Some(self.sub(members, stream)))
    }

    /// The communicator of `members` (ranks here, in their new order) on `stream`, over this
    /// one's transport, with its configuration, identity mode and what this rank has seen of
    /// the members ([`Communicator::health`], renumbered).
    fn sub(&self, members: Vec<Rank>, stream: u64) -> Communicator {
        let me = self.rank();
        let rank = members.iter().position(|&r| r == me).unwrap_or_default();
        let job_ranks = members.iter().map(|&m| self.job_ranks[m]).collect();
        let health = self.health.of_members(&members);
        let membership = self
            .transport
            .membership()
            .map(|m| Arc::new(m.subset(&members, stream)));
        Communicator {
            transport: Arc::new(SubTransport {
                parent: self.transport.clone(),
                members,
                rank,
                membership,
            }),
            config: self.config.clone(),
            stream,
            next_collective: 0,
            first_call: false,
            shared: self.shared.clone(),
            owner_tamper: None,
            step_tamper: None,
            identity: self.identity,
            step_id: None,
            health,
            stats: RoundStats::default(),
            job_ranks,
            epoch: self.epoch,
        }
    }

    /// Agrees on `v` with every member, as [`Communicator::shrink`] and `byzcoll::admit`
    /// decide membership: a gather-mode robust all-reduce, median with `f = (n - 1) / 3`,
    /// under [`Agreement::Enforce`](crate::Agreement) and waiting for every member's vector
    /// whatever this communicator's agreement and stragglers (a slow member is not voted out
    /// for its lateness in one round). Every honest member ends with the same vector.
    ///
    /// # Errors
    /// As [`Communicator::robust_all_reduce`].
    pub async fn agree(&mut self, v: &mut [f64]) -> Result<RoundReport> {
        let f = self.size().saturating_sub(1) / 3;
        let saved = (self.config.agreement, self.config.stragglers);
        self.config.agreement = crate::Agreement::Enforce;
        self.config.stragglers = crate::Stragglers::Exactly(0);
        let agreed = self
            .robust_all_reduce(
                v,
                &byzcoll_aggregators::Median::new(f),
                crate::Policy::Gather,
            )
            .await;
        (self.config.agreement, self.config.stragglers) = saved;
        agreed
    }

    /// Shrinks the communicator to the ranks that are alive, like `MPI_Comm_shrink`: every
    /// live rank calls it, and gets a communicator of the ranks the live ones agreed to keep,
    /// renumbered in their old order, over the same transport (the rules' preconditions are
    /// checked against its size at the next call).
    ///
    /// Two steps: every rank sends every other an empty message and notes who it heard from
    /// within the step deadline (a peer whose connection is gone is not waited for); then the
    /// ranks agree on those observations with a robust all-reduce under
    /// [`Agreement::Enforce`](crate::Agreement::Enforce), the coordinate-wise median of their
    /// "heard from" vectors, tolerating `f = (n - 1) / 3` Byzantine ranks: rank `r` is kept
    /// when at least half of the inputs that entered say they heard from it. So honest ranks
    /// agree on the same set, and no `f` ranks can have an honest rank that the others heard
    /// from dropped, or a dead one kept. The new communicator's stream is agreed in the same
    /// vector. A rank does not vouch for a peer it convicted of lying as an audited shard
    /// owner ([`PeerHealth::convicted`](crate::PeerHealth)): honest ranks checked the same
    /// proof, so a convicted owner is ejected this way.
    ///
    /// # Errors
    /// [`Error::Excluded`](crate::Error::Excluded) on a rank the others did not keep;
    /// the robust all-reduce's errors (too few ranks alive to agree: more than `f` gone);
    /// [`Error::Unsupported`] when the transport's streams are used up.
    ///
    /// # Cancel safety
    /// Not cancel safe: the other ranks count this rank missing.
    pub async fn shrink(&mut self) -> Result<Communicator> {
        let (me, n) = (self.rank(), self.size());
        let mut heard = vec![0.0f64; n + 1];
        heard[me] = 1.0;
        {
            let mut seq = self.begin("shrink", crate::calls::shrink(self.step_id));
            let (sends, recvs) = empty_exchange(me, n, |_| true);
            let peers: Vec<Rank> = recvs.iter().map(|r| r.peer).collect();
            let outcomes = seq.run(sends, recvs).await?;
            for (&p, o) in peers.iter().zip(&outcomes) {
                if matches!(o, RecvOutcome::Received(_)) {
                    heard[p] = 1.0;
                }
            }
        }
        // A peer this rank convicted of lying as an audited owner is not vouched for: every
        // honest rank checked the same proof, so they leave it out alike.
        for p in self.health() {
            if p.convicted > 0 {
                heard[p.rank] = 0.0;
            }
        }
        heard[n] = self.shared.streams.load(Ordering::Relaxed) as f64;
        self.agree(&mut heard).await?;
        let kept: Vec<Rank> = (0..n).filter(|&r| heard[r] >= 0.5).collect();
        if !kept.contains(&me) {
            return Err(Error::Excluded { kept });
        }
        let stream = (heard[n].max(0.0).round() as u64).saturating_add(1);
        if stream >= 1 << crate::STREAM_BITS {
            return Err(Error::Unsupported(format!(
                "shrink: the transport's {} communicator streams are used up",
                1u64 << crate::STREAM_BITS
            )));
        }
        self.shared.streams.fetch_max(stream, Ordering::Relaxed);
        tracing::info!(rank = me, ?kept, "communicator shrunk");
        Ok(self.sub(kept, stream))
    }
}

/// The transport of a communicator made by [`Communicator::split`]: its ranks are `members`
/// of the parent's, in order.
#[derive(Debug)]
struct SubTransport {
    parent: Arc<dyn Transport>,
    members: Vec<Rank>,
    rank: Rank,
    /// The parent's membership, its roster renumbered as the members are
    /// ([`Membership::subset`](crate::bootstrap::Membership::subset)): audited rounds sign
    /// and check with it.
    membership: Option<Arc<crate::bootstrap::Membership>>,
}

impl Transport for SubTransport {
    fn name(&self) -> &'static str {
        self.parent.name()
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn capabilities(&self) -> crate::Capabilities {
        self.parent.capabilities()
    }

    fn membership(&self) -> Option<Arc<crate::bootstrap::Membership>> {
        self.membership.clone()
    }

    fn exchange(
        &self,
        mut step: Step,
    ) -> futures::future::BoxFuture<'_, std::result::Result<Vec<RecvOutcome>, crate::TransportError>>
    {
        if let Err(e) = step.validate(self.rank, self.size(), &self.capabilities()) {
            return Box::pin(std::future::ready(Err(e)));
        }
        for s in &mut step.sends {
            s.peer = self.members[s.peer];
        }
        for r in &mut step.recvs {
            r.peer = self.members[r.peer];
        }
        self.parent.exchange(step)
    }
}
