//! `byzcoll simulate --mode audited`: audited sharded rounds with the real evidence
//! (`byzcoll_sim::AuditSim`), over many seeds, checked against the odds.

use std::fmt::Write as _;
use std::process::ExitCode;

use byzcoll::audit::Audit;
use byzcoll::Agreement;
use byzcoll_sim::{AuditRun, AuditSim, Lie, Lying};

use super::{LieArg, SimDType, SimulateArgs};

/// Audited rounds run by default.
const DEFAULT_ROUNDS: u32 = 10;

/// Parses `--lie-on`: `everywhere`, `sub-chunks:L`, `rounds:Q` or `unwatched:L`.
pub(super) fn parse_lying(s: &str) -> Result<Lying, String> {
    let count = |v: &str| {
        v.parse::<usize>()
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| format!("`{v}` is not a count of sub-chunks (1 or more)"))
    };
    match s.split_once(':') {
        None if s == "everywhere" => Ok(Lying::Everywhere),
        Some(("sub-chunks", l)) => count(l).map(Lying::SubChunks),
        Some(("unwatched", l)) => count(l).map(Lying::Unwatched),
        Some(("rounds", q)) => super::probability(q).map(Lying::Sometimes),
        _ => Err(format!(
            "`{s}`: everywhere, sub-chunks:L, rounds:Q or unwatched:L (e.g. sub-chunks:4)"
        )),
    }
}

fn describe_lying(how: Lying) -> String {
    match how {
        Lying::Everywhere => "everywhere".into(),
        Lying::SubChunks(l) => format!("on {l} random sub-chunks"),
        Lying::Sometimes(q) => format!("everywhere in a round with probability {q}"),
        Lying::Unwatched(l) => format!("on {l} sub-chunks its auditors did not ask for before"),
    }
}

fn lie_name(lie: LieArg) -> &'static str {
    match lie {
        LieArg::Signflip => "signflip",
        LieArg::Nan => "nan",
        LieArg::Equivocate => "equivocate",
    }
}

/// The first flag given that audited mode does not model, if any.
fn unmodelled(args: &SimulateArgs) -> Option<&'static str> {
    [
        (
            !args.replicas.is_empty(),
            "--replicas (audited rounds have one owner per shard)",
        ),
        (args.timeout_ms != 30_000.0, "--timeout-ms"),
        (args.loss != 0.0, "--loss"),
        (args.delay_us != 0.0, "--delay-us"),
        (!args.crash.is_empty(), "--crash"),
        (!args.stall.is_empty(), "--stall"),
        (
            args.byzantine != 0,
            "--byzantine (audited mode's Byzantine ranks are --lying-owners and --framers)",
        ),
        (args.equivocate, "--equivocate"),
        (
            args.stragglers != byzcoll::Stragglers::default(),
            "--stragglers",
        ),
        (args.slow_ranks.is_some(), "--slow-ranks"),
        (args.deaths.is_some(), "--deaths"),
        (
            args.dtype != SimDType::F32,
            "--dtype (audited mode carries f32)",
        ),
        (
            args.agreement != Agreement::Detect,
            "--agreement (audited rounds run under detect)",
        ),
        (
            args.m.is_some() || args.tau.is_some(),
            "--m and --tau (audits need a coordinate-wise rule)",
        ),
        (
            args.alpha_us.is_some()
                || args.gbps.is_some()
                || args.agg_throughput.is_some()
                || args.sum_throughput.is_some(),
            "the network and compute flags (audited mode does not model time)",
        ),
    ]
    .into_iter()
    .find_map(|(given, flag)| given.then_some(flag))
}

/// The audited worlds of one `n`, one per seed, checked.
fn worlds(args: &SimulateArgs, n: usize, rule: &str) -> Result<Vec<AuditSim>, String> {
    let (d, m) = (args.d as usize, args.sub_chunks as usize);
    if !d.is_multiple_of(n) || d / n < m {
        return Err(format!(
            "--mode audited cuts --d into n shards of at least --sub-chunks elements: with n = \
             {n} and {m} sub-chunks, --d must be a multiple of {n} and at least {}",
            n * m
        ));
    }
    if args.audit_samples > args.sub_chunks {
        return Err(format!(
            "--audit-samples {} is more than the {m} sub-chunks of a shard",
            args.audit_samples
        ));
    }
    if let Some(k) = args.audit_owners.filter(|&k| k as usize > n - 1) {
        return Err(format!(
            "--audit-owners {k}: a rank of {n} audits at most the {} other owners",
            n - 1
        ));
    }
    let (liars, framers) = (args.lying_owners, args.framers as usize);
    if liars.saturating_add(framers) > n {
        return Err(format!(
            "--lying-owners {liars} and --framers {framers} are more ranks than n = {n}"
        ));
    }
    let lie = match args.lie {
        LieArg::Signflip => Lie::SignFlip,
        LieArg::Nan => Lie::Nan,
        LieArg::Equivocate => Lie::Equivocate,
    };
    let rounds = args.rounds.unwrap_or(DEFAULT_ROUNDS);
    let sims: Vec<AuditSim> = (0..u64::from(args.seeds))
        .map(|i| AuditSim {
            n,
            f: args.f,
            rule: rule.to_string(),
            shard: d / n,
            audit: Audit {
                sub_chunks: m,
                samples: args.audit_samples as usize,
                owners: args.audit_owners.map(|k| k as usize),
            },
            rounds,
            seed: args.seed.wrapping_add(i),
            liars: (n - liars..n).map(|r| (r, args.lie_on)).collect(),
            lie,
            framers: (n - liars - framers..n - liars).collect(),
        })
        .collect();
    for sim in &sims {
        sim.validate().map_err(|e| {
            let flags = "(--lying-owners and --framers count against --f)";
            format!("--mode audited: {e} {flags}")
        })?;
    }
    let threads = std::thread::available_parallelism().map_or(1, |p| p.get());
    let needed = sims[0].memory(threads);
    if needed > args.memory_bound() {
        return Err(format!(
            "--mode audited --ranks {n} --d {d} needs about {} of memory, above the {} bound \
             (mostly the audits' signed pieces and proofs); lower --ranks, --sub-chunks or \
             --lying-owners, or raise --max-memory-gib",
            byzcoll_sim::format_gib(needed),
            byzcoll_sim::format_gib(args.memory_bound())
        ));
    }
    Ok(sims)
}

/// One line per round of a run.
fn round_lines(run: &AuditRun) -> String {
    let mut out = String::new();
    for (i, r) in run.rounds.iter().enumerate() {
        let convicted = if r.convicted.is_empty() {
            "nobody convicted".to_string()
        } else {
            format!("convicted {:?}", r.convicted)
        };
        let verdicts = if r.split {
            "SPLIT verdicts"
        } else {
            "verdicts agree"
        };
        let _ = writeln!(
            out,
            "  round {}: {} owners lying, {} audits, {} replays differ, {} proofs sent, \
             {convicted}, {} forged proofs refuted, {verdicts} (each proof checked {}x)",
            i + 1,
            r.lying,
            r.audits,
            r.accusations,
            r.proofs,
            r.framings_refuted,
            r.checkers
        );
    }
    out
}

/// One line: how the run's liars fared against their predictions.
fn summary(sim: &AuditSim, run: &AuditRun) -> String {
    let liars: Vec<String> = run
        .convicted
        .iter()
        .zip(&run.predicted)
        .map(|((rank, got), (_, want))| {
            let got = got.map_or("never convicted".into(), |r| {
                format!("convicted in round {r}")
            });
            let want = want.map_or(format!("not predicted within {} rounds", sim.rounds), |r| {
                format!("predicted by round {r}")
            });
            format!("liar {rank} {got} ({want})")
        })
        .collect();
    let liars = if liars.is_empty() {
        "no liar".to_string()
    } else {
        liars.join(", ")
    };
    format!(
        "seed {}: {liars}; honest owners convicted: {}; forged proofs refuted: {}, standing: {}; \
         rounds with split verdicts: {}; audits: {}",
        sim.seed,
        run.honest_convicted.len(),
        run.framings_refuted,
        run.framings_standing,
        run.split_rounds,
        run.audits
    )
}

/// Runs `byzcoll simulate --mode audited`: the exit code, or the one-line error of a bad set-up.
#[allow(clippy::print_stdout)]
pub(super) fn simulate_audited(args: &SimulateArgs) -> Result<ExitCode, String> {
    if let Some(flag) = unmodelled(args) {
        return Err(format!("--mode audited does not model {flag}"));
    }
    let Some(rule) = &args.rule else {
        return Err("--mode audited needs --rule (there is no default rule)".into());
    };
    // Every world and seed is checked before the first runs.
    let worlds = args
        .ranks
        .iter()
        .map(|&n| worlds(args, n as usize, rule))
        .collect::<Result<Vec<_>, String>>()?;
    let mut failed = 0;
    for sims in &worlds {
        let first = &sims[0];
        let (n, f, audit) = (first.n, first.f, first.audit);
        println!(
            "audited rounds: n = {n}, d = {} (shards of {} elements in {} sub-chunks), rule {rule} \
             (f = {f}); each rank audits {} owners, {} sub-chunks each ({:.2} of d in audit data \
             per rank); {} lying owners ({}, {}), {} framers; {} rounds, seeds {} to {}",
            first.shard * n,
            first.shard,
            audit.sub_chunks,
            audit.owners_per_rank(n, f),
            audit.samples,
            audit.traffic(n, f),
            first.liars.len(),
            describe_lying(args.lie_on),
            lie_name(args.lie),
            first.framers.len(),
            first.rounds,
            first.seed,
            sims[sims.len() - 1].seed,
        );
        for sim in sims {
            let run = sim.run().map_err(|e| e.to_string())?;
            if sims.len() == 1 {
                print!("{}", round_lines(&run));
            }
            println!("{}", summary(sim, &run));
            if args.check {
                if let Err(why) = run.check() {
                    println!("FAILED: seed {}: {why}", sim.seed);
                    failed += 1;
                }
            }
        }
    }
    if !args.check {
        return Ok(ExitCode::SUCCESS);
    }
    let seeds: usize = worlds.iter().map(Vec::len).sum();
    if failed == 0 {
        let (held, liars) = worlds.iter().flatten().fold((0, 0), |(held, all), sim| {
            let within = sim
                .liars
                .iter()
                .filter(|(_, how)| {
                    how.predicted(&sim.audit, sim.n, sim.f, sim.rounds)
                        .is_some()
                })
                .count();
            (held + within, all + sim.liars.len())
        });
        println!(
            "OK: every liar convicted within its predicted rounds ({held} of {liars} liars had a \
             prediction within the rounds run), no honest owner convicted, every forgery \
             refuted, the checks of every proof agreed; runs: {seeds}"
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!("FAILED: {failed} of {seeds} runs");
        Ok(ExitCode::from(1))
    }
}
