//! What a rank has seen of its peers (`byzcoll_comm_health`).

use byzcoll_rs::{PeerHealth, Symptom};

use crate::buffers::check_aligned;
use crate::status::Failure;
use crate::{byzcoll_comm_t, byzcoll_status_t, guard_comm};

/// `streak_symptom`: the peer was fine in its last robust round.
pub const BYZCOLL_SYMPTOM_NONE: i32 = 0;
/// `streak_symptom`: its input came after the quorum's grace.
pub const BYZCOLL_SYMPTOM_LATE: i32 = 1;
/// `streak_symptom`: nothing came by the deadline, or its connection is gone.
pub const BYZCOLL_SYMPTOM_MISSING: i32 = 2;
/// `streak_symptom`: it sent something unacceptable, or a message of another call.
pub const BYZCOLL_SYMPTOM_MALFORMED: i32 = 3;
/// `streak_symptom`: the cross-check found its result differing from the job's.
pub const BYZCOLL_SYMPTOM_DISAGREEING: i32 = 4;

/// What this rank has seen of one peer in its robust rounds: its own observations only,
/// evidence for the application, never an accusation the library acts on.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct byzcoll_peer_health_t {
    /// The peer.
    pub rank: u32,
    /// What it did in the last robust round in which it was at fault
    /// (`BYZCOLL_SYMPTOM_*`; `BYZCOLL_SYMPTOM_NONE`: fine in the last round).
    pub streak_symptom: i32,
    /// How many rounds in a row it has done so, up to the last one (0 with
    /// `BYZCOLL_SYMPTOM_NONE`).
    pub streak_rounds: u32,
    /// 1 when `score` holds a measured value (0: no round has measured its input yet).
    pub has_score: i32,
    /// Rounds in which it was late.
    pub late: u64,
    /// Rounds in which it was missing at a deadline or its connection was gone.
    pub missing: u64,
    /// Rounds in which it sent something unacceptable.
    pub malformed: u64,
    /// Rounds in which the cross-check found its result differing from the job's.
    pub disagreeing: u64,
    /// Rounds in which its input's attribution score exceeded `BYZCOLL_OUTLYING_SCORE`.
    pub outlying: u64,
    /// Selection rules (Krum family): rounds in which its input was not selected.
    pub not_selected: u64,
    /// A running attribution score of its input (each measured round moves it a quarter of
    /// the way to that round's score; about 1 typical). Never NaN.
    pub score: f64,
}

impl From<&PeerHealth> for byzcoll_peer_health_t {
    fn from(p: &PeerHealth) -> Self {
        let (streak_symptom, streak_rounds) = match p.streak {
            None => (BYZCOLL_SYMPTOM_NONE, 0),
            Some((symptom, rounds)) => (
                match symptom {
                    Symptom::Late => BYZCOLL_SYMPTOM_LATE,
                    Symptom::Missing => BYZCOLL_SYMPTOM_MISSING,
                    Symptom::Disagreeing => BYZCOLL_SYMPTOM_DISAGREEING,
                    _ => BYZCOLL_SYMPTOM_MALFORMED,
                },
                rounds,
            ),
        };
        byzcoll_peer_health_t {
            rank: p.rank as u32,
            streak_symptom,
            streak_rounds,
            has_score: i32::from(p.score.is_some()),
            late: p.late,
            missing: p.missing,
            malformed: p.malformed,
            disagreeing: p.disagreeing,
            outlying: p.outlying,
            not_selected: p.not_selected,
            score: p.score.unwrap_or(0.0),
        }
    }
}

/// Writes what this rank has seen of each other rank, in rank order, into `peers` (at most
/// `capacity` entries; NULL with `capacity` 0 to ask only for the count), and the number of
/// peers (the world size less one) into `*count`: `*count > capacity` means truncated.
/// `elem_size` is `sizeof(byzcoll_peer_health_t)` as the caller compiled it.
///
/// Thread safety: as `byzcoll_robust_allreduce`.
///
/// # Safety
/// `comm` is NULL or a live communicator; `peers` is NULL or holds `capacity` entries; `count`
/// is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn byzcoll_comm_health(
    comm: *mut byzcoll_comm_t,
    peers: *mut byzcoll_peer_health_t,
    capacity: usize,
    elem_size: usize,
    count: *mut usize,
) -> byzcoll_status_t {
    // SAFETY: forwarded.
    unsafe {
        guard_comm(comm, |comm| {
            if elem_size != size_of::<byzcoll_peer_health_t>() {
                return Err(Failure::invalid(format!(
                    "elem_size is {elem_size}, this library's byzcoll_peer_health_t has {} bytes: \
                     pass sizeof(byzcoll_peer_health_t) from this library's byzcoll.h",
                    size_of::<byzcoll_peer_health_t>()
                )));
            }
            if count.is_null() {
                return Err(Failure::invalid("count is NULL"));
            }
            if peers.is_null() && capacity > 0 {
                return Err(Failure::invalid("peers is NULL with a capacity above 0"));
            }
            if !peers.is_null() {
                check_aligned(peers.cast_const(), "peers")?;
            }
            let health = comm.run(async |c| Ok(c.health()))?;
            for (i, p) in health.iter().take(capacity).enumerate() {
                // SAFETY: `peers` holds `capacity > i` entries.
                peers.add(i).write(p.into());
            }
            // SAFETY: non-null and writable (the caller's promise).
            count.write(health.len());
            Ok(())
        })
    }
}
