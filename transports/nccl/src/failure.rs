//! What a failed NCCL step reports (pure: no NCCL calls).

use std::fmt;

use byzcoll_runtime::{Rank, TransportError};

/// Why a step's communicator was aborted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbortCause {
    /// The step's deadline passed with operations still open.
    Deadline,
    /// NCCL or CUDA reported an error first (`ncclRemoteError` when a peer's process or
    /// network went away); the string is theirs.
    Failed(String),
}

/// A failure of the NCCL communicator as a whole.
///
/// NCCL cannot time out or withdraw one peer's operation: a step either completes for every
/// peer or the communicator is aborted. This value travels as the cause of
/// [`TransportError::Aborted`], whose `ranks` are [`NcclFailure::ranks`]; get it back with
/// [`NcclFailure::from_transport_error`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NcclFailure {
    /// This step did not complete and the communicator was aborted. `ranks` are the peers of
    /// every operation that was open, because NCCL cannot tell which of them did not take
    /// part: some of them may have done nothing wrong. Build a new transport to continue.
    StepAborted {
        /// Collective sequence number of the step.
        collective: u64,
        /// Step number within the collective.
        step: u32,
        /// Peers with operations that had not completed (sorted, each once).
        ranks: Vec<Rank>,
        /// What ended the step.
        cause: AbortCause,
    },
    /// An earlier step (or setup) aborted the communicator; nothing more can be exchanged.
    /// Build a new transport.
    Broken {
        /// The step that aborted it, as `(collective, step)`, or `None` when it was lost
        /// outside a step (a cancelled exchange, an error between steps).
        at: Option<(u64, u32)>,
    },
}

impl NcclFailure {
    /// The failure carried by `err`, when `err` came from the NCCL transport's abort path.
    pub fn from_transport_error(err: &TransportError) -> Option<&NcclFailure> {
        match err {
            TransportError::Aborted { cause, .. } => cause.downcast_ref::<NcclFailure>(),
            _ => None,
        }
    }

    /// The ranks named by the failure (empty for [`NcclFailure::Broken`]).
    pub fn ranks(&self) -> &[Rank] {
        match self {
            NcclFailure::StepAborted { ranks, .. } => ranks,
            NcclFailure::Broken { .. } => &[],
        }
    }
}

impl From<NcclFailure> for TransportError {
    fn from(f: NcclFailure) -> Self {
        TransportError::Aborted {
            ranks: f.ranks().to_vec(),
            cause: Box::new(f),
        }
    }
}

impl fmt::Display for NcclFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NcclFailure::StepAborted {
                collective,
                step,
                ranks,
                cause,
            } => {
                write!(f, "NCCL step {step} of collective {collective} ")?;
                match cause {
                    AbortCause::Deadline => f.write_str("did not complete by its deadline")?,
                    AbortCause::Failed(why) => write!(f, "failed ({why})")?,
                }
                f.write_str("; the communicator was aborted. ")?;
                if ranks.is_empty() {
                    return f.write_str("No peer operation was open: the failure is local.");
                }
                f.write_str(
                    "NCCL cannot tell which peer did not complete, so every rank with an open \
                     operation is named: ",
                )?;
                write_ranks(f, ranks)
            }
            NcclFailure::Broken { at: Some((c, s)) } => write!(
                f,
                "the NCCL communicator was aborted at step {s} of collective {c}; \
                 build a new transport"
            ),
            NcclFailure::Broken { at: None } => f.write_str(
                "the NCCL communicator was aborted outside a step; build a new transport",
            ),
        }
    }
}

fn write_ranks(f: &mut fmt::Formatter<'_>, ranks: &[Rank]) -> fmt::Result {
    for (i, r) in ranks.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{r}")?;
    }
    Ok(())
}

impl std::error::Error for NcclFailure {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_names_every_open_peer_and_says_why() {
        let f = NcclFailure::StepAborted {
            collective: 4,
            step: 2,
            ranks: vec![1, 3, 6],
            cause: AbortCause::Deadline,
        };
        let msg = f.to_string();
        assert!(msg.contains("step 2 of collective 4"), "{msg}");
        assert!(msg.contains("did not complete by its deadline"), "{msg}");
        assert!(msg.contains("cannot tell which peer"), "{msg}");
        assert!(msg.ends_with("1, 3, 6"), "{msg}");
        let err = TransportError::from(f.clone());
        match &err {
            TransportError::Aborted { ranks, .. } => assert_eq!(ranks, &[1, 3, 6]),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(NcclFailure::from_transport_error(&err), Some(&f));
        assert_eq!(f.ranks(), &[1, 3, 6]);
        assert!(err.to_string().contains("1, 3, 6"));
    }

    #[test]
    fn nccl_errors_and_broken_transports_are_told_apart() {
        let f = NcclFailure::StepAborted {
            collective: 0,
            step: 0,
            ranks: vec![],
            cause: AbortCause::Failed("ncclRemoteError".into()),
        };
        assert!(f.to_string().contains("failed (ncclRemoteError)"));
        assert!(f.to_string().contains("local"));
        let broken = NcclFailure::Broken { at: Some((7, 1)) };
        let err = TransportError::from(broken.clone());
        match &err {
            TransportError::Aborted { ranks, .. } => assert!(ranks.is_empty()),
            other => panic!("unexpected {other:?}"),
        }
        assert!(err.to_string().contains("step 1 of collective 7"));
        assert!(broken.ranks().is_empty());
        let other = TransportError::Setup("x".into());
        assert_eq!(NcclFailure::from_transport_error(&other), None);
    }
}
