//! [`Shell`]: the [`Transport`](byzcoll_runtime::Transport) side of an engine-driven transport,
//! and its setup: [`check_world`], [`gather_addresses`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use byzcoll_runtime::bootstrap::{FrameSecret, JobAuth, Membership, StoreClient};
use byzcoll_runtime::{Capabilities, MemoryKind, Rank, RecvOutcome, Step, TransportError};
use tokio::sync::mpsc;

use super::{COMMAND_QUEUE, MAX_RANKS};
use crate::mailbox::Mailbox;
use crate::progress::{run_step_on_engine, Engine, Progress, SendCommand, Signal};
use crate::wire::{self, FrameKeys};

/// The future of [`Shell::exchange`] (that of [`byzcoll_runtime::Transport::exchange`]).
pub type Exchange<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<RecvOutcome>, TransportError>> + Send + 'a>>;

/// What a transport whose network moves in turns of an [`Engine`] (UCX, libfabric) answers as
/// a [`Transport`](byzcoll_runtime::Transport): its rank and size, host memory with per-peer
/// timeouts, and steps run through the engine's command queue ([`run_step_on_engine`]). A
/// transport holds it in a field `shell` and implements the trait with
/// [`shell_transport!`](crate::shell_transport). Dropping it is [`Shell::finish`].
pub struct Shell<E: Engine> {
    name: &'static str,
    rank: Rank,
    size: usize,
    mailbox: Arc<Mailbox>,
    commands: Option<mpsc::Sender<SendCommand>>,
    progress: Progress<E>,
    max_message_bytes: u64,
    /// The job's membership ([`Shell::set_membership`]): what audited rounds sign with.
    membership: Option<Arc<Membership>>,
}

impl<E: Engine> std::fmt::Debug for Shell<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shell")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("progress", &self.progress)
            .finish_non_exhaustive()
    }
}

impl<E: Engine> Shell<E> {
    /// Makes the engine with `engine` (from the mailbox it delivers into and the command queue
    /// it takes sends from) and starts its progress thread `thread`; `signal` wakes the thread.
    ///
    /// # Errors
    /// [`TransportError::Io`] when the thread cannot be spawned.
    pub fn start(
        name: &'static str,
        rank: Rank,
        size: usize,
        max_message_bytes: u64,
        thread: String,
        signal: impl Signal,
        engine: impl FnOnce(Arc<Mailbox>, mpsc::Receiver<SendCommand>) -> E,
    ) -> Result<Self, TransportError> {
        let mailbox = Arc::new(Mailbox::new(size));
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let engine = engine(mailbox.clone(), rx);
        let progress = Progress::start(thread, engine, signal).map_err(TransportError::Io)?;
        Ok(Shell {
            name,
            rank,
            size,
            mailbox,
            commands: Some(tx),
            progress,
            max_message_bytes,
            membership: None,
        })
    }

    /// Gives the transport the job's membership ([`gather_addresses`], [`local_memberships`]).
    pub fn set_membership(&mut self, membership: Option<Arc<Membership>>) {
        self.membership = membership;
    }

    /// The job's membership, where the transport was given one
    /// ([`Transport::membership`](byzcoll_runtime::Transport::membership)).
    pub fn membership(&self) -> Option<Arc<Membership>> {
        self.membership.clone()
    }

    /// Closes the command queue and stops the progress thread, which shuts the engine down
    /// (cancelling and draining its operations within a bounded time); what the shutdown
    /// left, the first time.
    pub fn finish(&mut self) -> Option<E::Remains> {
        self.commands = None;
        self.progress.finish()
    }

    /// [`byzcoll_runtime::Transport::name`].
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// [`byzcoll_runtime::Transport::rank`].
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// [`byzcoll_runtime::Transport::size`].
    pub fn size(&self) -> usize {
        self.size
    }

    /// [`byzcoll_runtime::Transport::capabilities`]: host memory, per-peer timeouts.
    pub fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory: vec![MemoryKind::Host],
            per_peer_timeout: true,
            quorum: true,
            max_message_bytes: self.max_message_bytes,
            steps_in_flight: byzcoll_runtime::PIPELINED_STEPS,
        }
    }

    /// [`byzcoll_runtime::Transport::exchange`]: validates the step and runs it through the
    /// engine.
    pub fn exchange(&self, step: Step) -> Exchange<'_> {
        Box::pin(async move {
            step.validate(self.rank, self.size, &self.capabilities())?;
            run_step_on_engine(
                &self.progress,
                &self.mailbox,
                &step,
                self.name,
                self.commands.as_ref(),
            )
            .await
        })
    }
}

impl<E: Engine> Drop for Shell<E> {
    fn drop(&mut self) {
        drop(self.finish());
    }
}

/// Refuses a rank outside the world or a world larger than the tag layout can address.
///
/// # Errors
/// [`TransportError::InvalidUsage`], naming the transport.
pub fn check_world(transport: &str, rank: Rank, size: usize) -> Result<(), TransportError> {
    if size > MAX_RANKS || rank >= size {
        return Err(TransportError::InvalidUsage(format!(
            "rank {rank} of {size}: the {transport} transport addresses at most {MAX_RANKS} ranks"
        )));
    }
    Ok(())
}

/// Publishes this rank's network `address` with a fresh frame key and its identity key through
/// `store` (under `label`) and gathers every rank's: their addresses, by rank, this rank's
/// frame keys, and the job's membership (every rank's identity key: what audited rounds check
/// signatures with). The store is authenticated, so the table of keys is the job's.
///
/// # Errors
/// [`TransportError::Setup`] when the store fails, a rank publishes an unusable value, or the
/// store does not hold one per rank (`what` names the addresses in the message).
pub async fn gather_addresses(
    store: &StoreClient,
    label: &str,
    what: &str,
    rank: Rank,
    size: usize,
    address: &[u8],
) -> Result<(Vec<Bytes>, FrameKeys, Arc<Membership>), TransportError> {
    let setup = |e: String| TransportError::Setup(e);
    let secret = FrameSecret::generate().map_err(|e| setup(e.to_string()))?;
    let identity = store.auth().identity().map_err(|e| setup(e.to_string()))?;
    let published = store
        .all_gather(label, &wire::publish(&secret, &identity.public(), address))
        .await
        .map_err(|e| setup(e.to_string()))?;
    if published.len() != size {
        return Err(setup(format!(
            "{} {what} for a world of {size}",
            published.len()
        )));
    }
    let mut publics = Vec::with_capacity(size);
    let mut identities = Vec::with_capacity(size);
    let mut addresses = Vec::with_capacity(size);
    for (peer, value) in published.iter().enumerate() {
        let (key, id, address) =
            wire::published(value).map_err(|e| setup(format!("rank {peer}: {e}")))?;
        publics.push(key);
        identities.push((id, address));
        addresses.push(value.slice_ref(address));
    }
    let keys = FrameKeys::new(store.auth(), rank, &secret, &publics).map_err(setup)?;
    // Under per-rank keys each identity must be the one the roster binds to its rank.
    let membership = Membership::new(store.auth().clone(), identity, &identities)
        .map_err(|e| setup(e.to_string()))?;
    Ok((addresses, keys, Arc::new(membership)))
}

/// The memberships of a world that lives in this process: a fresh identity key per rank and
/// the world's roster (`None` each where the OS gave no randomness for them).
pub fn local_memberships(size: usize) -> Vec<Option<Arc<Membership>>> {
    Membership::world(&JobAuth::Unauthenticated, &vec![Vec::new(); size])
        .map(|m| m.into_iter().map(|m| Some(Arc::new(m))).collect())
        .unwrap_or_else(|_| vec![None; size])
}

/// Implements [`byzcoll_runtime::Transport`] for a type whose field `shell` is a
/// [`Shell`](crate::tagged::Shell), by delegating every method to it.
#[macro_export]
macro_rules! shell_transport {
    ($transport:ty) => {
        impl $crate::__private::Transport for $transport {
            fn name(&self) -> &'static str {
                self.shell.name()
            }

            fn rank(&self) -> $crate::__private::Rank {
                self.shell.rank()
            }

            fn size(&self) -> usize {
                self.shell.size()
            }

            fn capabilities(&self) -> $crate::__private::Capabilities {
                self.shell.capabilities()
            }

            fn exchange(&self, step: $crate::__private::Step) -> $crate::tagged::Exchange<'_> {
                self.shell.exchange(step)
            }

            fn membership(&self) -> Option<::std::sync::Arc<$crate::__private::Membership>> {
                self.shell.membership()
            }

            fn as_any(&self) -> Option<&dyn ::std::any::Any> {
                Some(self)
            }
        }
    };
}
