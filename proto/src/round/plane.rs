//! [`Plane`]: the data side of a round, which each driver implements where its vectors live.

use std::borrow::Cow;
use std::ops::Range;

use byzcoll_aggregators::evidence::Measure;
use byzcoll_aggregators::{AggError, AggReport, Aggregator, DistanceMixing, DistanceSelection};

use super::{Digest, Src};

/// Where an aggregation writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// The caller's output (gather mode: the whole vector, written only on success).
    Output,
    /// The result of the `i`-th owned shard.
    Owned(usize),
}

/// The data side of a round: where the vectors live and what runs on them. The host driver's
/// plane works on host slices (`HostPlane` in `byzcoll-runtime`), the simulator's on its shared store, the
/// device path's on GPU memory. Every method is synchronous and deterministic.
pub trait Plane {
    /// A received message.
    type Buf;

    /// A received message's bytes on the host (statistics and cross-checks: small).
    fn host<'b>(&'b self, buf: &'b Self::Buf) -> Cow<'b, [u8]>;

    /// The digest of an input as this rank used it (XXH3-128, [`input_digest`](super::input_digest)).
    fn digest(&mut self, src: Src<'_, Self::Buf>) -> Digest;

    /// A collision-resistant digest of a whole input (BLAKE3 of its bytes): what the ranks
    /// agree on under [`Agreement::Enforce`](crate::Agreement::Enforce), where a sender could otherwise craft two vectors
    /// with one [`Plane::digest`].
    fn commitment(&mut self, src: Src<'_, Self::Buf>) -> Digest;

    /// Whether every element of `src` is finite.
    fn finite(&mut self, src: Src<'_, Self::Buf>) -> bool;

    /// `rule` over `inputs` (rank order) into `to`.
    ///
    /// # Errors
    /// The rule's (input indices are positions in `inputs`).
    fn aggregate(
        &mut self,
        rule: &dyn Aggregator,
        inputs: &[Src<'_, Self::Buf>],
        to: Dest,
    ) -> Result<AggReport, AggError>;

    /// The coordinate-wise median of `versions` (owner order) into shard `s` of the output
    /// (its elements `range`, or the whole output in a reduce-scatter): one version is copied,
    /// refused where it is not finite.
    ///
    /// # Errors
    /// [`AggError::NonFiniteResult`] with the coordinate within the shard.
    fn combine(
        &mut self,
        s: usize,
        range: Range<usize>,
        versions: &[Src<'_, Self::Buf>],
    ) -> Result<(), AggError>;

    /// The pairwise squared-distance table (`n × n`, `f64`) of one shard's inputs, rank order;
    /// erased inputs (`None`) count as infinitely far.
    fn distance_table(&mut self, inputs: &[Option<Src<'_, Self::Buf>>]) -> Vec<f64>;

    /// A selection rule's owned shard `i`: `selection` finishes over the `selected` inputs.
    ///
    /// # Errors
    /// The rule's; [`AggError::Backend`] where the plane cannot run it.
    fn finish_selected(
        &mut self,
        selection: &dyn DistanceSelection,
        inputs: &[Option<Src<'_, Self::Buf>>],
        selected: &[usize],
        i: usize,
    ) -> Result<(), AggError>;

    /// Starts the estimate of an iterative rule on owned shard `i`: the median of the present
    /// inputs.
    ///
    /// # Errors
    /// The median's; [`AggError::Backend`] where the plane cannot run iterative rules.
    fn estimate_start(
        &mut self,
        i: usize,
        inputs: &[Option<Src<'_, Self::Buf>>],
    ) -> Result<(), AggError>;

    /// The squared distances (`n`, rank order; erased or non-finite inputs: `+inf`) from each
    /// input of owned shard `i` to its estimate.
    fn estimate_distances(&mut self, i: usize, inputs: &[Option<Src<'_, Self::Buf>>]) -> Vec<f64>;

    /// One step of the estimate of owned shard `i` with coefficients `a`, `w`; returns the
    /// squared change and the squared size of the previous estimate.
    fn estimate_step(
        &mut self,
        i: usize,
        inputs: &[Option<Src<'_, Self::Buf>>],
        a: f64,
        w: &[f64],
    ) -> (f64, f64);

    /// Writes the estimate of owned shard `i` as its result.
    ///
    /// # Errors
    /// Why it cannot (the estimate is not finite).
    fn estimate_finish(&mut self, i: usize) -> Result<(), String>;

    /// A mixing rule's owned shard `i`: mixes the inputs with `neighbours`, then applies the
    /// coordinate-wise `inner` rule.
    ///
    /// # Errors
    /// The rule's.
    fn mix(
        &mut self,
        mixing: &dyn DistanceMixing,
        inputs: &[Src<'_, Self::Buf>],
        neighbours: &[Option<Vec<usize>>],
        i: usize,
    ) -> Result<(), AggError>;

    /// Whether [`Src::Mine`] still reads this rank's input once [`Dest::Output`] was written
    /// (the caller's vector is both): then a gather-mode round under [`Agreement::Detect`](crate::Agreement::Detect) can
    /// aggregate again over the inputs that the ranks holding the common result used
    /// ([`AgreementReport::realigned`](crate::AgreementReport::realigned)). `false` (the
    /// default): such a rank gets [`Error::Disagreement`](crate::Error::Disagreement) instead.
    fn keeps_input(&self) -> bool {
        false
    }

    /// The bytes of `src` on the host: what an audited round hashes, cuts and forwards
    /// (`PROTOCOL.md`, "Audited sharding"). `None` (the default): this plane does not run
    /// audited rounds, which then fail with [`Error::Unsupported`](crate::Error::Unsupported).
    fn host_bytes(&mut self, src: Src<'_, Self::Buf>) -> Option<Vec<u8>> {
        let _ = src;
        None
    }

    /// Writes `bytes` over the output from element `at`: the shard an audited round
    /// aggregated again after convicting its owner. `false`: as [`Plane::host_bytes`].
    fn write_output(&mut self, at: usize, bytes: &[u8]) -> bool {
        let _ = (at, bytes);
        false
    }

    /// The BLAKE3 digest of the output (all-reduce), what the cross-check compares.
    fn result_digest(&mut self) -> Digest;

    /// The BLAKE3 digest ([`commitment`](super::commitment) of its bytes) of shard `s` of the output
    /// (its elements `range`) as [`Plane::combine`] wrote it.
    fn output_digest(&mut self, s: usize, range: Range<usize>) -> Digest;

    /// Measures `inputs` (rank order; `None`: erased) against the result the rule (tolerating
    /// `f`) made of them at `of` ([`byzcoll_aggregators::evidence::measure`]): the
    /// [`RoundReport::attribution`](crate::RoundReport::attribution). `None` where this plane does not measure (the default).
    fn measure(
        &mut self,
        inputs: &[Option<Src<'_, Self::Buf>>],
        of: Dest,
        f: usize,
    ) -> Option<Measure> {
        let _ = (inputs, of, f);
        None
    }
}
