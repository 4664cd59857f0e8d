//! Timing mode: the α–β model's closed forms, scaling in n, deadlines and determinism.

use byzcoll_aggregators::by_name;
use byzcoll_proto::Agreement;
use byzcoll_sim::{
    predict, Algorithm, Compute, Crash, Network, Preset, RankResult, Scenario, Stall,
};

const BETA: f64 = 25e9;

/// A world timing the schedules' own steps: the cross-check step of `Agreement::Detect` is
/// timed by `the_cross_check_is_one_more_all_to_all_step`.
fn model(n: usize, network: Network) -> Scenario {
    let mut s = Scenario::new(n, network);
    s.agreement = Agreement::Off;
    s
}

fn network(alpha: f64) -> Network {
    Network {
        alpha,
        link_bandwidth: BETA,
        injection_bandwidth: BETA,
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs())
}

#[test]
fn one_message_costs_alpha_plus_b_over_beta() {
    // Two ranks in gather mode: one message each way, full duplex.
    for d in [1usize, 1000, 1 << 20] {
        let bytes = (4 * d) as f64;
        let s = model(2, network(0.0));
        let run = s.run_timing(Algorithm::Gather, d, None).unwrap();
        assert_eq!(run.time, bytes / BETA, "d={d}");
        assert_eq!(run.stats.messages, 2);
        assert_eq!(run.stats.bytes, 2 * 4 * d as u64);
        let s = model(2, network(2e-6));
        let run = s.run_timing(Algorithm::Gather, d, None).unwrap();
        assert_eq!(run.time, 2e-6 + bytes / BETA, "d={d}");
    }
    // A slower link than NIC bounds one message too.
    let mut s = model(2, network(0.0));
    s.network.link_bandwidth = BETA / 2.0;
    let run = s.run_timing(Algorithm::Gather, 1000, None).unwrap();
    assert_eq!(run.time, 4000.0 / (BETA / 2.0));
}

#[test]
fn gather_is_bound_by_the_receivers_nic() {
    // n - 1 vectors in and out of every NIC, pipelined: (n-1)·B/β + α.
    let alpha = 2e-6;
    for n in [3usize, 8, 33] {
        let d = 1 << 16;
        let b = (4 * d) as f64;
        let run = model(n, network(alpha))
            .run_timing(Algorithm::Gather, d, None)
            .unwrap();
        let want = (n - 1) as f64 * b / BETA + alpha;
        assert!(
            close(run.time, want, 1e-12),
            "n={n}: {} vs {want}",
            run.time
        );
    }
}

#[test]
fn gather_grows_linearly_in_n_and_sharded_stays_flat() {
    let d = 1 << 20;
    let time = |n: usize, alg: Algorithm| {
        model(n, Network::preset(Preset::Infiniband))
            .run_timing(alg, d, None)
            .unwrap()
            .time
    };
    let g16 = time(16, Algorithm::Gather);
    let g64 = time(64, Algorithm::Gather);
    assert!(close(g64 / g16, 63.0 / 15.0, 0.01), "{}", g64 / g16);
    let s16 = time(16, Algorithm::Sharded { replicas: 1 });
    let s256 = time(256, Algorithm::Sharded { replicas: 1 });
    assert!((0.9..1.2).contains(&(s256 / s16)), "{s16} {s256}");
    // r owners per shard take r times the pieces; the versions go by digest, so a taker
    // receives one version and r - 1 digests: (r + 1) / 2 times the bytes of r = 1 (it was r
    // times when every owner sent its version).
    let s7 = time(64, Algorithm::Sharded { replicas: 7 });
    let s1 = time(64, Algorithm::Sharded { replicas: 1 });
    assert!((3.5..4.6).contains(&(s7 / s1)), "{}", s7 / s1);
}

#[test]
fn ring_sum_matches_the_closed_form() {
    let alpha = 2e-6;
    for n in [2usize, 4, 16, 64, 100] {
        let d = 1000 * n; // n equal chunks
        let run = model(n, network(alpha))
            .run_timing(Algorithm::RingSum, d, None)
            .unwrap();
        let steps = 2.0 * (n - 1) as f64;
        let want = steps / n as f64 * (4 * d) as f64 / BETA + steps * alpha;
        assert!(close(run.time, want, 1e-9), "n={n}: {} vs {want}", run.time);
        assert_eq!(run.stats.messages as usize, 2 * n * (n - 1));
    }
}

#[test]
fn aggregation_throughput_is_charged() {
    let (n, d, alpha, rate) = (8usize, 1 << 16, 2e-6, 4.5e9);
    let b = (4 * d) as f64;
    let mut s = model(n, network(alpha));
    s.compute = Compute {
        rule_throughput: Some(rate),
        sum_throughput: None,
    };
    let run = s.run_timing(Algorithm::Gather, d, None).unwrap();
    let want = (n - 1) as f64 * b / BETA + alpha + n as f64 * b / rate;
    assert!(close(run.time, want, 1e-12), "{} vs {want}", run.time);
}

#[test]
fn computation_delays_the_next_steps_sends() {
    // Two ranks, one owner per shard: scatter half a vector, aggregate two halves, send the
    // result back. The result leaves only after the aggregation.
    let (d, alpha, rate) = (1 << 16, 2e-6, 1e9);
    let b = (4 * d) as f64;
    let mut s = model(2, network(alpha));
    s.compute.rule_throughput = Some(rate);
    let run = s
        .run_timing(Algorithm::Sharded { replicas: 1 }, d, None)
        .unwrap();
    let want = 2.0 * (alpha + b / 2.0 / BETA) + b / rate;
    assert!(close(run.time, want, 1e-12), "{} vs {want}", run.time);
}

#[test]
fn lost_messages_are_missing_at_the_deadline() {
    let mut s = model(3, network(1e-6));
    s.faults.loss = 1.0;
    s.timeout = 0.5e-3;
    let run = s.run_timing(Algorithm::Gather, 100, None).unwrap();
    assert_eq!(run.stats.lost, 6);
    assert_eq!(run.stats.erasures, 6);
    assert_eq!(run.time, 0.5e-3);
    for o in &run.ranks {
        assert_eq!(o.faults.len(), 2);
    }
    // With a rule, the precondition is applied to what arrived.
    let rule = by_name("median", 1).unwrap();
    let run = s
        .run_timing(Algorithm::Gather, 100, Some(rule.as_ref()))
        .unwrap();
    assert_eq!(run.failures().count(), 3);
}

#[test]
fn stalls_and_crashes_shape_the_timeline() {
    let alpha = 2e-6;
    let d = 1000;
    let b = 4000.0;
    // A rank that starts 100 us late holds everyone up (no deadline passes).
    let mut s = model(4, network(alpha));
    s.faults.stalls = vec![Stall {
        rank: 1,
        delay: 100e-6,
    }];
    let run = s.run_timing(Algorithm::Gather, d, None).unwrap();
    assert!(run.time > 100e-6 + alpha + b / BETA - 1e-12, "{}", run.time);
    assert_eq!(run.stats.erasures, 0);
    // A crashed rank costs the others a deadline.
    let mut s = model(4, network(alpha));
    s.timeout = 1e-3;
    s.faults.crashes = vec![Crash {
        rank: 3,
        from_step: 0,
    }];
    let run = s.run_timing(Algorithm::Gather, d, None).unwrap();
    assert_eq!(run.time, 1e-3);
    assert_eq!(run.stats.erasures, 3);
    assert!(matches!(run.ranks[3].result, RankResult::Crashed));
    // Crashing in the second sharded step: its scatter arrived, its results do not.
    s.faults.crashes[0].from_step = 1;
    let run = s
        .run_timing(Algorithm::Sharded { replicas: 3 }, d, None)
        .unwrap();
    assert_eq!(run.stats.erasures as usize, 3 * 3);
    assert!(run.ranks[0].faults.iter().any(|p| p.rank == 3));
}

#[test]
fn same_seed_same_timeline() {
    let run = |seed: u64| {
        let mut s = model(32, Network::preset(Preset::Slingshot));
        s.seed = seed;
        s.faults.loss = 0.01;
        s.faults.max_delay = 4e-6;
        s.timeout = 2e-3;
        [
            Algorithm::Gather,
            Algorithm::Sharded { replicas: 3 },
            Algorithm::RingSum,
        ]
        .map(|alg| {
            let run = s.run_timing(alg, 4096, None).unwrap();
            let finish: Vec<u64> = run.ranks.iter().map(|o| o.finish.to_bits()).collect();
            (run.time.to_bits(), run.stats, finish)
        })
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn predictions_compare_with_the_ring() {
    let base = Scenario::new(1, Network::preset(Preset::Infiniband));
    assert_eq!(base.agreement, Agreement::Detect);
    let rows = predict("infiniband", &base, 64, 1 << 20, 3, None).unwrap();
    let names: Vec<String> = rows.iter().map(|p| p.algorithm.to_string()).collect();
    assert_eq!(names, ["gather", "sharded r=1", "sharded r=7", "ring SUM"]);
    assert_eq!(rows[3].vs_ring, 1.0);
    assert!(rows[0].vs_ring > 1.0 && rows[1].vs_ring < 1.0);
    assert!(predict("x", &base, 4, 1 << 20, 3, None).is_err());
}

#[test]
fn the_cross_check_is_one_more_all_to_all_step() {
    let n = 8;
    let off = model(n, Network::preset(Preset::Infiniband));
    let detect = Scenario::new(n, Network::preset(Preset::Infiniband));
    for alg in [Algorithm::Gather, Algorithm::Sharded { replicas: 3 }] {
        let a = off.run_timing(alg, 1 << 20, None).unwrap();
        let b = detect.run_timing(alg, 1 << 20, None).unwrap();
        assert_eq!(
            b.stats.messages,
            a.stats.messages + (n * (n - 1)) as u64,
            "{alg}"
        );
        // One more latency at least, and small next to moving 4 MiB vectors.
        assert!(b.time > a.time + 2e-6, "{alg}: {} vs {}", b.time, a.time);
        assert!(b.time < a.time * 1.05, "{alg}: {} vs {}", b.time, a.time);
    }
}

/// A 16-bit element type halves every message of a run, and data mode refuses it.
#[test]
fn the_element_type_sets_the_bytes_on_the_wire() {
    use byzcoll_aggregators::DType;
    let d = 1 << 12;
    for algorithm in [
        Algorithm::Gather,
        Algorithm::Sharded { replicas: 1 },
        Algorithm::RingSum,
    ] {
        let mut s = model(8, network(1e-6));
        let f32_run = s.run_timing(algorithm, d, None).unwrap();
        s.dtype = DType::BF16;
        let bf16_run = s.run_timing(algorithm, d, None).unwrap();
        assert_eq!(
            bf16_run.stats.messages, f32_run.stats.messages,
            "{algorithm}"
        );
        assert_eq!(2 * bf16_run.stats.bytes, f32_run.stats.bytes, "{algorithm}");
        assert!(bf16_run.time < f32_run.time, "{algorithm}");
    }
    // Data mode takes f32, bf16 and f16 (`data_mode.rs`), and times f64 only.
    let mut s = model(4, network(1e-6));
    s.dtype = DType::F64;
    let data = byzcoll_sim::DataSet::generate(&Scenario::new(4, network(1e-6)), 8).unwrap();
    let median = by_name("median", 1).unwrap();
    let refused = s.run_data(Algorithm::Gather, &data, median.as_ref());
    assert!(
        matches!(&refused, Err(byzcoll_sim::SimError::Unsupported(why)) if why.contains("f64")),
        "{refused:?}"
    );
}
