//! The fingerprint of each collective call: a digest of what the caller asked for and of its
//! step id (`Communicator::set_step`), carried by every message of the call ([`Step::call`]).
//! A message whose fingerprint is not the receive's is [`RecvOutcome::OutOfStep`]: a rank that
//! skipped a call, made an extra one, or passed other arguments is named, never mixed into
//! another call. One function per collective, used by the communicator and by whatever else
//! speaks the protocol (a test's Byzantine rank sending raw steps).
//!
//! [`Step::call`]: crate::Step::call
//! [`RecvOutcome::OutOfStep`]: crate::RecvOutcome::OutOfStep

use byzcoll_aggregators::{Aggregator, Element};

use crate::round::Shape;

fn len(bytes: usize) -> [u8; 8] {
    (bytes as u64).to_le_bytes()
}

/// `Communicator::barrier`.
pub fn barrier(step: Option<u64>) -> u64 {
    call_fingerprint("barrier", &[], step)
}

/// `Communicator::broadcast_into` from `root` of `bytes`.
pub fn broadcast(root: usize, bytes: usize, step: Option<u64>) -> u64 {
    call_fingerprint("broadcast", &[&len(root), &len(bytes)], step)
}

/// `Communicator::close`'s farewell.
pub fn farewell() -> u64 {
    call_fingerprint("farewell", &[], None)
}

/// `Communicator::shrink`'s liveness exchange.
pub fn shrink(step: Option<u64>) -> u64 {
    call_fingerprint("shrink", &[], step)
}

/// `Communicator::all_gather_into` of `send` bytes per rank into `recv` bytes.
pub fn all_gather(send: usize, recv: usize, step: Option<u64>) -> u64 {
    call_fingerprint("all_gather", &[&len(send), &len(recv)], step)
}

/// `Communicator::all_to_all_into` of `send` bytes into `recv` bytes.
pub fn all_to_all(send: usize, recv: usize, step: Option<u64>) -> u64 {
    call_fingerprint("all_to_all", &[&len(send), &len(recv)], step)
}

/// `Communicator::all_reduce` of `elements` of `T` with `op` (its `Debug` name and the
/// schedule chosen, `"Sum ring"`, say). The element type is named by its [`DType`] name
/// (`"float"`, `"bfloat16"`, ...): the same whatever compiler built the rank, where
/// `std::any::type_name` may differ.
///
/// [`DType`]: byzcoll_aggregators::DType
pub fn all_reduce<T: Element>(op: &str, elements: usize, step: Option<u64>) -> u64 {
    call_fingerprint(
        "all_reduce",
        &[T::DTYPE.name().as_bytes(), op.as_bytes(), &len(elements)],
        step,
    )
}

/// One robust round (a whole robust all-reduce or reduce-scatter, or one sub-round of a
/// longer one) of `d` elements of `T` under `rule`, moved as `shape` says (the element
/// type by its `DType` name, as in [`all_reduce`]); `synced`: a sharded round with
/// stragglers allowed, which takes the owners' sync step.
pub fn robust<T: Element>(
    rule: &dyn Aggregator,
    shape: Shape,
    audit: Option<&crate::audit::Audit>,
    synced: bool,
    d: usize,
    step: Option<u64>,
) -> u64 {
    let (shape, d, parameters) = (format!("{shape:?}"), len(d), rule.parameters());
    let mut parts: Vec<&[u8]> = vec![
        T::DTYPE.name().as_bytes(),
        rule.name().as_bytes(),
        parameters.as_bytes(),
        shape.as_bytes(),
        &d,
    ];
    // An audited round takes other steps than the sharded round of its shape.
    let audit = audit.map(|a| format!("{a:?}"));
    if let Some(a) = &audit {
        parts.push(a.as_bytes());
    }
    // So does a sharded round with stragglers allowed (the owners' sync): ranks configured
    // apart are told, not left out of step.
    if synced {
        parts.push(b"owners' sync");
    }
    call_fingerprint("robust", &parts, step)
}

/// The fingerprint of a collective call: a digest of what the caller asked for (the
/// operation and its arguments, in `parts`) and of the caller's step id
/// (`Communicator::set_step`). Every rank computes it for the same call alike.
pub fn call_fingerprint(op: &str, parts: &[&[u8]], step_id: Option<u64>) -> u64 {
    let mut h = blake3::Hasher::new();
    let mut part = |b: &[u8]| {
        h.update(&(b.len() as u64).to_le_bytes());
        h.update(b);
    };
    part(b"byzcoll call");
    part(op.as_bytes());
    for p in parts {
        part(p);
    }
    match step_id {
        Some(id) => part(&id.to_le_bytes()),
        None => part(&[]),
    }
    let mut first = [0u8; 8];
    first.copy_from_slice(&h.finalize().as_bytes()[..8]);
    // 0 is the point-to-point value; a call never has it.
    u64::from_le_bytes(first).max(1)
}

#[cfg(test)]
mod tests {
    use byzcoll_aggregators::Median;

    use super::*;

    /// The element type is part of every fingerprint that moves elements: bf16 and f16, both
    /// two bytes, are never taken for each other.
    #[test]
    fn element_types_have_their_own_fingerprints() {
        let robust = [
            robust::<f32>(&Median::new(1), Shape::Gather, None, false, 8, None),
            robust::<f64>(&Median::new(1), Shape::Gather, None, false, 8, None),
            robust::<half::bf16>(&Median::new(1), Shape::Gather, None, false, 8, None),
            robust::<half::f16>(&Median::new(1), Shape::Gather, None, false, 8, None),
        ];
        let plain = [
            all_reduce::<f32>("Sum ring", 8, None),
            all_reduce::<f64>("Sum ring", 8, None),
            all_reduce::<half::bf16>("Sum ring", 8, None),
            all_reduce::<half::f16>("Sum ring", 8, None),
        ];
        // And a sharded round that takes the owners' sync is told from one that does not.
        let sharded = Shape::Sharded(crate::Replicas::Tolerant);
        assert_ne!(
            super::robust::<f32>(&Median::new(1), sharded, None, false, 8, None),
            super::robust::<f32>(&Median::new(1), sharded, None, true, 8, None)
        );
        for set in [robust, plain] {
            for (i, a) in set.iter().enumerate() {
                assert!(set[i + 1..].iter().all(|b| a != b), "{set:?}");
            }
        }
    }
}
