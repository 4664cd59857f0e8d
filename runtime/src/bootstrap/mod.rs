//! Bootstrap: where this process sits in the job, and the rendezvous store through which
//! transports exchange their addresses.

mod env;
mod store;

pub use env::{LaunchEnv, Launcher};
pub use store::{connect_with_retry, StoreClient, StoreServer, MAX_KEY, MAX_VALUE, MAX_WORLD};
