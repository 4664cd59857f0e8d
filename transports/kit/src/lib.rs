//! The toolkit byzcoll's transports are built from; transport authors depend on it, and
//! embedders (who depend on `byzcoll`) never see it.
//!
//! - [`mailbox`]: receive matching: which delivered message a step's receive takes, with
//!   deadlines, for transports that deliver into a queue.
//! - [`progress`]: a progress engine for tag-matching libraries (UCX, libfabric): the turns,
//!   the thread that runs them when no task does, and the send credit.
//! - `tagged` (feature `sealed`, the default): what the tag-matching transports share on top
//!   of [`progress`]: the tag layout, the header → claim → payload state machine, the sends
//!   and their credit, and the `Transport` shell (`shell_transport!`).
//! - [`wire`]: the frame header, and (feature `sealed`) sealed frames (keyed BLAKE3 headers and
//!   GMAC payload tags per pair of ranks) for transports whose tag matching cannot tell
//!   senders apart.
//! - [`pool`]: receive buffers used again, on transparent huge pages from 1 MiB (the runtime's
//!   own, re-exported: the collectives' outgoing payloads are made there too).

pub mod mailbox;
pub mod progress;
#[cfg(feature = "sealed")]
pub mod tagged;
pub mod wire;

pub use byzcoll_runtime::pool;

/// What `shell_transport!` expands to refers to.
#[cfg(feature = "sealed")]
#[doc(hidden)]
pub mod __private {
    pub use byzcoll_runtime::bootstrap::Membership;
    pub use byzcoll_runtime::{Capabilities, Rank, Step, Transport};
}
