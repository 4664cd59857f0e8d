//! In-process transport: every rank is a task or thread of one process, and a message is a
//! reference-counted buffer handed from sender to receiver without copying.
//!
//! It follows the same matching rules as the network transports (lengths checked against the
//! posted receive, stale messages dropped, deadlines), so tests written against it exercise the
//! runtime's real fault handling. Dropping a rank's transport makes it `Missing` for the others,
//! like a crashed process (once what its quorum steps left to deliver is delivered, as a TCP
//! connection writes its queued frames before it closes).
//!
//! ```
//! # tokio_test_block_on(async {
//! use byzcoll_runtime::{Communicator, Config, ReduceOp};
//! use byzcoll_transport_local::LocalTransport;
//!
//! let ranks = LocalTransport::world(3);
//! let tasks: Vec<_> = ranks
//!     .into_iter()
//!     .map(|t| tokio::spawn(async move {
//!         let mut comm = Communicator::new(Box::new(t), Config::default());
//!         let mut v = [comm.rank() as f32; 4];
//!         comm.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
//!         v
//!     }))
//!     .collect();
//! for t in tasks {
//!     assert_eq!(t.await.unwrap(), [3.0; 4]);
//! }
//! # });
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Runtime::new().unwrap().block_on(f)
//! # }
//! ```

use std::sync::Arc;

use bytes::Bytes;
use byzcoll_runtime::bootstrap::{JobAuth, Membership};
use byzcoll_runtime::{
    Capabilities, MemoryKind, MsgKey, Payload, Rank, RecvOutcome, Step, Transport, TransportError,
};
use byzcoll_transport_kit::mailbox::{run_step, Claim, Closed, Mailbox};
use futures::future::BoxFuture;

/// One rank of an in-process world; see the crate docs.
#[derive(Debug)]
pub struct LocalTransport {
    rank: Rank,
    /// `mailboxes[r]` receives for rank `r`.
    mailboxes: Arc<Vec<Mailbox>>,
    /// `departures[r]` closes rank `r`'s slot for this rank when the last of the transport
    /// and its deliveries to `r` in the background is gone.
    departures: Vec<Arc<Departure>>,
    /// The world's identity keys, made for it (audited rounds sign with them); `None` where
    /// the OS gave no randomness for them.
    membership: Option<Arc<Membership>>,
}

impl LocalTransport {
    /// Creates the `size` ranks of a world; hand one to each task or thread. Each rank gets an
    /// identity key of its own and the world's roster ([`Transport::membership`]), as ranks
    /// that joined through the store do (the ranks share a process: nothing authenticates).
    pub fn world(size: usize) -> Vec<LocalTransport> {
        let mailboxes = Arc::new((0..size).map(|_| Mailbox::new(size)).collect::<Vec<_>>());
        let mut memberships = Membership::world(&JobAuth::Unauthenticated, &vec![Vec::new(); size])
            .map(|m| m.into_iter().map(|m| Some(Arc::new(m))).collect())
            .unwrap_or_else(|_| vec![None; size])
            .into_iter();
        (0..size)
            .map(|rank| LocalTransport {
                rank,
                mailboxes: mailboxes.clone(),
                departures: (0..size)
                    .map(|to| {
                        Arc::new(Departure {
                            rank,
                            to,
                            mailboxes: mailboxes.clone(),
                        })
                    })
                    .collect(),
                membership: memberships.next().flatten(),
            })
            .collect()
    }
}

impl Drop for LocalTransport {
    /// The rank is gone, as a process whose connections close: sends to it end at once
    /// (nobody will take them), and receives from it once what its quorum steps left to
    /// deliver is delivered (`Departure`).
    fn drop(&mut self) {
        let mine = &self.mailboxes[self.rank];
        for r in (0..self.mailboxes.len()).filter(|&r| r != self.rank) {
            mine.close(r, Closed::Gone);
        }
    }
}

/// A rank's leaving, as one peer sees it: the peer's receives from it end (`Missing`) when
/// the transport and every delivery to that peer it left in the background are gone, as a
/// TCP connection closes after its queued frames are written (per connection: a straggler
/// that has not taken its messages yet keeps no other peer waiting).
#[derive(Debug)]
struct Departure {
    rank: Rank,
    to: Rank,
    mailboxes: Arc<Vec<Mailbox>>,
}

impl Drop for Departure {
    fn drop(&mut self) {
        if self.to != self.rank {
            self.mailboxes[self.to].close(self.rank, Closed::Gone);
        }
    }
}

/// Delivers one message into `target` once its receive is posted; a stale or closed receive
/// drops it.
async fn deliver(target: &Mailbox, from: Rank, key: MsgKey, call: u64, payload: Bytes) {
    if let Claim::Posted(delivery) = target.claim(from, key, call).await {
        delivery.deliver(Payload::Host(payload));
    }
}

impl Transport for LocalTransport {
    fn name(&self) -> &'static str {
        "local"
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> usize {
        self.mailboxes.len()
    }

    fn membership(&self) -> Option<Arc<Membership>> {
        self.membership.clone()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory: vec![MemoryKind::Host],
            per_peer_timeout: true,
            quorum: true,
            max_message_bytes: isize::MAX as u64,
            steps_in_flight: byzcoll_runtime::PIPELINED_STEPS,
        }
    }

    fn exchange(&self, step: Step) -> BoxFuture<'_, Result<Vec<RecvOutcome>, TransportError>> {
        Box::pin(async move {
            step.validate(self.rank, self.size(), &self.capabilities())?;
            let outcomes = run_step(
                &self.mailboxes[self.rank],
                &step,
                "local",
                || {},
                |s, key, call, payload| {
                    let peer = s.peer;
                    async move {
                        if step.quorum.is_none() {
                            deliver(&self.mailboxes[peer], self.rank, key, call, payload).await;
                            return Ok(());
                        }
                        // A quorum step can end before a straggler posts its receives: the
                        // message waits for it in the background until the step's deadline,
                        // as a TCP frame stays queued for a slow reader, rather than being
                        // dropped with the step. Not taken by then, it is dropped for a skip
                        // notice, as TCP drops what a peer far behind has not read: the
                        // straggler's receive of it ends at once as `Skipped`, rather than at
                        // its own deadline, and it catches up.
                        let departure = self.departures[peer].clone();
                        let deadline = step.deadline;
                        tokio::spawn(async move {
                            let (from, target) = (departure.rank, &departure.mailboxes[peer]);
                            let delivering = deliver(target, from, key, call, payload);
                            if tokio::time::timeout_at(deadline, delivering).await.is_err() {
                                target.skip_through(from, key);
                            }
                        });
                        Ok(())
                    }
                },
            )
            .await;
            Ok(outcomes)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn world(n: usize) -> Vec<Box<dyn Transport>> {
        LocalTransport::world(n)
            .into_iter()
            .map(|t| Box::new(t) as Box<dyn Transport>)
            .collect()
    }

    /// A communicator whose calls ran no quorum step leaves nobody behind: its close waits
    /// for no peer, not even one that is still busy and never closes.
    #[tokio::test]
    async fn a_close_without_quorum_steps_waits_for_nobody() {
        use byzcoll_runtime::{Communicator, Config};
        let mut comms = LocalTransport::world(2)
            .into_iter()
            .map(|t| Communicator::new(Box::new(t), Config::default()));
        let (mut a, mut b) = (comms.next().unwrap(), comms.next().unwrap());
        let (ra, rb) = tokio::join!(a.barrier(), b.barrier());
        ra.and(rb).unwrap();
        let started = tokio::time::Instant::now();
        a.close().await;
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        drop(b);
    }

    /// A rank left more than a step timeout behind by quorum rounds finds the messages it did
    /// not take in time dropped for skip notices: its calls for them fail at once with
    /// `FellBehind` (naming the ranks that went on, none of them counted at fault), not at
    /// their deadlines, and it comes back in step with the others' results. Under `Enforce`
    /// and `Detect`, 4 ranks, rank 3 paused 1.5 s (three step timeouts) before round 2, while
    /// the others run a round every 150 ms or so.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rank_left_behind_longer_than_a_step_timeout_fails_what_it_missed_at_once() {
        use byzcoll_aggregators::Median;
        use byzcoll_runtime::{Agreement, Communicator, Config, Error, Grace, Policy, Stragglers};
        use std::time::{Duration, Instant};
        // The others take about 3.4 s for their rounds: rank 3 resumes among them.
        let (rounds, timeout) = (20, Duration::from_millis(500));
        for agreement in [Agreement::Enforce, Agreement::Detect] {
            let tasks: Vec<_> = LocalTransport::world(4)
                .into_iter()
                .map(|t| {
                    let mut config = Config::with_step_timeout(timeout);
                    config.agreement = agreement;
                    config.stragglers = Stragglers::Exactly(1);
                    config.grace = Grace {
                        min: Duration::from_millis(50),
                        factor: 1,
                    };
                    let mut c = Communicator::new(Box::new(t), config);
                    tokio::spawn(async move {
                        let me = c.rank();
                        let mut log = Vec::new();
                        for round in 0..rounds {
                            if me == 3 && round == 2 {
                                tokio::time::sleep(3 * timeout).await;
                            }
                            let mut v = vec![(me * 7 + round) as f32; 16];
                            let start = Instant::now();
                            let r = c
                                .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                                .await;
                            log.push((start.elapsed(), r.map(|_| v[0])));
                            if me != 3 {
                                tokio::time::sleep(Duration::from_millis(150)).await;
                            }
                        }
                        let health = c.health();
                        c.close().await;
                        (log, health)
                    })
                })
                .collect();
            let mut logs = Vec::new();
            for t in tasks {
                logs.push(t.await.unwrap());
            }
            let (straggler, health) = &logs[3];
            let shown: Vec<String> = straggler
                .iter()
                .map(|(took, r)| format!("{took:?} {r:?}"))
                .collect();
            let behind: Vec<usize> = (0..rounds)
                .filter(|&r| {
                    matches!(&straggler[r].1, Err(Error::FellBehind { skipped_by, .. })
                        if skipped_by == &[0, 1, 2])
                })
                .collect();
            assert!(!behind.is_empty(), "{agreement:?}: {shown:#?}");
            for &r in &behind {
                assert!(
                    straggler[r].0 < timeout / 2,
                    "{agreement:?} round {r}: a skipped call waits no deadline: {shown:#?}"
                );
            }
            // Back in step: its last round is the others' result.
            let last = rounds - 1;
            assert_eq!(
                straggler[last].1.as_ref().ok(),
                logs[0].0[last].1.as_ref().ok(),
                "{agreement:?}: {shown:#?}"
            );
            for peer in health {
                assert_eq!(peer.missing, 0, "{agreement:?}: {peer:?}");
            }
            for (me, (log, _)) in logs.iter().enumerate().take(3) {
                for (round, (took, r)) in log.iter().enumerate() {
                    assert!(r.is_ok(), "{agreement:?} rank {me} round {round}: {r:?}");
                    assert!(
                        *took < timeout,
                        "{agreement:?} rank {me} round {round}: {took:?}"
                    );
                }
            }
        }
    }

    /// Rank 0's transport as if `peer` sent it skip notices instead of its messages (a
    /// Byzantine peer can): its receives from `peer` end as `Skipped`.
    #[derive(Debug)]
    struct SkippedBy {
        inner: LocalTransport,
        peer: Rank,
    }

    impl Transport for SkippedBy {
        fn name(&self) -> &'static str {
            "local"
        }
        fn rank(&self) -> Rank {
            self.inner.rank()
        }
        fn size(&self) -> usize {
            self.inner.size()
        }
        fn capabilities(&self) -> Capabilities {
            self.inner.capabilities()
        }
        fn exchange(&self, step: Step) -> BoxFuture<'_, Result<Vec<RecvOutcome>, TransportError>> {
            let from: Vec<Rank> = step.recvs.iter().map(|r| r.peer).collect();
            Box::pin(async move {
                let mut outcomes = self.inner.exchange(step).await?;
                for (o, &p) in outcomes.iter_mut().zip(&from) {
                    if p == self.peer {
                        *o = RecvOutcome::Skipped;
                    }
                }
                Ok(outcomes)
            })
        }
    }

    /// One peer's skip notices (at most the rule's `f`) do not make a rank think itself
    /// behind: the skipper is an erasure at fault, named missing and counted in the rank's
    /// health, and under `Enforce` the rank still ends the round with the others' result
    /// (its input passed on by the others). A notice cannot excuse a Byzantine rank nor make
    /// an honest one drop a round it can end.
    #[tokio::test]
    async fn a_single_peer_s_skip_notices_are_its_fault_not_this_rank_s_lateness() {
        use byzcoll_aggregators::Median;
        use byzcoll_runtime::{Agreement, Communicator, Config, Fault, Policy};
        let tasks: Vec<_> = LocalTransport::world(4)
            .into_iter()
            .map(|t| {
                let t: Box<dyn Transport> = if t.rank == 0 {
                    Box::new(SkippedBy { inner: t, peer: 3 })
                } else {
                    Box::new(t)
                };
                let mut config = Config::with_step_timeout(std::time::Duration::from_secs(10));
                config.agreement = Agreement::Enforce;
                let mut c = Communicator::new(t, config);
                tokio::spawn(async move {
                    let mut v = vec![c.rank() as f32; 8];
                    let r = c
                        .robust_all_reduce(&mut v, &Median::new(1), Policy::Gather)
                        .await;
                    let health = c.health();
                    c.close().await;
                    (r, v, health)
                })
            })
            .collect();
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.unwrap());
        }
        let (report, v, health) = &results[0];
        let report = report.as_ref().unwrap_or_else(|e| panic!("{e}"));
        assert!(report.skipped_by.is_empty(), "{report:?}");
        assert!(
            report
                .faults
                .iter()
                .any(|f| f.rank == 3 && f.fault == Fault::Missing),
            "{report:?}"
        );
        assert_eq!(health[2].rank, 3);
        assert_eq!(health[2].missing, 1, "{health:?}");
        for (r, (other, w, _)) in results.iter().enumerate().skip(1) {
            assert!(other.is_ok(), "rank {r}: {other:?}");
            assert_eq!(w, v, "rank {r} ends with rank 0's result");
        }
    }

    byzcoll_conformance::conformance_suite!(world);
    byzcoll_conformance::protocol_suite!(world);
}
