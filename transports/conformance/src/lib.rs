//! The transport conformance suite: one set of test bodies that every transport runs, with
//! the real transport underneath, and the protocol bodies that run once through the host
//! driver.
//!
//! A transport crate instantiates it with a factory that builds all ranks of a world in one
//! process:
//!
//! ```ignore
//! async fn world(n: usize) -> Vec<Box<dyn Transport>> { ... }
//! byzcoll_conformance::conformance_suite!(world);
//! ```
//!
//! [`conformance_suite!`] holds what a transport must get right: exact collectives of every
//! size, dead, stalled, late and out-of-step peers, malformed frames, matching by key, sends
//! that outlive their sender, splits and shrinks, and one robust round of each shape. The
//! protocol's own matrix (rules, shapes, Byzantine senders and owners, agreement, audits) is
//! the protocol core's, tested in `byzcoll-proto`'s deterministic harness; what of it needs
//! the host driver's plane (the statistic rounds of global rules, the evidence, the audits'
//! signatures) is [`protocol_suite!`], which the in-process transport runs, so each runs once
//! rather than once per transport.
//!
//! Every body runs at the world sizes in [`WORLD_SIZES`] unless it needs a particular one.

#![allow(clippy::unwrap_used)]

/// World sizes that break naive schedules.
pub const WORLD_SIZES: [usize; 5] = [1, 2, 3, 7, 8];

/// Instantiates every transport conformance test for a transport factory
/// `async fn(usize) -> Vec<Box<dyn Transport>>`.
#[macro_export]
macro_rules! conformance_suite {
    ($factory:expr) => {
        $crate::conformance_suite!(@tests $factory;
            collectives_match_reference,
            all_reduce_of_megabyte_chunks_is_exact,
            all_reduce_is_exact_across_the_doubling_crossover,
            pipelined_ring_all_reduce_is_exact,
            robust_all_reduce_survives_byzantine_and_crashed_ranks,
            wrong_length_is_malformed_and_named,
            missing_peer_is_reported_within_the_deadline,
            a_world_of_one_returns_its_own_vector,
            a_rank_out_of_step_is_named_never_mixed_in,
            a_shrink_drops_the_dead_and_renumbers,
            steps_are_matched_by_key_not_arrival_order,
            messages_outlive_their_sender,
            sent_messages_move_while_the_sender_is_away,
            early_messages_are_checked_like_any_other,
            invalid_steps_are_rejected,
            sharded_matches_gather_bitwise,
            sharded_sub_rounds_match_one_round_and_erase_a_dead_peer_once,
            a_peer_one_rank_sees_dead_at_once_costs_no_honest_rank,
            a_stalled_rank_that_resumes_never_returns_another_result_as_success,
            a_stalled_rank_that_resumes_under_enforce_is_never_split,
            a_stalled_rank_that_resumes_is_told_in_a_reduce_scatter,
            split_communicators_interleave_with_their_parent,
            nonblocking_collectives_run_in_start_order,
            a_straggler_does_not_set_the_pace,
            a_rank_silent_after_its_input_sets_no_pace,
            closing_waits_for_a_rank_left_behind,
            a_rank_far_behind_comes_back_in_step,
            narrow_types_reduce_bitwise_as_the_local_rule,
        );
    };
    (@tests $factory:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::$name($factory).await;
            }
        )*
    };
}

/// Instantiates the protocol bodies that need the host driver (run by the in-process
/// transport; see the crate's docs).
#[macro_export]
macro_rules! protocol_suite {
    ($factory:expr) => {
        $crate::conformance_suite!(@tests $factory;
            auto_runs_what_it_resolves_to_and_says_so,
            sharded_survives_byzantine_owners_only_with_replication,
            replicated_owners_send_one_version_and_digests,
            a_lone_owner_that_equivocates_never_splits_honest_ranks_silently,
            sharded_krum_family_matches_gather,
            sharded_iterative_rules_match_gather,
            an_equivocating_sender_never_splits_honest_ranks_silently,
            an_equivocating_sender_is_agreed_on_under_enforce,
            byzantine_owners_and_senders_are_agreed_on_under_enforce_in_sharded_mode,
            robust_reduce_scatter_gives_each_rank_its_shard_of_the_all_reduce,
            an_equivocating_sender_is_named_in_a_reduce_scatter,
            a_split_with_an_equivocated_color_is_refused,
            outlying_ranks_are_named_in_every_report,
            audited_rounds_of_honest_owners_match_gather,
            an_audited_owner_that_lies_is_convicted_and_its_shard_recomputed,
            a_convicted_owner_is_ejected_by_a_shrink,
            a_forged_proof_is_refuted_and_the_liar_still_convicted,
        );
    };
}

// The bodies by topic, declared after the macro so that its name resolves in their docs.
mod agreement;
mod attribution;
mod audited;
mod collectives;
mod faults;
mod harness;
mod narrow;
mod p2p;
mod sharded;
mod time;

pub use agreement::{
    a_lone_owner_that_equivocates_never_splits_honest_ranks_silently,
    a_stalled_rank_that_resumes_is_told_in_a_reduce_scatter,
    a_stalled_rank_that_resumes_never_returns_another_result_as_success,
    a_stalled_rank_that_resumes_under_enforce_is_never_split,
    an_equivocating_sender_is_agreed_on_under_enforce,
    an_equivocating_sender_is_named_in_a_reduce_scatter,
    an_equivocating_sender_never_splits_honest_ranks_silently,
    byzantine_owners_and_senders_are_agreed_on_under_enforce_in_sharded_mode,
};
pub use attribution::outlying_ranks_are_named_in_every_report;
pub use audited::{
    a_convicted_owner_is_ejected_by_a_shrink,
    a_forged_proof_is_refuted_and_the_liar_still_convicted,
    an_audited_owner_that_lies_is_convicted_and_its_shard_recomputed,
    audited_rounds_of_honest_owners_match_gather,
};
pub use collectives::{
    a_split_with_an_equivocated_color_is_refused,
    all_reduce_is_exact_across_the_doubling_crossover, all_reduce_of_megabyte_chunks_is_exact,
    collectives_match_reference, nonblocking_collectives_run_in_start_order,
    pipelined_ring_all_reduce_is_exact, split_communicators_interleave_with_their_parent,
};
pub use faults::{
    a_rank_out_of_step_is_named_never_mixed_in, a_shrink_drops_the_dead_and_renumbers,
    a_world_of_one_returns_its_own_vector, missing_peer_is_reported_within_the_deadline,
    robust_all_reduce_survives_byzantine_and_crashed_ranks, wrong_length_is_malformed_and_named,
};
pub use harness::{run_ranks, vector};
pub use narrow::narrow_types_reduce_bitwise_as_the_local_rule;
pub use p2p::{
    early_messages_are_checked_like_any_other, invalid_steps_are_rejected,
    messages_outlive_their_sender, p2p_bandwidth, sends_are_done_within_the_credit,
    sent_messages_move_while_the_sender_is_away, steps_are_matched_by_key_not_arrival_order,
};
pub use sharded::{
    a_peer_one_rank_sees_dead_at_once_costs_no_honest_rank,
    auto_runs_what_it_resolves_to_and_says_so, replicated_owners_send_one_version_and_digests,
    robust_reduce_scatter_gives_each_rank_its_shard_of_the_all_reduce,
    sharded_iterative_rules_match_gather, sharded_krum_family_matches_gather,
    sharded_matches_gather_bitwise, sharded_sub_rounds_match_one_round_and_erase_a_dead_peer_once,
    sharded_survives_byzantine_owners_only_with_replication,
};
pub use time::{
    a_rank_far_behind_comes_back_in_step, a_rank_silent_after_its_input_sets_no_pace,
    a_straggler_does_not_set_the_pace, closing_waits_for_a_rank_left_behind,
};
