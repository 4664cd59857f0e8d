//! Robust all-reduce of vectors that live on the device, over NCCL (or any
//! [`DeviceExchange`]), in gather and sharded modes: the vectors travel device to device and
//! are aggregated where the exchange left them, with no host copy of any vector.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use byzcoll_aggregators::{AggError, AggReport, Aggregator, Params, Structure};
use byzcoll_runtime::schedule::direct_peers;
use byzcoll_runtime::{sum_of_shard_medians, Error, Policy, RecvOp, Result};
use byzcoll_transport_nccl::{DeviceExchange, DeviceReceived, DeviceSend};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tokio::time::Instant;

use crate::rules::{CudaRule, GpuElement};
use crate::sharded::{ShardLayout, Source, Transfer};

/// Robust all-reduce of a vector on the device over NCCL, with no host copy: every rank's
/// `buf` becomes `rule` applied to all ranks' vectors, moved according to `policy`.
///
/// - [`Policy::Gather`]: each rank's vector goes to every peer by NCCL send/recv and the `n`
///   vectors are aggregated where NCCL left them (`n·d` device memory).
/// - [`Policy::Sharded`]: the runtime's sharded schedule on the device
///   ([`crate::sharded::ShardLayout`]): each shard of `d/n` coordinates goes to its `r` owners,
///   which aggregate it on the GPU and send their result to every rank, and every rank takes
///   the coordinate-wise median of the `r` versions on the GPU (about `2·r·d` device memory).
///   Coordinate-wise rules give bitwise the gather result. For the Krum family the owners
///   compute their shards' distance tables on the GPU and exchange them (a statistic round);
///   every rank sums the shard-wise medians of the versions and selects from the total, as the
///   host schedule does, then the owners finish their shards on the GPU.
///
/// Byzantine vectors are handled by the rule as everywhere. Where an owner's shard has
/// coordinates without a finite result (more than `f` non-finite values there), it logs why
/// and sends its result non-finite at those coordinates; the median of the versions discards
/// that where at most `(r - 1) / 2` owners did so, and otherwise the call fails with
/// [`AggError::NonFiniteResult`] naming the first such coordinate — never a NaN result. An
/// owner that cannot aggregate a shard for a reason of its own (a CUDA failure) still takes
/// part in every later step, sending NaN for that shard (and, for the Krum family, an infinite
/// distance table), and returns its error at the end, so the peers' steps complete and they
/// see its versions as missing. Only a failure of the round's own device buffers (allocation,
/// copy) ends the call at once; the peers' next step then fails at its deadline, as if this
/// rank had died.
/// A peer that does not take part makes NCCL abort when a step is not done `timeout` after it
/// was posted (`TransportError::Aborted` naming the ranks), as over NCCL generally. Every rank
/// must make this call at the same point of its NCCL sequence, with the same `collective`
/// number, length and policy. bf16 and f16 vectors travel and aggregate as they are.
///
/// # Errors
/// [`Error::Aggregation`] for the rule (precondition, non-finite result, CUDA failure),
/// [`Error::Transport`] for NCCL, [`Error::InvalidUsage`] when the rule's GPU is not the
/// exchange's or for a replica count outside `1..=n`. On error `buf` is unchanged.
pub async fn robust_all_reduce_nccl<E: GpuElement, N: DeviceExchange>(
    net: &N,
    collective: u64,
    buf: &mut CudaSlice<E>,
    rule: &CudaRule,
    policy: Policy,
    timeout: Duration,
) -> Result<AggReport> {
    let ((me, n), d) = (net.world(), buf.len());
    rule.check(n)?;
    let replicas = match policy {
        Policy::Gather => None,
        Policy::Sharded(replicas) => Some(replicas.count(rule.byzantine(), n)?),
        other => {
            return Err(Error::Unsupported(format!(
                "{other:?} for device vectors over NCCL"
            )))
        }
    };
    let gpu = rule.gpu().clone();
    if gpu.context().ordinal() != net.device_ordinal() {
        return Err(Error::InvalidUsage(format!(
            "the rule runs on GPU {} but the exchange on GPU {}",
            gpu.context().ordinal(),
            net.device_ordinal()
        )));
    }
    if d == 0 {
        return Ok(AggReport::default());
    }
    let stream = gpu.stream().clone();
    let mut out = stream.alloc_zeros::<E>(d).map_err(|e| rule.backend(e))?;
    let report = {
        let (mine, _read) = buf.device_ptr(&stream);
        let (out_ptr, _write) = out.device_ptr_mut(&stream);
        // Everything written to `buf` before this call is complete before it is sent: on its
        // own stream, and on others through the event `device_ptr` just made this stream wait
        // for.
        buf.stream()
            .synchronize()
            .and_then(|()| stream.synchronize())
            .map_err(|e| rule.backend(e))?;
        let round = Round {
            net,
            collective,
            rule,
            stream: &stream,
            timeout,
            size: std::mem::size_of::<E>(),
        };
        match replicas {
            None => round.gather::<E>((me, n), mine, d, out_ptr).await?,
            Some(r) => {
                let layout = ShardLayout::new(me, n, r, d);
                round.sharded::<E>(&layout, mine, out_ptr).await?
            }
        }
    };
    stream
        .memcpy_dtod(&out, buf)
        .and_then(|()| stream.synchronize())
        .map_err(|e| rule.backend(e))?;
    Ok(report)
}

/// What every step of one call shares.
struct Round<'a, N> {
    net: &'a N,
    collective: u64,
    rule: &'a CudaRule,
    stream: &'a Arc<CudaStream>,
    timeout: Duration,
    /// Bytes per element.
    size: usize,
}

impl<N: DeviceExchange> Round<'_, N> {
    /// One exchange; `sends` address fully written device memory that outlives the call.
    async fn exchange(
        &self,
        step: u32,
        sends: &[DeviceSend],
        recvs: &[RecvOp],
    ) -> Result<Received> {
        let deadline = Instant::now() + self.timeout;
        // SAFETY: every caller's sends address live, written device memory (see each call)
        // that it keeps borrowed until this returns.
        let got = unsafe {
            self.net
                .exchange_device(self.collective, step, sends, recvs, deadline)
        }
        .await?;
        Ok(Received::new(got, self.stream.clone()))
    }

    async fn gather<E: GpuElement>(
        &self,
        (me, n): (usize, usize),
        mine: CUdeviceptr,
        d: usize,
        out: CUdeviceptr,
    ) -> Result<AggReport> {
        let bytes = d * self.size;
        let sends: Vec<DeviceSend> = direct_peers(me, n)
            .map(|peer| DeviceSend {
                peer,
                tag: 0,
                ptr: mine,
                len: bytes,
            })
            .collect();
        let recvs: Vec<RecvOp> = direct_peers(me, n)
            .map(|peer| RecvOp {
                peer,
                tag: 0,
                len: bytes,
            })
            .collect();
        // `mine` is the caller's synchronized buffer, borrowed for the call.
        let received = self.exchange(0, &sends, &recvs).await?;
        let mut theirs = received.rows.iter();
        let rows: Vec<CUdeviceptr> = (0..n)
            .map(|p| match p == me {
                true => Some(mine),
                false => theirs.next().copied(),
            })
            .collect::<Option<_>>()
            .ok_or_else(|| Error::InvalidUsage("the exchange returned fewer receives".into()))?;
        // The kernels have finished (run reads their status back) before `received` is freed.
        Ok(self.rule.run::<E>(&rows, out, d)?)
    }

    async fn sharded<E: GpuElement>(
        &self,
        layout: &ShardLayout,
        mine: CUdeviceptr,
        out: CUdeviceptr,
    ) -> Result<AggReport> {
        let (rule, size) = (self.rule, self.size);
        let at = |base: CUdeviceptr, range: Range<usize>| base + (range.start * size) as u64;
        let len_of = |t: &Transfer| layout.shard(t.shard).len() * size;

        // Phase 1: each shard of this rank's vector to its owners.
        let sends = device_sends(
            &layout.scatter_sends(),
            |t| at(mine, layout.shard(t.shard)),
            len_of,
        );
        let recvs = recv_ops(&layout.scatter_recvs(), len_of);
        // `mine` is the caller's synchronized buffer, borrowed for the call.
        let pieces = self.exchange(0, &sends, &recvs).await?;
        let rows_of = |s: usize| -> Vec<CUdeviceptr> {
            layout
                .inputs(s)
                .into_iter()
                .map(|src| match src {
                    Source::Mine(range) => at(mine, range),
                    Source::Received(k) => pieces.rows[k],
                    Source::Owned(_) => unreachable!("inputs never come from results"),
                })
                .collect()
        };

        // Phase 2: the owned shards' results, back to back in one buffer.
        let owned = layout.owned();
        let mut starts = Vec::with_capacity(owned.len());
        let mut total = 0;
        for &s in &owned {
            starts.push(total);
            total += layout.shard(s).len();
        }
        let e = |x| rule.backend(x);
        let mut results = self.stream.alloc_zeros::<E>(total.max(1)).map_err(e)?;
        let (results_ptr, _write) = results.device_ptr_mut(self.stream);
        let result_at = |i: usize| results_ptr + (starts[i] * size) as u64;
        let mut step = 1;
        // This rank's own failure, reported once every step has been taken part in.
        let mut failed: Option<Error> = None;
        let report = match rule.structure() {
            Structure::CoordinateWise => {
                for (i, &s) in owned.iter().enumerate() {
                    let len = layout.shard(s).len();
                    let done = rule.run::<E>(&rows_of(s), result_at(i), len);
                    let own = self.owner_outcome(s, done.map(|_| ()), result_at(i), len)?;
                    failed = failed.or(own);
                }
                AggReport::default()
            }
            Structure::Global => {
                let selected = match self
                    .select::<E>(layout, &owned, &rows_of, step, &mut failed)
                    .await
                {
                    Ok(selected) => selected,
                    // This rank's own failure explains a failed selection best.
                    Err(e) => return Err(failed.unwrap_or(e)),
                };
                step += 1;
                for (i, &s) in owned.iter().enumerate() {
                    let len = layout.shard(s).len();
                    let rows = rows_of(s);
                    let chosen: Vec<CUdeviceptr> = selected.iter().map(|&j| rows[j]).collect();
                    let done = rule.finish_rows::<E>(&chosen, result_at(i), len);
                    let own = self.owner_outcome(s, done, result_at(i), len)?;
                    failed = failed.or(own);
                }
                AggReport::selected(selected)
            }
        };
        drop(pieces);

        // Phase 3: every owner's results to every rank; the median of the versions.
        self.stream.synchronize().map_err(e)?;
        let sends = device_sends(
            &layout.result_sends(),
            |t| result_at(owned_index(&owned, t.shard)),
            len_of,
        );
        let recvs = recv_ops(&layout.result_recvs(), len_of);
        // `results` is written (synchronized above) and borrowed until the end.
        let versions = self.exchange(step, &sends, &recvs).await?;
        let r = layout.replicas();
        let median = CudaRule::new(
            rule.gpu().clone(),
            "median",
            &Params {
                f: (r - 1) / 2,
                ..Params::default()
            },
        )?;
        for s in layout.shards() {
            let range = layout.shard(s);
            let rows: Vec<CUdeviceptr> = layout
                .versions(s)
                .into_iter()
                .map(|src| match src {
                    Source::Owned(i) => result_at(i),
                    Source::Received(k) => versions.rows[k],
                    Source::Mine(_) => unreachable!("versions never come from the input"),
                })
                .collect();
            let start = range.start;
            median
                .run::<E>(&rows, at(out, range.clone()), range.len())
                .map_err(|err| match err {
                    AggError::NonFiniteResult { f, coordinate, .. } => {
                        Error::Aggregation(AggError::NonFiniteResult {
                            rule: format!("median of the {r} owner versions of shard {s}"),
                            f,
                            coordinate: start + coordinate,
                        })
                    }
                    other => Error::Aggregation(other),
                })?;
        }
        // The median kernels have finished (run reads their status back) before `versions`
        // and `results` are freed.
        drop(versions);
        match failed {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// The Krum family's statistic round: the distance table of each owned shard goes to every
    /// rank, and every rank selects from the sum of the shards' median tables.
    async fn select<E: GpuElement>(
        &self,
        layout: &ShardLayout,
        owned: &[usize],
        rows_of: &(dyn Fn(usize) -> Vec<CUdeviceptr> + Sync),
        step: u32,
        failed: &mut Option<Error>,
    ) -> Result<Vec<usize>> {
        let (rule, n) = (self.rule, layout.size());
        let cells = n * n;
        let mut tables = Vec::with_capacity(owned.len() * cells);
        for &s in owned {
            match rule.distance_table::<E>(&rows_of(s), layout.shard(s).len()) {
                Ok(table) => tables.extend_from_slice(&table),
                Err(why) => {
                    // Every input infinitely far: a version the median of versions discards
                    // when the other owners answer, and no selection at all when none does.
                    tracing::warn!(
                        shard = s,
                        %why,
                        "no distance table for an owned shard; sending an infinite one"
                    );
                    tables.resize(tables.len() + cells, f64::INFINITY);
                    *failed = failed.take().or(Some(Error::Aggregation(why)));
                }
            }
        }
        let e = |x| rule.backend(x);
        let uploaded = self
            .stream
            .clone_htod(if tables.is_empty() {
                &[0.0][..]
            } else {
                &tables
            })
            .map_err(e)?;
        self.stream.synchronize().map_err(e)?;
        let (base, _read) = uploaded.device_ptr(self.stream);
        let bytes = cells * std::mem::size_of::<f64>();
        let sends = device_sends(
            &layout.result_sends(),
            |t| base + (owned_index(owned, t.shard) * bytes) as u64,
            |_| bytes,
        );
        let recvs = recv_ops(&layout.result_recvs(), |_| bytes);
        // `uploaded` is written (synchronized above) and borrowed until the end.
        let received = self.exchange(step, &sends, &recvs).await?;
        let host = received.download().map_err(e)?;
        let theirs: Vec<Vec<f64>> = received
            .ranges
            .iter()
            .map(|range| {
                host[range.clone()]
                    .chunks_exact(8)
                    .map(|b| {
                        let mut word = [0u8; 8];
                        word.copy_from_slice(b);
                        f64::from_le_bytes(word)
                    })
                    .collect()
            })
            .collect();
        let versions: Vec<Vec<&[f64]>> = layout
            .shards()
            .map(|s| {
                layout
                    .versions(s)
                    .into_iter()
                    .map(|src| match src {
                        Source::Owned(i) => &tables[i * cells..(i + 1) * cells],
                        Source::Received(k) => theirs[k].as_slice(),
                        Source::Mine(_) => unreachable!("versions never come from the input"),
                    })
                    .collect()
            })
            .collect();
        let total = sum_of_shard_medians(&versions, cells);
        Ok(rule.selection()?.select(&total, n)?)
    }

    /// What an owner does when its aggregation of shard `s` (`len` elements at `result`) is
    /// done. When some coordinates have no finite result, the kernels have still written every
    /// coordinate, non-finite exactly at those, so the owner logs why and sends that: the
    /// median of the versions discards it where at most `(r - 1) / 2` owners have no value,
    /// and otherwise names the first such coordinate. Any other failure is this rank's own
    /// (CUDA): the result is filled with NaN (all bits set, a NaN in every element type) so the
    /// peers see this version as missing, and the error is returned for the end of the round.
    /// If even the fill fails, the call ends at once.
    fn owner_outcome(
        &self,
        s: usize,
        done: std::result::Result<(), AggError>,
        result: CUdeviceptr,
        len: usize,
    ) -> Result<Option<Error>> {
        match done {
            Ok(()) => Ok(None),
            Err(why @ AggError::NonFiniteResult { .. }) => {
                tracing::warn!(shard = s, %why, "an owned shard's result is not finite everywhere");
                Ok(None)
            }
            Err(why) => {
                tracing::warn!(shard = s, %why, "no result for an owned shard; sending NaN");
                let backend = |x| Error::Aggregation(self.rule.backend(x));
                self.stream.context().bind_to_thread().map_err(backend)?;
                // SAFETY: `result` addresses `len` elements of the results buffer.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        result,
                        0xff,
                        len * self.size,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(backend)?;
                Ok(Some(Error::Aggregation(why)))
            }
        }
    }
}

/// The sends of a phase, in its order: each transfer's bytes at `ptr`, `len` long.
fn device_sends(
    list: &[Transfer],
    ptr: impl Fn(&Transfer) -> CUdeviceptr,
    len: impl Fn(&Transfer) -> usize,
) -> Vec<DeviceSend> {
    list.iter()
        .map(|t| DeviceSend {
            peer: t.peer,
            tag: t.shard as u32,
            ptr: ptr(t),
            len: len(t),
        })
        .collect()
}

/// The receives of a phase, in its order.
fn recv_ops(list: &[Transfer], len_of: impl Fn(&Transfer) -> usize) -> Vec<RecvOp> {
    list.iter()
        .map(|t| RecvOp {
            peer: t.peer,
            tag: t.shard as u32,
            len: len_of(t),
        })
        .collect()
}

fn owned_index(owned: &[usize], shard: usize) -> usize {
    owned
        .iter()
        .position(|&s| s == shard)
        .unwrap_or_else(|| unreachable!("a result of shard {shard}, which this rank does not own"))
}

/// An exchange's receives on the device, with the address of each. Kernels on the rule's
/// stream read them through raw addresses, so dropping it waits for that stream first (on every
/// path, errors included) before the buffer is freed.
struct Received {
    rows: Vec<CUdeviceptr>,
    ranges: Vec<Range<usize>>,
    buffer: Option<CudaSlice<u8>>,
    stream: Arc<CudaStream>,
}

impl Received {
    fn new(got: DeviceReceived, stream: Arc<CudaStream>) -> Self {
        let base = got.buffer.as_ref().map_or(0, |b| b.device_ptr(&stream).0);
        Received {
            rows: got
                .ranges
                .iter()
                .map(|range| base + range.start as u64)
                .collect(),
            ranges: got.ranges,
            buffer: got.buffer,
            stream,
        }
    }

    /// The whole receive buffer on the host.
    fn download(&self) -> std::result::Result<Vec<u8>, cudarc::driver::DriverError> {
        match &self.buffer {
            Some(b) => self.stream.clone_dtoh(b),
            None => Ok(Vec::new()),
        }
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
