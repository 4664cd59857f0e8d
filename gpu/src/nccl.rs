//! Robust all-reduce of vectors that live on the device, over NCCL (or any
//! [`DeviceExchange`]): the protocol core ([`byzcoll_proto::round`]) driven step by
//! step over device-to-device exchanges, on the device plane ([`crate::plane`]).

use std::time::Duration;

use byzcoll_aggregators::Aggregator;

use byzcoll_proto::round::{check_agreement, Arrival, Round, Shape, Spec};
use byzcoll_proto::{Agreement, Error, Policy, RecvOp, Result, RoundReport};
use byzcoll_transport_nccl::{DeviceExchange, DeviceSend};
use cudarc::driver::{CudaSlice, DevicePtr};
use tokio::time::Instant;

use crate::plane::{DevicePlane, Received, Row};
use crate::rules::{CudaRule, GpuElement};

/// Robust all-reduce of a vector on the device over NCCL: every rank's `buf` becomes `rule`
/// applied to all ranks' vectors, moved according to `policy`, with `agreement` among the
/// ranks. It is the round every other path runs (`Communicator::robust_all_reduce`, the
/// simulator): the same steps, erasures, preconditions, statistic rounds and cross-check,
/// executed here over device-to-device exchanges with the vectors aggregated where the
/// exchange left them.
///
/// - [`Policy::Gather`]: each rank's vector goes to every peer and the `n` vectors are
///   aggregated on the GPU (`n·d` device memory).
/// - [`Policy::Sharded`]: each shard of `d/n` coordinates goes to its `r` owners, which
///   aggregate it on the GPU (the Krum family after a statistic round of distance tables)
///   and send their result to every rank, and every rank takes the coordinate-wise median of
///   the `r` versions on the GPU (about `2·r·d` device memory). Coordinate-wise rules give
///   bitwise the gather result.
///
/// Under [`Agreement::Detect`] (the default of a communicator) the ranks cross-check digests
/// of their results and of the inputs they used, as on the host; the digests are computed on
/// the host from a transient copy of each vector read back one at a time (there is no digest
/// kernel), about one extra read of the round's inputs over the host link.
/// [`Agreement::Off`] moves nothing of a vector to the host. [`Agreement::Enforce`] runs as
/// everywhere.
///
/// An owner that cannot aggregate a shard sends the shard as NaN instead of an empty
/// message (NCCL pairs a send with a receive of the same length); the median of the versions
/// discards it where at most `(r - 1) / 2` owners did so, and otherwise the call fails with
/// [`byzcoll_aggregators::AggError::NonFiniteResult`] at the shard's first coordinate
/// (over host transports that shard is reported lost). A failure of this rank's own GPU work
/// (CUDA) is returned when the round ends, after it has taken part in every step, so its
/// peers finish theirs.
///
/// A peer that does not take part makes NCCL abort when a step is not done by its deadline
/// (`TransportError::Aborted` naming the ranks), as over NCCL generally: NCCL cannot erase one
/// peer and go on. Every rank must make this call at the same point of its NCCL sequence, with
/// the same `collective` number, length, policy and agreement. bf16 and f16 vectors travel
/// and aggregate as they are.
///
/// # Errors
/// As `Communicator::robust_all_reduce`: [`Error::Aggregation`] for the rule (precondition,
/// non-finite result, CUDA failure), [`Error::Transport`] for NCCL, [`Error::Disagreement`]
/// from the cross-check, [`Error::InvalidUsage`] when the rule's GPU is not the exchange's or
/// for a replica count outside `1..=n`, [`Error::Unsupported`] for other policies. On error
/// `buf` is unchanged.
pub async fn robust_all_reduce_nccl<E: GpuElement, N: DeviceExchange>(
    net: &N,
    collective: u64,
    buf: &mut CudaSlice<E>,
    rule: &CudaRule,
    policy: Policy,
    agreement: Agreement,
    timeout: Duration,
) -> Result<RoundReport> {
    let ((me, n), d) = (net.world(), buf.len());
    if let Policy::Audited(_) = policy {
        // Never a silent r = 1 round: the device plane cannot serve auditors.
        return Err(Error::Unsupported(
            "Policy::Audited over NCCL: audited rounds run on host vectors (over NCCL, copy \
             the vector to the host, or use a host transport, which stages f32 vectors)"
                .into(),
        ));
    }
    // NCCL cannot end a step early: no quorum.
    let shape = Shape::all_reduce(policy, n, d, std::mem::size_of::<E>(), rule, false);
    let gpu = rule.gpu().clone();
    if gpu.context().ordinal() != net.device_ordinal() {
        return Err(Error::InvalidUsage(format!(
            "the rule runs on GPU {} but the exchange on GPU {}",
            gpu.context().ordinal(),
            net.device_ordinal()
        )));
    }
    check_agreement(agreement, shape, n, rule.byzantine())?;
    let stream = gpu.stream().clone();
    // Everything written to `buf` before this call is complete before it is read or sent: on
    // its own stream, and on others through the event `device_ptr` makes this stream wait for.
    // Every later use of `mine` is on this stream, in order.
    let mine = buf.device_ptr(&stream).0;
    buf.stream()
        .synchronize()
        .and_then(|()| stream.synchronize())
        .map_err(|e| rule.backend(e))?;
    let spec = Spec {
        me,
        n,
        d,
        elem: std::mem::size_of::<E>(),
        shape,
        agreement,
        timeout,
        // NCCL's group calls complete whole: every input is waited for.
        stragglers: 0,
        grace: byzcoll_proto::Grace::DEFAULT,
    };
    let mut round: Round<'_, Row> = Round::new(spec, rule);
    let mut plane = DevicePlane::<E>::new(rule, mine, d, me, n)?;
    while let Some(plan) = round.step() {
        let plan = plan.clone();
        // Device memory the round's own bytes and empty results are staged in, kept until the
        // exchange is done with them.
        let mut staged = Vec::new();
        let mut sends = Vec::with_capacity(plan.sends.len());
        for send in &plan.sends {
            let (ptr, len) = match send.msg {
                byzcoll_proto::round::Msg::Forward(j) => {
                    let row = round.held(j).ok_or_else(|| {
                        Error::InvalidUsage(format!(
                            "the round forwards slot {j} but holds no message for it"
                        ))
                    })?;
                    (row.ptr(), row.bytes())
                }
                _ => plane.message(send, &mut staged)?,
            };
            // Both sides know every length, so a message of no bytes is never exchanged.
            if len > 0 {
                sends.push(DeviceSend {
                    peer: send.peer,
                    tag: send.tag,
                    ptr,
                    len,
                });
            }
        }
        plane.sync()?;
        let live: Vec<RecvOp> = plan.recvs.iter().filter(|r| r.len > 0).copied().collect();
        let deadline = Instant::now() + plan.timeout;
        // SAFETY: every send addresses written device memory (synchronized above) that lives
        // until the exchange returns: the caller's vector, the plane's results, the buffers in
        // `staged`, or received buffers the round holds.
        let got =
            unsafe { net.exchange_device(collective, plan.index, &sends, &live, deadline) }.await?;
        drop(staged);
        let step = Received::new(got, stream.clone());
        let mut next = 0;
        let arrivals = plan
            .recvs
            .iter()
            .map(|r| {
                Arrival::Received(if r.len == 0 {
                    Row::empty()
                } else {
                    next += 1;
                    Row::new(&step, next - 1)
                })
            })
            .collect();
        drop(step);
        round.handle(&mut plane, arrivals);
        for why in round.take_warnings() {
            tracing::warn!(rank = me, collective, "robust round on the device: {why}");
        }
    }
    let failure = plane.take_failure();
    let report = round.finish();
    // This rank's own failure explains a failed round best, and never lets one pass.
    if let Some(own) = failure {
        return Err(Error::Aggregation(own));
    }
    let report = report?;
    if d > 0 {
        stream
            .memcpy_dtod(&plane.output().slice(..d), buf)
            .and_then(|()| stream.synchronize())
            .map_err(|e| rule.backend(e))?;
    }
    Ok(report)
}
