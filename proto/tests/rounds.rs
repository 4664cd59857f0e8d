//! The protocol core under the deterministic harness: gather and sharded rounds at the world
//! sizes that break naive code, with dropped, delayed and rewritten messages, and quorum steps.

#![allow(missing_docs, clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use byzcoll_aggregators::{aggregate_into, Aggregator, Median, TrimmedMean};
use byzcoll_proto::round::Shape;
use byzcoll_proto::{Agreement, Error, Fault, PeerFault, Replicas, RoundReport, Stragglers};
use harness::{input, run, spec, Fate, Network, WORLD_SIZES};

const MS: Duration = Duration::from_millis(1);

fn reference(inputs: &[Vec<f32>], rule: &dyn Aggregator) -> Vec<f32> {
    let refs: Vec<&[f32]> = inputs.iter().map(|v| &v[..]).collect();
    let mut out = vec![0f32; inputs[0].len()];
    aggregate_into(rule, &refs, &mut out).unwrap();
    out
}

/// Gather-mode specs of `n` ranks and `d` elements under `agreement`, with `stragglers` allowed.
fn quorum_spec(
    n: usize,
    d: usize,
    agreement: Agreement,
    stragglers: usize,
) -> impl Fn(usize) -> byzcoll_proto::round::Spec + Copy {
    move |me| {
        let mut s = spec(me, n, d, Shape::Gather, agreement);
        s.stragglers = stragglers;
        s
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Without faults every rank of every shape and agreement returns the reference bitwise.
#[test]
fn every_shape_matches_the_reference_at_every_world_size() {
    for n in WORLD_SIZES {
        let f = (n - 1) / 3;
        let rule = Median::new(f);
        let d = 2 * n + 3;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
        let want = bits(&reference(&inputs, &rule));
        let shapes = [
            Shape::Gather,
            Shape::Sharded(Replicas::Exactly(1)),
            Shape::Sharded(Replicas::Tolerant),
        ];
        for shape in shapes {
            for agreement in [Agreement::Off, Agreement::Detect, Agreement::Enforce] {
                if agreement == Agreement::Enforce && n <= 3 * f {
                    continue;
                }
                let ended = run(
                    |me| spec(me, n, d, shape, agreement),
                    &rule,
                    &inputs,
                    &vec![Duration::ZERO; n],
                    &|_, _, _, _, _| Fate::After(MS),
                );
                for (me, e) in ended.iter().enumerate() {
                    let report = e.result.as_ref().unwrap_or_else(|err| {
                        panic!("n = {n} {shape:?} {agreement:?} rank {me}: {err}")
                    });
                    assert!(report.faults.is_empty(), "n = {n} rank {me}");
                    assert_eq!(bits(&e.output), want, "n = {n} {shape:?} {agreement:?}");
                }
            }
        }
    }
}

/// A dropped sender is an erasure named missing by every rank that waited for it, at the
/// deadline; the others agree on the median of the rest (with `f >= 1`: with `f = 0` no
/// fault is tolerated and the cross-check fails them all).
#[test]
fn a_silent_sender_is_missing_and_the_rest_agree() {
    for n in [4, 7, 8, 11] {
        let f = (n - 1) / 3;
        let rule = Median::new(f);
        let d = 5;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
        let silent = n - 1;
        let ended = run(
            |me| spec(me, n, d, Shape::Gather, Agreement::Detect),
            &rule,
            &inputs,
            &vec![Duration::ZERO; n],
            &|from, _, _, _, _| match from == silent {
                true => Fate::Dropped,
                false => Fate::After(MS),
            },
        );
        let want = bits(&reference(&inputs[..n - 1], &rule));
        for (me, e) in ended.iter().enumerate().take(n - 1) {
            let report = e.result.as_ref().unwrap();
            assert_eq!(report.faults.len(), 1, "n = {n} rank {me}");
            assert_eq!(report.faults[0].rank, silent);
            assert_eq!(report.faults[0].fault, Fault::Missing);
            assert_eq!(bits(&e.output), want, "n = {n} rank {me}");
            // The deadline of the gather step (1 s), then the cross-check.
            assert!(
                e.at >= Duration::from_secs(1),
                "n = {n} rank {me}: {:?}",
                e.at
            );
        }
    }
}

/// A silent owner with `r = 1` loses its shard: every other rank fails with `ShardLost` after
/// the deadline of the scatter step that found it missing, and its cross-check (which still
/// runs, to keep the ranks' steps alike) does not wait for it again. Before, the failed
/// round's cross-check waited its own deadline, three step timeouts, for the dead owner.
#[test]
fn a_lost_shard_costs_the_deadline_that_found_it_and_no_more() {
    for n in [4, 7, 8, 11] {
        let rule = Median::new((n - 1) / 3);
        let d = 2 * n + 3;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
        let silent = n - 1;
        let ended = run(
            |me| {
                spec(
                    me,
                    n,
                    d,
                    Shape::Sharded(Replicas::Exactly(1)),
                    Agreement::Detect,
                )
            },
            &rule,
            &inputs,
            &vec![Duration::ZERO; n],
            &|from, _, _, _, _| match from == silent {
                true => Fate::Dropped,
                false => Fate::After(MS),
            },
        );
        for (me, e) in ended.iter().enumerate().take(n - 1) {
            match &e.result {
                Err(Error::ShardLost { shard, faults, .. }) => {
                    assert_eq!(*shard, silent, "n = {n} rank {me}");
                    assert!(faults.iter().any(|f| f.rank == silent), "n = {n} rank {me}");
                }
                other => panic!("n = {n} rank {me}: {other:?}"),
            }
            let timeout = Duration::from_secs(1);
            assert!(
                e.at >= timeout && e.at < timeout + 100 * MS,
                "n = {n} rank {me} ended at {:?}",
                e.at
            );
        }
    }
}

/// A sender that gives rank 0 another vector than the others: under `Detect` rank 0 is told
/// it disagrees, never silently split; under `Enforce` every honest rank returns one result.
#[test]
fn an_equivocating_sender_never_splits_honest_ranks_silently() {
    let (n, f, d) = (7, 2, 4);
    let rule = Median::new(f);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32; d]).collect();
    let liar = n - 1;
    let lie = |from, to, _, _, b: &bytes::Bytes| match (from == liar, to == 0) {
        (true, true) => Fate::Rewritten(MS, vec![0x44u8; b.len()].into()),
        _ => Fate::After(MS),
    };
    let detect = run(
        |me| spec(me, n, d, Shape::Gather, Agreement::Detect),
        &rule,
        &inputs,
        &[Duration::ZERO; 7],
        &lie,
    );
    for (me, e) in detect.iter().enumerate().take(n - 1) {
        match (me, &e.result) {
            (0, Err(Error::Disagreement { .. })) => {}
            (0, Ok(_)) => {
                assert_eq!(bits(&e.output), bits(&detect[1].output), "a silent split");
            }
            (_, Ok(report)) => {
                let found = report.agreement.as_ref().unwrap();
                assert!(
                    found.differing_inputs.contains(&liar),
                    "rank {me}: {found:?}"
                );
            }
            (_, Err(err)) => panic!("rank {me}: {err}"),
        }
    }
    let enforce = run(
        |me| spec(me, n, d, Shape::Gather, Agreement::Enforce),
        &rule,
        &inputs,
        &[Duration::ZERO; 7],
        &lie,
    );
    let first = bits(&enforce[0].output);
    for (me, e) in enforce.iter().enumerate().take(n - 1) {
        e.result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), first, "rank {me}");
    }
}

/// Quorum steps: with one straggler allowed, a rank that starts 500 ms late is named late by
/// the others, who end within a few milliseconds (the grace scales with how long the quorum
/// took), never at the deadline; the straggler returns their result. Under `Enforce` the echo
/// tells it; under `Detect` it aggregates every input (they were all waiting for it), sees in
/// the cross-check that the others went without its own, and aggregates again without it
/// (its own input `realigned`).
#[test]
fn a_straggler_is_late_and_does_not_set_the_pace() {
    for agreement in [Agreement::Enforce, Agreement::Detect] {
        for n in [4, 7, 8, 11] {
            let f = (n - 1) / 3;
            let rule = Median::new(f);
            let d = 6;
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
            let mut starts = vec![Duration::ZERO; n];
            starts[n - 1] = Duration::from_millis(500);
            let ended = run(
                |me| {
                    let mut s = spec(me, n, d, Shape::Gather, agreement);
                    s.stragglers = 1;
                    s
                },
                &rule,
                &inputs,
                &starts,
                // Links of 1 to 3 ms, so that arrivals spread.
                &|from, to, _, _, _| Fate::After(MS * (1 + ((from + to) % 3) as u32)),
            );
            let want = bits(&reference(&inputs[..n - 1], &rule));
            let what = format!("{agreement:?} n = {n}");
            for (me, e) in ended.iter().enumerate() {
                let report = e
                    .result
                    .as_ref()
                    .unwrap_or_else(|err| panic!("{what} rank {me}: {err}"));
                assert_eq!(bits(&e.output), want, "{what} rank {me}");
                let realigned = report.agreement.as_ref().map(|a| &a.realigned[..]);
                if me == n - 1 {
                    assert!(report.erased_self, "{what}");
                    assert_eq!(report.inputs, n - 1, "{what}");
                    if agreement == Agreement::Detect {
                        assert_eq!(realigned, Some(&[n - 1][..]), "{what}");
                    }
                    continue;
                }
                assert_eq!(realigned.unwrap_or_default(), [], "{what} rank {me}");
                assert_eq!(
                    report.faults.len(),
                    1,
                    "{what} rank {me}: {:?}",
                    report.faults
                );
                assert_eq!(report.faults[0].fault, Fault::Late, "{what} rank {me}");
                assert!(
                    e.at < Duration::from_millis(100),
                    "{what} rank {me}: {:?}",
                    e.at
                );
            }
        }
    }
}

/// An input that reaches some ranks in time and others late: every rank moves to the common
/// inputs (those every rank it heard used), so every rank returns the result without it,
/// whichever side of its quorum each one got it on, and at once. The rank that went without
/// it does not lack anything: the others leave it out, as it did.
#[test]
fn an_input_late_to_some_ranks_is_left_out_by_every_rank() {
    let (n, d) = (4, 6);
    let rule = Median::new(1);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let spec = quorum_spec(n, d, Agreement::Detect, 1);
    let starts = vec![Duration::ZERO; n];
    // Rank 3's input reaches rank 0 in time, ranks 1 and 2 late: two ranks hold each result
    // (ranks 1 and 2 do not even hear rank 3, late to them), and every rank takes the one made
    // of fewer inputs: ranks 0 and 3 leave rank 3's input out (realign).
    for shift in 0..8 {
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| input(r, d).iter().map(|x| x + shift as f32).collect())
            .collect();
        let ended = run(
            spec,
            &rule,
            &inputs,
            &starts,
            &|from, to, step, _, _| match (from, to, step) {
                (3, 1 | 2, 0) => Fate::After(Duration::from_millis(200)),
                _ => Fate::After(MS),
            },
        );
        let want = bits(&reference(&inputs[..3], &rule));
        for (me, e) in ended.iter().enumerate() {
            let report = e
                .result
                .as_ref()
                .unwrap_or_else(|err| panic!("shift {shift} rank {me}: {err}"));
            assert_eq!(bits(&e.output), want, "shift {shift} rank {me}");
            let found = report.agreement.as_ref().unwrap();
            let realigned: &[usize] = if me == 0 || me == 3 { &[3] } else { &[] };
            assert_eq!(found.realigned, realigned, "shift {shift} rank {me}");
            assert_eq!(report.erased_self, me == 3, "shift {shift} rank {me}");
        }
    }
    // Rank 3's input reaches rank 0 late, the others in time: they leave it out as rank 0
    // did (before common inputs, rank 0 failed with `Disagreement`).
    let ended = run(
        spec,
        &rule,
        &inputs,
        &starts,
        &|from, to, step, _, _| match (from, to, step) {
            (3, 0, 0) => Fate::After(Duration::from_millis(200)),
            _ => Fate::After(MS),
        },
    );
    let want = bits(&reference(&inputs[..3], &rule));
    for (me, e) in ended.iter().enumerate() {
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), want, "rank {me}");
        let realigned: &[usize] = if me == 0 { &[] } else { &[3] };
        assert_eq!(
            report.agreement.as_ref().unwrap().realigned,
            realigned,
            "rank {me}"
        );
        assert_eq!(report.erased_self, me == 3, "rank {me}");
        assert!(e.at < Duration::from_millis(100), "rank {me}: {:?}", e.at);
    }
}

/// Two stragglers among 8 (`f = 2`, `s = 2`), each late to another set of ranks, as in
/// training with two slow ranks: the ranks' inputs sets all differ, and every rank still ends
/// with the one result made without either straggler's input, at once.
#[test]
fn two_stragglers_late_to_different_ranks_leave_every_rank_with_one_result() {
    let (n, d) = (8, 5);
    let rule = Median::new(2);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let spec = quorum_spec(n, d, Agreement::Detect, 2);
    let ended = run(
        spec,
        &rule,
        &inputs,
        &vec![Duration::ZERO; n],
        &|from, to, step, _, _| match (from, to, step) {
            (6, 0..=2, 0) | (7, 2..=4, 0) => Fate::After(Duration::from_millis(200)),
            _ => Fate::After(MS),
        },
    );
    let want = bits(&reference(&inputs[..6], &rule));
    for (me, e) in ended.iter().enumerate() {
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), want, "rank {me}");
        assert_eq!(report.inputs, 6, "rank {me}");
        assert_eq!(report.erased_self, me >= 6, "rank {me}");
        assert!(e.at < Duration::from_millis(100), "rank {me}: {:?}", e.at);
    }
}

/// One `Enforce` round of 8 ranks (`f = 2`, `s = 2`) whose rank 7's connections are gone (its
/// receives `Missing` at once), over `net` for every other message: checks that ranks 0 to 6
/// each return the median of their 7 inputs, within 500 ms, and returns their reports.
fn enforce_round_with_rank_7_dead(net: &Network<'_>) -> Vec<RoundReport> {
    let (n, d) = (8, 5);
    let rule = Median::new(2);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let spec = quorum_spec(n, d, Agreement::Enforce, 2);
    let dead = |from, to, step, tag, bytes: &bytes::Bytes| match from {
        7 => Fate::Closed,
        _ => net(from, to, step, tag, bytes),
    };
    let ended = run(spec, &rule, &inputs, &vec![Duration::ZERO; n], &dead);
    let want = bits(&reference(&inputs[..7], &rule));
    let mut reports = Vec::new();
    for (me, e) in ended.into_iter().enumerate().take(7) {
        let report = e.result.unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), want, "rank {me}");
        assert_eq!(report.inputs, 7, "rank {me}");
        assert!(e.at < Duration::from_millis(500), "rank {me}: {:?}", e.at);
        reports.push(report);
    }
    reports
}

/// Under `Enforce`, inputs late to one rank do not cost it the echo: ranks 1 and 4's inputs
/// reach rank 0 after its quorum (`f = 2`, `s = 2`, rank 7 dead), but their relays come in
/// time, and rank 0 waits for them (through the quorum's grace) rather than counting two more
/// relays as "none" (with rank 7's, three of the seven, where the echo's majorities need at
/// least four of six at its deepest level: rank 0 used to agree on no input of most ranks and
/// fail). The echo decides both inputs in, rank 0 recovers them, and every rank returns the
/// median of ranks 0 to 6.
#[test]
fn inputs_late_to_one_rank_under_enforce_leave_its_echo_whole() {
    let reports = enforce_round_with_rank_7_dead(&|from, to, step, _, _| match (from, to, step) {
        (1 | 4, 0, 0) => Fate::After(Duration::from_millis(50)),
        _ => Fate::After(MS),
    });
    // Ranks 1 and 4's inputs, late to rank 0, were recovered and used: no fault of theirs.
    let dead = PeerFault {
        rank: 7,
        fault: Fault::Missing,
    };
    for (me, report) in reports.iter().enumerate() {
        assert_eq!(report.faults, std::slice::from_ref(&dead), "rank {me}");
    }
}

/// The same, where the late ranks' relays come to rank 0 before those of two ranks in time
/// (ranks 2 and 3, 20 ms into the echo's last relay step, whose relays are the leaves its
/// majorities start from): the step's quorum forms only once every rank in time is in
/// (`Quorum::core`), so the late relays arriving first do not start the grace that would cut
/// those two ranks' relays and leave rank 0 three short again.
#[test]
fn late_relays_coming_first_do_not_cut_relays_in_time() {
    enforce_round_with_rank_7_dead(&|from, to, step, _, _| match (from, to, step) {
        (1 | 4, 0, 0) => Fate::After(Duration::from_millis(50)),
        (2 | 3, 0, 2) => Fate::After(Duration::from_millis(20)),
        _ => Fate::After(MS),
    });
}

/// The start of rank 3 of 4 in [`late_laggard_round`]: 500 ms after the others.
const LAGGARD_START: Duration = Duration::from_millis(500);

/// One `Enforce` round of 4 ranks (`d = 6`, median with `f = 1`, one straggler allowed) in
/// which rank 3, a laggard at the others ([`Carry::laggards`]) that counts itself `own_late`
/// rounds behind, starts [`LAGGARD_START`] late, over `net`.
fn late_laggard_round(own_late: u32, net: &harness::Network<'_>) -> Vec<harness::Ended> {
    use byzcoll_proto::round::{Carry, Round};
    let (n, d) = (4, 6);
    let rule = Median::new(1);
    let carry = |me: usize| Carry {
        laggards: if me != 3 { vec![3] } else { vec![] },
        own_late: if me == 3 { own_late } else { 0 },
        ..Carry::default()
    };
    let planes = (0..n)
        .map(|r| harness::TestPlane::new(r, n, input(r, d)))
        .collect();
    let mut starts = vec![Duration::ZERO; n];
    starts[3] = LAGGARD_START;
    harness::run_rounds(
        |me| {
            let mut s = spec(me, n, d, Shape::Gather, Agreement::Enforce);
            s.stragglers = 1;
            Round::resuming(s, &rule, &carry(me))
        },
        planes,
        &starts,
        net,
    )
}

/// Under `Enforce` nothing is passed on to a laggard late this round: it got the inputs before
/// it posted its steps, and passing each one on to it, round after round, was what cut a 10x
/// slower rank off (the fast ranks' send budgets). Rank 3 of 4, a laggard at the others,
/// starts 500 ms late: the others send it no input in the recovery step, and every rank,
/// rank 3 included, returns the median of ranks 0 to 2.
#[test]
fn nothing_is_passed_on_to_a_late_laggard() {
    use std::cell::Cell;
    let d = 6;
    // Whole inputs sent to rank 3 after the gather step (step 2 is the recovery).
    let passed_on = Cell::new(0);
    let ended = late_laggard_round(0, &|_from, to, step, _, bytes| {
        if to == 3 && step == 2 && bytes.len() == 4 * d {
            passed_on.set(passed_on.get() + 1);
        }
        Fate::After(MS)
    });
    assert_eq!(passed_on.get(), 0);
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| input(r, d)).collect();
    let want = bits(&reference(&inputs, &Median::new(1)));
    for (me, e) in ended.iter().enumerate() {
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), want, "rank {me}");
        assert_eq!(report.erased_self, me == 3, "rank {me}");
    }
}

/// A laggard that lacks an input the echo agreed on (rank 0's input to it dropped, as a
/// sender drops what a rank far behind has not read) gets nothing passed on (above). Rank 3,
/// late again after two rounds late ([`Carry::own_late`]), knows it is one and fails at once
/// for want of inputs; one that does not know waits for a passed-on input until its recovery
/// step's deadline (1 s here) and fails then. The others return the median of ranks 0 to 2
/// either way.
#[test]
fn a_laggard_that_knows_it_is_one_waits_for_nothing_to_be_passed_on() {
    let inputs: Vec<Vec<f32>> = (0..3).map(|r| input(r, 6)).collect();
    let want = bits(&reference(&inputs, &Median::new(1)));
    for own_late in [2, 0] {
        let ended = late_laggard_round(own_late, &|from, to, step, _, _| match (from, to, step) {
            (0, 3, 0) => Fate::Dropped,
            _ => Fate::After(MS),
        });
        for (me, e) in ended.iter().enumerate().take(3) {
            assert!(
                e.result.is_ok(),
                "own_late {own_late} rank {me}: {:?}",
                e.result
            );
            assert_eq!(bits(&e.output), want, "own_late {own_late} rank {me}");
        }
        let straggler = &ended[3];
        assert!(
            matches!(straggler.result, Err(Error::TooManyFaults { .. })),
            "own_late {own_late}: {:?}",
            straggler.result
        );
        let waited = straggler.at - LAGGARD_START;
        if own_late == 2 {
            assert!(
                waited < Duration::from_millis(100),
                "own_late 2: {waited:?}"
            );
        } else {
            assert!(waited >= Duration::from_secs(1), "own_late 0: {waited:?}");
        }
    }
}

/// The same under `Enforce`, with ranks 1 and 4's cross-checks late to rank 0 as well (after
/// the gather step, the echo's two relay steps and its recovery step): rank 0 hears only four
/// checks in time (rank 7 is dead), too few for the `n - f = 6` a result needs, so it waits
/// for the late ones until it has heard enough, rather than failing with them unconfirmed.
#[test]
fn a_cross_check_under_enforce_waits_for_late_checks_it_needs() {
    let reports = enforce_round_with_rank_7_dead(&|from, to, step, _, _| match (from, to, step) {
        (1 | 4, 0, 0 | 4) => Fate::After(Duration::from_millis(50)),
        _ => Fate::After(MS),
    });
    for (me, report) in reports.iter().enumerate() {
        let found = report.agreement.as_ref().expect("a cross-check");
        assert_eq!(found.unconfirmed, [7], "rank {me}");
    }
}

/// A straggler's own view does not shrink the others' set: rank 6 is late for ranks 0 to 2,
/// and rank 7's input is late for rank 6 alone. Ranks 3 to 5 hear rank 6's check (which lacks
/// rank 7's input) and ranks 0 to 2 do not; both leave rank 6's list out (its input was late
/// for some rank), keep rank 7's input and end alike. Rank 6, a straggler, computes the set as
/// they do: it lacks rank 7's input, has it passed on (`recovered`), leaves its own out as they
/// did, and ends with their result (before, it failed, loudly).
#[test]
fn a_stragglers_view_of_another_straggler_does_not_split_the_others() {
    let (n, d) = (8, 5);
    let rule = Median::new(2);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let spec = quorum_spec(n, d, Agreement::Detect, 2);
    let ended = run(
        spec,
        &rule,
        &inputs,
        &vec![Duration::ZERO; n],
        &|from, to, step, _, _| match (from, to, step) {
            (6, 0..=2, 0) | (7, 6, 0) => Fate::After(Duration::from_millis(200)),
            _ => Fate::After(MS),
        },
    );
    let kept: Vec<Vec<f32>> = (0..n)
        .filter(|&r| r != 6)
        .map(|r| inputs[r].clone())
        .collect();
    let want = bits(&reference(&kept, &rule));
    for (me, e) in ended.iter().enumerate() {
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), want, "rank {me}");
        assert_eq!(report.inputs, 7, "rank {me}");
        assert_eq!(report.erased_self, me == 6, "rank {me}");
        let found = report.agreement.as_ref().unwrap();
        let recovered: &[usize] = if me == 6 { &[7] } else { &[] };
        assert_eq!(found.recovered, recovered, "rank {me}");
        assert!(e.at < Duration::from_millis(100), "rank {me}: {:?}", e.at);
    }
}

/// Two stragglers of 4 (`f = 1`, `s = 1`), each late to another rank: rank 3's input is late
/// for rank 0, rank 2's for rank 1. The inputs every rank used are ranks 0 and 1's alone, too
/// few for the median, and before named inputs ranks 0 and 1 each kept their own result and
/// the round failed, two ranks against two (seen on two busy cores). Now each late input,
/// named by the two other ranks, is passed on to the rank it was late for: every rank ends
/// with the result of all four inputs, at once, and counts no one late.
#[test]
fn stragglers_late_to_different_ranks_of_four_are_passed_on_not_a_split() {
    let (n, d) = (4, 6);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    for rule in [&Median::new(1) as &dyn Aggregator, &TrimmedMean::new(1)] {
        let spec = quorum_spec(n, d, Agreement::Detect, 1);
        let ended = run(
            spec,
            rule,
            &inputs,
            &vec![Duration::ZERO; n],
            &|from, to, step, _, _| match (from, to, step) {
                (3, 0, 0) | (2, 1, 0) => Fate::After(Duration::from_millis(200)),
                _ => Fate::After(MS),
            },
        );
        let want = bits(&reference(&inputs, rule));
        for (me, e) in ended.iter().enumerate() {
            let what = format!("{} rank {me}", rule.name());
            let report = e
                .result
                .as_ref()
                .unwrap_or_else(|err| panic!("{what}: {err}"));
            assert_eq!(bits(&e.output), want, "{what}");
            assert_eq!(report.inputs, n, "{what}");
            let recovered: &[usize] = match me {
                0 => &[3],
                1 => &[2],
                _ => &[],
            };
            let found = report.agreement.as_ref().unwrap();
            assert_eq!(found.recovered, recovered, "{what}");
            assert_eq!(found.realigned, [], "{what}");
            assert_eq!(report.faults, [], "{what}");
            assert!(e.at < Duration::from_millis(100), "{what}: {:?}", e.at);
        }
    }
}

/// A late input that only its sender can pass on. Of 4 ranks (`f = 1`, `s = 1`), rank 3's
/// input is late for ranks 1 and 2, and rank 0's for rank 3. The round's set is the inputs of
/// ranks 0 to 2 (those the timely ranks 1 and 2 used), and rank 3 lacks rank 0's: ranks 1 and
/// 2 name it but did not get rank 3's input, so neither knows rank 3 lacks it. Rank 0 does
/// (it had rank 3's input and heard its check), and passes its own input on; rank 3 takes
/// that one copy (before, with no `f + 1` passers, it went without and failed the round, 3
/// ranks against 1; seen in simulated rounds with a slow rank on a jittery network). A copy
/// that rank 0 withholds or alters cannot give rank 3 another result silently: rank 3 waits
/// for it only through the grace and then fails loudly, as it did before, and the others
/// keep their result.
#[test]
fn a_late_input_only_its_sender_can_pass_on_comes_from_the_sender() {
    let (n, d) = (4, 6);
    let rule = Median::new(1);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let want = bits(&reference(&inputs[..3], &rule));
    for sender in ["honest", "withholds", "alters"] {
        // Steps: 0 the inputs, 1 the cross-check, 2 the recovery, 3 the confirmation.
        let ended = run(
            quorum_spec(n, d, Agreement::Detect, 1),
            &rule,
            &inputs,
            &vec![Duration::ZERO; n],
            &|from, to, step, _, bytes| match (from, to, step) {
                (3, 1 | 2, 0) | (0, 3, 0) => Fate::After(Duration::from_millis(200)),
                (0, 3, 2) if sender == "withholds" => Fate::Dropped,
                (0, 3, 2) if sender == "alters" => {
                    let mut altered = bytes.to_vec();
                    altered[0] ^= 1;
                    Fate::Rewritten(MS, altered.into())
                }
                _ => Fate::After(MS),
            },
        );
        rank_3_recovers_rank_0s_input(&ended, &want, sender == "honest", sender);
    }
}

/// The end of a 4-rank round in which rank 3 lacks rank 0's input and the others move to the
/// inputs of ranks 0 to 2: every rank ends within the round's time; with an `honest` copy
/// rank 3 recovers rank 0's input and every rank ends with `want`, otherwise rank 3 fails
/// loudly and the others keep `want`; no rank names another for more than lateness.
fn rank_3_recovers_rank_0s_input(ended: &[harness::Ended], want: &[u32], honest: bool, case: &str) {
    for (me, e) in ended.iter().enumerate() {
        let what = format!("{case}, rank {me}");
        assert!(e.at < Duration::from_millis(100), "{what}: {:?}", e.at);
        if me == 3 && !honest {
            assert!(
                matches!(e.result, Err(Error::Disagreement { .. })),
                "{what}: {:?}",
                e.result
            );
            continue;
        }
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|err| panic!("{what}: {err}"));
        assert_eq!(bits(&e.output), want, "{what}");
        assert_eq!(report.inputs, 3, "{what}");
        assert_eq!(report.erased_self, me == 3, "{what}");
        let found = report.agreement.as_ref().unwrap();
        let recovered: &[usize] = if me == 3 { &[0] } else { &[] };
        assert_eq!(found.recovered, recovered, "{what}");
        assert!(
            report.faults.iter().all(|f| f.fault == Fault::Late),
            "{what}: {:?}",
            report.faults
        );
    }
}

/// A rank that did not hear a straggler's check waits for no copies past the round's own
/// time. Of 4 ranks (`f = 1`, `s = 1`), rank 0's input is late for rank 1, rank 2's for rank
/// 0 and rank 3's for rank 2, and rank 0's check is late for rank 1 too. Ranks 0, 2 and 3 hear
/// every list and move to the inputs of ranks 1 to 3 (rank 1's list is the one timely one);
/// rank 1, without rank 0's list, finds too few common inputs, takes the named ones (all
/// four), and lacks rank 0's, which its passers 2 and 3 do not send (their set leaves it
/// out). Rank 1 cannot tell: it waits for their copies at most as long again as its round
/// so far, plus one grace (`Round::took`), not the step timeout (1 s here), and then keeps
/// its result, the others' (found by the simulator: 4 ranks, one slow rank, 2 ms of jitter;
/// the round took three step timeouts).
#[test]
fn a_rank_whose_passers_moved_to_another_set_waits_no_step_timeout_for_their_copies() {
    let (n, d) = (4, 6);
    let rule = Median::new(1);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let want = bits(&reference(&inputs[1..], &rule));
    let ended = run(
        quorum_spec(n, d, Agreement::Detect, 1),
        &rule,
        &inputs,
        &vec![Duration::ZERO; n],
        &|from, to, step, _, _| match (from, to, step) {
            (0, 1, 0 | 1) | (2, 0, 0) | (3, 2, 0) => Fate::After(Duration::from_millis(300)),
            _ => Fate::After(MS),
        },
    );
    for (me, e) in ended.iter().enumerate() {
        assert!(e.at < Duration::from_millis(100), "rank {me}: {:?}", e.at);
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), want, "rank {me}");
        assert_eq!(report.inputs, 3, "rank {me}");
    }
}

/// A rank silent after its input holds no step until the deadline (issue #36): a Byzantine
/// rank that sends its input in time and then withholds its check or its confirmation, or an
/// honest one stopped between steps. Of 4 ranks (`f = 1`, `s = 1`), rank 3's input reaches
/// every rank in time; then it sends nothing from the cross-check on, or nothing in the
/// confirmation only. The others wait for it about as long again as their round so far, not
/// the step timeout (1 s), return the median of the four inputs, and name it unconfirmed.
#[test]
fn a_rank_silent_after_its_input_holds_no_step_to_its_deadline() {
    let (n, d) = (4, 6);
    let rule = Median::new(1);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let want = bits(&reference(&inputs, &rule));
    // Steps: 0 the inputs, 1 the cross-check, 2 the recovery, 3 the confirmation.
    for silent_from in [1, 3] {
        let ended = run(
            quorum_spec(n, d, Agreement::Detect, 1),
            &rule,
            &inputs,
            &vec![Duration::ZERO; n],
            &|from, _, step, _, _| match from == 3 && step >= silent_from {
                true => Fate::Dropped,
                false => Fate::After(MS),
            },
        );
        for (me, e) in ended.iter().enumerate().take(3) {
            let case = format!("silent from step {silent_from}, rank {me}");
            assert!(e.at < Duration::from_millis(100), "{case}: {:?}", e.at);
            let report = e
                .result
                .as_ref()
                .unwrap_or_else(|err| panic!("{case}: {err}"));
            assert_eq!(bits(&e.output), want, "{case}");
            assert_eq!(report.inputs, n, "{case}");
            assert!(report.faults.is_empty(), "{case}: {:?}", report.faults);
            let found = report.agreement.as_ref().expect("a cross-checked round");
            assert_eq!(found.unconfirmed, [3], "{case}");
        }
    }
}

/// A late input with one passer, checked against its sender's commitment. Of 4 ranks
/// (`f = 1`, `s = 1`), rank 0's input is late for rank 3, and rank 3's for ranks 0 and 2. The
/// round's set is the inputs of ranks 0 to 2, and rank 3 lacks rank 0's: its one passer is
/// rank 1 (rank 2 did not get rank 3's input), and rank 0, which did not get it either, does
/// not know that rank 3 lacks its input. Rank 1's copy is taken because it is the vector rank
/// 0's check committed to (BLAKE3) at rank 3; before, with `f` or fewer passers, rank 3 went
/// without and failed the round. Where the passer withholds its copy, or rank 0 commits at
/// rank 3 to another vector than it sent the others, rank 3 takes nothing, fails loudly
/// within the round's time and names no one, and the others keep their result.
#[test]
fn a_late_input_with_one_passer_is_checked_against_its_senders_commitment() {
    let (n, d) = (4, 6);
    let rule = Median::new(1);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let want = bits(&reference(&inputs[..3], &rule));
    for case in ["honest", "passer withholds", "sender commits to another"] {
        // Steps: 0 the inputs, 1 the cross-check, 2 the recovery, 3 the confirmation.
        let ended = run(
            quorum_spec(n, d, Agreement::Detect, 1),
            &rule,
            &inputs,
            &vec![Duration::ZERO; n],
            &|from, to, step, _, bytes| match (from, to, step) {
                (0, 3, 0) | (3, 0 | 2, 0) => Fate::After(Duration::from_millis(200)),
                (1, 3, 2) if case == "passer withholds" => Fate::Dropped,
                (0, 3, 1) if case == "sender commits to another" => {
                    // The commitment is the check's last 32 bytes.
                    let mut other = bytes.to_vec();
                    let last = other.len() - 1;
                    other[last] ^= 1;
                    Fate::Rewritten(MS, other.into())
                }
                _ => Fate::After(MS),
            },
        );
        rank_3_recovers_rank_0s_input(&ended, &want, case == "honest", case);
    }
}

/// Passing a late input on cannot be abused. Of 8 ranks (`f = 2`, `s = 2`), rank 0 gets the
/// inputs of ranks 4 and 5 late and rank 1 those of 6 and 7: the inputs every rank used are
/// four, too few for the median, so each late input is passed on by the ranks that name it.
/// Rank 2 passes on forged copies and rank 3 none: ranks 0 and 1 take the copies of honest
/// namers, name rank 2 malformed, do not wait for rank 3's copies past the grace, and every
/// rank ends with the result of every input.
#[test]
fn a_forged_or_withheld_copy_of_a_late_input_neither_gets_in_nor_stalls() {
    let (n, d) = (8, 5);
    let rule = Median::new(2);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let spec = quorum_spec(n, d, Agreement::Detect, 2);
    // Steps: 0 the inputs, 1 the cross-check, 2 the recovery, 3 the confirmation.
    let ended = run(
        spec,
        &rule,
        &inputs,
        &vec![Duration::ZERO; n],
        &|from, to, step, _, bytes| match (from, to, step) {
            (4 | 5, 0, 0) | (6 | 7, 1, 0) => Fate::After(Duration::from_millis(200)),
            (2, _, 2) => {
                let mut forged = bytes.to_vec();
                forged[0] ^= 1;
                Fate::Rewritten(MS, forged.into())
            }
            (3, _, 2) => Fate::Dropped,
            _ => Fate::After(MS),
        },
    );
    let want = bits(&reference(&inputs, &rule));
    for (me, e) in ended.iter().enumerate() {
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), want, "rank {me}");
        let found = report.agreement.as_ref().unwrap();
        let recovered: &[usize] = match me {
            0 => &[4, 5],
            1 => &[6, 7],
            _ => &[],
        };
        assert_eq!(found.recovered, recovered, "rank {me}");
        if me <= 1 {
            assert!(
                matches!(
                    report.faults[..],
                    [PeerFault {
                        rank: 2,
                        fault: Fault::Malformed(_)
                    }]
                ),
                "rank {me}: {:?}",
                report.faults
            );
        }
        assert!(e.at < Duration::from_millis(100), "rank {me}: {:?}", e.at);
    }
}

/// Fault memory: a laggard (a peer late in each of this rank's last rounds) is waited for
/// only up to the quorum. Rank 3's input comes 0.5 ms after the others', within their grace:
/// taken where ranks 0 to 2 do not count rank 3 a laggard, late where they do (the step ends
/// as soon as the others' inputs are in), and rank 3 then ends with their result.
#[test]
fn a_laggard_is_waited_for_only_up_to_the_quorum() {
    use byzcoll_proto::round::{Carry, Round};
    let (n, d) = (4, 6);
    let rule = Median::new(1);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let net = |from, _to, step, _tag, _: &bytes::Bytes| match (from, step) {
        (3, 0) => Fate::After(MS + MS / 2),
        _ => Fate::After(MS),
    };
    for laggard in [false, true] {
        let carry = |me: usize| Carry {
            laggards: if laggard && me != 3 { vec![3] } else { vec![] },
            ..Carry::default()
        };
        let planes = (0..n)
            .map(|r| harness::TestPlane::new(r, n, inputs[r].clone()))
            .collect();
        let ended = harness::run_rounds(
            |me| {
                let mut s = spec(me, n, d, Shape::Gather, Agreement::Detect);
                s.stragglers = 1;
                Round::resuming(s, &rule, &carry(me))
            },
            planes,
            &vec![Duration::ZERO; n],
            &net,
        );
        let want = match laggard {
            false => bits(&reference(&inputs, &rule)),
            true => bits(&reference(&inputs[..3], &rule)),
        };
        for (me, e) in ended.iter().enumerate() {
            let report = e
                .result
                .as_ref()
                .unwrap_or_else(|err| panic!("laggard {laggard} rank {me}: {err}"));
            assert_eq!(bits(&e.output), want, "laggard {laggard} rank {me}");
            if me < 3 {
                let late = report
                    .faults
                    .iter()
                    .any(|f| f.rank == 3 && f.fault == Fault::Late);
                assert_eq!(late, laggard, "rank {me}: {:?}", report.faults);
            }
        }
    }
}

/// A rank that starts past the others' deadline in a sharded round with `2f + 1` owners
/// (versions by digest) returns their result, not another one: its co-owners erased its
/// pieces, every one of them contradicts its version alike, and it makes its shards again
/// without its own piece (`erased_self`), asking nobody to resend.
#[test]
fn a_stalled_owner_rejoins_with_the_others_result() {
    for n in [4, 7, 8] {
        let f = (n - 1) / 3;
        let rule = Median::new(f);
        let d = 3 * n;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
        let mut starts = vec![Duration::ZERO; n];
        starts[1] = Duration::from_millis(1500);
        for agreement in [Agreement::Off, Agreement::Detect] {
            let ended = run(
                |me| spec(me, n, d, Shape::Sharded(Replicas::Tolerant), agreement),
                &rule,
                &inputs,
                &starts,
                &|_, _, _, _, _| Fate::After(MS),
            );
            let others: Vec<Vec<f32>> = (0..n)
                .filter(|&r| r != 1)
                .map(|r| inputs[r].clone())
                .collect();
            let want = bits(&reference(&others, &rule));
            for (me, e) in ended.iter().enumerate() {
                let report = e
                    .result
                    .as_ref()
                    .unwrap_or_else(|err| panic!("n = {n} {agreement:?} rank {me}: {err}"));
                assert_eq!(bits(&e.output), want, "n = {n} {agreement:?} rank {me}");
                assert_eq!(
                    report.erased_self,
                    me == 1,
                    "n = {n} {agreement:?} rank {me}"
                );
            }
            // The stalled rank waits out no deadline: it ends soon after it starts.
            assert!(
                ended[1].at < starts[1] + Duration::from_millis(100),
                "n = {n} {agreement:?}: {:?}",
                ended[1].at
            );
        }
    }
}

/// `Policy::Auto`: gather for small vectors, few ranks, quorum rounds and rules sharded mode
/// cannot run; sharded with `2f + 1` owners where that sends fewer bytes than gather at a
/// size where it pays, or where gather would hold too much; any other policy as it is.
#[test]
fn auto_picks_gather_or_tolerant_sharding_by_size_world_and_rule() {
    use byzcoll_proto::{Policy, AUTO_GATHER_MAX_BYTES, AUTO_SHARDED_MIN_BYTES};
    let median = Median::new(1);
    let krum = byzcoll_aggregators::build(
        "krum",
        &byzcoll_aggregators::Params {
            f: 1,
            m: None,
            tau: None,
        },
    )
    .unwrap();
    let nnm_krum = byzcoll_aggregators::build(
        "nnm+krum",
        &byzcoll_aggregators::Params {
            f: 1,
            m: None,
            tau: None,
        },
    )
    .unwrap();
    let tolerant = Policy::Sharded(Replicas::Tolerant);
    let big = AUTO_SHARDED_MIN_BYTES / 4;
    let auto = |n, d, rule: &dyn byzcoll_aggregators::Aggregator, quorum| {
        Policy::Auto.resolve(n, d, 4, rule, quorum)
    };
    // 16 ranks, f = 1: 3 owners send (3 + 1)·d against gather's 15·d.
    assert_eq!(auto(16, big, &median, false), tolerant);
    assert_eq!(auto(16, big - 1, &median, false), Policy::Gather);
    assert_eq!(auto(16, 1, &median, false), Policy::Gather);
    assert_eq!(auto(16, big, krum.as_ref(), false), tolerant);
    // Sharded mode cannot run it; a quorum round cannot be sharded.
    assert_eq!(auto(16, big, nnm_krum.as_ref(), false), Policy::Gather);
    assert_eq!(auto(16, big, &median, true), Policy::Gather);
    // Stragglers are allowed by default (`auto`, none under Off), which chooses the schedule
    // first: a vector large enough still goes sharded. Only a count above 0 asks for a
    // quorum round.
    let default = Stragglers::default();
    assert_eq!(default, Stragglers::Auto);
    assert_eq!(Stragglers::parse("default"), Ok(Stragglers::Auto));
    assert_eq!(default.under(Agreement::Enforce), Stragglers::Auto);
    assert_eq!(default.under(Agreement::Detect), Stragglers::Auto);
    assert_eq!(default.under(Agreement::Off), Stragglers::Exactly(0));
    assert_eq!(
        Stragglers::Auto.under(Agreement::Off),
        Stragglers::Exactly(0)
    );
    assert_eq!(
        Stragglers::Exactly(1).under(Agreement::Off),
        Stragglers::Exactly(1)
    );
    assert!(!default.forces_quorum());
    assert!(!Stragglers::Auto.forces_quorum());
    assert!(!Stragglers::Exactly(0).forces_quorum());
    assert!(Stragglers::Exactly(1).forces_quorum());
    let quorum = Stragglers::Auto.forces_quorum();
    assert_eq!(auto(16, big, &median, quorum), tolerant);
    // 4 ranks, f = 1: 3 owners send no fewer bytes than gather, until gather holds too much.
    assert_eq!(auto(4, big * 16, &median, false), Policy::Gather);
    let too_much = AUTO_GATHER_MAX_BYTES / 4 / 4 + 1;
    assert_eq!(auto(4, too_much, &median, false), tolerant);
    assert_eq!(auto(2, too_much, &median, false), Policy::Gather);
    // Shapes follow, and explicit policies are kept.
    assert_eq!(
        Shape::all_reduce(Policy::Auto, 16, big, 4, &median, false),
        Shape::Sharded(Replicas::Tolerant)
    );
    let one = Policy::Sharded(Replicas::Exactly(1));
    assert_eq!(one.resolve(4, 1, 4, &median, false), one);
    assert_eq!(
        Policy::Gather.resolve(16, big, 4, &median, false),
        Policy::Gather
    );
}

/// Byzantine shard owners (seven ranks, `f = 2`, ranks 5 and 6 adding 1000 to every result they
/// own): with `2f + 1` owners per shard every honest rank gets the honest result bitwise under
/// every agreement; with one owner per shard and no cross-check the liars' shards come out
/// corrupted and the others exact, the documented price of trusting owners.
#[test]
fn lying_owners_are_outvoted_only_with_replication() {
    use byzcoll_proto::round::Round;
    use byzcoll_proto::schedule::chunk_range;
    let (n, f) = (7, 2);
    let d = 3 * n + 2;
    let rule = Median::new(f);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let want = bits(&reference(&inputs, &rule));
    let liar = |r| r >= 5;
    let cases = [
        (Replicas::Tolerant, Agreement::Off),
        (Replicas::Tolerant, Agreement::Detect),
        (Replicas::Tolerant, Agreement::Enforce),
        (Replicas::Exactly(1), Agreement::Off),
    ];
    for (replicas, agreement) in cases {
        let planes = (0..n)
            .map(|r| {
                let p = harness::TestPlane::new(r, n, inputs[r].clone());
                if liar(r) {
                    p.lying(1000.0)
                } else {
                    p
                }
            })
            .collect();
        let shape = Shape::Sharded(replicas);
        let ended = harness::run_rounds(
            |me| Round::new(spec(me, n, d, shape, agreement), &rule),
            planes,
            &vec![Duration::ZERO; n],
            &|_, _, _, _, _| Fate::After(MS),
        );
        for (me, e) in ended.iter().enumerate().filter(|(me, _)| !liar(*me)) {
            let case = format!("{replicas:?} {agreement:?} rank {me}");
            e.result
                .as_ref()
                .unwrap_or_else(|err| panic!("{case}: {err}"));
            let got = bits(&e.output);
            if replicas == Replicas::Tolerant {
                assert_eq!(got, want, "{case}");
                continue;
            }
            for s in 0..n {
                let range = chunk_range(d, n, s);
                let exact = got[range.clone()] == want[range];
                assert_eq!(exact, !liar(s), "{case}, shard {s}: r = 1 trusts its owner");
            }
        }
    }
}

/// A robust reduce-scatter gives each rank shard `rank` of the all-reduce's reference,
/// bitwise, at every world size, with one owner per shard or `2f + 1`, with or without the
/// cross-check; `Enforce` (no common result to agree on) is refused up front.
#[test]
fn a_reduce_scatter_gives_each_rank_its_shard_of_the_reference() {
    use byzcoll_proto::schedule::chunk_range;
    for n in WORLD_SIZES {
        let f = (n - 1) / 3;
        let rule = Median::new(f);
        let d = 2 * n + 3;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
        let want = bits(&reference(&inputs, &rule));
        for replicas in [Replicas::Exactly(1), Replicas::Tolerant] {
            let ended = run(
                |me| spec(me, n, d, Shape::ReduceScatter(replicas), Agreement::Enforce),
                &rule,
                &inputs,
                &vec![Duration::ZERO; n],
                &|_, _, _, _, _| Fate::After(MS),
            );
            for e in &ended {
                assert!(
                    matches!(&e.result, Err(Error::Unsupported(why)) if why.contains("reduce-scatter")),
                    "n = {n} {replicas:?}: {:?}",
                    e.result
                );
            }
            for agreement in [Agreement::Off, Agreement::Detect] {
                let ended = run(
                    |me| spec(me, n, d, Shape::ReduceScatter(replicas), agreement),
                    &rule,
                    &inputs,
                    &vec![Duration::ZERO; n],
                    &|_, _, _, _, _| Fate::After(MS),
                );
                for (me, e) in ended.iter().enumerate() {
                    let case = format!("n = {n} {replicas:?} {agreement:?} rank {me}");
                    let report = e
                        .result
                        .as_ref()
                        .unwrap_or_else(|err| panic!("{case}: {err}"));
                    assert!(report.faults.is_empty(), "{case}: {:?}", report.faults);
                    let mine = chunk_range(d, n, me);
                    assert_eq!(bits(&e.output[mine.clone()]), want[mine], "{case}");
                }
            }
        }
    }
}

/// Sharded specs (`2f + 1` owners) of `n` ranks and `d` elements under `Detect`, with one
/// straggler allowed.
fn sharded_quorum_spec(n: usize, d: usize) -> impl Fn(usize) -> byzcoll_proto::round::Spec + Copy {
    move |me| {
        let mut s = spec(
            me,
            n,
            d,
            Shape::Sharded(Replicas::Tolerant),
            Agreement::Detect,
        );
        s.stragglers = 1;
        s
    }
}

/// A co-owner silent after its pieces holds no step of a sharded round (issue #36). Of 4 and
/// 7 ranks (`2f + 1` owners per shard, `s = 1`, `Detect`), the last scatters its pieces in
/// time and then, from step 1, 2, 3 or 4 on (the owners' sync, the versions, the requests,
/// the steps after them), sends nothing (a Byzantine owner, or one stopped between steps).
/// The others wait for its messages only a grace of the round so far (plus one grace of it)
/// past their other peers', take each shard it owns from the other owners' alike versions,
/// and end in milliseconds (1 s step timeout) with the median of all the inputs, naming it
/// unconfirmed (and late where its versions did not come). Before, the sync and the requests
/// waited for it until the deadline (2 s and 4 s, stretched).
#[test]
fn a_co_owner_silent_after_its_pieces_holds_no_step() {
    for (n, silent_from) in [(4, 1), (7, 1), (4, 2), (4, 3), (4, 4), (7, 4)] {
        let f = (n - 1) / 3;
        let rule = Median::new(f);
        let d = 3 * n + 1;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
        let want = bits(&reference(&inputs, &rule));
        let silent = n - 1;
        let ended = run(
            sharded_quorum_spec(n, d),
            &rule,
            &inputs,
            &vec![Duration::ZERO; n],
            &|from, _, step, _, _| match from == silent && step >= silent_from {
                true => Fate::Dropped,
                false => Fate::After(MS),
            },
        );
        for (me, e) in ended.iter().enumerate().take(silent) {
            assert!(
                e.at < Duration::from_millis(100),
                "n = {n} rank {me}: {:?}",
                e.at
            );
            let report = e
                .result
                .as_ref()
                .unwrap_or_else(|err| panic!("n = {n} rank {me}: {err}"));
            assert_eq!(bits(&e.output), want, "n = {n} rank {me}");
            // Counted late where its versions were cut (they are from step 2 on); its sync
            // cut alone is not a fault.
            let late = PeerFault {
                rank: silent,
                fault: Fault::Late,
            };
            let faults = if silent_from <= 3 { vec![late] } else { vec![] };
            assert_eq!(
                report.faults, faults,
                "n = {n} from {silent_from} rank {me}"
            );
            let found = report.agreement.as_ref().expect("a cross-checked round");
            assert_eq!(found.unconfirmed, [silent], "n = {n} from {silent_from}");
        }
    }
}

/// Sharded rounds are quorum steps (`s = 1`, `2f + 1` owners, `Detect`): a rank that starts
/// 500 ms late sets no pace. The others end within 100 ms with the median of their own inputs
/// bitwise, naming it late; it hears its co-owners' syncs, leaves its own late piece out as
/// they did, and ends with their result (`erased_self`), asking nobody for a version.
#[test]
fn a_sharded_straggler_sets_no_pace_and_ends_with_the_others_result() {
    for n in [4, 7, 8] {
        let f = (n - 1) / 3;
        let rule = Median::new(f);
        let d = 3 * n + 1;
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
        let mut starts = vec![Duration::ZERO; n];
        starts[n - 1] = Duration::from_millis(500);
        let ended = run(
            sharded_quorum_spec(n, d),
            &rule,
            &inputs,
            &starts,
            &|from, to, _, _, _| Fate::After(MS * (1 + ((from + to) % 3) as u32)),
        );
        let want = bits(&reference(&inputs[..n - 1], &rule));
        for (me, e) in ended.iter().enumerate() {
            let report = e
                .result
                .as_ref()
                .unwrap_or_else(|err| panic!("n = {n} rank {me}: {err}"));
            assert_eq!(bits(&e.output), want, "n = {n} rank {me}");
            assert_eq!(report.stragglers, 1, "n = {n} rank {me}");
            assert_eq!(report.erased_self, me == n - 1, "n = {n} rank {me}");
            if me == n - 1 {
                assert!(
                    e.at < starts[me] + Duration::from_millis(100),
                    "n = {n}: the straggler took {:?}",
                    e.at
                );
                continue;
            }
            let late = PeerFault {
                rank: n - 1,
                fault: Fault::Late,
            };
            assert_eq!(report.faults, [late], "n = {n} rank {me}");
            assert!(
                e.at < Duration::from_millis(100),
                "n = {n} rank {me}: {:?}",
                e.at
            );
        }
    }
}

/// A piece late at one owner and in time at its co-owners (rank 3's pieces reach rank 0 after
/// the grace): the owners' sync has every owner of rank 0's shards leave rank 3's input out of
/// them, so the owners of each shard hold one version and every rank ends at once with one
/// result, bitwise: each coordinate the median without rank 3's input (rank 0's shards) or
/// with it (the others). Without the sync, rank 0's co-owners keep the piece and outvote its
/// version (with 3 owners of 4 ranks, the same split leaves two versions, neither `f + 1`
/// alike, and the round failed in the simulator before the sync).
#[test]
fn a_piece_late_at_one_owner_is_left_out_by_its_co_owners_alike() {
    let (n, d) = (7, 22);
    let rule = Median::new(2);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let starts = vec![Duration::ZERO; n];
    let ended = run(
        |me| {
            // 2f + 1 = 5 owners keep f + 1 = 3 alike with one late owner.
            let mut s = sharded_quorum_spec(n, d)(me);
            s.shape = Shape::Sharded(Replicas::Exactly(5));
            s
        },
        &rule,
        &inputs,
        &starts,
        &|from, to, step, _, _| match (from, to, step) {
            (3, 0, 0) => Fate::After(Duration::from_millis(200)),
            _ => Fate::After(MS),
        },
    );
    let with = bits(&reference(&inputs, &rule));
    let others: Vec<Vec<f32>> = (0..n)
        .filter(|&r| r != 3)
        .map(|r| inputs[r].clone())
        .collect();
    let without = bits(&reference(&others, &rule));
    let first = bits(&ended[0].output);
    assert!(
        first
            .iter()
            .zip(with.iter().zip(&without))
            .all(|(x, (a, b))| x == a || x == b),
        "{first:?}"
    );
    assert_ne!(first, with, "rank 3's input left out somewhere");
    for (me, e) in ended.iter().enumerate() {
        e.result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), first, "rank {me}");
        assert!(e.at < Duration::from_millis(100), "rank {me}: {:?}", e.at);
    }
}

/// A Byzantine co-owner's sync that names more senders than the stragglers allowed (all of
/// them, to strip the shards of their inputs) is ignored: its co-owners keep every input, and
/// every rank ends with the reference (without the limit they would have no input left).
#[test]
fn an_owners_sync_naming_more_than_s_senders_is_ignored() {
    let (n, d) = (7, 22);
    let rule = Median::new(2);
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(r, d)).collect();
    let starts = vec![Duration::ZERO; n];
    let ended = run(
        |me| {
            let mut s = sharded_quorum_spec(n, d)(me);
            s.shape = Shape::Sharded(Replicas::Exactly(5));
            s
        },
        &rule,
        &inputs,
        &starts,
        // Step 1 is the owners' sync: rank 1 says it holds nobody's pieces.
        &|from, _, step, _, bytes| match (from, step) {
            (1, 1) => Fate::Rewritten(MS, vec![0u8; bytes.len()].into()),
            _ => Fate::After(MS),
        },
    );
    let want = bits(&reference(&inputs, &rule));
    for (me, e) in ended.iter().enumerate() {
        let report = e
            .result
            .as_ref()
            .unwrap_or_else(|err| panic!("rank {me}: {err}"));
        assert_eq!(bits(&e.output), want, "rank {me}");
        assert_eq!(report.inputs, n, "rank {me}");
    }
}
