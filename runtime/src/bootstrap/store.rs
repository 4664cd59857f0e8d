//! The rendezvous store: a small TCP service, hosted by rank 0 (or by `byzcoll launch`), whose
//! one operation is an all-gather of short values. Transports publish their addresses through
//! it before they connect to each other.
//!
//! Wire format, little-endian. Request: `b"BZS1"`, rank `u32`, world `u32`, key length `u16`,
//! key, value length `u32`, value. Response: status `u8` (0 ok), then either `count u32` and
//! `count` times (`len u32`, bytes), or an error message (`len u16`, UTF-8). Every length is
//! checked against a fixed limit before anything is allocated.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};

use crate::{BootstrapError, Rank};

const MAGIC: &[u8; 4] = b"BZS1";
/// Longest key accepted.
pub const MAX_KEY: usize = 256;
/// Longest value accepted.
pub const MAX_VALUE: usize = 64 * 1024;
/// Largest world accepted.
pub const MAX_WORLD: usize = 1 << 20;
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(30);

type Gathered = Result<Arc<Vec<Bytes>>, String>;

#[derive(Debug, Default)]
struct Round {
    world: usize,
    values: Vec<Option<Bytes>>,
    filled: usize,
    waiters: Vec<oneshot::Sender<Gathered>>,
}

/// A running store; stops when dropped.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free one) and starts serving on the current
    /// tokio runtime.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn bind(addr: &str) -> io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let rounds = Arc::new(Mutex::new(HashMap::<String, Round>::new()));
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    continue;
                };
                let rounds = rounds.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve(stream, &rounds).await {
                        tracing::warn!(%peer, error = %e, "rendezvous store: request failed");
                    }
                });
            }
        });
        tracing::debug!(%addr, "rendezvous store listening");
        Ok(StoreServer { addr, task })
    }

    /// The address the store listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

async fn serve(mut stream: TcpStream, rounds: &Mutex<HashMap<String, Round>>) -> io::Result<()> {
    let request = timeout(REQUEST_READ_TIMEOUT, read_request(&mut stream))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "request not received in time"))?;
    let rx = match request {
        Ok((rank, world, key, value)) => join_round(rounds, rank, world, key, value),
        Err(e) => {
            let (tx, rx) = oneshot::channel();
            let _ = tx.send(Err(e.to_string()));
            rx
        }
    };
    let result = rx.await.unwrap_or_else(|_| Err("store shut down".into()));
    match result {
        Ok(values) => {
            let mut out = Vec::with_capacity(5 + values.iter().map(|v| 4 + v.len()).sum::<usize>());
            out.push(0u8);
            out.extend_from_slice(&(values.len() as u32).to_le_bytes());
            for v in values.iter() {
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
            stream.write_all(&out).await
        }
        Err(msg) => {
            let msg = &msg.as_bytes()[..msg.len().min(u16::MAX as usize)];
            let mut out = vec![1u8];
            out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
            out.extend_from_slice(msg);
            stream.write_all(&out).await?;
            Err(invalid(String::from_utf8_lossy(msg)))
        }
    }
}

async fn read_request(stream: &mut TcpStream) -> io::Result<(Rank, usize, String, Bytes)> {
    let mut magic = [0u8; 4];
    stream.read_exact(&mut magic).await?;
    if &magic != MAGIC {
        return Err(invalid("not a byzcoll store request"));
    }
    let rank = stream.read_u32_le().await? as usize;
    let world = stream.read_u32_le().await? as usize;
    if world == 0 || world > MAX_WORLD || rank >= world {
        return Err(invalid(format!("rank {rank} / world {world} out of range")));
    }
    let key_len = stream.read_u16_le().await? as usize;
    if key_len > MAX_KEY {
        return Err(invalid(format!("key of {key_len} bytes exceeds {MAX_KEY}")));
    }
    let mut key = vec![0u8; key_len];
    stream.read_exact(&mut key).await?;
    let key = String::from_utf8(key).map_err(|_| invalid("key is not UTF-8"))?;
    let value_len = stream.read_u32_le().await? as usize;
    if value_len > MAX_VALUE {
        return Err(invalid(format!(
            "value of {value_len} bytes exceeds {MAX_VALUE}"
        )));
    }
    let mut value = vec![0u8; value_len];
    stream.read_exact(&mut value).await?;
    Ok((rank, world, key, value.into()))
}

fn join_round(
    rounds: &Mutex<HashMap<String, Round>>,
    rank: Rank,
    world: usize,
    key: String,
    value: Bytes,
) -> oneshot::Receiver<Gathered> {
    let (tx, rx) = oneshot::channel();
    let mut rounds = rounds.lock().unwrap_or_else(PoisonError::into_inner);
    let round = rounds.entry(key.clone()).or_insert_with(|| Round {
        world,
        values: vec![None; world],
        ..Round::default()
    });
    if round.world != world {
        let _ = tx.send(Err(format!(
            "key {key:?}: rank {rank} says the world has {world} ranks, others say {}",
            round.world
        )));
        return rx;
    }
    if round.values[rank].is_some() {
        let _ = tx.send(Err(format!("key {key:?}: rank {rank} joined twice")));
        return rx;
    }
    round.values[rank] = Some(value);
    round.filled += 1;
    round.waiters.push(tx);
    if round.filled == world {
        if let Some(done) = rounds.remove(&key) {
            let values: Arc<Vec<Bytes>> = Arc::new(
                done.values
                    .into_iter()
                    .map(Option::unwrap_or_default)
                    .collect(),
            );
            for w in done.waiters {
                let _ = w.send(Ok(values.clone()));
            }
        }
    }
    rx
}

/// A client of the rendezvous store.
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    rank: Rank,
    world: usize,
    timeout: Duration,
    rounds: Mutex<HashMap<String, u64>>,
}

impl StoreClient {
    /// A client for rank `rank` of `world` talking to the store at `addr` (`host:port`);
    /// each operation gives up after `timeout`.
    pub fn new(addr: impl Into<String>, rank: Rank, world: usize, timeout: Duration) -> Self {
        StoreClient {
            addr: addr.into(),
            rank,
            world,
            timeout,
            rounds: Mutex::new(HashMap::new()),
        }
    }

    /// The store's address as configured.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Contributes `value` under `key` and returns every rank's value, indexed by rank.
    /// Calling again with the same key starts a new round (ranks must call in the same order).
    ///
    /// # Errors
    /// [`BootstrapError::Store`] when the store rejects the request or does not answer within
    /// the timeout (connections are retried until then, since rank 0 may still be starting),
    /// or when its answer is malformed.
    ///
    /// # Cancel safety
    /// Not cancel safe: the contribution may already be recorded.
    pub async fn all_gather(&self, key: &str, value: &[u8]) -> Result<Vec<Bytes>, BootstrapError> {
        let round = {
            let mut rounds = self.rounds.lock().unwrap_or_else(PoisonError::into_inner);
            let n = rounds.entry(key.to_string()).or_insert(0);
            *n += 1;
            *n
        };
        let key = format!("{key}#{round}");
        if key.len() > MAX_KEY || value.len() > MAX_VALUE {
            return Err(BootstrapError::Store(format!(
                "key or value too long ({} / {} bytes)",
                key.len(),
                value.len()
            )));
        }
        let deadline = Instant::now() + self.timeout;
        tokio::time::timeout_at(deadline, self.exchange(&key, value, deadline))
            .await
            .map_err(|_| {
                BootstrapError::Store(format!(
                    "no answer from {} for {key:?} within {:?}: are all {} ranks running?",
                    self.addr, self.timeout, self.world
                ))
            })?
    }

    async fn exchange(
        &self,
        key: &str,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Bytes>, BootstrapError> {
        let mut stream = connect_with_retry(&self.addr, deadline)
            .await
            .map_err(|e| BootstrapError::Store(format!("cannot reach {}: {e}", self.addr)))?;
        let mut req = Vec::with_capacity(18 + key.len() + value.len());
        req.extend_from_slice(MAGIC);
        req.extend_from_slice(&(self.rank as u32).to_le_bytes());
        req.extend_from_slice(&(self.world as u32).to_le_bytes());
        req.extend_from_slice(&(key.len() as u16).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(&(value.len() as u32).to_le_bytes());
        req.extend_from_slice(value);
        stream.write_all(&req).await?;
        let status = stream.read_u8().await?;
        if status != 0 {
            let len = stream.read_u16_le().await? as usize;
            let mut msg = vec![0u8; len];
            stream.read_exact(&mut msg).await?;
            return Err(BootstrapError::Store(
                String::from_utf8_lossy(&msg).into_owned(),
            ));
        }
        let count = stream.read_u32_le().await? as usize;
        if count != self.world {
            return Err(BootstrapError::Store(format!(
                "answer has {count} values for a world of {}",
                self.world
            )));
        }
        let mut values = Vec::with_capacity(count);
        for _ in 0..count {
            let len = stream.read_u32_le().await? as usize;
            if len > MAX_VALUE {
                return Err(BootstrapError::Store(format!(
                    "value of {len} bytes in answer"
                )));
            }
            let mut v = vec![0u8; len];
            stream.read_exact(&mut v).await?;
            values.push(Bytes::from(v));
        }
        Ok(values)
    }
}

/// Connects to `addr`, retrying refused connections until `deadline`.
///
/// # Errors
/// The last connection error once the deadline has passed.
pub async fn connect_with_retry(addr: &str, deadline: Instant) -> io::Result<TcpStream> {
    let mut backoff = Duration::from_millis(5);
    loop {
        match TcpStream::connect(addr).await {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) if Instant::now() + backoff >= deadline => return Err(e),
            Err(_) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn all_gather_returns_every_value_in_rank_order_and_rounds_repeat() {
        let server = StoreServer::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().to_string();
        let tasks: Vec<_> = (0..5)
            .map(|r| {
                let addr = addr.clone();
                tokio::spawn(async move {
                    let c = StoreClient::new(addr, r, 5, Duration::from_secs(10));
                    let first = c.all_gather("k", format!("v{r}").as_bytes()).await.unwrap();
                    let second = c.all_gather("k", &[r as u8]).await.unwrap();
                    (first, second)
                })
            })
            .collect();
        for t in tasks {
            let (first, second) = t.await.unwrap();
            let first: Vec<&[u8]> = first.iter().map(|b| &b[..]).collect();
            assert_eq!(first, [b"v0", b"v1", b"v2", b"v3", b"v4"]);
            assert_eq!(
                second,
                (0..5u8).map(|r| Bytes::from(vec![r])).collect::<Vec<_>>()
            );
        }
    }

    #[tokio::test]
    async fn conflicting_world_sizes_and_garbage_are_rejected() {
        let server = StoreServer::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().to_string();
        let a = StoreClient::new(addr.clone(), 0, 2, Duration::from_secs(5));
        let b = StoreClient::new(addr.clone(), 1, 3, Duration::from_secs(5));
        let (_, rb) = tokio::join!(
            tokio::time::timeout(Duration::from_millis(300), a.all_gather("x", b"a")),
            b.all_gather("x", b"b")
        );
        let err = rb.unwrap_err().to_string();
        assert!(err.contains("world has 3 ranks, others say 2"), "{err}");

        let mut raw = TcpStream::connect(&addr).await.unwrap();
        raw.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        assert_eq!(raw.read_u8().await.unwrap(), 1);

        let mut raw = TcpStream::connect(&addr).await.unwrap();
        let mut req = MAGIC.to_vec();
        req.extend_from_slice(&0u32.to_le_bytes());
        req.extend_from_slice(&1u32.to_le_bytes());
        req.extend_from_slice(&1u16.to_le_bytes());
        req.push(b'k');
        req.extend_from_slice(&u32::MAX.to_le_bytes());
        raw.write_all(&req).await.unwrap();
        assert_eq!(
            raw.read_u8().await.unwrap(),
            1,
            "a 4 GiB value must be refused"
        );
    }

    #[tokio::test]
    async fn a_missing_store_is_a_timeout_error() {
        let c = StoreClient::new("127.0.0.1:9", 1, 2, Duration::from_millis(200));
        let err = c.all_gather("k", b"").await.unwrap_err().to_string();
        assert!(err.contains("127.0.0.1:9"), "{err}");
    }
}
