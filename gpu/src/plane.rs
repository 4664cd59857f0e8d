//! The device plane: a round's vectors in GPU memory, aggregated by the CUDA kernels. The NCCL
//! driver ([`crate::nccl`]) runs the protocol core ([`byzcoll_proto::round`]) on it,
//! as the host driver runs the core on host slices and the simulator on its store, so every
//! decision of a round (erasures, preconditions, statistic rounds, the cross-check, the echo)
//! is the core's, made once for all three.
//!
//! Everything runs on the rule's stream, in order; kernels read received messages through raw
//! addresses into buffers that wait for that stream before they are freed ([`Received`]).
//! Small things come back to the host: statistics and cross-check messages
//! ([`Plane::host`]), and the digests, which are computed on the host from a copy of the
//! vector (one at a time, dropped at once; there is no digest kernel). Under
//! `Agreement::Off` nothing of a vector leaves the device.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use byzcoll_aggregators::{
    aggregate_into, distance::distance_table_of_present, AggError, AggReport, Aggregator,
    DistanceMixing, DistanceSelection, Params,
};
use byzcoll_proto::round::{
    self, commitment, input_digest, owned_index, result_digest, Dest, Digest, Msg, Plane, Src,
};
use byzcoll_proto::schedule::chunk_range;
use byzcoll_proto::Rank;
use byzcoll_transport_nccl::DeviceReceived;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DriverError};

use crate::rules::{CudaRule, GpuElement};

/// One step's receives on the device. Kernels on the rule's stream read them through raw
/// addresses, so dropping it waits for that stream first (on every path, errors included)
/// before the buffer is freed.
pub(crate) struct Received {
    base: CUdeviceptr,
    ranges: Vec<Range<usize>>,
    buffer: Option<CudaSlice<u8>>,
    stream: Arc<CudaStream>,
}

impl Received {
    pub(crate) fn new(got: DeviceReceived, stream: Arc<CudaStream>) -> Arc<Self> {
        let base = got.buffer.as_ref().map_or(0, |b| b.device_ptr(&stream).0);
        Arc::new(Received {
            base,
            ranges: got.ranges,
            buffer: got.buffer,
            stream,
        })
    }
}

impl Drop for Received {
    fn drop(&mut self) {
        if self.buffer.is_some() {
            if let Err(e) = self.stream.synchronize() {
                tracing::warn!(error = %e, "waiting for kernels before freeing received buffers");
            }
        }
    }
}

/// A received message: the `k`-th receive of a step, or an empty one (the driver never asks
/// the exchange for a message of no bytes).
#[derive(Clone)]
pub(crate) struct Row {
    step: Option<Arc<Received>>,
    k: usize,
}

impl Row {
    /// The `k`-th receive of `step`.
    pub(crate) fn new(step: &Arc<Received>, k: usize) -> Self {
        Row {
            step: Some(step.clone()),
            k,
        }
    }

    /// A message of no bytes.
    pub(crate) fn empty() -> Self {
        Row { step: None, k: 0 }
    }

    /// Its device address (`0` when empty).
    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.step
            .as_ref()
            .map_or(0, |s| s.base + s.ranges[self.k].start as u64)
    }

    /// Its length in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.step.as_ref().map_or(0, |s| s.ranges[self.k].len())
    }
}

/// A round's data on the device (see the module docs).
pub(crate) struct DevicePlane<'a, E: GpuElement> {
    rule: &'a CudaRule,
    stream: Arc<CudaStream>,
    me: Rank,
    n: usize,
    /// The caller's vector, read only, synchronized before the round and borrowed for it.
    mine: CUdeviceptr,
    d: usize,
    /// The result, whole (gather) or shard by shard (sharded); the driver copies it into the
    /// caller's vector only when the round succeeds.
    out: CudaSlice<E>,
    /// The owned shards' results (at least one element is allocated) and their lengths, by
    /// position among the owned shards.
    results: Vec<Option<(CudaSlice<E>, usize)>>,
    /// The median rules of `k` versions (`f = (k - 1) / 2`), by `k`.
    medians: Vec<(usize, CudaRule)>,
    /// Where finiteness checks write (the median of one row is the row).
    scratch: Option<CudaSlice<E>>,
    /// The first failure of this rank's own (CUDA), returned when the round ends: methods that
    /// cannot return an error record it here, and so do those that can, so a local failure is
    /// never mistaken for a peer's.
    failure: Mutex<Option<AggError>>,
}

impl<'a, E: GpuElement> DevicePlane<'a, E> {
    /// Rank `me` of `n`'s round on the `d` elements at `mine` (on the rule's device, fully
    /// written, alive for the plane's life).
    ///
    /// # Errors
    /// The output buffer's allocation.
    pub(crate) fn new(
        rule: &'a CudaRule,
        mine: CUdeviceptr,
        d: usize,
        me: Rank,
        n: usize,
    ) -> Result<Self, AggError> {
        let stream = rule.gpu().stream().clone();
        let out = stream
            .alloc_zeros::<E>(d.max(1))
            .map_err(|e| rule.backend(e))?;
        Ok(DevicePlane {
            rule,
            stream,
            me,
            n,
            mine,
            d,
            out,
            results: Vec::new(),
            medians: Vec::new(),
            scratch: None,
            failure: Mutex::new(None),
        })
    }

    /// The result of a successful round, `d` elements.
    pub(crate) fn output(&self) -> &CudaSlice<E> {
        &self.out
    }

    /// This rank's own failure, if any.
    pub(crate) fn take_failure(&mut self) -> Option<AggError> {
        self.failure
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Where `send`'s bytes are and how many there are; bytes the round made and empty results
    /// are staged into device memory that `staged` keeps until the exchange is done.
    ///
    /// An empty result (an owner that could not aggregate its shard) travels as the shard's
    /// length of NaN (every bit set, a NaN in every element type): NCCL pairs a send with a
    /// receive of the same length, so it cannot be short, as it is over host transports. The
    /// median of the owners' versions discards it as it discards an erased version when at
    /// most `(r - 1) / 2` owners sent it; otherwise the shard fails with
    /// [`AggError::NonFiniteResult`] at its first coordinate.
    ///
    /// # Errors
    /// CUDA's, staging.
    pub(crate) fn message(
        &self,
        send: &round::Send,
        staged: &mut Vec<CudaSlice<u8>>,
    ) -> Result<(CUdeviceptr, usize), AggError> {
        let size = std::mem::size_of::<E>();
        let e = |x: DriverError| self.rule.backend(x);
        Ok(match &send.msg {
            Msg::Input => (self.mine, self.d * size),
            Msg::Piece(s) => {
                let range = chunk_range(self.d, self.n, *s);
                (self.at(self.mine, &range), range.len() * size)
            }
            Msg::Result(s) => {
                let i = owned_index(self.me, *s, self.n);
                let (result, len) = self
                    .results
                    .get(i)
                    .and_then(Option::as_ref)
                    .ok_or_else(|| self.fail(format!("owned shard {s} has no result to send")))?;
                (result.device_ptr(&self.stream).0, len * size)
            }
            Msg::Empty => {
                let len = chunk_range(self.d, self.n, send.tag as usize).len() * size;
                if len == 0 {
                    return Ok((0, 0));
                }
                let fill = self.stream.alloc_zeros::<u8>(len).map_err(e)?;
                let ptr = fill.device_ptr(&self.stream).0;
                self.stream.context().bind_to_thread().map_err(e)?;
                // SAFETY: `ptr` addresses the `len` bytes just allocated on this stream.
                unsafe {
                    cudarc::driver::result::memset_d8_async(ptr, 0xff, len, self.stream.cu_stream())
                }
                .map_err(e)?;
                staged.push(fill);
                (ptr, len)
            }
            Msg::ResultDigest(s) => {
                // The digest a taker compares with the version it holds
                // ([`Plane::commitment`] of the result).
                let i = owned_index(self.me, *s, self.n);
                let digest = commitment::<u8>(&self.download(&Src::Owned(i)));
                let up = self.stream.clone_htod(&digest[..]).map_err(e)?;
                let ptr = up.device_ptr(&self.stream).0;
                staged.push(up);
                (ptr, digest.len())
            }
            Msg::Bytes(b) => {
                if b.is_empty() {
                    return Ok((0, 0));
                }
                let up = self.stream.clone_htod(&b[..]).map_err(e)?;
                let ptr = up.device_ptr(&self.stream).0;
                staged.push(up);
                (ptr, b.len())
            }
            Msg::Forward(j) => {
                return Err(self.fail(format!(
                    "slot {j}'s message is the round's to forward (Round::held), not the plane's"
                )))
            }
        })
    }

    /// Waits until everything queued on the stream (results, staged messages) is written.
    ///
    /// # Errors
    /// CUDA's.
    pub(crate) fn sync(&self) -> Result<(), AggError> {
        self.stream.synchronize().map_err(|e| self.rule.backend(e))
    }

    fn at(&self, base: CUdeviceptr, range: &Range<usize>) -> CUdeviceptr {
        base + (range.start * std::mem::size_of::<E>()) as u64
    }

    /// Where `src` is on the device, and its length in elements.
    fn locate(&self, src: &Src<'_, Row>) -> (CUdeviceptr, usize) {
        match src {
            Src::Mine(range) => (self.at(self.mine, range), range.len()),
            Src::Got(row) => (row.ptr(), row.bytes() / std::mem::size_of::<E>()),
            Src::Owned(i) => self
                .results
                .get(*i)
                .and_then(Option::as_ref)
                .map_or((0, 0), |(r, len)| (r.device_ptr(&self.stream).0, *len)),
        }
    }

    /// This rank's own failure, described.
    fn fail(&self, message: String) -> AggError {
        AggError::Backend {
            rule: self.rule.name().to_string(),
            backend: "CUDA",
            message,
        }
    }

    /// Records `e` when it is this rank's own failure (CUDA), and passes it on.
    fn note(&self, e: AggError) -> AggError {
        if matches!(e, AggError::Backend { .. }) {
            let mut failure = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
            if failure.is_none() {
                *failure = Some(e.clone());
            }
        }
        e
    }

    /// `src`'s bytes on the host (a transient copy, for the digests).
    fn download(&self, src: &Src<'_, Row>) -> Vec<u8> {
        let (ptr, len) = self.locate(src);
        let mut host = vec![0u8; len * std::mem::size_of::<E>()];
        if let Err(e) = self.copy_to_host(ptr, &mut host) {
            self.note(self.rule.backend(e));
        }
        host
    }

    fn copy_to_host(&self, ptr: CUdeviceptr, host: &mut [u8]) -> Result<(), DriverError> {
        if host.is_empty() {
            return Ok(());
        }
        self.stream.context().bind_to_thread()?;
        // SAFETY: `ptr` addresses at least `host.len()` bytes on this device (a received
        // message, the caller's vector or a result); the copy is ordered after every kernel
        // that writes them, and waited for before `host` is read.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut host[..], ptr, self.stream.cu_stream())
        }?;
        self.stream.synchronize()
    }

    /// The position in `medians` of the median of `k` versions, made once per `k`.
    fn median(&mut self, k: usize) -> Result<usize, AggError> {
        if let Some(at) = self.medians.iter().position(|(m, _)| *m == k) {
            return Ok(at);
        }
        let params = Params {
            f: k.saturating_sub(1) / 2,
            ..Params::default()
        };
        let rule = CudaRule::new(self.rule.gpu().clone(), "median", &params)?;
        self.medians.push((k, rule));
        Ok(self.medians.len() - 1)
    }

    /// A fresh result of `len` elements (at least one is allocated).
    fn fresh(&self, len: usize) -> Result<CudaSlice<E>, AggError> {
        self.stream
            .alloc_zeros::<E>(len.max(1))
            .map_err(|e| self.note(self.rule.backend(e)))
    }

    fn set_result(&mut self, i: usize, result: CudaSlice<E>, len: usize) {
        if self.results.len() <= i {
            self.results.resize_with(i + 1, || None);
        }
        self.results[i] = Some((result, len));
    }

    /// A shard's inputs by rank, with the first present one standing in for erased ones
    /// (which the caller marks infinitely far or never selects), and their length.
    fn placeholder_rows(&self, inputs: &[Option<Src<'_, Row>>]) -> (Vec<CUdeviceptr>, usize) {
        let stand_in = inputs.iter().flatten().next().map(|s| self.locate(s));
        let rows = inputs
            .iter()
            .map(|x| match x {
                Some(src) => self.locate(src).0,
                None => stand_in.map_or(0, |(p, _)| p),
            })
            .collect();
        (rows, stand_in.map_or(0, |(_, len)| len))
    }
}

impl<E: GpuElement> Plane for DevicePlane<'_, E> {
    type Buf = Row;

    fn host<'b>(&'b self, buf: &'b Row) -> Cow<'b, [u8]> {
        let mut host = vec![0u8; buf.bytes()];
        match self.copy_to_host(buf.ptr(), &mut host) {
            Ok(()) => Cow::Owned(host),
            Err(e) => {
                self.note(self.rule.backend(e));
                Cow::Owned(Vec::new())
            }
        }
    }

    fn digest(&mut self, src: Src<'_, Row>) -> Digest {
        input_digest::<u8>(&self.download(&src))
    }

    fn commitment(&mut self, src: Src<'_, Row>) -> Digest {
        commitment::<u8>(&self.download(&src))
    }

    fn finite(&mut self, src: Src<'_, Row>) -> bool {
        let (ptr, len) = self.locate(&src);
        if len == 0 {
            return true;
        }
        if self.scratch.as_ref().is_none_or(|s| s.len() < len) {
            match self.stream.alloc_zeros::<E>(len.max(self.d)) {
                Ok(s) => self.scratch = Some(s),
                Err(e) => {
                    self.note(self.rule.backend(e));
                    return true;
                }
            }
        }
        let to = match &self.scratch {
            Some(s) => s.device_ptr(&self.stream).0,
            None => return true,
        };
        // The median of one row is the row; its kernel names a non-finite coordinate.
        let checked = self
            .median(1)
            .and_then(|at| self.medians[at].1.run::<E>(&[ptr], to, len));
        match checked {
            Ok(_) => true,
            Err(AggError::NonFiniteResult { .. }) => false,
            Err(other) => {
                self.note(other);
                true
            }
        }
    }

    fn aggregate(
        &mut self,
        rule: &dyn Aggregator,
        inputs: &[Src<'_, Row>],
        to: Dest,
    ) -> Result<AggReport, AggError> {
        debug_assert_eq!(
            rule.name(),
            self.rule.name(),
            "the round runs the plane's rule"
        );
        let located: Vec<(CUdeviceptr, usize)> = inputs.iter().map(|s| self.locate(s)).collect();
        let rows: Vec<CUdeviceptr> = located.iter().map(|&(p, _)| p).collect();
        let len = located.first().map_or(0, |&(_, len)| len);
        if len == 0 {
            // Nothing to launch: the CPU rule on empty vectors gives the same report
            // (selections included) and the same precondition errors.
            let empty: Vec<&[f32]> = vec![&[]; inputs.len()];
            let report = aggregate_into(self.rule.reference(), &empty, &mut [])?;
            if let Dest::Owned(i) = to {
                let result = self.fresh(0)?;
                self.set_result(i, result, 0);
            }
            return Ok(report);
        }
        match to {
            Dest::Output => {
                let out = self.out.device_ptr(&self.stream).0;
                self.rule
                    .run::<E>(&rows, out, len)
                    .map_err(|e| self.note(e))
            }
            Dest::Owned(i) => {
                let result = self.fresh(len)?;
                let at = result.device_ptr(&self.stream).0;
                let report = self
                    .rule
                    .run::<E>(&rows, at, len)
                    .map_err(|e| self.note(e))?;
                self.set_result(i, result, len);
                Ok(report)
            }
        }
    }

    fn combine(
        &mut self,
        _s: usize,
        range: Range<usize>,
        versions: &[Src<'_, Row>],
    ) -> Result<(), AggError> {
        if range.is_empty() {
            return Ok(());
        }
        let rows: Vec<CUdeviceptr> = versions.iter().map(|v| self.locate(v).0).collect();
        let out = self.at(self.out.device_ptr(&self.stream).0, &range);
        let len = range.len();
        let at = match self.median(rows.len()) {
            Ok(at) => at,
            Err(e) => return Err(self.note(e)),
        };
        // The median of one version copies it, refused where it is not finite.
        match self.medians[at].1.run::<E>(&rows, out, len) {
            Ok(_) => Ok(()),
            Err(e) => Err(self.note(e)),
        }
    }

    fn distance_table(&mut self, inputs: &[Option<Src<'_, Row>>]) -> Vec<f64> {
        let n = inputs.len();
        let present: Vec<bool> = inputs.iter().map(Option::is_some).collect();
        let (rows, len) = self.placeholder_rows(inputs);
        if len == 0 {
            let empty: Vec<&[f32]> = vec![&[]; n];
            return distance_table_of_present(&empty, &present);
        }
        match self.rule.distance_table::<E>(&rows, len) {
            Ok(mut table) => {
                // Erased inputs are infinitely far from everything, themselves included, as
                // the CPU's `distance_table_of_present` has them.
                for (p, _) in present.iter().enumerate().filter(|(_, &here)| !here) {
                    for q in 0..n {
                        table[p * n + q] = f64::INFINITY;
                        table[q * n + p] = f64::INFINITY;
                    }
                }
                table
            }
            Err(why) => {
                // Every input infinitely far: a version the median of versions discards when
                // the other owners answer, and no selection at all when none does.
                tracing::warn!(%why, "no distance table for an owned shard; sending an infinite one");
                self.note(why);
                vec![f64::INFINITY; n * n]
            }
        }
    }

    fn finish_selected(
        &mut self,
        _selection: &dyn DistanceSelection,
        inputs: &[Option<Src<'_, Row>>],
        selected: &[usize],
        i: usize,
    ) -> Result<(), AggError> {
        let (rows, len) = self.placeholder_rows(inputs);
        let result = self.fresh(len)?;
        if len > 0 {
            let chosen: Vec<CUdeviceptr> = selected.iter().map(|&j| rows[j]).collect();
            let at = result.device_ptr(&self.stream).0;
            self.rule
                .finish_rows::<E>(&chosen, at, len)
                .map_err(|e| self.note(e))?;
        }
        self.set_result(i, result, len);
        Ok(())
    }

    fn estimate_start(
        &mut self,
        _i: usize,
        _inputs: &[Option<Src<'_, Row>>],
    ) -> Result<(), AggError> {
        Err(self.no_iterative())
    }

    fn estimate_distances(&mut self, _i: usize, inputs: &[Option<Src<'_, Row>>]) -> Vec<f64> {
        self.note(self.no_iterative());
        vec![f64::INFINITY; inputs.len()]
    }

    fn estimate_step(
        &mut self,
        _i: usize,
        _inputs: &[Option<Src<'_, Row>>],
        _a: f64,
        _w: &[f64],
    ) -> (f64, f64) {
        self.note(self.no_iterative());
        (f64::INFINITY, 0.0)
    }

    fn estimate_finish(&mut self, _i: usize) -> Result<(), String> {
        Err(self.no_iterative().to_string())
    }

    fn mix(
        &mut self,
        mixing: &dyn DistanceMixing,
        _inputs: &[Src<'_, Row>],
        _neighbours: &[Option<Vec<usize>>],
        _i: usize,
    ) -> Result<(), AggError> {
        Err(AggError::Unsupported {
            rule: mixing.inner().name().to_string(),
            what: "mixing rules on the device".to_string(),
        })
    }

    fn result_digest(&mut self) -> Digest {
        let mut host = vec![0u8; self.d * std::mem::size_of::<E>()];
        if let Err(e) = self.copy_to_host(self.out.device_ptr(&self.stream).0, &mut host) {
            self.note(self.rule.backend(e));
        }
        result_digest::<u8>(&host)
    }

    fn output_digest(&mut self, _s: usize, range: Range<usize>) -> Digest {
        let mut host = vec![0u8; range.len() * std::mem::size_of::<E>()];
        let at = self.at(self.out.device_ptr(&self.stream).0, &range);
        if let Err(e) = self.copy_to_host(at, &mut host) {
            self.note(self.rule.backend(e));
        }
        commitment::<u8>(&host)
    }
}

impl<E: GpuElement> DevicePlane<'_, E> {
    /// Iterative rules have no device implementation ([`CudaRule::new`] refuses them, so a
    /// round never asks).
    fn no_iterative(&self) -> AggError {
        AggError::Unsupported {
            rule: self.rule.name().to_string(),
            what: "iterative rules on the device".to_string(),
        }
    }
}
