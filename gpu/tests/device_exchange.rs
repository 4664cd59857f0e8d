//! `robust_all_reduce_nccl` with several ranks on one GPU, in gather and sharded modes.
//!
//! NCCL refuses two ranks on one device, so the ranks here are tasks of this process that
//! exchange device buffers through [`SharedGpuExchange`], **an in-process stand-in for NCCL,
//! named as such**: every message is a device-to-device copy on the shared GPU, queued per
//! ordered pair of ranks and taken in tag order, as NCCL matches a pair's messages. It checks
//! the device schedules (which shard goes where, which rows each kernel reads, the statistic
//! round, the median of the owners' versions) with real kernels; the NCCL transport itself is
//! checked at world size 1 in `tests/device.rs` and by the transport's own tests.
//!
//! Every test skips with a visible `SKIPPED` line where there is no GPU (CI builds them).

#![cfg(feature = "nccl")]

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use byzcoll_aggregators::{AggError, Params};
use byzcoll_cuda::{robust_all_reduce_nccl, CudaRule, Gpu};
use byzcoll_runtime::{
    Agreement, Communicator, Config, Error, Policy, Rank, RecvOp, Replicas, RoundReport, Tag,
    TransportError,
};
use byzcoll_transport_local::LocalTransport;
use byzcoll_transport_nccl::{DeviceExchange, DeviceReceived, DeviceSend};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use tokio::time::Instant;
mod common;

use common::{gpu, inputs};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// A message in flight: the step it belongs to, its tag, the bytes.
type Message = ((u64, u32), Tag, CudaSlice<u8>);

/// Messages in flight, by (from, to).
type Queues = HashMap<(Rank, Rank), VecDeque<Message>>;

/// In-process stand-in for NCCL between ranks sharing one GPU (see the file's docs).
struct SharedGpuExchange {
    me: Rank,
    n: usize,
    stream: Arc<CudaStream>,
    queues: Arc<Mutex<Queues>>,
}

impl SharedGpuExchange {
    fn world(n: usize, stream: &Arc<CudaStream>) -> Vec<SharedGpuExchange> {
        let queues = Arc::new(Mutex::new(Queues::new()));
        (0..n)
            .map(|me| SharedGpuExchange {
                me,
                n,
                stream: stream.clone(),
                queues: queues.clone(),
            })
            .collect()
    }

    fn fail(why: String) -> TransportError {
        TransportError::InvalidUsage(format!("shared-GPU exchange: {why}"))
    }

    /// A device copy of `len` bytes at `ptr` (at least one byte is allocated).
    ///
    /// # Safety
    /// `ptr` addresses `len` readable bytes on the stream's device.
    unsafe fn copy_out(&self, ptr: u64, len: usize) -> Result<CudaSlice<u8>, TransportError> {
        let err = |e: cudarc::driver::DriverError| Self::fail(e.to_string());
        // SAFETY: written by the copy below before anyone reads it.
        let mut copy = unsafe { self.stream.alloc::<u8>(len.max(1)) }.map_err(err)?;
        self.stream.context().bind_to_thread().map_err(err)?;
        {
            let (dst, _record) = copy.device_ptr_mut(&self.stream);
            // SAFETY: `len` bytes from the caller's memory into the fresh copy.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, ptr, len, self.stream.cu_stream())
            }
            .map_err(err)?;
        }
        Ok(copy)
    }
}

impl DeviceExchange for SharedGpuExchange {
    fn world(&self) -> (Rank, usize) {
        (self.me, self.n)
    }

    fn device_ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    unsafe fn exchange_device(
        &self,
        collective: u64,
        step: u32,
        sends: &[DeviceSend],
        recvs: &[RecvOp],
        deadline: Instant,
    ) -> impl Future<Output = Result<DeviceReceived, TransportError>> + Send {
        // The sends are copied before the future is made, so it never reads the caller's
        // memory; each pair's messages are queued in tag order.
        let mut ordered: Vec<&DeviceSend> = sends.iter().collect();
        ordered.sort_by_key(|s| (s.peer, s.tag));
        let copies: Result<Vec<(Rank, Tag, CudaSlice<u8>)>, TransportError> = ordered
            .into_iter()
            .map(|s| {
                // SAFETY: the caller's guarantee on `ptr` and `len`.
                let copy = unsafe { self.copy_out(s.ptr, s.len) }?;
                Ok((s.peer, s.tag, copy))
            })
            .collect();
        let mut wanted: Vec<(usize, &RecvOp)> = recvs.iter().enumerate().collect();
        wanted.sort_by_key(|(_, r)| (r.peer, r.tag));
        let wanted: Vec<(usize, Rank, Tag, usize)> = wanted
            .into_iter()
            .map(|(i, r)| (i, r.peer, r.tag, r.len))
            .collect();
        let me = self.me;
        async move {
            let copies = copies?;
            self.stream
                .synchronize()
                .map_err(|e| Self::fail(e.to_string()))?;
            {
                let mut queues = self.queues.lock().expect("queues");
                for (peer, tag, copy) in copies {
                    let message = ((collective, step), tag, copy);
                    queues.entry((me, peer)).or_default().push_back(message);
                }
            }
            let mut got: Vec<Option<CudaSlice<u8>>> = (0..recvs.len()).map(|_| None).collect();
            for (i, peer, tag, len) in wanted {
                let message = loop {
                    let next = self
                        .queues
                        .lock()
                        .expect("queues")
                        .get_mut(&(peer, me))
                        .and_then(VecDeque::pop_front);
                    if let Some(m) = next {
                        break m;
                    }
                    if Instant::now() >= deadline {
                        return Err(Self::fail(format!(
                            "rank {me}: nothing from rank {peer} (tag {tag}) by the deadline"
                        )));
                    }
                    tokio::time::sleep(Duration::from_micros(200)).await;
                };
                let (at, sent_tag, slice) = message;
                if at != (collective, step) || sent_tag != tag || slice.len() != len.max(1) {
                    return Err(Self::fail(format!(
                        "rank {me} expected step {:?} tag {tag} ({len} B) from rank {peer}, \
                         got step {at:?} tag {sent_tag} ({} B)",
                        (collective, step),
                        slice.len()
                    )));
                }
                got[i] = Some(slice);
            }
            // One buffer holding every receive, in the caller's order.
            let mut ranges = Vec::with_capacity(recvs.len());
            let mut total = 0;
            for r in recvs {
                ranges.push(total..total + r.len);
                total += r.len.next_multiple_of(256);
            }
            if recvs.is_empty() {
                return Ok(DeviceReceived {
                    buffer: None,
                    ranges,
                });
            }
            let err = |e: cudarc::driver::DriverError| Self::fail(e.to_string());
            let mut buffer = self.stream.alloc_zeros::<u8>(total.max(1)).map_err(err)?;
            for (range, slice) in ranges.iter().zip(&got) {
                let slice = slice.as_ref().expect("every receive was taken");
                let mut dst = buffer.slice_mut(range.clone());
                let src = slice.slice(..range.len());
                self.stream.memcpy_dtod(&src, &mut dst).map_err(err)?;
            }
            self.stream.synchronize().map_err(err)?;
            drop(got);
            Ok(DeviceReceived {
                buffer: Some(buffer),
                ranges,
            })
        }
    }
}

/// The same round on host vectors over the local transport with the CPU rule: the reference.
async fn on_the_host(
    x: &[Vec<f32>],
    rule: &str,
    params: &Params,
    policy: Policy,
    agreement: Agreement,
) -> Vec<Outcome> {
    let mut tasks = Vec::new();
    for (r, t) in LocalTransport::world(x.len()).into_iter().enumerate() {
        let (mut mine, params) = (x[r].clone(), params.clone());
        let reference = byzcoll_aggregators::build(rule, &params).expect("rule");
        tasks.push(tokio::spawn(async move {
            let mut comm = Communicator::new(Box::new(t), Config::default());
            comm.set_agreement(agreement);
            comm.robust_all_reduce(&mut mine, &*reference, policy)
                .await
                .map(|report| seen(mine, &report))
                .map_err(|e| describe(&e))
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("host rank"));
    }
    out
}

/// Every rank's device round over the shared-GPU exchange.
async fn on_the_device(
    gpu: &Arc<Gpu>,
    x: &[Vec<f32>],
    rule: &str,
    params: &Params,
    policy: Policy,
    agreement: Agreement,
) -> Vec<Outcome> {
    let stream = gpu.stream().clone();
    let mut tasks = Vec::new();
    for (r, net) in SharedGpuExchange::world(x.len(), &stream)
        .into_iter()
        .enumerate()
    {
        let cuda = CudaRule::new(gpu.clone(), rule, params).expect("rule");
        let mut buf = stream.clone_htod(&x[r]).expect("upload");
        let stream = stream.clone();
        tasks.push(tokio::spawn(async move {
            let done = robust_all_reduce_nccl(
                &net,
                1,
                &mut buf,
                &cuda,
                policy,
                agreement,
                Duration::from_secs(20),
            )
            .await;
            let got = stream.clone_dtoh(&buf).expect("download");
            done.map(|report: RoundReport| seen(got, &report))
                .map_err(|e| describe(&e))
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("device rank"));
    }
    out
}

/// What a rank's round gave, as compared between host and device: its result, the selection
/// and, under a cross-check, the ranks it found disagreeing (none in these honest worlds).
type Outcome = Result<(Vec<f32>, Option<Vec<Rank>>, Option<Vec<Rank>>), String>;

fn seen(
    result: Vec<f32>,
    report: &RoundReport,
) -> (Vec<f32>, Option<Vec<Rank>>, Option<Vec<Rank>>) {
    let disagreeing = report.agreement.as_ref().map(|a| a.disagreeing.clone());
    (result, report.selected.clone(), disagreeing)
}

/// An error as compared between host and device: the non-finite coordinate, or its kind.
fn describe(e: &Error) -> String {
    match e {
        Error::Aggregation(AggError::NonFiniteResult { coordinate, .. }) => {
            format!("non-finite result at coordinate {coordinate}")
        }
        Error::Aggregation(AggError::Precondition { .. }) => "precondition".into(),
        other => format!("{other}"),
    }
}

const AGREEMENTS: [Agreement; 3] = [Agreement::Off, Agreement::Detect, Agreement::Enforce];

const POLICIES: [Policy; 3] = [
    Policy::Gather,
    Policy::Sharded(Replicas::Tolerant),
    Policy::Sharded(Replicas::Exactly(1)),
];

/// Seven ranks on one GPU: every rule, policy and agreement gives every rank bitwise the host
/// round's result with the CPU rule (the same selection, and the same cross-check: agreeing
/// with everyone), for d a few thousand and for d < n (empty shards), with one rank sending
/// NaN and infinities. The device path runs the host's round core, so this checks its plane.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_rounds_match_the_host_schedule_with_the_cpu_rule() {
    let Some(gpu) = gpu() else { return };
    let n = 7;
    let mut rng = StdRng::seed_from_u64(31);
    for d in [5003, 5] {
        let mut x = inputs(&mut rng, n, d);
        for (j, v) in x[3].iter_mut().enumerate() {
            *v = [f32::NAN, f32::INFINITY, -1e30][j % 3];
        }
        for rule in ["median", "trimmed-mean", "krum", "multi-krum", "bulyan"] {
            let f = if rule == "bulyan" { 1 } else { 2 };
            let params = Params {
                f,
                ..Params::default()
            };
            for policy in POLICIES {
                for agreement in AGREEMENTS {
                    if agreement == Agreement::Enforce && policy != Policy::Gather {
                        continue;
                    }
                    let want = on_the_host(&x, rule, &params, policy, agreement).await;
                    let got = on_the_device(&gpu, &x, rule, &params, policy, agreement).await;
                    let what = format!("{rule} {policy:?} {agreement:?} d = {d}");
                    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(w.is_ok(), "{what}: host rank {r}: {w:?}");
                        assert_eq!(g, w, "{what} rank {r}");
                    }
                }
            }
        }
    }
}

/// More non-finite values at one coordinate than the rule tolerates (4 NaN of 7 with f = 2, so
/// the median itself would be NaN): every rank fails instead of returning NaN or waiting for a
/// result that never comes. Gather mode names the coordinate; in sharded mode every owner of
/// its shard (300..400) fails and sends the shard as NaN (the device's empty result, which
/// NCCL's fixed lengths make whole), so every rank names the shard's first coordinate. (Over
/// host transports the owners' empty results are erasures and the shard is reported lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinate_no_rule_can_save_fails_on_every_rank_without_hanging() {
    let Some(gpu) = gpu() else { return };
    let n = 7;
    let d = 700;
    let mut rng = StdRng::seed_from_u64(32);
    let mut x = inputs(&mut rng, n, d);
    let bad = 345;
    for v in x.iter_mut().take(4) {
        v[bad] = f32::NAN;
    }
    let params = Params {
        f: 2,
        ..Params::default()
    };
    for policy in POLICIES {
        let got = on_the_device(&gpu, &x, "median", &params, policy, Agreement::Detect).await;
        let at = match policy {
            Policy::Gather => bad,
            _ => 300,
        };
        for (r, g) in got.iter().enumerate() {
            assert_eq!(
                g,
                &Err(format!("non-finite result at coordinate {at}")),
                "{policy:?} rank {r}"
            );
        }
    }
}
