//! The CUDA rules on a real GPU, checked against the CPU rules on fresh random inputs.
//!
//! Every test skips with a visible `SKIPPED` line where there is no GPU (CI); the kernels' logic
//! is also checked without a GPU in `tests/emulated.rs`. Tolerances as stated there: f32 results
//! of the network path (n ≤ 64), Multi-Krum's mean and Bulyan's phase are bitwise those of the
//! CPU; the selection path (n > 64) within one f32 ulp; bf16/f16 equal the CPU rule on the
//! widened values rounded to the element type.

use std::sync::Arc;
#[cfg(feature = "nccl")]
use std::time::Duration;

use byzcoll_aggregators::{aggregate_into, build, AggError, Params};
use byzcoll_cuda::{robust_all_reduce_device, CudaRule, Gpu};
use byzcoll_runtime::{Communicator, Config, Policy, Replicas, Stragglers};
use byzcoll_transport_local::LocalTransport;
use cudarc::driver::CudaSlice;
mod common;

use common::{assert_close, gpu, inputs};
use rand::rngs::StdRng;
use rand::SeedableRng;

fn cpu(rule: &str, f: usize, x: &[Vec<f32>]) -> Result<(Vec<f32>, Option<Vec<usize>>), AggError> {
    let views: Vec<&[f32]> = x.iter().map(|v| v.as_slice()).collect();
    let mut out = vec![0.0f32; x[0].len()];
    let rule = build(
        rule,
        &Params {
            f,
            ..Params::default()
        },
    )?;
    let report = aggregate_into(&*rule, &views, &mut out)?;
    Ok((out, report.selected))
}

fn device(
    gpu: &Gpu,
    rule: &CudaRule,
    x: &[Vec<f32>],
) -> Result<(Vec<f32>, Option<Vec<usize>>), AggError> {
    let stream = gpu.stream();
    let rows: Vec<CudaSlice<f32>> = x
        .iter()
        .map(|v| stream.clone_htod(v).expect("upload"))
        .collect();
    let mut out = stream.alloc_zeros::<f32>(x[0].len()).expect("alloc");
    let report = rule.aggregate_device(&rows, &mut out)?;
    Ok((stream.clone_dtoh(&out).expect("download"), report.selected))
}

fn median(gpu: &Arc<Gpu>, f: usize) -> CudaRule {
    let params = Params {
        f,
        ..Params::default()
    };
    CudaRule::new(gpu.clone(), "median", &params).expect("median")
}

const RULES: [&str; 5] = ["median", "trimmed-mean", "krum", "multi-krum", "bulyan"];

#[test]
fn every_rule_matches_the_cpu_rule_on_the_device() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(21);
    for n in [3, 4, 7, 16, 17, 64, 65, 130] {
        let d = 10_007;
        let x = inputs(&mut rng, n, d);
        for rule in RULES {
            for f in [0, (n - 1) / 4, (n - 1) / 2] {
                let params = Params {
                    f,
                    ..Params::default()
                };
                let cuda = CudaRule::new(gpu.clone(), rule, &params).expect("rule");
                let want = cpu(rule, f, &x);
                let got = device(&gpu, &cuda, &x);
                let what = format!("{rule} n = {n} f = {f}");
                match (got, want) {
                    (Ok(got), Ok(want)) => {
                        assert_eq!(got.1, want.1, "{what}: selection");
                        if n <= 64 || rule != "median" && rule != "trimmed-mean" {
                            assert_eq!(got.0, want.0, "{what}: must be bitwise");
                        } else {
                            assert_close(&got.0, &want.0, &what);
                        }
                    }
                    (Err(AggError::Precondition { .. }), Err(AggError::Precondition { .. })) => {}
                    (Err(AggError::Unsupported { .. }), Ok(_)) if rule == "bulyan" => {}
                    (got, want) => panic!("{what}: GPU {got:?}, CPU {want:?}"),
                }
            }
        }
    }
}

#[test]
fn non_finite_inputs_follow_the_cpu_policy_on_the_device() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(22);
    for n in [5, 8, 33, 65] {
        let f = (n - 1) / 2;
        let d = 4099;
        let mut x = inputs(&mut rng, n, d);
        for (i, v) in x.iter_mut().take(f).enumerate() {
            for (j, c) in v.iter_mut().enumerate() {
                *c = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(i + j) % 3];
            }
        }
        for rule in ["median", "trimmed-mean"] {
            let cuda = CudaRule::new(
                gpu.clone(),
                rule,
                &Params {
                    f,
                    ..Params::default()
                },
            )
            .expect("rule");
            let (got, _) = device(&gpu, &cuda, &x).expect("f non-finite inputs are tolerated");
            assert!(got.iter().all(|v| v.is_finite()), "{rule} n = {n}");
            let (want, _) = cpu(rule, f, &x).expect("cpu");
            assert_close(&got, &want, &format!("{rule} n = {n}"));
        }
        let mut y = x.clone();
        for v in y.iter_mut().take(f + 1) {
            v[1234] = f32::NAN;
        }
        let cuda = median(&gpu, f);
        match device(&gpu, &cuda, &y) {
            Err(AggError::NonFiniteResult { coordinate, .. }) => assert_eq!(coordinate, 1234),
            other => panic!("median n = {n} with f + 1 NaN: {other:?}"),
        }
    }
}

#[test]
fn half_precision_inputs_are_aggregated_in_float() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(23);
    let stream = gpu.stream();
    for n in [5, 16, 65] {
        let d = 3001;
        let x = inputs(&mut rng, n, d);
        let f = (n - 1) / 2;
        let cuda = median(&gpu, f);
        let bf: Vec<Vec<half::bf16>> = x
            .iter()
            .map(|v| v.iter().map(|&c| half::bf16::from_f32(c)).collect())
            .collect();
        let widened: Vec<Vec<f32>> = bf
            .iter()
            .map(|v| v.iter().map(|c| c.to_f32()).collect())
            .collect();
        let rows: Vec<CudaSlice<half::bf16>> = bf
            .iter()
            .map(|v| stream.clone_htod(v).expect("upload"))
            .collect();
        let mut out = stream.alloc_zeros::<half::bf16>(d).expect("alloc");
        cuda.aggregate_device(&rows, &mut out).expect("bf16 median");
        let got = stream.clone_dtoh(&out).expect("download");
        let (want, _) = cpu("median", f, &widened).expect("cpu");
        let want: Vec<half::bf16> = want.iter().map(|&v| half::bf16::from_f32(v)).collect();
        assert_eq!(got, want, "bf16 median of {n}");
    }
}

#[test]
fn rules_without_kernels_are_refused_not_run_elsewhere() {
    let Some(gpu) = gpu() else { return };
    for rule in ["geometric-median", "nnm+median", "mean"] {
        match CudaRule::new(gpu.clone(), rule, &Params::default()) {
            Err(AggError::Unsupported { .. }) => {}
            other => panic!("{rule}: {other:?}"),
        }
    }
}

/// Seven ranks (tasks of this process over the local transport) share the GPU: the robust
/// all-reduce with the CUDA rule gives bitwise the CPU rule's result in gather and sharded
/// modes, and on device vectors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn robust_all_reduce_with_the_gpu_rule_matches_the_cpu_rule() {
    let Some(gpu) = gpu() else { return };
    let n = 7;
    let d = 5000;
    let mut rng = StdRng::seed_from_u64(24);
    let x = inputs(&mut rng, n, d);
    for rule in ["median", "trimmed-mean", "krum", "bulyan"] {
        let f = if rule == "bulyan" { 1 } else { 2 };
        let params = Params {
            f,
            ..Params::default()
        };
        for policy in [Policy::Gather, Policy::Sharded(Replicas::Tolerant)] {
            let mut tasks = Vec::new();
            for (r, t) in LocalTransport::world(n).into_iter().enumerate() {
                let (gpu, mine, params) = (gpu.clone(), x[r].clone(), params.clone());
                tasks.push(tokio::spawn(async move {
                    // Every input waited for: the three rounds compared must aggregate the same
                    // inputs (stragglers are allowed by default, and seven ranks sharing the
                    // GPU can be late).
                    let mut config = Config::default();
                    config.stragglers = Stragglers::Exactly(0);
                    let mut comm = Communicator::new(Box::new(t), config);
                    let cuda = CudaRule::new(gpu.clone(), rule, &params).expect("rule");
                    let reference = build(rule, &params).expect("rule");
                    let mut on_gpu = mine.clone();
                    comm.robust_all_reduce(&mut on_gpu, &cuda, policy)
                        .await
                        .expect("gpu rule");
                    let mut on_cpu = mine.clone();
                    comm.robust_all_reduce(&mut on_cpu, &*reference, policy)
                        .await
                        .expect("cpu rule");
                    let mut dev = gpu.stream().clone_htod(&mine).expect("upload");
                    robust_all_reduce_device(&mut comm, &mut dev, &cuda, policy)
                        .await
                        .expect("device vector");
                    let dev = gpu.stream().clone_dtoh(&dev).expect("download");
                    (on_gpu, on_cpu, dev)
                }));
            }
            for task in tasks {
                let (on_gpu, on_cpu, dev) = task.await.expect("rank");
                assert_eq!(on_gpu, on_cpu, "{rule} {policy:?}");
                assert_eq!(dev, on_cpu, "{rule} {policy:?} on device vectors");
            }
        }
    }
}

/// NCCL at world size 1 (one GPU cannot hold two NCCL ranks): in gather and sharded modes
/// the device-vector path returns the rank's own vector for a median of one, for f32 and bf16,
/// and its future can be spawned.
#[cfg(feature = "nccl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nccl_device_all_reduce_at_world_size_one() {
    use byzcoll_cuda::robust_all_reduce_nccl;
    use byzcoll_runtime::Agreement;
    use byzcoll_transport_nccl::{NcclOptions, NcclTransport};
    use std::io::Write as _;
    let Some(gpu) = gpu() else { return };
    let nccl = match NcclTransport::single(NcclOptions::default()).await {
        Ok(t) => t,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED: NCCL unavailable ({e})");
            return;
        }
    };
    fn assert_send<T: Send>(_: &T) {}
    let mut rng = StdRng::seed_from_u64(25);
    let x = inputs(&mut rng, 1, 10_007).remove(0);
    let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let stream = gpu.stream().clone();
    let rule = median(&gpu, 0);
    let timeout = Duration::from_secs(10);
    let mut collective = 0;
    for policy in [Policy::Gather, Policy::Sharded(Replicas::Tolerant)] {
        collective += 1;
        let mut buf = stream.clone_htod(&x).expect("upload");
        let call = robust_all_reduce_nccl(
            &nccl,
            collective,
            &mut buf,
            &rule,
            policy,
            Agreement::Detect,
            timeout,
        );
        assert_send(&call);
        let report = call.await.expect("f32 over NCCL");
        assert_eq!(report.inputs, 1, "{policy:?}");
        assert!(report.agreement.is_some(), "{policy:?}: cross-checked");
        assert_eq!(stream.clone_dtoh(&buf).expect("download"), x, "{policy:?}");

        collective += 1;
        let mut buf = stream.clone_htod(&xb).expect("upload");
        robust_all_reduce_nccl(
            &nccl,
            collective,
            &mut buf,
            &rule,
            policy,
            Agreement::Off,
            timeout,
        )
        .await
        .expect("bf16 over NCCL");
        assert_eq!(stream.clone_dtoh(&buf).expect("download"), xb, "{policy:?}");
    }
}

/// The one device-vector entry point: on a communicator over NCCL (world size 1) it takes
/// the device path for f32 and bf16, numbered in the communicator's sequence (a host
/// collective before and after still meets itself), under the communicator's agreement
/// (`Detect` by default, cross-checked; `Off` when set); over a host transport it refuses
/// bf16, which only NCCL carries.
#[cfg(feature = "nccl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_device_entry_point_over_nccl_and_host_transports() {
    use byzcoll_runtime::{Agreement, Error};
    use byzcoll_transport_nccl::{NcclOptions, NcclTransport};
    use std::io::Write as _;
    let Some(gpu) = gpu() else { return };
    let nccl = match NcclTransport::single(NcclOptions::default()).await {
        Ok(t) => t,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED: NCCL unavailable ({e})");
            return;
        }
    };
    let mut comm = Communicator::new(Box::new(nccl), Config::default());
    let mut rng = StdRng::seed_from_u64(26);
    let x = inputs(&mut rng, 1, 4099).remove(0);
    let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let stream = gpu.stream().clone();
    let rule = median(&gpu, 0);
    for (policy, agreement) in [
        (Policy::Gather, Agreement::Detect),
        (Policy::Sharded(Replicas::Tolerant), Agreement::Detect),
        (Policy::Gather, Agreement::Off),
        (Policy::Sharded(Replicas::Tolerant), Agreement::Off),
    ] {
        comm.set_agreement(agreement);
        comm.barrier().await.expect("host collective before");
        let mut buf = stream.clone_htod(&x).expect("upload");
        let report = robust_all_reduce_device(&mut comm, &mut buf, &rule, policy)
            .await
            .expect("f32 over NCCL");
        assert_eq!(report.inputs, 1);
        assert_eq!(
            report.agreement.is_some(),
            agreement == Agreement::Detect,
            "{policy:?} {agreement:?}"
        );
        assert_eq!(stream.clone_dtoh(&buf).expect("download"), x, "{policy:?}");
        let mut buf = stream.clone_htod(&xb).expect("upload");
        robust_all_reduce_device(&mut comm, &mut buf, &rule, policy)
            .await
            .expect("bf16 over NCCL");
        assert_eq!(stream.clone_dtoh(&buf).expect("download"), xb, "{policy:?}");
        comm.barrier().await.expect("host collective after");
    }

    let mut host = Communicator::new(
        Box::new(LocalTransport::world(1).remove(0)),
        Config::default(),
    );
    let mut buf = stream.clone_htod(&xb).expect("upload");
    let refused = robust_all_reduce_device(&mut host, &mut buf, &rule, Policy::Gather).await;
    assert!(matches!(refused, Err(Error::Unsupported(_))), "{refused:?}");
}
