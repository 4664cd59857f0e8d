//! The round report, written into a struct and arrays the caller owns.

use std::ffi::c_char;
use std::ptr;

use byzcoll_rs::{Fault, IdentityMode, RoundReport};

use crate::buffers::{check_aligned, read_sized};
use crate::status::Failure;

/// A peer that sent nothing before the deadline, or whose connection is gone.
pub const BYZCOLL_FAULT_MISSING: i32 = 0;
/// A peer that sent something unacceptable (wrong length, bad frame).
pub const BYZCOLL_FAULT_MALFORMED: i32 = 1;
/// A peer that sent nothing by the end of a quorum step's grace, before the deadline: a
/// straggler, erased for that round so that it does not set the others' pace.
pub const BYZCOLL_FAULT_LATE: i32 = 2;
/// A peer whose message was for another call: its collective call's fingerprint (operation,
/// lengths, type, rule and parameters, policy, step id: `byzcoll_comm_set_step`) differs from
/// this rank's, so the ranks are out of step.
pub const BYZCOLL_FAULT_OUT_OF_STEP: i32 = 3;

/// `identity` of a report: no peers to authenticate (a world of one).
pub const BYZCOLL_IDENTITY_LOCAL: i32 = 0;
/// `identity`: every rank proved the key a public roster binds to it (`byzcoll launch`, or
/// `BYZCOLL_ROSTER_FILE` with `BYZCOLL_KEY_FILE`): a rank can claim only its own rank.
pub const BYZCOLL_IDENTITY_PER_RANK: i32 = 1;
/// `identity`: ranks proved the shared job secret only: a process holding it can register as
/// another rank.
pub const BYZCOLL_IDENTITY_SHARED_SECRET: i32 = 2;
/// `identity`: no authentication (`BYZCOLL_ALLOW_UNAUTHENTICATED=1`).
pub const BYZCOLL_IDENTITY_UNAUTHENTICATED: i32 = 3;

/// What happened in one robust round. The caller owns it and the arrays it points to:
/// initialise with `BYZCOLL_REPORT_INIT`, then point the arrays you want at storage for
/// `capacity` entries (NULL arrays are skipped). The library fills at most `capacity` entries
/// of each array and always the true counts, so `num_* > capacity` means truncated.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct byzcoll_report_t {
    /// `sizeof(byzcoll_report_t)` as the caller compiled it.
    pub size: usize,
    /// Entries each array below can hold.
    pub capacity: usize,
    /// Ranks treated as erasures this round.
    pub fault_ranks: *mut u32,
    /// For each of `fault_ranks`: `BYZCOLL_FAULT_MISSING`, `BYZCOLL_FAULT_MALFORMED`,
    /// `BYZCOLL_FAULT_LATE` or `BYZCOLL_FAULT_OUT_OF_STEP`.
    pub fault_kinds: *mut i32,
    /// Ranks whose vector held NaN or infinities (it still entered the rule).
    pub non_finite_ranks: *mut u32,
    /// Selection rules (Krum family): the ranks whose vectors were selected.
    pub selected_ranks: *mut u32,
    /// A NUL-terminated summary: every fault's reason, the agreement findings, and whether this
    /// rank's own input was left out (`Enforce`) (truncated to `text_capacity`).
    pub text: *mut c_char,
    /// Bytes `text` can hold, NUL included.
    pub text_capacity: usize,
    /// Out: vectors that entered this rank's aggregation (its own included).
    pub inputs: usize,
    /// Out: owners per shard (0 for the gather policy).
    pub replicas: usize,
    /// Out: number of faulty peers.
    pub num_faults: usize,
    /// Out: number of ranks with non-finite values.
    pub num_non_finite: usize,
    /// Out: number of selected ranks (0 unless `has_selection`).
    pub num_selected: usize,
    /// Out: 1 when the rule selects inputs.
    pub has_selection: i32,
    /// Out: 1 when the job runs without authentication.
    pub unauthenticated: i32,
    /// Out: 1 when the round ended with the agreement cross-check.
    pub agreement_checked: i32,
    /// Out: ranks that hold another result (named in `text`).
    pub num_disagreeing: usize,
    /// Out: ranks whose result is unknown (missing, failed, erased; named in `text`).
    pub num_unconfirmed: usize,
    /// Out: senders whose vectors differed between the ranks that used them (named in `text`).
    pub num_differing_inputs: usize,
    /// Out: peak bytes the collective held at once.
    pub peak_bytes: usize,
    /// Out: how the ranks proved who they are: `BYZCOLL_IDENTITY_PER_RANK`,
    /// `BYZCOLL_IDENTITY_SHARED_SECRET`, `BYZCOLL_IDENTITY_UNAUTHENTICATED` or
    /// `BYZCOLL_IDENTITY_LOCAL`.
    pub identity: i32,
    /// Attribution, per rank in rank order (`capacity` entries): the root mean square
    /// deviation of its input from the aggregate at the coordinates measured (0 for a rank
    /// whose input did not enter; `INFINITY` where it held NaN or infinities). Evidence for an
    /// operator, never acted on by the library.
    pub attribution_deviations: *mut f64,
    /// Attribution, per rank: that deviation in units of the inputs' median deviation (about
    /// 1 typical; above `BYZCOLL_OUTLYING_SCORE` outlying). Never NaN.
    pub attribution_scores: *mut f64,
    /// Attribution, per rank: the share of the coordinates measured where its value was among
    /// the `f` lowest or highest (what a trimmed mean would drop).
    pub attribution_extremes: *mut f64,
    /// The ranks whose attribution score exceeds `BYZCOLL_OUTLYING_SCORE`, ascending.
    pub outlying_ranks: *mut u32,
    /// Out: entries of the attribution arrays (the world size; 0 where the round was not
    /// measured).
    pub num_attributed: usize,
    /// Out: number of outlying ranks.
    pub num_outlying: usize,
}

/// The attribution score above which a rank is listed in `outlying_ranks`: three times the
/// inputs' median deviation from the aggregate.
pub const BYZCOLL_OUTLYING_SCORE: f64 = 3.0;
// Written out for cbindgen, which cannot follow the path.
const _: () = assert!(BYZCOLL_OUTLYING_SCORE == byzcoll_rs::OUTLYING_SCORE);

/// The caller's report, checked: where to write, and the arrays as they were checked.
pub(crate) struct Out(Option<(*mut byzcoll_report_t, byzcoll_report_t)>);

impl Out {
    /// # Safety
    /// `report` is NULL or points to an initialised report whose arrays hold `capacity`
    /// entries and whose `text` holds `text_capacity` bytes.
    pub(crate) unsafe fn new(report: *mut byzcoll_report_t) -> Result<Self, Failure> {
        if report.is_null() {
            return Ok(Out(None));
        }
        // SAFETY: non-null; the caller passes an initialised report.
        let r = unsafe {
            read_sized(
                report.cast_const(),
                "report",
                "byzcoll_report_t",
                "BYZCOLL_REPORT_INIT",
            )?
        };
        for (p, name) in [
            (r.fault_ranks.cast_const(), "report->fault_ranks"),
            (r.non_finite_ranks.cast_const(), "report->non_finite_ranks"),
            (r.selected_ranks.cast_const(), "report->selected_ranks"),
        ] {
            if !p.is_null() {
                check_aligned(p, name)?;
            }
        }
        if !r.fault_kinds.is_null() {
            check_aligned(r.fault_kinds.cast_const(), "report->fault_kinds")?;
        }
        if !r.outlying_ranks.is_null() {
            check_aligned(r.outlying_ranks.cast_const(), "report->outlying_ranks")?;
        }
        for (p, name) in [
            (r.attribution_deviations, "report->attribution_deviations"),
            (r.attribution_scores, "report->attribution_scores"),
            (r.attribution_extremes, "report->attribution_extremes"),
        ] {
            if !p.is_null() {
                check_aligned(p.cast_const(), name)?;
            }
        }
        Ok(Out(Some((report, r))))
    }

    /// Writes `round` into the caller's report.
    pub(crate) fn fill(&mut self, round: &RoundReport) {
        let Some((dst, checked)) = self.0 else { return };
        let mut r = checked;
        let faults: Vec<u32> = round.faults.iter().map(|f| f.rank as u32).collect();
        let kinds: Vec<i32> = round
            .faults
            .iter()
            .map(|f| match f.fault {
                Fault::Missing => BYZCOLL_FAULT_MISSING,
                Fault::Malformed(_) => BYZCOLL_FAULT_MALFORMED,
                Fault::Late => BYZCOLL_FAULT_LATE,
                Fault::OutOfStep => BYZCOLL_FAULT_OUT_OF_STEP,
            })
            .collect();
        let non_finite: Vec<u32> = round.non_finite.iter().map(|&r| r as u32).collect();
        let selected: Vec<u32> = round.selected.iter().flatten().map(|&r| r as u32).collect();
        let evidence = round.attribution.as_ref().map_or(&[][..], |a| &a.ranks[..]);
        let deviations: Vec<f64> = evidence.iter().map(|e| e.deviation).collect();
        let scores: Vec<f64> = evidence.iter().map(|e| e.score).collect();
        let extremes: Vec<f64> = evidence.iter().map(|e| e.extreme).collect();
        let outlying: Vec<u32> = round
            .attribution
            .iter()
            .flat_map(|a| a.outlying())
            .map(|r| r as u32)
            .collect();
        // SAFETY (all): each array is NULL or holds `capacity` entries (checked in `new`).
        unsafe {
            write_array(r.fault_ranks, r.capacity, &faults);
            write_array(r.fault_kinds, r.capacity, &kinds);
            write_array(r.non_finite_ranks, r.capacity, &non_finite);
            write_array(r.selected_ranks, r.capacity, &selected);
            write_array(r.attribution_deviations, r.capacity, &deviations);
            write_array(r.attribution_scores, r.capacity, &scores);
            write_array(r.attribution_extremes, r.capacity, &extremes);
            write_array(r.outlying_ranks, r.capacity, &outlying);
        }
        r.num_attributed = evidence.len();
        r.num_outlying = outlying.len();
        r.inputs = round.inputs;
        r.replicas = round.replicas.unwrap_or(0);
        r.num_faults = faults.len();
        r.num_non_finite = non_finite.len();
        r.num_selected = selected.len();
        r.has_selection = i32::from(round.selected.is_some());
        r.unauthenticated = i32::from(round.unauthenticated);
        r.agreement_checked = i32::from(round.agreement.is_some());
        let a = round.agreement.clone().unwrap_or_default();
        r.num_disagreeing = a.disagreeing.len();
        r.num_unconfirmed = a.unconfirmed.len();
        r.num_differing_inputs = a.differing_inputs.len();
        r.peak_bytes = round.peak_bytes;
        r.identity = match round.identity {
            IdentityMode::PerRank => BYZCOLL_IDENTITY_PER_RANK,
            IdentityMode::SharedSecret => BYZCOLL_IDENTITY_SHARED_SECRET,
            IdentityMode::Unauthenticated => BYZCOLL_IDENTITY_UNAUTHENTICATED,
            _ => BYZCOLL_IDENTITY_LOCAL,
        };
        let mut text = String::new();
        for f in &round.faults {
            text.push_str(&format!("{f}; "));
        }
        if !round.non_finite.is_empty() {
            text.push_str(&format!("non-finite values from {:?}; ", round.non_finite));
        }
        if !outlying.is_empty() {
            text.push_str(&format!("outlying inputs from {outlying:?}; "));
        }
        if let Some(a) = &round.agreement {
            if !(a.disagreeing.is_empty()
                && a.unconfirmed.is_empty()
                && a.differing_inputs.is_empty())
            {
                text.push_str(&format!(
                    "agreement: other results at {:?}, unconfirmed {:?}, differing inputs from \
                     {:?}, differing versions from {:?}; ",
                    a.disagreeing, a.unconfirmed, a.differing_inputs, a.differing_versions
                ));
            }
            if !a.realigned.is_empty() {
                text.push_str(&format!(
                    "realigned: left out the inputs of {:?} to take the result the others \
                     hold (they went without them); ",
                    a.realigned
                ));
            }
            if !a.recovered.is_empty() {
                text.push_str(&format!(
                    "recovered: the inputs of {:?} came late and were passed on by ranks that \
                     had them in time; ",
                    a.recovered
                ));
            }
        }
        if let Some(a) = &round.audit {
            if !a.convicted.is_empty() {
                let owners: Vec<usize> = a.convicted.iter().map(|l| l.owner).collect();
                text.push_str(&format!(
                    "convicted owners {owners:?} (proven lies; shards {:?} aggregated again); ",
                    a.recomputed
                ));
            }
            if !a.refused.is_empty() {
                text.push_str(&format!("audits refused by {:?}; ", a.refused));
            }
            if !a.false_accusers.is_empty() {
                let ranks: Vec<usize> = a.false_accusers.iter().map(|(r, _)| *r).collect();
                text.push_str(&format!("false accusations from {ranks:?}; "));
            }
        }
        if round.erased_self {
            text.push_str(
                "own input left out: it did not reach the other ranks in time, and this \
                 rank went without it as they did; ",
            );
        }
        if !round.skipped_by.is_empty() {
            text.push_str(&format!(
                "ranks {:?} went on without this rank (it fell behind them); ",
                round.skipped_by
            ));
        }
        if round.unauthenticated {
            text.push_str("UNAUTHENTICATED job; ");
        }
        // SAFETY: NULL or `text_capacity` bytes.
        unsafe { write_text(r.text, r.text_capacity, text.trim_end_matches("; ")) };
        // SAFETY: `dst` was checked in `new`; only the outputs differ from what the caller wrote.
        unsafe { dst.write(r) };
    }

    /// Writes the round's outcome: its report, or on failure the peers at fault; passes the
    /// outcome on.
    pub(crate) fn record(&mut self, round: Result<RoundReport, Failure>) -> Result<(), Failure> {
        match round {
            Ok(r) => {
                self.fill(&r);
                Ok(())
            }
            Err(e) => {
                self.failed(&e);
                Err(e)
            }
        }
    }

    /// A failed round: the peers at fault where the error names them, every other output zero.
    pub(crate) fn failed(&mut self, failure: &Failure) {
        self.fill(&RoundReport {
            faults: failure.faults.clone(),
            ..RoundReport::default()
        });
    }
}

/// # Safety
/// `dst` is NULL or holds `capacity` entries.
unsafe fn write_array<T: Copy>(dst: *mut T, capacity: usize, src: &[T]) {
    if dst.is_null() {
        return;
    }
    let n = src.len().min(capacity);
    if n == 0 {
        return;
    }
    // SAFETY: the caller's array holds `capacity >= n` entries.
    unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst, n) };
}

/// # Safety
/// `dst` is NULL or holds `capacity` bytes.
unsafe fn write_text(dst: *mut c_char, capacity: usize, text: &str) {
    if dst.is_null() || capacity == 0 {
        return;
    }
    let n = text.len().min(capacity - 1);
    // SAFETY: `n + 1 <= capacity`.
    unsafe {
        ptr::copy_nonoverlapping(text.as_ptr().cast(), dst, n);
        dst.add(n).write(0);
    }
}
