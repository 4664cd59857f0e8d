//! Errors returned by collectives, transports and the bootstrap.

use std::fmt;
use std::io;

use byzcoll_aggregators::AggError;

use crate::Rank;

/// What a peer did wrong in one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Nothing arrived before the deadline, or the peer's connection is gone.
    Missing,
    /// Something arrived but was not acceptable (wrong length, bad frame, non-finite values
    /// where the rule refuses them); the string says what.
    Malformed(String),
    /// Nothing arrived by the end of a quorum step's grace, though the deadline had not
    /// passed: a straggler (slow, stalled, or a rank that sends as late as it dares), erased
    /// for that step so that it does not set the others' pace.
    Late,
    /// Its message was for another call: its collective's fingerprint (operation, length,
    /// element type, rule and parameters, policy, and the caller's step id) differs from this
    /// rank's, so the ranks are out of step (a skipped or extra call, or different arguments).
    OutOfStep,
}

/// A peer at fault, as reported by collectives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFault {
    /// The rank at fault.
    pub rank: Rank,
    /// What it did.
    pub fault: Fault,
}

impl fmt::Display for PeerFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.fault {
            Fault::Missing => write!(
                f,
                "rank {}: missing (nothing by the deadline, or its connection closed)",
                self.rank
            ),
            Fault::Malformed(why) => write!(f, "rank {}: malformed ({why})", self.rank),
            Fault::Late => write!(f, "rank {}: late (after the quorum's grace)", self.rank),
            Fault::OutOfStep => write!(
                f,
                "rank {}: out of step (its call differs from this rank's: another operation, \
                 length, type, rule, policy or step id)",
                self.rank
            ),
        }
    }
}

/// Formats a list of faults for error messages.
#[derive(Debug)]
pub struct Faults<'a>(pub &'a [PeerFault]);

impl fmt::Display for Faults<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// Failures of a transport as a whole (per-peer problems are outcomes, not errors).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The caller broke the transport's contract (unknown peer, sending to itself, a memory
    /// kind the transport does not support): fix the calling code.
    #[error("invalid use of transport: {0}")]
    InvalidUsage(String),
    /// Establishing the transport failed (a peer never connected, addresses could not be
    /// exchanged): check that every rank started and can reach the others.
    #[error("transport setup failed: {0}")]
    Setup(String),
    /// An operating-system I/O error.
    #[error("transport I/O error: {0}")]
    Io(#[from] io::Error),
    /// A transport that cannot time out one peer (NCCL: `Capabilities::per_peer_timeout` is
    /// false) aborted the whole communicator because a step did not complete. `ranks` had
    /// operations still open; when the transport cannot tell which of them failed, some are
    /// innocent. The transport is unusable afterwards: build a new one.
    #[error(
        "transport aborted; ranks with unfinished operations: {}: {cause}",
        RankList(ranks)
    )]
    Aborted {
        /// Peers whose operations had not completed (sorted, each once).
        ranks: Vec<Rank>,
        /// The transport's own account (downcast it for details).
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Ranks as `1, 3, 6` (`none` when empty).
struct RankList<'a>(&'a [Rank]);

impl fmt::Display for RankList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// Failures of the bootstrap: launcher environment and rendezvous store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// A launcher variable is missing: set it, or run under a launcher that sets it.
    #[error("{launcher} environment is incomplete: {var} is not set")]
    MissingVar {
        /// The launcher whose variables were found.
        launcher: &'static str,
        /// The variable that is missing.
        var: &'static str,
    },
    /// A variable is set to something that cannot be used.
    #[error("{var}={value:?} is invalid: {why}")]
    InvalidVar {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// No launcher environment at all.
    #[error(
        "no launcher environment found: run under `byzcoll launch`, srun, mpirun or torchrun, \
         or set BYZCOLL_RANK and BYZCOLL_WORLD_SIZE"
    )]
    NoLauncher,
    /// A multi-rank job needs its secret and none is set: under `byzcoll launch` it is set for
    /// you; under other launchers export one to every rank.
    #[error(
        "no job secret: a job of more than one rank authenticates its ranks with a shared secret. \
         Generate one (`export BYZCOLL_SECRET=$(openssl rand -hex 32)`, or write it to a file \
         only you can read and set BYZCOLL_SECRET_FILE) and pass it to every rank: \
         `mpirun -x BYZCOLL_SECRET ...`, `srun --export=ALL,BYZCOLL_SECRET ...`, or export it \
         before `torchrun`. `byzcoll launch` does this for you. To run without authentication \
         (any local process can then join the job), set BYZCOLL_ALLOW_UNAUTHENTICATED=1"
    )]
    NoSecret,
    /// Authentication failed: a peer did not prove the job secret or its identity, or the
    /// membership table is inconsistent. The message names the rank or address.
    #[error("authentication: {0}")]
    Auth(String),
    /// The rendezvous store failed or answered with an error.
    #[error("rendezvous store: {0}")]
    Store(String),
    /// The ranks chose a job-wide parameter differently (it sets which steps a collective
    /// takes, so they must agree): give every rank the same value.
    #[error(
        "the ranks chose the {parameter} differently: {choices}; every rank must choose alike"
    )]
    JobMismatch {
        /// The parameter, with the variable that sets it.
        parameter: &'static str,
        /// Each value and the ranks that chose it.
        choices: String,
    },
    /// An I/O error talking to the store.
    #[error("rendezvous store I/O error: {0}")]
    Io(#[from] io::Error),
}

/// The error type of byzcoll's collectives.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller broke a collective's contract (buffer lengths, root out of range, ...): fix
    /// the calling code.
    #[error("invalid use: {0}")]
    InvalidUsage(String),
    /// A non-robust collective could not complete because these peers failed it. Robust
    /// collectives report faults in their report instead and only fail with
    /// [`Error::TooManyFaults`].
    #[error("{collective} step {step} failed: {}", Faults(faults))]
    PeerFaults {
        /// The collective.
        collective: &'static str,
        /// The step that failed.
        step: u32,
        /// The peers at fault.
        faults: Vec<PeerFault>,
    },
    /// Too many peers were at fault this round for the rule's precondition to hold; no result
    /// is returned rather than an unprotected one.
    #[error("{source}; peers at fault: {}", Faults(faults))]
    TooManyFaults {
        /// The precondition that failed.
        source: AggError,
        /// The peers at fault.
        faults: Vec<PeerFault>,
    },
    /// This rank's result is not the one at least `n − f` ranks hold (the cross-check of
    /// [`Agreement::Detect`](crate::Agreement)): it is out of step with the job (it stalled
    /// past a deadline, or a Byzantine rank sent it something else than the others). Do not
    /// use this round's result; the ranks that agree with each other went on with theirs.
    #[error(
        "this rank's result disagrees with the job's: agreeing {agreeing:?}, other results at \
         {disagreeing:?}, unconfirmed {unconfirmed:?}, inputs that differed between ranks from \
         {differing_inputs:?}"
    )]
    Disagreement {
        /// Ranks (this one included) that hold the same result as this rank.
        agreeing: Vec<Rank>,
        /// Ranks that hold another result.
        disagreeing: Vec<Rank>,
        /// Ranks whose result is unknown (missing, failed, erased).
        unconfirmed: Vec<Rank>,
        /// Senders whose vectors differed between the ranks that aggregated them (gather).
        differing_inputs: Vec<Rank>,
    },
    /// No owner delivered a usable result for a shard in sharded mode (all of them missing,
    /// malformed or unable to aggregate); the round has no trustworthy value for it.
    #[error(
        "shard {shard}: no result from any of its owners {owners:?}; peers at fault: {}",
        Faults(faults)
    )]
    ShardLost {
        /// The shard.
        shard: usize,
        /// Its owners.
        owners: Vec<Rank>,
        /// The peers at fault.
        faults: Vec<PeerFault>,
    },
    /// The aggregation rule refused its inputs (input indices have been mapped to ranks in
    /// `NonFiniteInputs`).
    #[error(transparent)]
    Aggregation(#[from] AggError),
    /// The transport failed as a whole.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// Bootstrapping failed.
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    /// Something was asked for that this build or this transport does not provide; the message
    /// says how to get it.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The other ranks shrank the communicator without this rank (`Communicator::shrink`):
    /// they agreed it was not alive. It takes no further part in their communicator.
    #[error("the ranks shrank the communicator without this rank: they agreed to keep {kept:?}")]
    Excluded {
        /// The ranks kept (in the old communicator's numbering).
        kept: Vec<Rank>,
    },
    /// This rank fell behind its peers: `skipped_by` dropped this call's messages to it
    /// unsent and went on (TCP skip notices, `PROTOCOL.md` "TCP transport"), so the call has
    /// no result here; `cause` is how it failed for want of them. Those peers are not at
    /// fault ([`Error::faults`] names none of them, and the communicator's health does not
    /// count them): this rank is the one late. Its later calls take part as usual, and the
    /// skipped ones are not retried. A robust round says so only where more than its `f`
    /// peers skipped this rank (not all of them can be Byzantine); fewer are erasures at
    /// fault, as missing peers are.
    #[error(
        "this rank fell behind: ranks {skipped_by:?} dropped this call's messages to it and went \
         on ({cause})"
    )]
    FellBehind {
        /// The peers that skipped this rank, ascending.
        skipped_by: Vec<Rank>,
        /// How the call failed without their messages; its faults leave them out.
        cause: Box<Error>,
    },
    /// A collective started through a `CommHandle` did not run: the
    /// communicator's task ended first.
    #[error("background task: {0}")]
    Background(String),
}

/// What kind of failure an [`Error`] is, for bindings that report it as a status code or an
/// exception class (the C ABI's `byzcoll_status_t`, Python's exceptions): one table, so that
/// every binding classifies alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller broke the API's contract (an argument, a closed communicator, a rule's
    /// parameter or an input's length).
    InvalidUsage,
    /// The rule's precondition does not hold for the world size.
    Precondition,
    /// Too many peers failed the round (or a shard lost every owner), or the inputs that
    /// arrived were too many non-finite ones for the rule.
    TooManyFaults,
    /// The honest ranks' results differ ([`Error::Disagreement`]).
    Disagreement,
    /// The other ranks shrank the communicator without this rank.
    Excluded,
    /// Peers were missing at the deadline and nothing else went wrong.
    Timeout,
    /// This rank fell behind its peers, which went on without it ([`Error::FellBehind`]).
    FellBehind,
    /// Peers misbehaved, or the transport failed.
    Transport,
    /// The job's secret was missing or a peer failed authentication.
    Unauthenticated,
    /// Joining the job failed otherwise.
    Bootstrap,
    /// This build, transport or rule cannot do what was asked.
    Unsupported,
    /// The device or library that runs a rule (CUDA driver, NVRTC) failed.
    Device,
    /// Anything else (a bug, or a task that ended first).
    Internal,
}

impl Error {
    /// The kind of failure, as bindings report it.
    pub fn kind(&self) -> ErrorKind {
        use byzcoll_aggregators::AggError;
        match self {
            Error::InvalidUsage(_) => ErrorKind::InvalidUsage,
            Error::PeerFaults { faults, .. }
                if faults.iter().all(|f| f.fault == Fault::Missing) =>
            {
                ErrorKind::Timeout
            }
            Error::PeerFaults { .. } | Error::Transport(_) => ErrorKind::Transport,
            Error::TooManyFaults { .. } | Error::ShardLost { .. } => ErrorKind::TooManyFaults,
            Error::Disagreement { .. } => ErrorKind::Disagreement,
            Error::Excluded { .. } => ErrorKind::Excluded,
            Error::FellBehind { .. } => ErrorKind::FellBehind,
            Error::Aggregation(AggError::Precondition { .. }) => ErrorKind::Precondition,
            Error::Aggregation(AggError::InvalidSpec(_) | AggError::LengthMismatch { .. }) => {
                ErrorKind::InvalidUsage
            }
            Error::Aggregation(AggError::Unsupported { .. }) | Error::Unsupported(_) => {
                ErrorKind::Unsupported
            }
            Error::Aggregation(AggError::Backend { .. }) => ErrorKind::Device,
            Error::Aggregation(_) => ErrorKind::TooManyFaults,
            Error::Bootstrap(BootstrapError::NoSecret | BootstrapError::Auth(_)) => {
                ErrorKind::Unauthenticated
            }
            Error::Bootstrap(_) => ErrorKind::Bootstrap,
            Error::Background(_) => ErrorKind::Internal,
        }
    }

    /// The peers at fault that the error names (empty where it names none).
    pub fn faults(&self) -> &[PeerFault] {
        match self {
            Error::PeerFaults { faults, .. }
            | Error::TooManyFaults { faults, .. }
            | Error::ShardLost { faults, .. } => faults,
            Error::FellBehind { cause, .. } => cause.faults(),
            _ => &[],
        }
    }

    /// [`Error::FellBehind`]: `cause`, with the peers in `skipped_by` no longer named
    /// missing (their erasures are this rank's lateness); any other fault of theirs stays.
    pub fn fell_behind(mut skipped_by: Vec<Rank>, mut cause: Error) -> Error {
        skipped_by.sort_unstable();
        skipped_by.dedup();
        if let Error::PeerFaults { faults, .. }
        | Error::TooManyFaults { faults, .. }
        | Error::ShardLost { faults, .. } = &mut cause
        {
            faults.retain(|f| {
                f.fault != Fault::Missing || skipped_by.binary_search(&f.rank).is_err()
            });
        }
        Error::FellBehind {
            skipped_by,
            cause: Box::new(cause),
        }
    }
}

/// Result alias for byzcoll's collectives.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use byzcoll_aggregators::AggError;

    fn peer(rank: Rank, fault: Fault) -> PeerFault {
        PeerFault { rank, fault }
    }

    /// The kinds bindings map to statuses and exceptions: peers that are only missing are a
    /// timeout, any other peer fault a transport error, and the faults named come along.
    #[test]
    fn every_error_has_the_kind_bindings_report() {
        let faults = |fs: Vec<PeerFault>| Error::PeerFaults {
            collective: "all_reduce",
            step: 0,
            faults: fs,
        };
        let missing = faults(vec![peer(1, Fault::Missing), peer(2, Fault::Missing)]);
        assert_eq!(missing.kind(), ErrorKind::Timeout);
        assert_eq!(missing.faults().len(), 2);
        let mixed = faults(vec![peer(1, Fault::Missing), peer(2, Fault::Late)]);
        assert_eq!(mixed.kind(), ErrorKind::Transport);
        let backend = Error::Aggregation(AggError::Backend {
            rule: "median".into(),
            backend: "CUDA",
            message: "out of memory".into(),
        });
        assert_eq!(backend.kind(), ErrorKind::Device);
        assert!(backend.faults().is_empty());
        let cases = [
            (Error::InvalidUsage("x".into()), ErrorKind::InvalidUsage),
            (Error::Unsupported("x".into()), ErrorKind::Unsupported),
            (Error::Excluded { kept: vec![0] }, ErrorKind::Excluded),
            (
                Error::Bootstrap(BootstrapError::NoSecret),
                ErrorKind::Unauthenticated,
            ),
            (Error::Background("gone".into()), ErrorKind::Internal),
            (
                Error::Aggregation(AggError::InvalidSpec("x".into())),
                ErrorKind::InvalidUsage,
            ),
        ];
        for (e, kind) in cases {
            assert_eq!(e.kind(), kind, "{e}");
        }
    }

    /// A call that failed because peers went on without this rank names them as the ones it
    /// fell behind, and its cause no longer counts them at fault.
    #[test]
    fn falling_behind_names_the_peers_that_went_on_and_blames_none_of_them() {
        let cause = Error::TooManyFaults {
            source: AggError::Precondition {
                rule: "median".into(),
                n: 2,
                f: 1,
                requirement: "n > 2f",
            },
            faults: vec![
                peer(2, Fault::Missing),
                peer(3, Fault::Malformed("x".into())),
                peer(0, Fault::Malformed("y".into())),
            ],
        };
        let e = Error::fell_behind(vec![2, 0, 2], cause);
        assert_eq!(e.kind(), ErrorKind::FellBehind);
        // A skipper is excused its missing messages only: what else it did stays its fault.
        assert_eq!(
            e.faults(),
            [
                peer(3, Fault::Malformed("x".into())),
                peer(0, Fault::Malformed("y".into()))
            ]
        );
        let Error::FellBehind { skipped_by, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(skipped_by, &[0, 2]);
        let text = e.to_string();
        assert!(
            text.starts_with("this rank fell behind: ranks [0, 2]"),
            "{text}"
        );
        assert!(text.contains("rank 3"), "{text}");
    }
}
