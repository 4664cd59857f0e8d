//! Setup logic without NCCL calls: what each rank publishes through the bootstrap store, which
//! device a rank uses, and which NCCL versions are accepted.
//!
//! Every rank contributes to one all-gather under [`STORE_KEY`], even a rank that cannot run
//! NCCL, so that no rank waits for a peer that has already given up: rank 0 publishes
//! `0x00 ++ id` (the 128-byte `ncclUniqueId`), other ready ranks `0x00`, and a rank that
//! cannot take part `0x01 ++ reason`. Every rank then fails with the same message naming the
//! ranks that cannot, or takes rank 0's id.

use bytes::Bytes;
use byzcoll_runtime::Rank;

/// Key of the all-gather that shares the NCCL unique id.
pub(crate) const STORE_KEY: &str = "byzcoll/nccl";
/// Size of an `ncclUniqueId`.
pub(crate) const ID_BYTES: usize = 128;
/// Longest reason a rank publishes (the store caps values at 64 KiB).
const MAX_REASON: usize = 1024;
/// Oldest NCCL accepted: non-blocking communicators (`ncclCommInitRankConfig`) came in 2.14.
pub(crate) const MIN_VERSION: (u32, u32, u32) = (2, 14, 0);

/// What one rank publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Contribution {
    /// Ready; rank 0 carries the id.
    Ready(Option<[u8; ID_BYTES]>),
    /// This rank cannot take part, and why.
    Unable(String),
}

impl Contribution {
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Contribution::Ready(id) => {
                let mut v = vec![0u8];
                if let Some(id) = id {
                    v.extend_from_slice(id);
                }
                v
            }
            Contribution::Unable(why) => {
                let mut end = why.len().min(MAX_REASON);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                let mut v = vec![1u8];
                v.extend_from_slice(&why.as_bytes()[..end]);
                v
            }
        }
    }
}

/// Rank 0's id from the gathered contributions, or a message naming every rank that cannot
/// take part (or sent something unreadable).
pub(crate) fn root_id(values: &[Bytes]) -> Result<[u8; ID_BYTES], String> {
    let mut problems = Vec::new();
    for (rank, v) in values.iter().enumerate() {
        match v.first() {
            Some(0) => {}
            Some(1) => problems.push(format!("rank {rank}: {}", String::from_utf8_lossy(&v[1..]))),
            _ => problems.push(format!("rank {rank}: unreadable setup message")),
        }
    }
    if !problems.is_empty() {
        return Err(format!(
            "NCCL cannot start on every rank ({})",
            problems.join("; ")
        ));
    }
    let root = values
        .first()
        .ok_or_else(|| "the bootstrap returned no values".to_string())?;
    <[u8; ID_BYTES]>::try_from(&root[1..]).map_err(|_| {
        format!(
            "rank 0 published an NCCL id of {} bytes, not {ID_BYTES}",
            root.len() - 1
        )
    })
}

/// The device a rank uses: `explicit` if given, else its local rank (or its rank, when the
/// launcher gave no local rank) modulo the number of visible devices.
pub(crate) fn pick_device(
    explicit: Option<usize>,
    local_rank: Option<usize>,
    rank: Rank,
    count: usize,
) -> Result<usize, String> {
    if count == 0 {
        return Err("no CUDA device is visible (check CUDA_VISIBLE_DEVICES)".into());
    }
    match explicit {
        Some(d) if d >= count => Err(format!(
            "device {d} requested but only {count} CUDA device(s) are visible"
        )),
        Some(d) => Ok(d),
        None => Ok(byzcoll_runtime::bootstrap::local_device(
            local_rank, rank, count,
        )),
    }
}

/// Decodes `ncclGetVersion`'s code (`major*10000 + minor*100 + patch` since 2.9, `major*1000 +
/// minor*100 + patch` before).
pub(crate) fn decode_version(code: i32) -> (u32, u32, u32) {
    let code = code.max(0) as u32;
    if code >= 10_000 {
        (code / 10_000, (code % 10_000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> [u8; ID_BYTES] {
        std::array::from_fn(|i| i as u8 ^ 0x5a)
    }

    fn gathered(cs: &[Contribution]) -> Vec<Bytes> {
        cs.iter().map(|c| Bytes::from(c.encode())).collect()
    }

    #[test]
    fn every_rank_takes_rank_zeros_id() {
        let values = gathered(&[
            Contribution::Ready(Some(id())),
            Contribution::Ready(None),
            Contribution::Ready(None),
        ]);
        assert_eq!(values[0].len(), 1 + ID_BYTES);
        assert_eq!(root_id(&values), Ok(id()));
    }

    #[test]
    fn ranks_that_cannot_start_are_named() {
        let values = gathered(&[
            Contribution::Unable("libnccl not found".into()),
            Contribution::Ready(None),
            Contribution::Unable("no CUDA device".into()),
        ]);
        let err = root_id(&values).unwrap_err();
        assert!(err.contains("rank 0: libnccl not found"), "{err}");
        assert!(err.contains("rank 2: no CUDA device"), "{err}");
        assert!(!err.contains("rank 1"), "{err}");
    }

    #[test]
    fn malformed_contributions_are_errors_not_panics() {
        let short = vec![Bytes::from_static(&[0, 1, 2])];
        assert!(root_id(&short).unwrap_err().contains("2 bytes"));
        let garbage = vec![Bytes::from_static(&[0]), Bytes::from_static(&[9])];
        assert!(root_id(&garbage)
            .unwrap_err()
            .contains("rank 1: unreadable"));
        let empty = vec![Bytes::new()];
        assert!(root_id(&empty).unwrap_err().contains("rank 0"));
        assert!(root_id(&[]).is_err());
    }

    #[test]
    fn long_reasons_are_cut_at_a_character_boundary() {
        let c = Contribution::Unable("é".repeat(2000));
        let v = c.encode();
        assert!(v.len() <= 1 + MAX_REASON);
        assert!(std::str::from_utf8(&v[1..]).is_ok());
    }

    #[test]
    fn devices() {
        assert_eq!(pick_device(None, Some(5), 13, 4), Ok(1));
        assert_eq!(pick_device(None, None, 13, 4), Ok(1));
        assert_eq!(pick_device(Some(2), Some(0), 0, 4), Ok(2));
        assert!(pick_device(Some(4), None, 0, 4)
            .unwrap_err()
            .contains("only 4"));
        assert!(pick_device(None, None, 0, 0).is_err());
    }

    #[test]
    fn versions() {
        assert_eq!(decode_version(22803), (2, 28, 3));
        assert_eq!(decode_version(21400), (2, 14, 0));
        assert_eq!(decode_version(2804), (2, 8, 4));
        assert!(decode_version(2804) < MIN_VERSION);
        assert!(decode_version(22803) >= MIN_VERSION);
    }
}
