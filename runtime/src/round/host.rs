//! The host plane: a round's data in host memory, aggregated by the CPU rules. The
//! `Communicator`'s driver runs rounds on it; so can anything that holds its vectors as host
//! slices and its messages as [`Payload`]s.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use byzcoll_aggregators::evidence::{self, Measure};
use byzcoll_aggregators::{
    aggregate_into, AggError, AggReport, Aggregator, DistanceMixing, DistanceSelection, Element,
    Median,
};

use super::{commitment, input_digest, result_digest, Dest, Digest, Msg, Plane, Src};
use crate::schedule::chunk_range;
use crate::types::{cast_bytes, cast_payload, fill_bytes, host_bytes, to_bytes};
use crate::{Payload, Rank};

/// Rewrites the result a Byzantine shard owner sends for `shard` to `dest` (a test double's
/// hook: feature `fault-injection`).
pub type Tamper = Arc<dyn Fn(usize, Rank, &[u8]) -> Bytes + Send + Sync>;

/// Where a host round reads its input and writes its result.
#[derive(Debug)]
pub enum Target<'a, T> {
    /// All-reduce: the vector is the input, and the result comes back into it.
    All(&'a mut [T]),
    /// Reduce-scatter: only this rank's own shard comes back, into `output`.
    OwnShard {
        /// The whole input.
        input: &'a [T],
        /// This rank's shard of the result.
        output: &'a mut [T],
    },
}

/// A round's data on the host (see the module docs).
pub struct HostPlane<'a, T> {
    target: Target<'a, T>,
    me: Rank,
    n: usize,
    /// The owned shards' results, by position among the owned shards, computed straight into
    /// their wire form (sent to every rank that takes them, without a copy).
    results: Vec<Bytes>,
    /// Their BLAKE3 digests, made once: sent to the takers of versions by digest, and
    /// compared with the co-owners'.
    result_digests: Vec<Option<Digest>>,
    /// The iterative rules' estimates, by owned shard.
    estimates: Vec<Vec<f64>>,
    /// Whether [`Plane::measure`] measures ([`HostPlane::measuring`]).
    measuring: bool,
    /// The measure of the inputs against the output (gather mode), taken as `aggregate`
    /// writes it, by position among the inputs, until [`Plane::measure`] asks for it.
    output_measure: Option<Measure>,
    /// The whole input's wire form (gather mode), made once.
    input_payload: Option<Payload>,
    /// The pieces' wire forms (sharded mode), by shard, made once.
    pieces: Vec<Option<Payload>>,
    tamper: Option<Tamper>,
    /// The output was written over the caller's vector ([`Target::All`]).
    output_written: bool,
    /// [`HostPlane::keeping_input`].
    keep_input: bool,
    /// The input's bytes, kept for an audited round ([`HostPlane::auditing`]).
    audit_input: Option<Bytes>,
}

impl<T> std::fmt::Debug for HostPlane<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPlane")
            .field("me", &self.me)
            .field("n", &self.n)
            .field("tamper", &self.tamper.is_some())
            .finish_non_exhaustive()
    }
}

impl<'a, T: Element> HostPlane<'a, T> {
    /// Rank `me` of `n`'s data; `tamper` rewrites the results it sends as a shard owner.
    pub fn new(target: Target<'a, T>, me: Rank, n: usize, tamper: Option<Tamper>) -> Self {
        HostPlane {
            target,
            me,
            n,
            results: Vec::new(),
            result_digests: Vec::new(),
            estimates: Vec::new(),
            measuring: true,
            output_measure: None,
            input_payload: None,
            pieces: vec![None; n],
            tamper,
            output_written: false,
            keep_input: false,
            audit_input: None,
        }
    }

    /// Keeps a copy of the input's bytes for an audited round (`Policy::Audited`), where the
    /// result overwrites the caller's vector shard by shard while the input is still needed:
    /// the owner serves its own piece to its auditors, and every rank sends its piece of a
    /// convicted owner's shard again. Off unless turned on here (it costs a copy of the
    /// vector).
    pub fn auditing(mut self, on: bool) -> Self {
        self.audit_input = on.then(|| to_bytes(self.input()));
        self
    }

    /// The input's bytes (an audited round's pieces are signed over them).
    pub fn input_bytes(&self) -> Cow<'_, [u8]> {
        match &self.audit_input {
            Some(b) => Cow::Borrowed(&b[..]),
            None => Cow::Borrowed(bytemuck::cast_slice(self.input())),
        }
    }

    /// Whether rounds on this plane measure their inputs against the results
    /// ([`Plane::measure`]; on unless turned off here).
    pub fn measuring(mut self, on: bool) -> Self {
        self.measuring = on;
        self
    }

    fn input(&self) -> &[T] {
        match &self.target {
            Target::All(buf) => buf,
            Target::OwnShard { input, .. } => input,
        }
    }

    /// The bytes of `msg` for `dest`.
    pub fn payload(&mut self, msg: &Msg, dest: Rank) -> Payload {
        match msg {
            Msg::Input => {
                if self.input_payload.is_none() {
                    self.input_payload = Some(Payload::Host(to_bytes(self.input())));
                }
                self.input_payload.clone().expect("made above")
            }
            Msg::Piece(s) => {
                if self.pieces[*s].is_none() {
                    let range = chunk_range(self.input().len(), self.n, *s);
                    // An audited round sends pieces again after the result overwrote the
                    // input: from the copy it keeps.
                    let piece = match &self.audit_input {
                        Some(b) => {
                            let e = std::mem::size_of::<T>();
                            b.slice(range.start * e..range.end * e)
                        }
                        None => to_bytes(&self.input()[range]),
                    };
                    self.pieces[*s] = Some(Payload::Host(piece));
                }
                self.pieces[*s].clone().expect("made above")
            }
            Msg::Result(s) => {
                let i = (self.me + self.n - s) % self.n;
                let honest = self.results.get(i).cloned().unwrap_or_default();
                match &self.tamper {
                    Some(t) => Payload::Host(t(*s, dest, &honest)),
                    None => Payload::Host(honest),
                }
            }
            Msg::ResultDigest(s) => {
                let i = (self.me + self.n - s) % self.n;
                let digest = match &self.tamper {
                    Some(t) => {
                        let honest = self.results.get(i).cloned().unwrap_or_default();
                        commitment::<u8>(&t(*s, dest, &honest))
                    }
                    None => self.result_commitment(i),
                };
                Payload::Host(Bytes::copy_from_slice(&digest))
            }
            Msg::Empty => Payload::Host(Bytes::new()),
            Msg::Bytes(b) => Payload::Host(b.clone()),
            Msg::Forward(j) => unreachable!(
                "slot {j}'s message is the round's to forward (Round::held), not the plane's"
            ),
        }
    }

    /// Keeps the input's wire form until the round ends, where the round may aggregate again
    /// after the output overwrote the caller's vector ([`Plane::keeps_input`]: a gather-mode
    /// round under `Agreement::Detect`); off unless turned on here.
    pub fn keeping_input(mut self, on: bool) -> Self {
        self.keep_input = on;
        self
    }

    /// Drops the wire forms of the input and its pieces (sent; the transport holds what it
    /// still needs), but the input's where it is [kept](HostPlane::keeping_input).
    pub fn release_sent(&mut self) {
        if !self.keep_input {
            self.input_payload = None;
        }
        self.pieces.iter_mut().for_each(|p| *p = None);
    }

    fn view<'b>(&'b self, src: &Src<'b, Payload>) -> Cow<'b, [T]> {
        match src {
            // The caller's vector holds the output now: the input is in its wire form where
            // it is kept ([`Plane::keeps_input`], which is false without it).
            Src::Mine(range) if self.output_written && self.input_payload.is_some() => {
                match self.input_payload.as_ref().map(cast_payload::<T>) {
                    Some(Cow::Borrowed(all)) => Cow::Borrowed(&all[range.clone()]),
                    Some(Cow::Owned(all)) => Cow::Owned(all[range.clone()].to_vec()),
                    None => Cow::Borrowed(&[]),
                }
            }
            Src::Mine(range) => Cow::Borrowed(&self.input()[range.clone()]),
            Src::Got(p) => cast_payload::<T>(p),
            Src::Owned(i) => cast_bytes(&self.results[*i]),
        }
    }

    /// A shard's inputs by rank, with the first present one standing in for erased ones
    /// (which callers mark non-finite or never select, so its values are never used).
    fn placeholder_views<'b>(&'b self, inputs: &[Option<Src<'b, Payload>>]) -> Vec<Cow<'b, [T]>> {
        let stand_in = inputs.iter().flatten().next().map(|s| self.view(s));
        inputs
            .iter()
            .map(|x| match x {
                Some(src) => self.view(src),
                None => stand_in.clone().unwrap_or(Cow::Borrowed(&[])),
            })
            .collect()
    }

    fn set_result(&mut self, i: usize, out: Bytes) {
        if self.results.len() <= i {
            self.results.resize_with(i + 1, Bytes::new);
            self.result_digests.resize(i + 1, None);
        }
        self.results[i] = out;
        self.result_digests[i] = None;
    }

    /// The BLAKE3 digest of owned result `i` ([`commitment`] of its bytes), made once.
    fn result_commitment(&mut self, i: usize) -> Digest {
        if self.result_digests.len() <= i {
            self.result_digests.resize(i + 1, None);
        }
        let results = &self.results;
        *self.result_digests[i]
            .get_or_insert_with(|| commitment::<u8>(results.get(i).map_or(&[][..], |b| &b[..])))
    }
}

/// `len` elements that `compute` writes, straight into a wire buffer (`compute`'s error
/// leaves no buffer behind).
fn computed<T: Element, R, E>(
    len: usize,
    compute: impl FnOnce(&mut [T]) -> Result<R, E>,
) -> Result<(Bytes, R), E> {
    let mut outcome = None;
    let bytes = fill_bytes(len, |out: &mut [T]| outcome = Some(compute(out)));
    outcome
        .expect("fill_bytes calls its fill once")
        .map(|r| (bytes, r))
}

fn refs<'b, T: Clone>(views: &'b [Cow<'_, [T]>]) -> Vec<&'b [T]> {
    views.iter().map(|v| v.as_ref()).collect()
}

impl<T: Element> Plane for HostPlane<'_, T> {
    type Buf = Payload;

    fn host<'b>(&'b self, buf: &'b Payload) -> Cow<'b, [u8]> {
        Cow::Borrowed(host_bytes(buf))
    }

    fn digest(&mut self, src: Src<'_, Payload>) -> Digest {
        match src {
            Src::Got(p) => input_digest::<u8>(host_bytes(p)),
            other => input_digest(&self.view(&other)),
        }
    }

    fn commitment(&mut self, src: Src<'_, Payload>) -> Digest {
        match src {
            Src::Got(p) => commitment::<u8>(host_bytes(p)),
            Src::Owned(i) => self.result_commitment(i),
            other => commitment(&self.view(&other)),
        }
    }

    fn finite(&mut self, src: Src<'_, Payload>) -> bool {
        byzcoll_aggregators::all_finite(&self.view(&src))
    }

    fn aggregate(
        &mut self,
        rule: &dyn Aggregator,
        inputs: &[Src<'_, Payload>],
        to: Dest,
    ) -> Result<AggReport, AggError> {
        let views: Vec<Cow<'_, [T]>> = inputs.iter().map(|s| self.view(s)).collect();
        let len = views.first().map_or(0, |v| v.len());
        match to {
            // Written only on success: on error the caller's vector is unchanged.
            Dest::Output => {
                let mut out = vec![T::zeroed(); len];
                let report = aggregate_into(rule, &refs(&views), &mut out)?;
                // Measured now: the output overwrites this rank's own input.
                let present: Vec<Option<&[T]>> = views.iter().map(|v| Some(v.as_ref())).collect();
                let measured = self
                    .measuring
                    .then(|| evidence::measure(&present, &out, rule.byzantine()));
                drop(present);
                drop(views);
                self.output_measure = measured;
                match &mut self.target {
                    Target::All(buf) => {
                        buf.copy_from_slice(&out);
                        self.output_written = true;
                    }
                    Target::OwnShard { output, .. } => output.copy_from_slice(&out),
                }
                Ok(report)
            }
            Dest::Owned(i) => {
                let (out, report) = computed(len, |out| aggregate_into(rule, &refs(&views), out))?;
                drop(views);
                self.set_result(i, out);
                Ok(report)
            }
        }
    }

    fn combine(
        &mut self,
        _s: usize,
        range: Range<usize>,
        versions: &[Src<'_, Payload>],
    ) -> Result<(), AggError> {
        let HostPlane {
            target, results, ..
        } = self;
        let views: Vec<Cow<'_, [T]>> = versions
            .iter()
            .map(|src| match src {
                Src::Got(p) => cast_payload::<T>(p),
                Src::Owned(i) => cast_bytes(&results[*i]),
                Src::Mine(_) => unreachable!("versions never come from the input"),
            })
            .collect();
        let out = match target {
            Target::All(buf) => &mut buf[range],
            Target::OwnShard { output, .. } => &mut output[..],
        };
        let median = Median::new(views.len().saturating_sub(1) / 2);
        if let [only] = &views[..] {
            // The median of one version is that version: copied, refused where it is not
            // finite, as the median would. Each run is checked right after its copy, while it
            // is still in cache (one pass over memory, not two).
            const RUN: usize = 16 << 10;
            let bad = out
                .chunks_mut(RUN)
                .zip(only.chunks(RUN))
                .enumerate()
                .find_map(|(k, (dst, src))| {
                    dst.copy_from_slice(src);
                    byzcoll_aggregators::first_non_finite(dst).map(|c| k * RUN + c)
                });
            return match bad {
                Some(coordinate) => Err(AggError::NonFiniteResult {
                    rule: median.name().to_string(),
                    f: 0,
                    coordinate,
                }),
                None => Ok(()),
            };
        }
        aggregate_into(&median, &refs(&views), out).map(|_| ())
    }

    fn distance_table(&mut self, inputs: &[Option<Src<'_, Payload>>]) -> Vec<f64> {
        let present: Vec<bool> = inputs.iter().map(Option::is_some).collect();
        let views = self.placeholder_views(inputs);
        byzcoll_aggregators::distance::distance_table_of_present(&refs(&views), &present)
    }

    fn finish_selected(
        &mut self,
        selection: &dyn DistanceSelection,
        inputs: &[Option<Src<'_, Payload>>],
        selected: &[usize],
        i: usize,
    ) -> Result<(), AggError> {
        let views = self.placeholder_views(inputs);
        let len = views.first().map_or(0, |v| v.len());
        let r = refs(&views);
        let (out, ()) = computed(len, |out| {
            selection.finish(T::inputs(&r), selected, T::output(out))
        })?;
        drop(views);
        self.set_result(i, out);
        Ok(())
    }

    fn estimate_start(
        &mut self,
        i: usize,
        inputs: &[Option<Src<'_, Payload>>],
    ) -> Result<(), AggError> {
        let views: Vec<Cow<'_, [T]>> = inputs.iter().flatten().map(|s| self.view(s)).collect();
        let len = views.first().map_or(0, |v| v.len());
        let mut m = vec![T::zeroed(); len];
        aggregate_into(
            &Median::new(views.len().saturating_sub(1) / 2),
            &refs(&views),
            &mut m,
        )?;
        drop(views);
        if self.estimates.len() <= i {
            self.estimates.resize_with(i + 1, Vec::new);
        }
        self.estimates[i] = m.iter().map(|v| v.to_f64()).collect();
        Ok(())
    }

    fn estimate_distances(&mut self, i: usize, inputs: &[Option<Src<'_, Payload>>]) -> Vec<f64> {
        let finite: Vec<bool> = inputs
            .iter()
            .map(|x| {
                x.as_ref()
                    .is_some_and(|s| byzcoll_aggregators::all_finite(&self.view(s)))
            })
            .collect();
        let views = self.placeholder_views(inputs);
        byzcoll_aggregators::iteration::sq_distances_to(&refs(&views), &finite, &self.estimates[i])
    }

    fn estimate_step(
        &mut self,
        i: usize,
        inputs: &[Option<Src<'_, Payload>>],
        a: f64,
        w: &[f64],
    ) -> (f64, f64) {
        let views = self.placeholder_views(inputs);
        let z = &self.estimates[i];
        let mut next = vec![0.0f64; z.len()];
        byzcoll_aggregators::iteration::step_into(&refs(&views), a, w, z, &mut next);
        let change: f64 = next.iter().zip(z).map(|(p, q)| (p - q) * (p - q)).sum();
        let size: f64 = z.iter().map(|q| q * q).sum();
        drop(views);
        self.estimates[i] = next;
        (change, size)
    }

    fn estimate_finish(&mut self, i: usize) -> Result<(), String> {
        let estimate = &self.estimates[i];
        let (out, ()) = computed(estimate.len(), |out: &mut [T]| {
            for (o, &v) in out.iter_mut().zip(estimate) {
                *o = T::from_f64(v);
            }
            match byzcoll_aggregators::all_finite(out) {
                true => Ok(()),
                false => Err("the estimate is not finite".to_string()),
            }
        })?;
        self.set_result(i, out);
        Ok(())
    }

    fn mix(
        &mut self,
        mixing: &dyn DistanceMixing,
        inputs: &[Src<'_, Payload>],
        neighbours: &[Option<Vec<usize>>],
        i: usize,
    ) -> Result<(), AggError> {
        let views: Vec<Cow<'_, [T]>> = inputs.iter().map(|s| self.view(s)).collect();
        let mixed = byzcoll_aggregators::mix(&refs(&views), neighbours);
        drop(views);
        let refs: Vec<&[T]> = mixed.iter().map(Vec::as_slice).collect();
        let len = refs.first().map_or(0, |v| v.len());
        let (out, _) = computed(len, |out| aggregate_into(mixing.inner(), &refs, out))?;
        self.set_result(i, out);
        Ok(())
    }

    fn keeps_input(&self) -> bool {
        // The input's wire form, made for the gather step, outlives the caller's vector.
        matches!(self.target, Target::All(_)) && self.input_payload.is_some()
    }

    fn result_digest(&mut self) -> Digest {
        let out: &[T] = match &self.target {
            Target::All(buf) => buf,
            Target::OwnShard { output, .. } => output,
        };
        result_digest(out)
    }

    fn measure(
        &mut self,
        inputs: &[Option<Src<'_, Payload>>],
        of: Dest,
        f: usize,
    ) -> Option<Measure> {
        if !self.measuring {
            return None;
        }
        let Dest::Owned(i) = of else {
            // Measured by `aggregate`, by position among the present inputs.
            let by_position = self.output_measure.take()?;
            let mut by_rank = Measure::new(inputs.len());
            let ranks = inputs.iter().enumerate().filter(|(_, x)| x.is_some());
            for (at, (p, _)) in ranks.enumerate() {
                by_rank.coordinates[p] = by_position.coordinates[at];
                by_rank.sq_deviation[p] = by_position.sq_deviation[at];
                by_rank.extreme[p] = by_position.extreme[at];
            }
            return Some(by_rank);
        };
        let views: Vec<Option<Cow<'_, [T]>>> = inputs
            .iter()
            .map(|x| x.as_ref().map(|src| self.view(src)))
            .collect();
        let refs: Vec<Option<&[T]>> = views.iter().map(|v| v.as_deref()).collect();
        Some(evidence::measure(&refs, &cast_bytes(&self.results[i]), f))
    }

    fn host_bytes(&mut self, src: Src<'_, Payload>) -> Option<Vec<u8>> {
        let e = std::mem::size_of::<T>();
        match src {
            // The input as it was, whatever the output overwrote since.
            Src::Mine(range) => self
                .audit_input
                .as_ref()
                .map(|b| b[range.start * e..range.end * e].to_vec()),
            // The result as this rank sends it (a fault-injection owner's tamper, as it would
            // send it to itself, included).
            Src::Owned(i) => {
                let honest = self.results.get(i).cloned().unwrap_or_default();
                Some(match &self.tamper {
                    Some(t) => t((self.me + self.n - i) % self.n, self.me, &honest).to_vec(),
                    None => honest.to_vec(),
                })
            }
            Src::Got(p) => Some(host_bytes(p).to_vec()),
        }
    }

    fn write_output(&mut self, at: usize, bytes: &[u8]) -> bool {
        match &mut self.target {
            Target::All(buf) => {
                let v: Vec<T> = bytemuck::pod_collect_to_vec(bytes);
                match buf.get_mut(at..at + v.len()) {
                    Some(out) => {
                        out.copy_from_slice(&v);
                        true
                    }
                    None => false,
                }
            }
            Target::OwnShard { .. } => false,
        }
    }

    fn output_digest(&mut self, _s: usize, range: Range<usize>) -> Digest {
        // As `combine` writes: a reduce-scatter's output is its one shard.
        let out: &[T] = match &self.target {
            Target::All(buf) => &buf[range],
            Target::OwnShard { output, .. } => output,
        };
        commitment(out)
    }
}

#[cfg(test)]
mod round_tests {
    use std::time::Duration;

    use byzcoll_aggregators::Median;
    use byzcoll_proto::round::{Arrival, Carry, Round, Shape, Spec};
    use byzcoll_proto::{Agreement, Error, Replicas};

    use super::*;

    /// A 16-bit element goes as its two bytes (little-endian), whole inputs and pieces alike.
    #[test]
    fn narrow_elements_go_as_two_bytes() {
        let values: Vec<half::bf16> = (0..10)
            .map(|j| half::bf16::from_f32(j as f32 - 4.5))
            .collect();
        let mut v = values.clone();
        let mut plane = HostPlane::new(Target::All(&mut v), 0, 4, None);
        let le: Vec<u8> = values
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect();
        assert_eq!(host_bytes(&plane.payload(&Msg::Input, 1)), &le[..]);
        let piece = chunk_range(10, 4, 1);
        assert_eq!(
            host_bytes(&plane.payload(&Msg::Piece(1), 1)),
            &le[2 * piece.start..2 * piece.end]
        );
    }

    /// Rank 0 of 4's sharded median over `r` owners per shard with rank 3 silent from the
    /// first step on, after a sub-round that left `lag`: the stretch of each step it posts
    /// (in step timeouts), the lag it leaves, and whether its shard was lost. (The other
    /// peers send zeros, which the cross-check does not take for checks: only the steps'
    /// timeouts matter here.)
    fn silent_peer(r: usize, lag: u32) -> (Vec<u32>, u32, bool) {
        let t = Duration::from_millis(100);
        let spec = Spec {
            me: 0,
            n: 4,
            d: 8,
            elem: 4,
            shape: Shape::Sharded(Replicas::Exactly(r)),
            agreement: Agreement::Detect,
            timeout: t,
            stragglers: 0,
            grace: byzcoll_proto::Grace::DEFAULT,
        };
        let rule = Median::new(1);
        let mut v = vec![1.0f32; 8];
        let mut plane = HostPlane::new(Target::All(&mut v), 0, 4, None);
        let carry = Carry {
            lag,
            ..Carry::default()
        };
        let mut round = Round::resuming(spec, &rule, &carry);
        let mut stretches = Vec::new();
        while let Some(plan) = round.step() {
            stretches.push((plan.timeout.as_millis() / t.as_millis()) as u32);
            let outcomes = plan
                .recvs
                .iter()
                .map(|r| match r.peer {
                    3 => Arrival::Missing,
                    _ => Arrival::Received(Payload::Host(Bytes::from(vec![0u8; r.len]))),
                })
                .collect();
            round.handle(&mut plane, outcomes);
        }
        let lag = round.lag();
        let lost = matches!(round.finish(), Err(Error::ShardLost { .. }));
        (stretches, lag, lost)
    }

    /// Each step waits a step timeout more than the one before (a rank that waited out a
    /// deadline is that much behind those that did not), plus the lag an earlier sub-round
    /// left; a round in which a peer went missing leaves the stretch of its last step.
    #[test]
    fn each_step_waits_longer_and_a_missing_peer_leaves_its_lag() {
        // Two owners per shard: rank 3 is an erasure after the scatter, and only the scatter
        // waits for it; a rank that still sends to it can wait out every later step (scatter,
        // versions by digest, requests, resends, cross-check).
        assert_eq!(silent_peer(2, 0), (vec![1, 2, 3, 4, 5], 5, false));
        assert_eq!(silent_peer(2, 4), (vec![5, 6, 7, 8, 9], 9, false));
        // One owner: rank 3's shard is lost, and the failed round's cross-check waits for
        // every peer, rank 3 too.
        assert_eq!(silent_peer(1, 0), (vec![1, 2, 3], 3, true));
    }
}
