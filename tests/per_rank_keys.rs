//! Per-rank keys through the out-of-band join (`init_with_allgather`, what MPI programs and
//! `byzcoll.init_mpi4py` use): each rank proves the key the roster binds to it, and a rank
//! holding another rank's key does not join.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use byzcoll::bootstrap::keygen;
use byzcoll::{init_with_allgather, IdentityMode, JobConfig};

/// An in-memory all-gather among `n` threads: each call returns every rank's record of that
/// call in rank order, or an error once `limit` passes (a rank that gave up).
struct Hub {
    n: usize,
    state: Mutex<Calls>,
    changed: Condvar,
}

/// Calls completed, the records of the call under way, and the last call's answer.
type Calls = (u64, Vec<Option<Vec<u8>>>, Vec<u8>);

impl Hub {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Hub {
            n,
            state: Mutex::new((0, vec![None; n], Vec::new())),
            changed: Condvar::new(),
        })
    }

    fn gather(&self, rank: usize, call: u64, record: &[u8]) -> Result<Vec<u8>, String> {
        let limit = Duration::from_secs(10);
        let mut s = self.state.lock().unwrap();
        // Wait until the previous call's records are handed out.
        while s.0 < call {
            let (g, t) = self.changed.wait_timeout(s, limit).unwrap();
            s = g;
            if t.timed_out() {
                return Err("a rank gave up".into());
            }
        }
        s.1[rank] = Some(record.to_vec());
        if s.1.iter().all(Option::is_some) {
            s.2 = s.1.iter_mut().flat_map(|r| r.take().unwrap()).collect();
            s.0 += 1;
            self.changed.notify_all();
        }
        while s.0 == call {
            let (g, t) = self.changed.wait_timeout(s, limit).unwrap();
            s = g;
            if t.timed_out() {
                return Err("a rank gave up".into());
            }
        }
        Ok(s.2.clone())
    }
}

/// Joins `n` ranks through the hub; rank `r` holds the key of rank `key_of(r)`.
fn join(n: usize, key_of: impl Fn(usize) -> usize) -> Vec<byzcoll::Result<IdentityMode>> {
    let (ids, roster) = keygen(n).unwrap();
    let dir = std::env::temp_dir().join(format!("byzcoll-oob-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let roster_path = dir.join(format!("roster-{n}"));
    std::fs::write(&roster_path, roster.to_text()).unwrap();
    let hub = Hub::new(n);
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let hub = hub.clone();
            let key = ids[key_of(rank)].to_hex();
            let roster = roster_path.to_string_lossy().into_owned();
            std::thread::spawn(move || {
                let get = |k: &str| match k {
                    "BYZCOLL_ROSTER_FILE" => Some(roster.clone()),
                    "BYZCOLL_KEY" => Some(key.clone()),
                    _ => None,
                };
                let config = JobConfig::for_allgather_from_lookup(rank, hub.n, get)?
                    .with_tcp_listen([127, 0, 0, 1].into())?
                    .with_step_timeout(Duration::from_secs(10))?;
                let rt = tokio::runtime::Runtime::new().unwrap();
                let mut call = 0;
                let mut gather = |record: &[u8]| {
                    call += 1;
                    hub.gather(rank, call - 1, record)
                };
                let mut comm = init_with_allgather(&config, &mut gather, rt.handle())?;
                rt.block_on(comm.barrier())?;
                let mode = comm.identity();
                let _entered = rt.enter();
                drop(comm);
                Ok(mode)
            })
        })
        .collect();
    let out = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let _ = std::fs::remove_file(&roster_path);
    out
}

#[test]
fn ranks_with_their_own_keys_join_per_rank() {
    for r in join(3, |r| r) {
        assert_eq!(r.unwrap(), IdentityMode::PerRank);
    }
}

#[test]
fn a_rank_holding_another_ranks_key_does_not_join() {
    let results = join(2, |_| 0);
    let err = results[1].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("not the one the roster binds to rank 1"),
        "{err}"
    );
    assert!(results[0].is_err(), "rank 0 joined a job without rank 1");
}
