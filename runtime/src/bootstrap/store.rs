//! The rendezvous store: a small TCP service, hosted by rank 0 (or by `byzcoll launch`). Its
//! main operation is an all-gather of short values: transports publish their addresses (and
//! identity keys) through it before they connect to each other. Beside it, each rank may post
//! a few values under its own name ([`MAX_POSTS`]), which any rank of the job can read without
//! waiting: a restarted rank asks to rejoin that way, and the members answer, and the ranks of
//! a rejoined world all-gather through posts ([`StoreClient::among`]), since the store's own
//! rounds take every rank of the job.
//!
//! Every request starts with the handshake of [`super::auth`] (purpose store), which
//! authenticates the client as a process of this job and names its rank; the request and the
//! answer are then each followed by an HMAC under the session key. After the handshake,
//! little-endian: request `op u8` (0 all-gather, 1 post, 2 read a post, then the poster's rank
//! `u32`), `key_len u16`, key, `value_len u32`, value, MAC; answer status `u8` (0 ok), then
//! either `count u32` and `count` times (`len u32`, bytes), or an error message (`len u16`,
//! UTF-8), then the MAC. Nothing is allocated for a client before it has proven the secret;
//! after that, only within fixed limits ([`MAX_KEY`], [`MAX_VALUE`], [`MAX_OPEN_ROUNDS`] and
//! [`MAX_POSTS`] per rank) and the job's own world size, never a size from a request; a failed
//! round is freed at once.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::auth::{self, Endpoint, HandshakeError, JobAuth, Purpose, Session, STORE};
use super::gate::{self, Gate};
use crate::{BootstrapError, Rank};

/// Longest key accepted.
pub const MAX_KEY: usize = 256;
/// Longest value accepted.
pub const MAX_VALUE: usize = 64 * 1024;
/// Largest world accepted.
pub const MAX_WORLD: usize = 1 << 20;
/// Most rounds one rank may have joined that have not completed yet: what a rank (or a
/// process claiming it) can make the store hold is at most this many values of
/// [`MAX_VALUE`] and the bookkeeping of as many rounds. Honest ranks run their rounds one
/// after another.
pub const MAX_OPEN_ROUNDS: usize = 8;
/// Most values one rank keeps posted: a new key beyond them replaces its oldest.
pub const MAX_POSTS: usize = 8;
const REQUEST_LABEL: &[u8] = b"byzcoll-v3 store request";
const ANSWER_LABEL: &[u8] = b"byzcoll-v3 store answer";

/// What a request asks of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    /// Join the all-gather round of the key.
    Gather,
    /// Post the value under the key, in this rank's name.
    Post,
    /// Read what rank `from` posted under the key, without waiting.
    Read { from: Rank },
}

impl Op {
    /// The request's leading bytes.
    fn header(self) -> Vec<u8> {
        match self {
            Op::Gather => vec![0],
            Op::Post => vec![1],
            Op::Read { from } => {
                let mut h = vec![2];
                h.extend_from_slice(&(from as u32).to_le_bytes());
                h
            }
        }
    }
}

type Gathered = Result<Arc<Vec<Bytes>>, String>;

#[derive(Debug)]
struct Round {
    values: Vec<Option<Bytes>>,
    filled: usize,
    waiters: Vec<(Rank, oneshot::Sender<Gathered>)>,
}

#[derive(Debug)]
struct Rounds {
    world: usize,
    open: HashMap<String, Round>,
    /// The most recently completed keys, so that a late registration is refused at once.
    completed: VecDeque<String>,
    /// The most recently failed keys and why, so that a late registration gets the error; the
    /// round itself (its values) is freed when it fails.
    failed: VecDeque<(String, String)>,
    /// Rounds each rank joined that are still open ([`MAX_OPEN_ROUNDS`] at most).
    joined: Vec<usize>,
    /// Each rank's posts, oldest first ([`MAX_POSTS`] at most).
    posts: Vec<VecDeque<(String, Bytes)>>,
}

impl Rounds {
    fn new(world: usize) -> Self {
        Rounds {
            world,
            open: HashMap::new(),
            completed: VecDeque::new(),
            failed: VecDeque::new(),
            joined: vec![0; world],
            posts: vec![VecDeque::new(); world],
        }
    }

    /// Posts `value` under `key` in `rank`'s name, replacing what it posted there before, or
    /// its oldest post when it has [`MAX_POSTS`].
    fn post(&mut self, rank: Rank, key: String, value: Bytes) {
        let posts = &mut self.posts[rank];
        posts.retain(|(k, _)| *k != key);
        if posts.len() == MAX_POSTS {
            posts.pop_front();
        }
        posts.push_back((key, value));
    }

    /// What `rank` posted under `key`.
    fn read(&self, rank: Rank, key: &str) -> Option<Bytes> {
        let posts = self.posts.get(rank)?;
        posts.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    /// Closes `key`'s round: the ranks that joined it are charged for it no more.
    fn close(&mut self, key: &str) -> Option<Round> {
        let round = self.open.remove(key)?;
        for (rank, v) in round.values.iter().enumerate() {
            if v.is_some() {
                self.joined[rank] -= 1;
            }
        }
        Some(round)
    }
}

/// Completed keys remembered.
const COMPLETED_KEPT: usize = 1024;

/// A running store; stops when dropped.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl StoreServer {
    /// Binds `addr` (`host:port`; port 0 picks a free one) and serves the ranks of a job of
    /// `world` ranks authenticated by `auth`, on the current tokio runtime.
    ///
    /// # Errors
    /// When the address cannot be bound, or `world` is 0 or above [`MAX_WORLD`].
    pub async fn bind(addr: &str, world: usize, auth: JobAuth) -> io::Result<Self> {
        if world == 0 || world > MAX_WORLD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a store for {world} ranks (1 to {MAX_WORLD})"),
            ));
        }
        if let Some(c) = auth.credentials() {
            if c.roster().len() != world {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "a store for {world} ranks with a key roster of {}",
                        c.roster().len()
                    ),
                ));
            }
        }
        if !auth.is_authenticated() {
            tracing::warn!("rendezvous store: running UNAUTHENTICATED (BYZCOLL_ALLOW_UNAUTHENTICATED=1): any local process can join this job");
        }
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let rounds = Arc::new(Mutex::new(Rounds::new(world)));
        let auth = Arc::new(auth);
        let task = tokio::spawn(async move {
            let gate = Gate::default();
            loop {
                let (mut stream, peer) = gate::accept(&listener).await;
                let _ = stream.set_nodelay(true);
                let (auth, rounds) = (auth.clone(), rounds.clone());
                gate.admit(
                    peer,
                    async move {
                        let me = Endpoint {
                            auth: &auth,
                            purpose: Purpose::Store,
                            world: world as u32,
                            rank: STORE,
                            identity: None,
                            frame_macs: false,
                        };
                        match auth::respond(&mut stream, me, |_| Ok(())).await {
                            Ok(session) => Some((stream, session)),
                            Err(HandshakeError::Rejected { why, .. }) => {
                                crate::warn_limited!(
                                    peer,
                                    "rendezvous store: refused a connection: {why}"
                                );
                                None
                            }
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "rendezvous store: handshake failed");
                                None
                            }
                        }
                    },
                    move |(stream, session)| async move {
                        if let Err(e) = serve(stream, session, &rounds).await {
                            tracing::warn!(%peer, error = %e, "rendezvous store: request failed");
                        }
                    },
                );
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

async fn serve(mut stream: TcpStream, session: Session, rounds: &Mutex<Rounds>) -> io::Result<()> {
    let rank = session.peer as Rank;
    let request = tokio::time::timeout(gate::AUTH_DEADLINE, read_request(&mut stream, &session))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "request not received in time"))?;
    let (key, rx) = match request {
        Ok((Op::Gather, key, value)) => {
            let rx = join_round(rounds, rank, &key, value);
            (Some(key), rx)
        }
        Ok((op, key, value)) => {
            let answer = {
                let mut rounds = rounds.lock().unwrap_or_else(PoisonError::into_inner);
                match op {
                    Op::Read { from } if from >= rounds.world => Err(format!(
                        "rank {from} is not in a job of {} ranks",
                        rounds.world
                    )),
                    Op::Read { from } => Ok(rounds.read(from, &key).into_iter().collect()),
                    _ => {
                        rounds.post(rank, key, value);
                        Ok(Vec::new())
                    }
                }
            };
            let (tx, rx) = oneshot::channel();
            let _ = tx.send(answer.map(Arc::new));
            (None, rx)
        }
        Err(e) => {
            let (tx, rx) = oneshot::channel();
            let _ = tx.send(Err(e.to_string()));
            (None, rx)
        }
    };
    // Wait for the round, and withdraw the contribution if the client hangs up meanwhile,
    // so that a round whose ranks all left is dropped.
    let mut probe = [0u8; 1];
    let result = tokio::select! {
        r = rx => r.unwrap_or_else(|_| Err("store shut down".into())),
        _ = stream.read(&mut probe) => {
            if let Some(key) = &key {
                leave_round(rounds, rank, key);
            }
            return Err(invalid(format!("rank {rank} hung up while waiting")));
        }
    };
    let mut body = Vec::new();
    let outcome = match result {
        Ok(values) => {
            body.reserve(5 + values.iter().map(|v| 4 + v.len()).sum::<usize>());
            body.push(0u8);
            body.extend_from_slice(&(values.len() as u32).to_le_bytes());
            for v in values.iter() {
                body.extend_from_slice(&(v.len() as u32).to_le_bytes());
                body.extend_from_slice(v);
            }
            Ok(())
        }
        Err(msg) => {
            let msg = &msg.as_bytes()[..msg.len().min(u16::MAX as usize)];
            body.push(1u8);
            body.extend_from_slice(&(msg.len() as u16).to_le_bytes());
            body.extend_from_slice(msg);
            Err(invalid(String::from_utf8_lossy(msg)))
        }
    };
    body.extend_from_slice(&session.mac(ANSWER_LABEL, &[&body]));
    stream.write_all(&body).await?;
    outcome
}

async fn read_request(
    stream: &mut TcpStream,
    session: &Session,
) -> io::Result<(Op, String, Bytes)> {
    let op = match stream.read_u8().await? {
        0 => Op::Gather,
        1 => Op::Post,
        2 => Op::Read {
            from: stream.read_u32_le().await? as Rank,
        },
        other => return Err(invalid(format!("unknown request {other}"))),
    };
    let key_len = stream.read_u16_le().await?;
    if key_len as usize > MAX_KEY {
        return Err(invalid(format!("key of {key_len} bytes exceeds {MAX_KEY}")));
    }
    let mut key = vec![0u8; key_len as usize];
    stream.read_exact(&mut key).await?;
    let value_len = stream.read_u32_le().await?;
    if value_len as usize > MAX_VALUE {
        return Err(invalid(format!(
            "value of {value_len} bytes exceeds {MAX_VALUE}"
        )));
    }
    let mut value = vec![0u8; value_len as usize];
    stream.read_exact(&mut value).await?;
    let mut mac = [0u8; 32];
    stream.read_exact(&mut mac).await?;
    let parts: [&[u8]; 5] = [
        &op.header(),
        &key_len.to_le_bytes(),
        &key,
        &value_len.to_le_bytes(),
        &value,
    ];
    if !session.verify(REQUEST_LABEL, &parts, &mac) {
        return Err(invalid("the request's MAC does not match"));
    }
    let key = String::from_utf8(key).map_err(|_| invalid("key is not UTF-8"))?;
    Ok((op, key, value.into()))
}

fn join_round(
    rounds: &Mutex<Rounds>,
    rank: Rank,
    key: &str,
    value: Bytes,
) -> oneshot::Receiver<Gathered> {
    let (tx, rx) = oneshot::channel();
    let mut rounds = rounds.lock().unwrap_or_else(PoisonError::into_inner);
    let world = rounds.world;
    if rounds.completed.iter().any(|k| k == key) {
        let _ = tx.send(Err(format!(
            "key {key:?}: the round completed without this registration of rank {rank} \
             (another process registered as rank {rank})"
        )));
        return rx;
    }
    if let Some((_, why)) = rounds.failed.iter().find(|(k, _)| k == key) {
        let _ = tx.send(Err(why.clone()));
        return rx;
    }
    let joined = rounds
        .open
        .get(key)
        .is_some_and(|r| r.values[rank].is_some());
    if !joined && rounds.joined[rank] >= MAX_OPEN_ROUNDS {
        let _ = tx.send(Err(format!(
            "key {key:?}: rank {rank} has joined {MAX_OPEN_ROUNDS} rounds that are still open"
        )));
        return rx;
    }
    if joined {
        // Never a silent replacement: the whole round fails, naming the rank, for every rank
        // that joined it and every rank that still will; its values are freed now.
        let why = format!(
            "key {key:?}: rank {rank} registered twice (another process claims its identity)"
        );
        tracing::warn!("rendezvous store: {why}");
        if let Some(round) = rounds.close(key) {
            for (_, w) in round.waiters {
                let _ = w.send(Err(why.clone()));
            }
        }
        if rounds.failed.len() == COMPLETED_KEPT {
            rounds.failed.pop_front();
        }
        rounds.failed.push_back((key.to_string(), why.clone()));
        let _ = tx.send(Err(why));
        return rx;
    }
    rounds.joined[rank] += 1;
    let round = rounds.open.entry(key.to_string()).or_insert_with(|| Round {
        values: vec![None; world],
        filled: 0,
        waiters: Vec::new(),
    });
    round.values[rank] = Some(value);
    round.filled += 1;
    round.waiters.push((rank, tx));
    if round.filled == world {
        if rounds.completed.len() == COMPLETED_KEPT {
            rounds.completed.pop_front();
        }
        rounds.completed.push_back(key.to_string());
        if let Some(done) = rounds.close(key) {
            let values: Arc<Vec<Bytes>> = Arc::new(
                done.values
                    .into_iter()
                    .map(Option::unwrap_or_default)
                    .collect(),
            );
            for (_, w) in done.waiters {
                let _ = w.send(Ok(values.clone()));
            }
        }
    }
    rx
}

fn leave_round(rounds: &Mutex<Rounds>, rank: Rank, key: &str) {
    let mut rounds = rounds.lock().unwrap_or_else(PoisonError::into_inner);
    let rounds = &mut *rounds;
    let Some(round) = rounds.open.get_mut(key) else {
        return;
    };
    if round.values[rank].take().is_some() {
        round.filled -= 1;
        round.waiters.retain(|(r, _)| *r != rank);
        rounds.joined[rank] -= 1;
    }
    if round.waiters.is_empty() {
        rounds.open.remove(key);
    }
}

/// A client of the rendezvous store.
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    rank: Rank,
    world: usize,
    timeout: Duration,
    auth: JobAuth,
    rounds: Mutex<HashMap<String, u64>>,
    /// A world of some of the job's ranks ([`StoreClient::among`]); `None`: the job's.
    among: Option<Among>,
}

/// The world of a [`StoreClient::among`].
#[derive(Debug)]
struct Among {
    /// The members (job ranks, ascending); this rank is `members[at]`.
    members: Vec<Rank>,
    at: usize,
    /// Prefixed to every key, so that no two worlds' values meet.
    prefix: String,
    /// The job's authentication renumbered for the members ([`JobAuth::among`]).
    auth: JobAuth,
}

impl StoreClient {
    /// A client for rank `rank` of `world` talking to the store at `addr` (`host:port`),
    /// authenticated by `auth`; each operation gives up after `timeout`.
    pub fn new(
        addr: impl Into<String>,
        rank: Rank,
        world: usize,
        timeout: Duration,
        auth: JobAuth,
    ) -> Self {
        StoreClient {
            addr: addr.into(),
            rank,
            world,
            timeout,
            auth,
            rounds: Mutex::new(HashMap::new()),
            among: None,
        }
    }

    /// A client for the world of `members` (ranks of this job, ascending, this one among
    /// them), renumbered `0..members.len()` in that order, named `world` (distinct from every
    /// other such world of the job: values of another never meet it): its all-gathers go
    /// through posts and reads of the members alone, so transports connect through it as
    /// through the job's store, and its [`auth`](StoreClient::auth) is the job's for that world
    /// ([`JobAuth::among`]). A read that finds nothing is tried again after a pause that
    /// doubles from 5 ms to 100 ms, until the timeout. Requests still authenticate as this
    /// rank of the job (each read is a connection and a handshake: fine for the worlds a
    /// rejoin builds, not for thousands of ranks).
    ///
    /// # Errors
    /// [`BootstrapError::Auth`] when `members` is not ascending, lies outside the job, or does
    /// not hold this rank.
    pub fn among(&self, members: &[Rank], world: &str) -> Result<StoreClient, BootstrapError> {
        let at = members
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| {
                BootstrapError::Auth(format!("rank {} is not among {members:?}", self.rank))
            })?;
        if members.iter().any(|&r| r >= self.world) {
            return Err(BootstrapError::Auth(format!(
                "members {members:?}: not all in a job of {} ranks",
                self.world
            )));
        }
        Ok(StoreClient {
            addr: self.addr.clone(),
            rank: self.rank,
            world: self.world,
            timeout: self.timeout,
            auth: self.auth.clone(),
            rounds: Mutex::new(HashMap::new()),
            among: Some(Among {
                members: members.to_vec(),
                at,
                prefix: format!("{world}/"),
                auth: self.auth.among(members)?,
            }),
        })
    }

    /// This client with each operation giving up after `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The store's address as configured.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// How this client's world authenticates (transports authenticate their connections the
    /// same way): the job's, or for a world of some of its ranks the job's renumbered.
    pub fn auth(&self) -> &JobAuth {
        self.among.as_ref().map_or(&self.auth, |a| &a.auth)
    }

    /// Posts `value` under `key` in this rank's name (replacing what it posted there before;
    /// a rank keeps [`MAX_POSTS`]), for any rank of the job to [`read`](StoreClient::read).
    ///
    /// # Errors
    /// As [`StoreClient::all_gather`].
    pub async fn post(&self, key: &str, value: &[u8]) -> Result<(), BootstrapError> {
        self.request(Op::Post, key, value).await.map(drop)
    }

    /// What rank `from` of the job posted under `key`, if anything: does not wait.
    ///
    /// # Errors
    /// As [`StoreClient::all_gather`].
    pub async fn read(&self, from: Rank, key: &str) -> Result<Option<Bytes>, BootstrapError> {
        let mut values = self.request(Op::Read { from }, key, &[]).await?;
        Ok(values.pop())
    }

    /// Contributes `value` under `key` and returns every rank's value, indexed by rank.
    /// Calling again with the same key starts a new round (ranks must call in the same order).
    ///
    /// # Errors
    /// [`BootstrapError::Store`] when the store rejects the request (a rank registered twice,
    /// too many open rounds) or does not answer within the timeout (connections are retried
    /// until then, since rank 0 may still be starting), or when its answer is malformed;
    /// [`BootstrapError::Auth`] when the store is not of this job (or this process is not).
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
        if let Some(among) = &self.among {
            return self
                .gather_among(among, &format!("{}{key}#{round}", among.prefix), value)
                .await;
        }
        self.request(Op::Gather, &format!("{key}#{round}"), value)
            .await
    }

    /// The all-gather of a world of some of the job's ranks: post, then read every other
    /// member's post until all are there or the timeout.
    async fn gather_among(
        &self,
        among: &Among,
        key: &str,
        value: &[u8],
    ) -> Result<Vec<Bytes>, BootstrapError> {
        let deadline = Instant::now() + self.timeout;
        self.post(key, value).await?;
        let mut values: Vec<Option<Bytes>> = vec![None; among.members.len()];
        values[among.at] = Some(Bytes::copy_from_slice(value));
        let mut pause = Duration::from_millis(5);
        loop {
            for (i, &member) in among.members.iter().enumerate() {
                if values[i].is_none() {
                    values[i] = self.read(member, key).await?;
                }
            }
            let missing: Vec<Rank> = (0..values.len())
                .filter(|&i| values[i].is_none())
                .map(|i| among.members[i])
                .collect();
            if missing.is_empty() {
                return Ok(values.into_iter().flatten().collect());
            }
            if Instant::now() >= deadline {
                return Err(BootstrapError::Store(format!(
                    "ranks {missing:?} posted nothing under {key:?} at {} within {:?}",
                    self.addr, self.timeout
                )));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// Sends one request and returns the answer's values.
    async fn request(&self, op: Op, key: &str, value: &[u8]) -> Result<Vec<Bytes>, BootstrapError> {
        if key.len() > MAX_KEY || value.len() > MAX_VALUE || self.world > MAX_WORLD {
            return Err(BootstrapError::Store(format!(
                "key, value or world too large ({} / {} bytes, {} ranks)",
                key.len(),
                value.len(),
                self.world
            )));
        }
        let deadline = Instant::now() + self.timeout;
        tokio::time::timeout_at(deadline, self.exchange(op, key, value, deadline))
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
        op: Op,
        key: &str,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Bytes>, BootstrapError> {
        let mut stream = connect_with_retry(&self.addr, deadline)
            .await
            .map_err(|e| BootstrapError::Store(format!("cannot reach {}: {e}", self.addr)))?;
        let me = Endpoint {
            auth: &self.auth,
            purpose: Purpose::Store,
            world: self.world as u32,
            rank: self.rank as u32,
            identity: None,
            frame_macs: false,
        };
        let session = auth::initiate(&mut stream, me, STORE)
            .await
            .map_err(|e| match e {
                HandshakeError::Io(e) => BootstrapError::Io(e),
                e => BootstrapError::Auth(format!("store at {}: {e}", self.addr)),
            })?;
        let header = op.header();
        let key_len = (key.len() as u16).to_le_bytes();
        let value_len = (value.len() as u32).to_le_bytes();
        let parts: [&[u8]; 5] = [&header, &key_len, key.as_bytes(), &value_len, value];
        let mut req = parts.concat();
        req.extend_from_slice(&session.mac(REQUEST_LABEL, &parts));
        stream.write_all(&req).await?;

        let bad = |what: String| BootstrapError::Store(format!("{}: {what}", self.addr));
        let mut body = vec![stream.read_u8().await?];
        if body[0] != 0 {
            let len = stream.read_u16_le().await?;
            let mut msg = vec![0u8; len as usize];
            stream.read_exact(&mut msg).await?;
            body.extend_from_slice(&len.to_le_bytes());
            body.extend_from_slice(&msg);
            read_answer_mac(&mut stream, &session, &body).await?;
            return Err(BootstrapError::Store(
                String::from_utf8_lossy(&msg).into_owned(),
            ));
        }
        let count = stream.read_u32_le().await?;
        body.extend_from_slice(&count.to_le_bytes());
        let expected = match op {
            Op::Gather => self.world,
            Op::Post => 0,
            Op::Read { .. } => count.min(1) as usize,
        };
        if count as usize != expected {
            return Err(bad(format!(
                "answer has {count} values, expected {expected}"
            )));
        }
        let mut values = Vec::with_capacity(expected);
        for _ in 0..count {
            let len = stream.read_u32_le().await?;
            if len as usize > MAX_VALUE {
                return Err(bad(format!("value of {len} bytes in answer")));
            }
            let mut v = vec![0u8; len as usize];
            stream.read_exact(&mut v).await?;
            body.extend_from_slice(&len.to_le_bytes());
            body.extend_from_slice(&v);
            values.push(Bytes::from(v));
        }
        read_answer_mac(&mut stream, &session, &body).await?;
        // What every rank builds its roster from must hold this rank as it registered: a
        // store (rank 0, or whoever hosts it) that swapped this rank's entry would otherwise
        // hand the others an impostor's key for it.
        if op == Op::Gather && values.get(self.rank).map(|v| &v[..]) != Some(value) {
            return Err(bad(format!(
                "its answer does not hold this rank's own value at position {}: the store \
                 replaced it",
                self.rank
            )));
        }
        Ok(values)
    }
}

async fn read_answer_mac(
    stream: &mut TcpStream,
    session: &Session,
    body: &[u8],
) -> Result<(), BootstrapError> {
    let mut mac = [0u8; 32];
    stream.read_exact(&mut mac).await?;
    if session.verify(ANSWER_LABEL, &[body], &mac) {
        Ok(())
    } else {
        Err(BootstrapError::Auth(
            "the store's answer does not carry its MAC".into(),
        ))
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
    use crate::bootstrap::JobSecret;

    fn secret() -> JobAuth {
        JobAuth::Secret(JobSecret::from_hex(&"ab".repeat(32)).unwrap())
    }

    fn client(addr: &str, rank: Rank, world: usize, auth: JobAuth) -> StoreClient {
        StoreClient::new(addr, rank, world, Duration::from_secs(10), auth)
    }

    #[tokio::test]
    async fn all_gather_returns_every_value_in_rank_order_and_rounds_repeat() {
        let server = StoreServer::bind("127.0.0.1:0", 5, secret()).await.unwrap();
        let addr = server.local_addr().to_string();
        let tasks: Vec<_> = (0..5)
            .map(|r| {
                let c = client(&addr, r, 5, secret());
                tokio::spawn(async move {
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

    /// A store that answers with another value in this rank's place (an insider hosting it,
    /// handing the others an impostor's key): the rank refuses the answer, naming it.
    #[tokio::test]
    async fn an_answer_without_this_ranks_own_value_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let liar = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let auth = secret();
            let me = Endpoint {
                auth: &auth,
                purpose: Purpose::Store,
                world: 2,
                rank: STORE,
                identity: None,
                frame_macs: false,
            };
            let session = auth::respond(&mut stream, me, |_| Ok(())).await.unwrap();
            let (_op, _key, value) = read_request(&mut stream, &session).await.unwrap();
            assert_eq!(&value[..], b"mine");
            let mut body = vec![0u8];
            body.extend_from_slice(&2u32.to_le_bytes());
            for v in [&b"rank 0"[..], b"an impostor"] {
                body.extend_from_slice(&(v.len() as u32).to_le_bytes());
                body.extend_from_slice(v);
            }
            body.extend_from_slice(&session.mac(ANSWER_LABEL, &[&body]));
            stream.write_all(&body).await.unwrap();
        });
        let err = client(&addr, 1, 2, secret())
            .all_gather("byzcoll/tcp", b"mine")
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("own value at position 1"), "{err}");
        liar.await.unwrap();
    }

    #[tokio::test]
    async fn strangers_other_worlds_and_garbage_are_refused() {
        let server = StoreServer::bind("127.0.0.1:0", 2, secret()).await.unwrap();
        let addr = server.local_addr().to_string();
        let wrong = JobAuth::Secret(JobSecret::from_hex(&"cd".repeat(32)).unwrap());
        let err = client(&addr, 1, 2, wrong.clone())
            .all_gather("x", b"b")
            .await
            .unwrap_err();
        assert!(err.to_string().contains("wrong job secret"), "{err}");
        // A stranger learns nothing of the job: not whether it is authenticated, not its
        // world size.
        for (auth, world) in [(JobAuth::Unauthenticated, 2), (wrong.clone(), 3)] {
            let err = client(&addr, 1, world, auth)
                .all_gather("x", b"b")
                .await
                .unwrap_err()
                .to_string();
            assert!(err.contains("not of this job"), "{err}");
            assert!(
                !err.contains("ranks") && !err.contains("runs unauthenticated"),
                "{err}"
            );
        }
        // A member (it proved the secret) with another world size is told what is wrong.
        let err = client(&addr, 1, 3, secret())
            .all_gather("x", b"b")
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("world of 3 ranks, this job has 2"),
            "{err}"
        );

        let mut raw = TcpStream::connect(&addr).await.unwrap();
        raw.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        assert_eq!(
            raw.read_u8().await.unwrap(),
            auth::Refusal::NotByzcoll as u8
        );
    }

    #[tokio::test]
    async fn old_protocol_requests_with_huge_worlds_are_refused_by_version() {
        let server = StoreServer::bind("127.0.0.1:0", 2, secret()).await.unwrap();
        let addr = server.local_addr().to_string();
        let mut req = b"BZS1".to_vec();
        req.extend_from_slice(&0u32.to_le_bytes());
        req.extend_from_slice(&(1u32 << 20).to_le_bytes());
        req.extend_from_slice(&1u16.to_le_bytes());
        req.push(b'k');
        req.extend_from_slice(&0u32.to_le_bytes());
        let mut raw = TcpStream::connect(&addr).await.unwrap();
        raw.write_all(&req).await.unwrap();
        assert_eq!(raw.read_u8().await.unwrap(), auth::Refusal::Version as u8);
        let len = raw.read_u16_le().await.unwrap();
        let mut msg = vec![0; len as usize];
        raw.read_exact(&mut msg).await.unwrap();
        let msg = String::from_utf8(msg).unwrap();
        assert!(msg.contains("protocol version 1, this side 2"), "{msg}");
    }

    #[tokio::test]
    async fn a_second_registration_for_a_rank_fails_the_round_for_everyone() {
        let server = StoreServer::bind("127.0.0.1:0", 3, secret()).await.unwrap();
        let addr = server.local_addr().to_string();
        let honest = client(&addr, 0, 3, secret());
        let real = client(&addr, 1, 3, secret());
        let impostor = client(&addr, 1, 3, secret());
        let waiting = [
            tokio::spawn(async move { honest.all_gather("k", b"0").await }),
            tokio::spawn(async move { real.all_gather("k", b"1").await }),
        ];
        tokio::time::sleep(Duration::from_millis(100)).await;
        let err = impostor
            .all_gather("k", b"evil")
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 1 registered twice"), "{err}");
        for w in waiting {
            let err = w.await.unwrap().unwrap_err().to_string();
            assert!(err.contains("rank 1 registered twice"), "{err}");
        }
    }

    /// Bytes of values the store holds.
    fn held(rounds: &Mutex<Rounds>) -> usize {
        let rounds = rounds.lock().unwrap();
        rounds
            .open
            .values()
            .flat_map(|r| r.values.iter().flatten())
            .map(Bytes::len)
            .sum()
    }

    #[test]
    fn rounds_whose_ranks_left_are_dropped_and_open_rounds_are_capped_per_rank() {
        let rounds = Mutex::new(Rounds::new(4));
        let _rx = join_round(&rounds, 2, "k", Bytes::from_static(b"x"));
        assert_eq!(rounds.lock().unwrap().open.len(), 1);
        leave_round(&rounds, 2, "k");
        assert!(rounds.lock().unwrap().open.is_empty());
        let mut keep = Vec::new();
        for i in 0..MAX_OPEN_ROUNDS {
            keep.push(join_round(&rounds, 0, &format!("k{i}"), Bytes::new()));
        }
        let mut rx = join_round(&rounds, 0, "one too many", Bytes::new());
        let err = rx.try_recv().unwrap().unwrap_err();
        assert!(err.contains("rank 0 has joined 8 rounds"), "{err}");
        // Another rank is not held back by rank 0's rounds.
        let mut other = join_round(&rounds, 1, "one too many", Bytes::new());
        assert!(other.try_recv().is_err(), "rank 1 was refused");
        // A round that completes frees its ranks' budget.
        for r in 1..4 {
            keep.push(join_round(&rounds, r, "k0", Bytes::new()));
        }
        let mut again = join_round(&rounds, 0, "now room", Bytes::new());
        assert!(again.try_recv().is_err(), "rank 0 still refused");
    }

    /// Issue #37: an insider that fills rounds and then fails them (by registering a rank
    /// twice) pinned every value for the rest of the job (1.06 GB in the launcher at -n 256)
    /// and, once 64 rounds were failed, made the store refuse every new key.
    #[test]
    fn failed_rounds_are_freed_and_the_store_stays_usable() {
        let world = 256;
        let rounds = Mutex::new(Rounds::new(world));
        let value = Bytes::from(vec![7u8; MAX_VALUE]);
        for k in 0..64 {
            let key = format!("fill#{k}");
            let mut waiting = Vec::new();
            for r in 1..world {
                waiting.push(join_round(&rounds, r, &key, value.clone()));
            }
            assert_eq!(held(&rounds), (world - 1) * MAX_VALUE);
            let mut twice = join_round(&rounds, 1, &key, value.clone());
            assert!(twice.try_recv().unwrap().is_err());
            for mut w in waiting {
                assert!(w
                    .try_recv()
                    .unwrap()
                    .unwrap_err()
                    .contains("registered twice"));
            }
            // Freed at once; a late registration still gets the error.
            assert_eq!(held(&rounds), 0);
            let mut late = join_round(&rounds, 0, &key, Bytes::new());
            assert!(late
                .try_recv()
                .unwrap()
                .unwrap_err()
                .contains("registered twice"));
        }
        assert!(rounds.lock().unwrap().open.is_empty());
        assert!(rounds.lock().unwrap().joined.iter().all(|&j| j == 0));
        // The job's next round runs.
        let mut all: Vec<_> = (0..world)
            .map(|r| join_round(&rounds, r, "next", Bytes::from_static(b"v")))
            .collect();
        assert_eq!(all.pop().unwrap().try_recv().unwrap().unwrap().len(), world);
    }

    #[test]
    fn a_registration_after_its_round_completed_is_refused_at_once() {
        let rounds = Mutex::new(Rounds::new(2));
        let _a = join_round(&rounds, 0, "k#1", Bytes::new());
        let _b = join_round(&rounds, 1, "k#1", Bytes::new());
        let mut late = join_round(&rounds, 1, "k#1", Bytes::new());
        let err = late.try_recv().unwrap().unwrap_err();
        assert!(
            err.contains("another process registered as rank 1"),
            "{err}"
        );
        assert!(rounds.lock().unwrap().open.is_empty());
    }

    #[tokio::test]
    async fn a_missing_store_is_a_timeout_error() {
        let c = StoreClient::new("127.0.0.1:9", 1, 2, Duration::from_millis(200), secret());
        let err = c.all_gather("k", b"").await.unwrap_err().to_string();
        assert!(err.contains("127.0.0.1:9"), "{err}");
    }

    #[tokio::test]
    async fn posts_are_read_without_waiting_and_bounded_per_rank() {
        let server = StoreServer::bind("127.0.0.1:0", 3, secret()).await.unwrap();
        let addr = server.local_addr().to_string();
        let (zero, two) = (client(&addr, 0, 3, secret()), client(&addr, 2, 3, secret()));
        assert_eq!(two.read(0, "knock").await.unwrap(), None);
        zero.post("knock", b"first").await.unwrap();
        zero.post("knock", b"again").await.unwrap();
        assert_eq!(&two.read(0, "knock").await.unwrap().unwrap()[..], b"again");
        // Posts are in the poster's name: rank 2 reads nothing of its own there.
        assert_eq!(two.read(2, "knock").await.unwrap(), None);
        // A rank keeps MAX_POSTS: one more key pushes its oldest out.
        for k in 0..MAX_POSTS {
            zero.post(&format!("k{k}"), b"v").await.unwrap();
        }
        assert_eq!(two.read(0, "knock").await.unwrap(), None);
        assert!(two.read(0, "k0").await.unwrap().is_some());
        let err = two.read(3, "knock").await.unwrap_err().to_string();
        assert!(err.contains("rank 3 is not in a job of 3"), "{err}");
    }

    /// Ranks 0, 2 and 3 of a job of four all-gather among themselves through posts, under
    /// per-rank keys renumbered for their world; rank 1 (gone) is never waited for.
    #[tokio::test]
    async fn a_world_of_some_ranks_gathers_through_posts() {
        let (ids, roster) = crate::bootstrap::keys::keygen(4).unwrap();
        let roster = Arc::new(roster);
        let job_secret = JobSecret::from_hex(&"ab".repeat(32)).unwrap();
        let host = JobAuth::PerRank(crate::bootstrap::Credentials::host(
            job_secret.clone(),
            roster.clone(),
        ));
        let rank_auth = |r: Rank| {
            JobAuth::PerRank(
                crate::bootstrap::Credentials::rank(
                    job_secret.clone(),
                    roster.clone(),
                    r,
                    ids[r].clone(),
                )
                .unwrap(),
            )
        };
        let server = StoreServer::bind("127.0.0.1:0", 4, host).await.unwrap();
        let addr = server.local_addr().to_string();
        let members = [0, 2, 3];
        let tasks: Vec<_> = members
            .iter()
            .map(|&r| {
                let c = client(&addr, r, 4, rank_auth(r))
                    .among(&members, "epoch1")
                    .unwrap();
                let public = ids[r].public();
                tokio::spawn(async move {
                    let renumbered = c.auth().credentials().unwrap().own().unwrap().public();
                    assert_eq!(renumbered, public);
                    let got = c.all_gather("k", format!("v{r}").as_bytes()).await.unwrap();
                    let again = c.all_gather("k", &[r as u8]).await.unwrap();
                    (got, again)
                })
            })
            .collect();
        for t in tasks {
            let (got, again) = t.await.unwrap();
            let got: Vec<&[u8]> = got.iter().map(|v| &v[..]).collect();
            assert_eq!(got, [&b"v0"[..], b"v2", b"v3"]);
            assert_eq!(again, [&[0u8][..], &[2], &[3]]);
        }
        // A member that never posts is named at the timeout.
        let lone = client(&addr, 0, 4, rank_auth(0))
            .with_timeout(Duration::from_millis(300))
            .among(&[0, 1], "epoch2")
            .unwrap();
        let err = lone.all_gather("k", b"x").await.unwrap_err().to_string();
        assert!(err.contains("ranks [1] posted nothing"), "{err}");
        // Not a member, or members out of order: refused.
        assert!(client(&addr, 1, 4, rank_auth(1))
            .among(&[0, 2], "e")
            .is_err());
        assert!(client(&addr, 2, 4, rank_auth(2))
            .among(&[2, 0], "e")
            .is_err());
    }
}
