//! The robust round of the protocol core ([`byzcoll_proto::round`]), re-exported, and the host
//! plane the [`Communicator`](crate::Communicator) runs it on.

pub use byzcoll_proto::round::*;

pub mod host;
