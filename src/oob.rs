//! Joining a world through the caller's own all-gather (UCC's "out-of-band" habit): an MPI
//! program bootstraps byzcoll over `MPI_Allgather`, so it needs no store port and byzcoll
//! never links MPI.
//!
//! Two all-gathers of fixed-size records, then the TCP mesh:
//! 1. `BZO2 | protocol version | rank | world | 32 bytes | job-wide parameters`: every rank
//!    checks that the callback gathered in rank order, that every rank runs this protocol and
//!    that every rank chose the job-wide parameters alike (`Config::check_job`); rank 0's 32
//!    bytes, fresh from the OS CSPRNG, become the job secret. The caller's channel is trusted
//!    with it, as a launcher's environment is.
//! 2. `rank | Ed25519 identity key | address length | address`: every rank's TCP listener
//!    and identity, from which each rank builds the same roster (its digest is compared on
//!    every connection, as with the store).
//!
//! The caller's callback runs on the calling thread (MPI's `MPI_THREAD_SINGLE` programs
//! need that); the connections are made on the given tokio runtime.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use byzcoll_runtime::bootstrap::{Credentials, JobAuth, JobSecret, Membership};
use byzcoll_runtime::JOB_RECORD_LEN;
use byzcoll_transport_tcp::TcpTransport;
use tokio::net::TcpListener;

use crate::config::{Bootstrap, JobConfig};
use crate::{BootstrapError, Communicator, Error, Result, TransportError};

const MAGIC: &[u8; 4] = b"BZO2";
const VERSION: u32 = byzcoll_runtime::bootstrap::PROTOCOL_VERSION as u32;
const HELLO_LEN: usize = 4 + 4 + 4 + 4 + 32 + JOB_RECORD_LEN;
/// Where a hello's secret starts (its job-wide parameters follow it).
const SECRET_AT: usize = 16;
const MAX_ADDR: usize = 94;
const ENTRY_LEN: usize = 4 + 32 + 2 + MAX_ADDR;

/// The caller's all-gather: given this rank's record, every rank's record of the same length,
/// concatenated in rank order (or why not).
pub type AllGather<'a> = dyn FnMut(&[u8]) -> std::result::Result<Vec<u8>, String> + 'a;

/// Largest world [`init_with_allgather`] accepts.
pub const MAX_OOB_WORLD: usize = byzcoll_runtime::bootstrap::MAX_WORLD;

/// Creates the rank `config` names ([`JobConfig::for_allgather`]) of a world over TCP,
/// bootstrapped through `allgather`, which must behave like `MPI_Allgather` on the caller's
/// group: given this rank's record, it returns every rank's record of the same length,
/// concatenated in rank order.
///
/// The listener binds to the configuration's TCP address (`BYZCOLL_TCP_ADDR` or
/// [`JobConfig::with_tcp_listen`]), else to the address this host's name resolves to. The
/// connections are authenticated with a secret that rank 0 draws and the all-gather
/// distributes, so the job needs no `BYZCOLL_SECRET`.
///
/// The calling thread waits on `runtime` (`Handle::block_on`) and cannot drive it: another
/// thread must, as tokio's multi-threaded runtime does; a [`crate::blocking::Runtime`] does it
/// in [`init_with_allgather`](crate::blocking::Runtime::init_with_allgather).
///
/// # Errors
/// [`Error::InvalidUsage`] for a configuration made for another bootstrap than
/// [`Bootstrap::AllGather`]; [`Error::Bootstrap`] when the callback fails, returns records out
/// of order or of another protocol version, or a rank publishes an unusable address;
/// [`Error::Transport`] when connecting fails.
pub fn init_with_allgather(
    config: &JobConfig,
    allgather: &mut AllGather<'_>,
    runtime: &tokio::runtime::Handle,
) -> Result<Communicator> {
    if config.bootstrap() != Bootstrap::AllGather {
        return Err(Error::InvalidUsage(
            "init_with_allgather takes a configuration made by JobConfig::for_allgather".into(),
        ));
    }
    let (rank, size) = (config.launch().rank, config.launch().size);
    let mut chosen = config.chosen().clone();
    let Some(tcp) = chosen.tcp() else {
        return Err(Error::Unsupported(
            "the all-gather join connects over TCP only".into(),
        ));
    };
    let options = tcp.options(crate::registry::setup_timeout(config.comm()));
    let ip = match tcp.listen {
        Some(ip) => ip,
        None => host_address()?,
    };

    let secret = JobSecret::generate()?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(size as u32).to_le_bytes());
    hello.extend_from_slice(&secret.to_bytes());
    hello.extend_from_slice(&config.comm().job_record());
    let hellos = gather(allgather, &hello, size)?;
    for (r, h) in hellos.chunks_exact(HELLO_LEN).enumerate() {
        let version = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let (their_rank, world) = (le32(&h[8..12]), le32(&h[12..16]));
        if &h[..4] != MAGIC || version != VERSION {
            return Err(bootstrap(format!(
                "the record at position {r} is not a byzcoll protocol {} hello (magic {:?}, \
                 version {version}): every rank must run the same byzcoll",
                VERSION,
                &h[..4]
            )));
        }
        if their_rank != r || world != size {
            return Err(bootstrap(format!(
                "the record at position {r} comes from rank {their_rank} of {world}: the \
                 all-gather must return every rank's record in rank order, from a group of \
                 {size}"
            )));
        }
    }
    if hellos[rank * HELLO_LEN..(rank + 1) * HELLO_LEN] != hello[..] {
        return Err(bootstrap(format!(
            "the all-gather did not return this rank's own record at position {rank}"
        )));
    }
    let jobs: Vec<&[u8]> = hellos
        .chunks_exact(HELLO_LEN)
        .map(|h| &h[SECRET_AT + 32..])
        .collect();
    config.comm().check_job(&jobs)?;
    let mut key = [0u8; 32];
    key.copy_from_slice(&hellos[SECRET_AT..SECRET_AT + 32]);
    let secret = JobSecret::from_bytes(key);
    let auth = match config.rank_key() {
        Some((roster, id)) => {
            JobAuth::PerRank(Credentials::rank(secret, roster.clone(), rank, id.clone())?)
        }
        None => JobAuth::Secret(secret),
    };

    let listener = runtime
        .block_on(TcpListener::bind((ip, 0)))
        .map_err(TransportError::from)?;
    let me = listener.local_addr().map_err(TransportError::from)?;
    let identity = auth.identity()?;
    let addr = me.to_string();
    let mut entry = vec![0u8; ENTRY_LEN];
    entry[..4].copy_from_slice(&(rank as u32).to_le_bytes());
    entry[4..36].copy_from_slice(&identity.public());
    entry[36..38].copy_from_slice(&(addr.len() as u16).to_le_bytes());
    entry[38..38 + addr.len()].copy_from_slice(addr.as_bytes());
    let entries = gather(allgather, &entry, size)?;

    let mut keys = Vec::with_capacity(size);
    let mut addrs = Vec::with_capacity(size);
    for (r, e) in entries.chunks_exact(ENTRY_LEN).enumerate() {
        let invalid = |why: &str| bootstrap(format!("rank {r} published an invalid entry: {why}"));
        if le32(&e[..4]) != r {
            return Err(invalid("out of rank order"));
        }
        let len = u16::from_le_bytes([e[36], e[37]]) as usize;
        let text = e
            .get(38..38 + len)
            .filter(|_| len <= MAX_ADDR)
            .ok_or_else(|| invalid("address too long"))?;
        let addr = std::str::from_utf8(text)
            .ok()
            .and_then(|s| s.parse::<SocketAddr>().ok())
            .ok_or_else(|| invalid("not a socket address"))?;
        let mut key = [0u8; 32];
        key.copy_from_slice(&e[4..36]);
        keys.push((key, text));
        addrs.push(addr);
    }
    if entries[rank * ENTRY_LEN..(rank + 1) * ENTRY_LEN] != entry[..] {
        return Err(bootstrap(format!(
            "the all-gather did not return this rank's own record at position {rank}"
        )));
    }
    if let Some(r) = addrs.iter().position(|a| a.ip().is_unspecified()) {
        return Err(bootstrap(format!(
            "rank {r} listens on {}, which no peer can connect to: give it a specific address \
             (config listen address or BYZCOLL_TCP_ADDR)",
            addrs[r]
        )));
    }
    let looped: Vec<usize> = (0..size).filter(|&r| addrs[r].ip().is_loopback()).collect();
    if !looped.is_empty() && looped.len() < size {
        return Err(bootstrap(format!(
            "ranks {looped:?} listen on loopback addresses and the others do not, so they cannot \
             all reach each other: set BYZCOLL_TCP_ADDR (or the config's listen address) to an \
             address of each host's network"
        )));
    }
    let membership = Membership::new(auth, identity, &keys)?;
    let transport = runtime.block_on(TcpTransport::connect_mesh(
        rank,
        size,
        listener,
        &addrs,
        &membership,
        options,
    ))?;
    let mut comm = Communicator::new(Box::new(transport), config.comm().clone());
    if size > 1 {
        comm.set_identity(membership.auth.mode());
    }
    Ok(comm)
}

fn gather(allgather: &mut AllGather<'_>, record: &[u8], size: usize) -> Result<Vec<u8>> {
    let all =
        allgather(record).map_err(|why| bootstrap(format!("the all-gather failed: {why}")))?;
    if all.len() != record.len() * size {
        return Err(bootstrap(format!(
            "the all-gather returned {} bytes for {size} records of {}",
            all.len(),
            record.len()
        )));
    }
    Ok(all)
}

fn le32(b: &[u8]) -> usize {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
}

fn bootstrap(why: String) -> Error {
    Error::Bootstrap(BootstrapError::Store(format!(
        "out-of-band bootstrap: {why}"
    )))
}

/// An address this host's name resolves to, where the other ranks of a multi-node job can
/// reach this one.
fn host_address() -> Result<IpAddr> {
    let mut name = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or fails.
    let rc = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let host = String::from_utf8_lossy(&name[..end]).into_owned();
    let unresolvable = |why: String| {
        Error::Bootstrap(BootstrapError::InvalidVar {
            var: "BYZCOLL_TCP_ADDR",
            value: String::new(),
            why: format!(
                "unset, and this host's name {host:?} gives no address ({why}): set it to the \
                 IP address other ranks reach this one at"
            ),
        })
    };
    if rc != 0 {
        return Err(unresolvable(std::io::Error::last_os_error().to_string()));
    }
    let addrs: Vec<SocketAddr> = (host.as_str(), 0)
        .to_socket_addrs()
        .map_err(|e| unresolvable(e.to_string()))?
        .collect();
    // A non-loopback address first (Debian maps the host name to 127.0.1.1 as well), IPv4
    // before IPv6; loopback only when there is nothing else (a single-host job).
    let rank = |a: &&SocketAddr| (a.ip().is_loopback(), !a.is_ipv4());
    addrs
        .iter()
        .min_by_key(rank)
        .map(SocketAddr::ip)
        .ok_or_else(|| unresolvable("no address".into()))
}
