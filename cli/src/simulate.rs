//! `byzcoll simulate`: its arguments, data mode and `--predict` (audited mode in `audited`).

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use byzcoll::aggregators::{Aggregator, Params};
use byzcoll_sim::{
    Adversary, Algorithm, Compute, Crash, DataSet, Deaths, Delay, Faults, Footprint, Lie,
    MemoryEstimate, Network, Preset, Rounds, Scenario, SimError, Slow, Stall,
};
use clap::{Args, ValueEnum};

use crate::check_f;

mod audited;

/// `byzcoll simulate`: data mode (real vectors, real rules, checked against the gather-mode
/// reference), audited mode (`--mode audited`: audits with the real evidence, checked against
/// their odds) or `--predict` (timing table over vector sizes).
#[derive(Debug, Args)]
pub(crate) struct SimulateArgs {
    /// World sizes to simulate, comma-separated (e.g. 64,256,1024): 1 to 10^6, and within
    /// what --max-memory-gib allows (about 3000 ranks for --predict by default).
    #[arg(
        long,
        value_name = "N,...",
        value_delimiter = ',',
        required = true,
        value_parser = clap::value_parser!(u32).range(1..=1_000_000)
    )]
    ranks: Vec<u32>,
    /// Data mode: float32 coordinates per rank's vector, 1 to 2^28; n * d must also be at
    /// most 2^28 (1 GiB of inputs) for every n, and the run's estimated memory (2 to 5 copies
    /// of the inputs, by --mode) within --max-memory-gib.
    #[arg(long, value_name = "D", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=MAX_SIM_ELEMENTS as i64))]
    d: u32,
    /// Aggregation rule (`byzcoll info` lists them); required in data mode, there is no default.
    #[arg(long, required_unless_present = "predict")]
    rule: Option<String>,
    /// Number of Byzantine ranks to tolerate (sharded mode uses r = 2f+1 owners per shard);
    /// below every n of --ranks.
    #[arg(short = 'f', long = "f", value_name = "F", default_value_t = 0)]
    f: usize,
    /// Multi-Krum: how many inputs to average, 1 to n - f (default n - f).
    #[arg(long = "m", value_name = "M")]
    m: Option<usize>,
    /// Centered clipping: the clipping radius, finite and > 0.
    #[arg(long, value_name = "T")]
    tau: Option<f64>,
    /// Which collectives to run in data mode.
    #[arg(long, value_enum, default_value_t = SimMode::All)]
    mode: SimMode,
    /// Owners per shard for sharded mode, comma-separated, 1 to n (default: 1 and 2f+1).
    #[arg(long, value_name = "R,...", value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    replicas: Vec<u32>,
    /// Check every honest rank's result against the gather-mode reference (exit 1 if not). In
    /// rounds mode, check instead that in every round the honest ranks that set the pace
    /// completed, no honest ranks ended with different results silently, and the round took
    /// at most the healthy round (run too) plus the grace when --stragglers covers the slow and
    /// dead ranks, or plus the last start's lag and one step deadline otherwise (and, where
    /// late inputs were passed on, one healthy round and grace more).
    #[arg(long)]
    check: bool,
    /// Timing mode: predict gather, sharded r=1, sharded r=2f+1 and ring SUM completion times
    /// for vectors of 1 MiB to 1 GiB (of --dtype, float32 by default), without faults.
    #[arg(long, conflicts_with_all = [
        "d", "mode", "replicas", "check", "timeout_ms", "loss", "delay_us", "crash", "stall",
        "byzantine", "attack", "lying_owners", "lie", "seed", "equivocate", "rounds",
        "stragglers", "grace_ms", "grace_factor", "slow_ranks", "slow_delay", "deaths",
        "rejoin", "framers", "lie_on", "sub_chunks", "audit_samples", "audit_owners", "seeds",
    ])]
    predict: bool,
    /// Timing mode: vector sizes in bytes instead of the 1 MiB..1 GiB sweep, comma-separated;
    /// multiples of the element size (--dtype; 4 for f32) up to 2^40 (1 TiB), with n^2 * bytes
    /// at most 2^62.
    #[arg(
        long,
        value_name = "BYTES,...",
        value_delimiter = ',',
        requires = "predict",
        value_parser = clap::value_parser!(u64).range(1..=MAX_PREDICT_BYTES)
    )]
    bytes: Vec<u64>,
    /// Network preset: latency and bandwidth of the links and NICs.
    #[arg(long, value_enum, default_value_t = PresetArg::Infiniband)]
    preset: PresetArg,
    /// Latency alpha in microseconds (overrides the preset).
    #[arg(long, value_name = "US", value_parser = non_negative)]
    alpha_us: Option<f64>,
    /// Link and NIC bandwidth in Gb/s (overrides the preset).
    #[arg(long, value_name = "GBPS", value_parser = positive)]
    gbps: Option<f64>,
    /// Aggregation throughput in bytes of input per second (e.g. 4.5e9 for a median); free
    /// when not given.
    #[arg(long, value_name = "B_PER_S", value_parser = positive)]
    agg_throughput: Option<f64>,
    /// SUM throughput in bytes of input per second (ring reduce steps); free when not given.
    #[arg(long, value_name = "B_PER_S", value_parser = positive)]
    sum_throughput: Option<f64>,
    /// Per-step deadline in virtual milliseconds, finite and > 0 (data mode; predictions have
    /// none).
    #[arg(long, value_name = "MS", default_value_t = 30_000.0, value_parser = positive)]
    timeout_ms: f64,
    /// Probability that a message is lost, 0 to 1.
    #[arg(long, value_name = "P", default_value_t = 0.0, value_parser = probability)]
    loss: f64,
    /// Maximum extra latency per message in microseconds (uniform in [0, X], seeded; the
    /// messages one step sends one peer share a draw); finite and >= 0.
    #[arg(long, value_name = "X", default_value_t = 0.0, value_parser = non_negative)]
    delay_us: f64,
    /// Crashed ranks, comma-separated: R (never takes part) or R@STEP (sends nothing from
    /// that step on).
    #[arg(long, value_name = "R[@STEP],...", value_delimiter = ',', value_parser = parse_crash)]
    crash: Vec<Crash>,
    /// Stalled ranks, comma-separated: R:US starts rank R US microseconds late.
    #[arg(long, value_name = "R:US,...", value_delimiter = ',', value_parser = parse_stall)]
    stall: Vec<Stall>,
    /// The last K ranks contribute Byzantine inputs forged by --attack; K below n.
    #[arg(long, value_name = "K", default_value_t = 0)]
    byzantine: usize,
    /// How Byzantine inputs are forged.
    #[arg(long, default_value = "signflip", value_parser = clap::builder::PossibleValuesParser::new(
        byzcoll_sim::ATTACKS.iter().map(|(name, _)| *name)
    ))]
    attack: String,
    /// In sharded and audited modes, the last K ranks lie about their shard results (see
    /// --lie, and --lie-on in audited mode); K at most n.
    #[arg(long, value_name = "K", default_value_t = 0)]
    lying_owners: usize,
    /// What lying owners send.
    #[arg(long, value_enum, default_value_t = LieArg::Signflip)]
    lie: LieArg,
    /// The --byzantine ranks also equivocate: every destination (every peer in gather mode,
    /// every owner of a shard in sharded mode) gets a different forged vector.
    #[arg(long, requires = "byzantine")]
    equivocate: bool,
    /// With --equivocate: only this rank gets another vector, every other destination the
    /// same one (detect leaves the victim out of step; enforce has it recover the majority's).
    #[arg(long, value_name = "RANK", requires = "equivocate")]
    equivocate_toward: Option<u64>,
    /// The robust rounds' agreement, as the runtime's `BYZCOLL_AGREEMENT`: detect (the
    /// default: one more step; a rank out of step fails, the others name the difference),
    /// enforce (n > 3f: the digests of the inputs (gather) or of the owners' results
    /// (sharded) are echoed for f steps so that honest ranks aggregate the same ones; --check
    /// then requires every honest rank to end with bitwise the same result) or off
    /// (explicit: splits between honest ranks go unreported).
    #[arg(long, default_value = "detect", value_parser = parse_agreement)]
    agreement: byzcoll::Agreement,
    /// Seed of the inputs, losses and delays (any u64).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Run N rounds in a row, 1 to 10000, and print each round (rounds mode, also with
    /// --slow-ranks or --deaths): every rank starts a round when it has finished the one
    /// before, on the same inputs; crashed ranks stay crashed, --stall delays round 0.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=byzcoll_sim::MAX_ROUNDS as i64))]
    rounds: Option<u32>,
    /// Inputs a robust round may go without for their lateness alone, as the runtime's
    /// BYZCOLL_STRAGGLERS: auto (the largest s <= f that keeps the rule's precondition; none
    /// under --agreement off, none in sharded mode), a count s (0: every input is waited for
    /// until the deadline), or default (auto, as in the runtime). The input step ends once
    /// all but s inputs are in plus the grace; the rest are late. In sharded mode (a count
    /// only) a late owner is handled like a missing one, which needs r >= f + 1 + s owners
    /// per shard, versions by digest (not --agreement enforce) and a coordinate-wise rule;
    /// ring SUM has none, as in the runtime.
    #[arg(long, value_name = "S|auto|default", default_value = "default", value_parser = parse_stragglers)]
    stragglers: byzcoll::Stragglers,
    /// The vectors' element type: f32 (the default), bf16, f16 or f64. Timing mode (--predict)
    /// times d = bytes / element size elements, and each message carries that width; data and
    /// rounds modes carry f32, bf16 and f16 vectors (every value one of the type, each rule
    /// run in it) and refuse f64.
    #[arg(long, value_enum, default_value_t = SimDType::F32)]
    dtype: SimDType,
    /// The quorum's grace, as the runtime's Grace::min: a quorum step waits at least this
    /// many virtual milliseconds past its quorum (0 to 86400000; 1 by default).
    #[arg(long, value_name = "MS", default_value_t = 1.0, value_parser = grace_ms)]
    grace_ms: f64,
    /// The quorum's grace, as the runtime's Grace::factor: a quorum step waits at least K
    /// times as long past its quorum as the quorum took to form (0 to 2^32-1; 1 by default).
    #[arg(long, value_name = "K", default_value_t = 1)]
    grace_factor: u32,
    /// Rounds mode: the first K ranks are slow (stragglers), 1 to 10^6 and at most n: each
    /// starts every round a delay late, drawn from --slow-delay (seeded by --seed).
    #[arg(long, value_name = "K", requires = "slow_delay", value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    slow_ranks: Option<u32>,
    /// The slow ranks' delay before each round: fixed:T, exp:MEAN or lognormal:MEDIAN,SIGMA
    /// with times such as 5ms, 250us, 1.5s (at most a day; sigma 0 to 10), e.g. fixed:6ms,
    /// exp:2ms, lognormal:2ms,0.5.
    #[arg(long, value_name = "DIST", requires = "slow_ranks", value_parser = parse_delay)]
    slow_delay: Option<Delay>,
    /// Rounds mode: K ranks (the last honest ones) die at round ROUND (from 0) and stay silent
    /// (no connection closes: each round waits for them as for a hung node), e.g. 2@1.
    #[arg(long, value_name = "K@ROUND", value_parser = parse_deaths)]
    deaths: Option<Deaths>,
    /// The dead ranks come back at round ROUND (after the deaths' round, before the last
    /// round's end), present when it starts.
    #[arg(long, value_name = "ROUND", requires = "deaths")]
    rejoin: Option<u32>,
    /// The most memory a simulation may use, in GiB: 1 to 65536, 4 by default (a fixed bound,
    /// whatever the machine has). Its peak is estimated from the flags before anything is
    /// allocated (every rank's posted step is O(n^2) messages, sharded distance rules
    /// O(r*n^3), data mode's vectors O(n*d)); a larger run is refused, naming the flags to
    /// lower. Parallel predictions share it: larger worlds run on fewer threads.
    #[arg(long, value_name = "GIB", default_value_t = DEFAULT_MAX_MEMORY_GIB, value_parser = clap::value_parser!(u64).range(1..=MAX_MEMORY_GIB))]
    max_memory_gib: u64,
    /// Audited mode: K ranks (those just below the --lying-owners) send a forged accusation
    /// against a random honest owner every round; liars and framers together at most f.
    #[arg(long, value_name = "K", default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    framers: u32,
    /// Audited mode: where the --lying-owners lie: everywhere (every sub-chunk of their shard,
    /// every round), sub-chunks:L (L random sub-chunks each round), rounds:Q (everywhere, in
    /// each round with probability Q) or unwatched:L (L sub-chunks, first those no auditor
    /// asked for the round before).
    #[arg(long, value_name = "WHERE", default_value = "everywhere", value_parser = audited::parse_lying)]
    lie_on: byzcoll_sim::Lying,
    /// Audited mode: the sub-chunks a shard is cut into for commitments, 1 to 4096 (the
    /// runtime's 64 by default).
    #[arg(long, value_name = "M", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    sub_chunks: u32,
    /// Audited mode: the sub-chunks an auditor replays of each owner it audits, 1 to
    /// --sub-chunks (1 by default, the runtime's).
    #[arg(long, value_name = "S", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    audit_samples: u32,
    /// Audited mode: the owners each rank audits per round, 1 to n - 1 (by default the fewest
    /// that catch an owner lying everywhere in its first round with probability 1 - 10^-6, as
    /// the runtime).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..))]
    audit_owners: Option<u32>,
    /// Audited mode: run seeds --seed to --seed + N - 1, 1 to 1000 (each round's lines are
    /// printed for one seed only).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    seeds: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SimMode {
    /// Gather, sharded (r = 1 and r = 2f+1) and ring SUM.
    All,
    /// Gather-mode robust all-reduce only.
    Gather,
    /// Sharded robust all-reduce only.
    Sharded,
    /// Ring SUM all-reduce only (not robust).
    Ring,
    /// Audited sharded rounds (one owner per shard, PROTOCOL.md "Audited sharding") with the
    /// real evidence: every piece and claim signed with Ed25519, audits drawn after the claims,
    /// every proof checked; --rounds rounds (10 by default) per --seeds seed.
    Audited,
}

impl SimMode {
    /// The value `--mode` takes for it.
    fn name(self) -> &'static str {
        match self {
            SimMode::All => "all",
            SimMode::Gather => "gather",
            SimMode::Sharded => "sharded",
            SimMode::Ring => "ring",
            SimMode::Audited => "audited",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PresetArg {
    /// 200 Gb/s, alpha = 2 us.
    Infiniband,
    /// 200 Gb/s, alpha = 2.5 us.
    Slingshot,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LieArg {
    /// The negated result, to everyone.
    Signflip,
    /// All NaN, to everyone.
    Nan,
    /// Different garbage to every destination.
    Equivocate,
}

/// The most float32 elements a data-mode world holds (n * d): 2^28, 1 GiB.
const MAX_SIM_ELEMENTS: u64 = 1 << 28;
/// `--max-memory-gib` by default: [`byzcoll_sim::DEFAULT_MEMORY_BOUND`], 4 GiB.
const DEFAULT_MAX_MEMORY_GIB: u64 = byzcoll_sim::DEFAULT_MEMORY_BOUND >> 30;
/// The largest `--max-memory-gib`: 64 TiB.
const MAX_MEMORY_GIB: u64 = 1 << 16;
/// The largest `--bytes` of a prediction: 1 TiB.
const MAX_PREDICT_BYTES: u64 = 1 << 40;
/// The most bytes a prediction may move in all (n^2 * bytes bounds gather's traffic): the
/// simulator counts bytes in a u64.
const MAX_PREDICT_TRAFFIC: u64 = 1 << 62;

fn parse_agreement(s: &str) -> Result<byzcoll::Agreement, String> {
    byzcoll::Agreement::parse(s)
}

fn parse_number(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(format!("`{s}` is not a finite number"))
    }
}

fn non_negative(s: &str) -> Result<f64, String> {
    parse_number(s).and_then(|v| {
        if v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("{v} must be >= 0"))
        }
    })
}

fn positive(s: &str) -> Result<f64, String> {
    parse_number(s).and_then(|v| {
        if v > 0.0 {
            Ok(v)
        } else {
            Err(format!("{v} must be > 0"))
        }
    })
}

fn probability(s: &str) -> Result<f64, String> {
    parse_number(s).and_then(|v| {
        if (0.0..=1.0).contains(&v) {
            Ok(v)
        } else {
            Err(format!("{v} is not a probability in [0, 1]"))
        }
    })
}

/// `--dtype`: the element types the simulator times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SimDType {
    F32,
    Bf16,
    F16,
    F64,
}

impl From<SimDType> for byzcoll::aggregators::DType {
    fn from(d: SimDType) -> Self {
        use byzcoll::aggregators::DType;
        match d {
            SimDType::F32 => DType::F32,
            SimDType::Bf16 => DType::BF16,
            SimDType::F16 => DType::F16,
            SimDType::F64 => DType::F64,
        }
    }
}

fn parse_stragglers(s: &str) -> Result<byzcoll::Stragglers, String> {
    byzcoll::Stragglers::parse(s)
}

/// The longest grace (a day, in milliseconds).
const MAX_GRACE_MS: f64 = byzcoll_sim::MAX_DELAY * 1e3;

fn grace_ms(s: &str) -> Result<f64, String> {
    non_negative(s).and_then(|v| {
        if v <= MAX_GRACE_MS {
            Ok(v)
        } else {
            Err(format!("{v} ms is longer than a day ({MAX_GRACE_MS} ms)"))
        }
    })
}

fn parse_delay(s: &str) -> Result<Delay, String> {
    s.parse::<Delay>().map_err(|e| e.to_string())
}

fn parse_deaths(s: &str) -> Result<Deaths, String> {
    s.parse::<Deaths>().map_err(|e| e.to_string())
}

fn parse_crash(s: &str) -> Result<Crash, String> {
    s.parse::<Crash>().map_err(|e| e.to_string())
}

fn parse_stall(s: &str) -> Result<Stall, String> {
    s.parse::<Stall>().map_err(|e| e.to_string())
}

impl SimulateArgs {
    fn network(&self) -> (String, Network) {
        let preset = match self.preset {
            PresetArg::Infiniband => Preset::Infiniband,
            PresetArg::Slingshot => Preset::Slingshot,
        };
        let mut network = Network::preset(preset);
        let mut label = preset.to_string();
        if self.alpha_us.is_some() || self.gbps.is_some() {
            let alpha_us = self.alpha_us.unwrap_or(network.alpha * 1e6);
            let gbps = self.gbps.unwrap_or(network.link_bandwidth * 8e-9);
            network = Network::new(alpha_us, gbps);
            label = "custom".to_string();
        }
        (label, network)
    }

    /// `--max-memory-gib` in bytes.
    fn memory_bound(&self) -> u64 {
        self.max_memory_gib << 30
    }

    /// Whether to run rounds mode (a table per round).
    fn rounds_mode(&self) -> bool {
        self.rounds.is_some() || self.slow_ranks.is_some() || self.deaths.is_some()
    }

    /// The first flag of audited mode given to another mode, if any.
    fn audit_flag(&self) -> Option<&'static str> {
        [
            (self.framers != 0, "--framers"),
            (self.lie_on != byzcoll_sim::Lying::Everywhere, "--lie-on"),
            (self.sub_chunks != 64, "--sub-chunks"),
            (self.audit_samples != 1, "--audit-samples"),
            (self.audit_owners.is_some(), "--audit-owners"),
            (self.seeds != 1, "--seeds"),
        ]
        .into_iter()
        .find_map(|(given, flag)| given.then_some(flag))
    }

    /// The quorum's grace.
    fn grace(&self) -> byzcoll::Grace {
        byzcoll::Grace {
            min: Duration::from_secs_f64(self.grace_ms * 1e-3),
            factor: self.grace_factor,
        }
    }

    fn compute(&self) -> Compute {
        Compute {
            rule_throughput: self.agg_throughput,
            sum_throughput: self.sum_throughput,
        }
    }

    fn rule(&self) -> Result<Option<Box<dyn Aggregator>>, String> {
        let Some(name) = &self.rule else {
            return Ok(None);
        };
        let params = Params {
            f: self.f,
            m: self.m,
            tau: self.tau,
        };
        byzcoll::aggregators::build(name, &params)
            .map(Some)
            .map_err(|e| e.to_string())
    }
}

/// The first line of a data or rounds run: the world, its vectors (their type where not
/// f32), the rule and the network.
fn describe_world(scenario: &Scenario, d: usize, rule: &dyn Aggregator, label: &str) -> String {
    let dtype = scenario.dtype;
    let of = if dtype == byzcoll::aggregators::DType::F32 {
        String::new()
    } else {
        format!(" of {}", dtype.name())
    };
    format!(
        "n = {}, d = {d}{of} ({}), rule {} (f = {}), {}",
        scenario.ranks,
        byzcoll_sim::format_bytes((dtype.size() * d) as u64),
        rule.name(),
        rule.byzantine(),
        describe_network(label, &scenario.network)
    )
}

/// One line: the network's parameters.
fn describe_network(label: &str, network: &Network) -> String {
    format!(
        "{label} (alpha {}, {} Gb/s)",
        byzcoll_sim::format_time(network.alpha),
        network.link_bandwidth * 8e-9
    )
}

/// Runs `byzcoll simulate`; returns the exit code, or the one-line error of a bad setup.
#[allow(clippy::print_stdout)]
pub(crate) fn simulate(args: &SimulateArgs) -> Result<ExitCode, String> {
    for &n in &args.ranks {
        check_f(args.f, n as usize)?;
    }
    let (label, network) = args.network();
    let rule = args.rule()?;
    if args.predict {
        predict(args, &label, &network, rule.as_deref())?;
        return Ok(ExitCode::SUCCESS);
    }
    if args.mode == SimMode::Audited {
        return audited::simulate_audited(args);
    }
    if let Some(flag) = args.audit_flag() {
        return Err(format!("{flag} applies to --mode audited"));
    }
    if args.dtype == SimDType::F64 {
        return Err(
            "--dtype f64: data and rounds modes carry f32, bf16 and f16 vectors; time f64 \
             with --predict"
                .into(),
        );
    }
    let Some(rule) = rule else {
        return Err("data mode needs --rule (there is no default rule)".into());
    };
    for &n in &args.ranks {
        if u64::from(n) * u64::from(args.d) > MAX_SIM_ELEMENTS {
            return Err(format!(
                "n = {n} ranks of d = {} coordinates is {} values, more than data mode's \
                 2^28 (1 GiB); use a smaller --d",
                args.d,
                u64::from(n) * u64::from(args.d)
            ));
        }
    }
    // Every world is checked, its memory estimate included, before the first is built.
    let worlds = args
        .ranks
        .iter()
        .map(|&n| prepare_data(args, n as usize, network, rule.as_ref()))
        .collect::<Result<Vec<_>, String>>()?;
    let mut ok = true;
    for world in &worlds {
        ok &= simulate_data(args, world, &label, rule.as_ref())?;
    }
    if args.check && ok && !args.rounds_mode() {
        println!("OK: results match the gather-mode reference");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `byzcoll simulate --predict`: the timing table for every world size and vector size.
#[allow(clippy::print_stdout)]
fn predict(
    args: &SimulateArgs,
    label: &str,
    network: &Network,
    rule: Option<&dyn Aggregator>,
) -> Result<(), String> {
    let sizes = if args.bytes.is_empty() {
        byzcoll_sim::sweep_sizes()
    } else {
        args.bytes.clone()
    };
    let jobs: Vec<(usize, u64)> = args
        .ranks
        .iter()
        .flat_map(|&n| sizes.iter().map(move |&b| (n as usize, b)))
        .collect();
    for &(n, bytes) in &jobs {
        let traffic = (n as u64)
            .checked_mul(n as u64)
            .and_then(|t| t.checked_mul(bytes));
        if traffic.is_none_or(|t| t > MAX_PREDICT_TRAFFIC) {
            return Err(format!(
                "n = {n} ranks of {bytes} bytes each: n^2 * bytes is more than the 2^62 bytes \
                 the simulator can count; use fewer ranks or smaller --bytes"
            ));
        }
    }
    let bound = args.memory_bound();
    let mut largest = 0;
    for &(n, _) in &jobs {
        let peak = byzcoll_sim::prediction_peak(n, args.f, args.agreement, rule);
        let lower = |part| match part {
            Footprint::Statistics => {
                "--ranks, or predict a coordinate-wise --rule (median, trimmed-mean)".into()
            }
            _ if args.f > 0 => "--ranks or --f (sharded r = 2f+1)".into(),
            _ => "--ranks".to_string(),
        };
        check_memory(&peak, bound, &format!("--ranks {n} with --predict"), lower)?;
        largest = largest.max(peak.total());
    }
    let mut base = Scenario::new(1, *network);
    base.compute = args.compute();
    base.agreement = args.agreement;
    base.dtype = args.dtype.into();
    let predict_one = |&(n, bytes): &(usize, u64)| {
        byzcoll_sim::predict(label, &base, n, bytes, args.f, rule).map_err(|e| e.to_string())
    };
    // Each prediction is an independent, deterministic simulation: run them on all cores, or
    // on as many threads as the bound holds the largest of them on (a thread's allocator arena
    // keeps what its last prediction freed, so threads, not running jobs, are what adds up).
    // Rayon keeps the results in the jobs' order.
    let threads = usize::try_from(bound / largest.max(1))
        .unwrap_or(usize::MAX)
        .clamp(1, rayon::current_num_threads());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| format!("cannot start {threads} prediction threads: {e}"))?;
    let results: Vec<Result<Vec<byzcoll_sim::Prediction>, String>> = pool.install(|| {
        use rayon::prelude::*;
        jobs.par_iter().map(predict_one).collect()
    });
    let mut rows = Vec::new();
    for r in results {
        rows.extend(r?);
    }
    println!(
        "predicted completion times: {}, no faults, no deadline, robust rounds' cross-check \
         {}, computation {}",
        describe_network(label, network),
        match args.agreement {
            byzcoll::Agreement::Off => "off",
            byzcoll::Agreement::Enforce => "enforce",
            _ => "detect",
        },
        match (args.agg_throughput, args.sum_throughput) {
            (None, None) => "free".to_string(),
            (a, s) => {
                let rate = |v: Option<f64>| v.map_or("free".into(), |v| format!("{v:e} B/s"));
                format!("rule {}, sum {}", rate(a), rate(s))
            }
        }
    );
    print!("{}", byzcoll_sim::prediction_table(&rows));
    Ok(())
}

/// One world of data mode, checked and estimated, not yet built.
struct DataWorld {
    scenario: Scenario,
    algorithms: Vec<Algorithm>,
}

/// Data mode for `n` ranks: the scenario and the algorithms the flags ask for, every parameter
/// checked and the run's estimated peak within `--max-memory-gib`.
fn prepare_data(
    args: &SimulateArgs,
    n: usize,
    network: Network,
    rule: &dyn Aggregator,
) -> Result<DataWorld, String> {
    let attack = byzcoll_sim::attack_by_name(&args.attack, n, args.f, args.seed)
        .map_err(|e| e.to_string())?;
    let lie = match args.lie {
        LieArg::Signflip => Lie::SignFlip,
        LieArg::Nan => Lie::Nan,
        LieArg::Equivocate => Lie::Equivocate,
    };
    let scenario = Scenario {
        ranks: n,
        network,
        compute: args.compute(),
        faults: Faults {
            loss: args.loss,
            max_delay: args.delay_us * 1e-6,
            crashes: args.crash.clone(),
            stalls: args.stall.clone(),
            slow: args
                .slow_ranks
                .zip(args.slow_delay)
                .map(|(ranks, delay)| Slow {
                    ranks: ranks as usize,
                    delay,
                }),
            deaths: args.deaths.map(|d| Deaths {
                rejoin: args.rejoin.map(|r| r as usize),
                ..d
            }),
        },
        adversary: Adversary {
            byzantine_inputs: args.byzantine,
            attack,
            lying_owners: args.lying_owners,
            lie,
            equivocate_inputs: args.equivocate,
            equivocation_victim: args
                .equivocate_toward
                .map(|r| usize::try_from(r).unwrap_or(usize::MAX)),
        },
        timeout: args.timeout_ms * 1e-3,
        seed: args.seed,
        agreement: args.agreement,
        stragglers: args.stragglers,
        grace: args.grace(),
        dtype: args.dtype.into(),
    };
    scenario.validate().map_err(|e| e.to_string())?;
    rule.check(n).map_err(|e| e.to_string())?;

    let mut algorithms = Vec::new();
    if matches!(args.mode, SimMode::All | SimMode::Gather) {
        algorithms.push(Algorithm::Gather);
    }
    if matches!(args.mode, SimMode::All | SimMode::Sharded) {
        let mut replicas: Vec<usize> = if args.replicas.is_empty() {
            vec![1, args.f.saturating_mul(2).saturating_add(1).min(n)]
        } else {
            args.replicas.iter().map(|&r| r as usize).collect()
        };
        replicas.dedup();
        if let Some(r) = replicas.iter().find(|&&r| r > n) {
            return Err(format!(
                "sharded mode with {r} replicas in a world of {n}: need 1 <= r <= n"
            ));
        }
        algorithms.extend(
            replicas
                .into_iter()
                .map(|replicas| Algorithm::Sharded { replicas }),
        );
    }
    if matches!(args.mode, SimMode::All | SimMode::Ring) {
        algorithms.push(Algorithm::RingSum);
    }

    let rounds = args.rounds.map_or(1, |r| r as usize);
    scenario.check_rounds(rounds).map_err(|e| e.to_string())?;
    for &alg in &algorithms {
        scenario.stragglers_in(alg, rule).map_err(|e| match e {
            SimError::Unsupported(_) => format!("{e} (--mode gather)"),
            e => e.to_string(),
        })?;
    }
    let peak = scenario
        .data_peak(args.d as usize, &algorithms, rule)
        .with_rounds(n, rounds);
    let owners = algorithms
        .iter()
        .any(|a| matches!(a, Algorithm::Sharded { replicas } if *replicas > 1));
    let lower = |part| match part {
        Footprint::Vectors if args.mode == SimMode::All => {
            "--d or --ranks, or run one --mode (gather or ring hold fewer copies)".into()
        }
        Footprint::Vectors => "--d or --ranks".into(),
        Footprint::Statistics => {
            "--ranks, or use --mode gather or a coordinate-wise --rule (median, trimmed-mean)"
                .into()
        }
        Footprint::Forged => "--byzantine, --lying-owners or --d (or equivocate toward one \
                              rank with --equivocate-toward)"
            .into(),
        _ if owners => "--ranks, or the owners per shard (--f, --replicas)".into(),
        _ => "--ranks".to_string(),
    };
    let asked = format!("--ranks {n} --d {} --mode {}", args.d, args.mode.name());
    check_memory(&peak, args.memory_bound(), &asked, lower)?;
    Ok(DataWorld {
        scenario,
        algorithms,
    })
}

/// Refuses a run whose estimated `peak` is above `bound` bytes, in one line: what was `asked`,
/// about how much it needs, what weighs most, and the flags that `lower` it.
fn check_memory(
    peak: &MemoryEstimate,
    bound: u64,
    asked: &str,
    lower: impl Fn(Footprint) -> String,
) -> Result<(), String> {
    match peak.check(bound) {
        Ok(()) => Ok(()),
        Err(SimError::TooLarge {
            needed,
            bound,
            largest,
        }) => Err(format!(
            "{asked} needs about {} of memory, above the {} bound (mostly {largest}); lower {}, \
             or raise --max-memory-gib",
            byzcoll_sim::format_gib(needed),
            byzcoll_sim::format_gib(bound),
            lower(largest)
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Data mode for one world size: prints one line per algorithm; returns whether every honest
/// rank completed (and passed the check with `--check`).
#[allow(clippy::print_stdout)]
fn simulate_data(
    args: &SimulateArgs,
    world: &DataWorld,
    label: &str,
    rule: &dyn Aggregator,
) -> Result<bool, String> {
    if args.rounds_mode() {
        return simulate_rounds(args, world, label, rule);
    }
    let DataWorld {
        scenario,
        algorithms,
    } = world;
    let d = args.d as usize;
    let data = DataSet::generate(scenario, d).map_err(|e| e.to_string())?;
    let reference = data.reference(rule);

    println!("{}", describe_world(scenario, d, rule, label));
    let header = format!(
        "  {:<14} {:>12} {:>10} {:>6} {:>9}  {}",
        "algorithm",
        "time",
        "messages",
        "lost",
        "erasures",
        if args.check { "check" } else { "" }
    );
    println!("{}", header.trim_end());
    let mut ok = true;
    let mut problems = Vec::new();
    for &alg in algorithms {
        let run = scenario
            .run_data(alg, &data, rule)
            .map_err(|e| format!("{alg}: {e}"))?;
        let verdict = if args.check {
            // Honest ranks that completed must not hold different results silently (with
            // the cross-check off, that is what --check reports; under enforce every honest
            // rank must complete with bitwise the same result), and must match the
            // reference.
            let split = match args.agreement {
                byzcoll::Agreement::Enforce => run.divergence(),
                _ => run.silent_split(),
            };
            match (split, reference.check(&run)) {
                (Some(split), _) => {
                    ok = false;
                    problems.push(split);
                    "SPLIT".to_string()
                }
                (None, Ok(v)) => v.to_string(),
                (None, Err(m)) => {
                    ok = false;
                    problems.push(m.to_string());
                    "FAILED".to_string()
                }
            }
        } else {
            String::new()
        };
        let failed: Vec<_> = run.failures().collect();
        if let Some((r, e)) = failed.first() {
            ok = false;
            if !args.check {
                problems.push(format!(
                    "{alg}: {} honest ranks failed; rank {r}: {e}",
                    failed.len()
                ));
            }
        }
        let line = format!(
            "  {:<14} {:>12} {:>10} {:>6} {:>9}  {verdict}",
            alg.to_string(),
            byzcoll_sim::format_time(run.time),
            run.stats.messages,
            run.stats.lost,
            run.stats.erasures,
        );
        println!("{}", line.trim_end());
    }
    for p in &problems {
        let line = p.split_whitespace().collect::<Vec<_>>().join(" ");
        eprintln!("FAIL: {line}");
    }
    Ok(ok)
}

/// Rounds mode for one world size: one table per algorithm, a row per round; returns whether
/// every honest rank that sets the pace completed every round (and, with `--check`, whether
/// the honest ranks agreed and every round's time followed the quorum).
#[allow(clippy::print_stdout)]
fn simulate_rounds(
    args: &SimulateArgs,
    world: &DataWorld,
    label: &str,
    rule: &dyn Aggregator,
) -> Result<bool, String> {
    let DataWorld {
        scenario,
        algorithms,
    } = world;
    let d = args.d as usize;
    let count = args.rounds.map_or(1, |r| r as usize);
    let data = DataSet::generate(scenario, d).map_err(|e| e.to_string())?;
    println!("{}", describe_world(scenario, d, rule, label));
    println!("  {}", describe_rounds(scenario, count));
    let mut ok = true;
    let mut problems = Vec::new();
    for &alg in algorithms {
        let healthy = if args.check {
            let base = scenario
                .healthy()
                .run_rounds(alg, 1, &data, rule)
                .map_err(|e| format!("{alg}: {e}"))?;
            Some(base.rounds.first().map_or(0.0, |r| r.time))
        } else {
            None
        };
        let rounds = scenario
            .run_rounds(alg, count, &data, rule)
            .map_err(|e| format!("{alg}: {e}"))?;
        println!(
            "{alg}: s = {}{}",
            rounds.stragglers,
            healthy.map_or(String::new(), |h| format!(
                "; healthy round: {:.3} us (no slow or dead ranks)",
                h * 1e6
            ))
        );
        print_rounds(&rounds, healthy);
        match healthy {
            Some(h) => {
                if let Err(found) = rounds.check(h) {
                    ok = false;
                    problems.extend(found);
                }
            }
            None => {
                for r in &rounds.rounds {
                    if let Some(why) = &r.incomplete {
                        ok = false;
                        problems.push(format!("{alg} round {}: {why}", r.round));
                    }
                }
            }
        }
    }
    for p in &problems {
        let line = p.split_whitespace().collect::<Vec<_>>().join(" ");
        eprintln!("FAIL: {line}");
    }
    if args.check && ok {
        println!(
            "OK: in every round the honest ranks agree and the round's time follows the quorum"
        );
    }
    Ok(ok)
}

/// One line: the rounds, the quorum, the slow and dying ranks, the deadline.
fn describe_rounds(scenario: &Scenario, count: usize) -> String {
    let mut line = format!(
        "{count} round{}; stragglers allowed: {}; grace: at least {} and {}x the quorum's time",
        if count == 1 { "" } else { "s" },
        scenario.stragglers.name(),
        byzcoll_sim::format_time(scenario.grace.min.as_secs_f64()),
        scenario.grace.factor
    );
    if let Some(slow) = scenario.faults.slow {
        let ranks = scenario.slow_ranks();
        let _ = write!(
            line,
            "; slow ranks {}..{} ({}) before each round",
            ranks.start, ranks.end, slow.delay
        );
    }
    if let Some(deaths) = scenario.faults.deaths {
        let ranks = scenario.dying_ranks();
        let _ = write!(
            line,
            "; ranks {}..{} die at round {}",
            ranks.start, ranks.end, deaths.at
        );
        if let Some(back) = deaths.rejoin {
            let _ = write!(line, " and rejoin at round {back}");
        }
    }
    let _ = write!(
        line,
        "; step deadline {}",
        byzcoll_sim::format_time(scenario.timeout)
    );
    line
}

/// The table of `rounds`: times in microseconds; with `healthy`, each round's bound and
/// verdict (`-` without); then the late, missing and out-of-step ranks, each a count with the
/// lowest of them in brackets.
#[allow(clippy::print_stdout)]
fn print_rounds(rounds: &Rounds, healthy: Option<f64>) {
    println!(
        "  {:>5} {:>12} {:>12} {:>12} {:>12} {:>5} {:>7} {:>6}  {:<14} {:<14} out-of-step",
        "round",
        "start(us)",
        "time(us)",
        "slowest(us)",
        "bound(us)",
        "dead",
        "inputs",
        "check",
        "late",
        "missing",
    );
    let us = |t: f64| format!("{:.3}", t * 1e6);
    for r in &rounds.rounds {
        let (bound, verdict) = match healthy {
            Some(h) => {
                let bound = rounds.bound(r, h);
                let mut verdict = Vec::new();
                if r.incomplete.is_some() {
                    verdict.push("FAILED");
                }
                if r.split.is_some() {
                    verdict.push("SPLIT");
                }
                if r.time > bound {
                    verdict.push("SLOW");
                }
                if verdict.is_empty() {
                    verdict.push("ok");
                }
                (us(bound), verdict.join(","))
            }
            None => ("-".to_string(), "-".to_string()),
        };
        println!(
            "  {:>5} {:>12} {:>12} {:>12} {:>12} {:>5} {:>7} {:>6}  {:<14} {:<14} {}",
            r.round,
            us(r.start),
            us(r.time),
            us(r.slowest),
            bound,
            r.dead,
            r.inputs,
            verdict,
            r.late.to_string(),
            r.missing.to_string(),
            r.out_of_step,
        );
    }
}
