//! The audit's signatures ([`byzcoll_proto::audit`]) with the ranks' Ed25519 identity keys:
//! a rank signs its statements with the key it proved in the handshake, and any rank checks
//! them against the roster every pair of ranks compared. The statements carry their own
//! domain (`byzcoll-audit-v1 ...`), which no handshake transcript (`byzcoll-v2 ...`) begins
//! with, so a signature made for one is never valid for the other.

use byzcoll_proto::audit::{CallId, Signature, Signer, Verifier};
use ed25519_dalek::Signer as _;

use super::auth::{Identity, Membership, Roster};
use crate::Rank;

impl Signer for Identity {
    fn sign(&self, message: &[u8]) -> Signature {
        self.0.sign(message).to_bytes()
    }
}

impl Verifier for Roster {
    /// Strict Ed25519 verification (no small-order keys or non-canonical signatures), so
    /// that one statement has one valid signature per key.
    fn verify(&self, rank: Rank, message: &[u8], signature: &Signature) -> bool {
        self.key(rank).is_some_and(|k| {
            k.verify_strict(message, &ed25519_dalek::Signature::from_bytes(signature))
                .is_ok()
        })
    }
}

impl Membership {
    /// The audit's name for collective `collective` of this job: the roster's digest (keys
    /// and addresses of every rank) and the number.
    pub fn audit_call(&self, collective: u64) -> CallId {
        CallId {
            job: self.roster.digest(),
            collective,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_verify_with_the_signers_key_only() {
        let ids: Vec<Identity> = (0..3u8).map(|r| Identity::from_seed([r + 9; 32])).collect();
        let entries: Vec<([u8; 32], &[u8])> =
            ids.iter().map(|i| (i.public(), &b"addr"[..])).collect();
        let roster = Roster::new(&entries).expect("valid keys");
        let message = b"byzcoll-audit-v1 piece\0...";
        let sig = ids[1].sign(message);
        assert!(roster.verify(1, message, &sig));
        assert!(!roster.verify(0, message, &sig), "another rank's key");
        assert!(!roster.verify(3, message, &sig), "a rank the job lacks");
        assert!(!roster.verify(1, b"byzcoll-audit-v1 result\0", &sig));
        let mut bad = sig;
        bad[10] ^= 1;
        assert!(!roster.verify(1, message, &bad));
    }

    /// A communicator made of some ranks checks each member's statements with its key under
    /// its new number, and names its calls apart from the parent's and from any other
    /// communicator's (another stream, other members or another order).
    #[test]
    fn a_sub_roster_renumbers_the_keys_and_names_its_calls_apart() {
        let ids: Vec<Identity> = (0..4u8).map(|r| Identity::from_seed([r + 3; 32])).collect();
        let entries: Vec<([u8; 32], &[u8])> =
            ids.iter().map(|i| (i.public(), &b"addr"[..])).collect();
        let roster = Roster::new(&entries).expect("valid keys");
        let sub = roster.subset(&[3, 1], 7);
        let message = b"statement";
        assert!(sub.verify(0, message, &ids[3].sign(message)));
        assert!(sub.verify(1, message, &ids[1].sign(message)));
        assert!(!sub.verify(1, message, &ids[3].sign(message)));
        assert!(
            !sub.verify(2, message, &ids[0].sign(message)),
            "not a member"
        );
        let digests = [
            roster.digest(),
            sub.digest(),
            roster.subset(&[3, 1], 8).digest(),
            roster.subset(&[1, 3], 7).digest(),
            roster.subset(&[3, 1, 0], 7).digest(),
        ];
        for (i, a) in digests.iter().enumerate() {
            assert!(
                digests[i + 1..].iter().all(|b| a != b),
                "digest {i} repeats"
            );
        }
        assert_eq!(roster.subset(&[3, 1], 7).digest(), sub.digest());
    }
}
