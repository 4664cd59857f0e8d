//! `byzcoll launch` and the TCP example as separate processes on 127.0.0.1.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{byzcoll, example, run_with_limit, text};

#[test]
fn tcp_example_passes_under_the_launcher_at_several_world_sizes() {
    for n in [1, 2, 3, 7, 8] {
        let (out, _) = run_with_limit(
            Command::new(byzcoll())
                .args(["launch", "-n", &n.to_string(), "--"])
                .arg(example("tcp_allreduce"))
                .env("BYZCOLL_TIMEOUT_MS", "20000"),
            Duration::from_secs(120),
        );
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "n={n}\n{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("[0] OK: {n} ranks over tcp")),
            "n={n}\n{stdout}\n{stderr}"
        );
        if n >= 3 {
            assert!(stdout.contains("[0] median"), "{stdout}");
        }
    }
}

#[test]
fn output_is_prefixed_with_the_rank_and_the_environment_is_set() {
    let (out, _) = run_with_limit(
        Command::new(byzcoll()).args([
            "launch",
            "-n",
            "3",
            "--",
            "sh",
            "-c",
            "echo out $BYZCOLL_RANK/$BYZCOLL_WORLD_SIZE $BYZCOLL_STORE; echo err >&2",
        ]),
        Duration::from_secs(30),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success());
    for r in 0..3 {
        assert!(
            stdout.contains(&format!("[{r}] out {r}/3 127.0.0.1:")),
            "{stdout}"
        );
        assert!(stderr.contains(&format!("[{r}] err")), "{stderr}");
    }
}

#[test]
fn first_failure_ends_the_other_ranks_and_sets_the_exit_status() {
    // The marker makes the test's sleepers findable without touching anyone else's.
    let marker = format!("byzcoll-orphan-check-{}", std::process::id());
    let script = format!(
        "if [ \"$BYZCOLL_RANK\" = 1 ]; then sleep 0.3; exit 7; fi; \
         trap '' TERM; exec -a {marker} sleep 60"
    );
    let (out, elapsed) = run_with_limit(
        Command::new(byzcoll()).args([
            "launch",
            "-n",
            "4",
            "--grace-secs",
            "1",
            "--",
            "bash",
            "-c",
            &script,
        ]),
        Duration::from_secs(30),
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("rank 1 exited with status 7"), "{stderr}");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    let left = Command::new("pgrep")
        .args(["-f", &marker])
        .output()
        .expect("pgrep");
    assert!(
        left.stdout.is_empty(),
        "orphans left: {}",
        String::from_utf8_lossy(&left.stdout)
    );
}

#[test]
fn a_rank_killed_by_a_signal_is_reported() {
    let (out, _) = run_with_limit(
        Command::new(byzcoll()).args(["launch", "-n", "2", "--", "sh", "-c", "kill -9 $$"]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(128 + 9));
}

#[test]
fn bad_arguments_get_clear_errors() {
    let cases: [(&[&str], &str); 4] = [
        (&["launch", "-n", "0", "--", "true"], "0 is not in 1..=4096"),
        (&["launch", "-n", "2"], "required"),
        (&["launch", "-n", "x", "--", "true"], "invalid value 'x'"),
        (&["frobnicate"], "unrecognized subcommand"),
    ];
    for (args, needle) in cases {
        let (out, _) = run_with_limit(Command::new(byzcoll()).args(args), Duration::from_secs(10));
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    let (out, _) = run_with_limit(
        Command::new(byzcoll()).args(["launch", "-n", "2", "--", "/nonexistent/program"]),
        Duration::from_secs(10),
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("cannot start rank 0 (/nonexistent/program)"),
        "{stderr}"
    );
}

#[test]
fn an_unavailable_transport_is_an_error_not_a_fallback() {
    let (out, _) = run_with_limit(
        Command::new(byzcoll())
            .args(["launch", "-n", "2", "--"])
            .arg(example("tcp_allreduce"))
            .env("BYZCOLL_TRANSPORT", "nccl"),
        Duration::from_secs(30),
    );
    let (_, stderr) = text(&out);
    assert_ne!(out.status.code(), Some(0));
    // Without the feature the build says so; with it, a machine without a GPU says what is
    // missing on which rank. Either way nothing falls back to TCP.
    let why = if cfg!(feature = "nccl") {
        "NCCL cannot start on every rank (rank 0: "
    } else {
        "BYZCOLL_TRANSPORT=nccl: not in this build"
    };
    let gpu_here = std::path::Path::new("/dev/nvidiactl").exists();
    if !(cfg!(feature = "nccl") && gpu_here) {
        assert!(stderr.contains(why), "{stderr}");
    }
    assert!(!stderr.contains("over tcp"), "{stderr}");
}

#[test]
fn the_tcp_spin_is_set_from_the_environment_and_bad_values_are_refused() {
    let run = |spin: &str| {
        let (out, _) = run_with_limit(
            Command::new(byzcoll())
                .args(["launch", "-n", "3", "--"])
                .arg(example("tcp_allreduce"))
                .env("BYZCOLL_TCP_SPIN_US", spin),
            Duration::from_secs(120),
        );
        let (stdout, stderr) = text(&out);
        (out.status.success(), stdout, stderr)
    };
    // No spin at all still completes every collective.
    let (ok, stdout, stderr) = run("0");
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("[0] OK: 3 ranks over tcp"), "{stdout}");
    let (ok, stdout, stderr) = run("half a millisecond");
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("BYZCOLL_TCP_SPIN_US") && stderr.contains("microseconds"),
        "{stderr}"
    );
}

#[test]
fn frame_macs_are_chosen_by_the_environment_and_bad_values_are_refused() {
    let run = |vars: &[(&str, &str)]| {
        let mut cmd = Command::new(byzcoll());
        cmd.args(["launch", "-n", "3", "--"])
            .arg(example("tcp_allreduce"))
            .env_remove("BYZCOLL_FRAME_MAC");
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let (out, _) = run_with_limit(&mut cmd, Duration::from_secs(120));
        let (stdout, stderr) = text(&out);
        (out.status.success(), stdout, stderr)
    };
    // Every collective of the example, every TCP frame carrying a MAC.
    let (ok, stdout, stderr) = run(&[("BYZCOLL_FRAME_MAC", "1")]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("[0] OK: 3 ranks over tcp"), "{stdout}");
    let (ok, stdout, stderr) = run(&[("BYZCOLL_FRAME_MAC", "yes")]);
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("BYZCOLL_FRAME_MAC"), "{stderr}");
    // Never ignored: a transport without the option refuses it.
    let (ok, _, stderr) = run(&[("BYZCOLL_FRAME_MAC", "1"), ("BYZCOLL_TRANSPORT", "nccl")]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "BYZCOLL_FRAME_MAC is an option of tcp, ucx, libfabric, and the transport is nccl"
        ),
        "{stderr}"
    );
}

#[test]
fn the_agreement_policy_is_chosen_by_the_environment_and_bad_values_are_refused() {
    let run = |value: &str| {
        let (out, _) = run_with_limit(
            Command::new(byzcoll())
                .args(["launch", "-n", "3", "--"])
                .arg(example("tcp_allreduce"))
                .env("BYZCOLL_AGREEMENT", value),
            Duration::from_secs(120),
        );
        let (stdout, stderr) = text(&out);
        (out.status.success(), stdout, stderr)
    };
    for value in ["off", "detect"] {
        let (ok, stdout, stderr) = run(value);
        assert!(ok, "{value}: {stdout}\n{stderr}");
        assert!(stdout.contains("[0] OK: 3 ranks over tcp"), "{stdout}");
    }
    // The example tolerates f = 1 among 3 ranks: Enforce's precondition (n > 3f) refuses it
    // up front, on every rank, before any data moves.
    let (ok, _, stderr) = run("enforce");
    assert!(!ok);
    assert!(
        stderr.contains("Agreement::Enforce needs n > 3f: 3 ranks"),
        "{stderr}"
    );
    let (ok, _, stderr) = run("sometimes");
    assert!(!ok);
    assert!(
        stderr.contains("BYZCOLL_AGREEMENT") && stderr.contains("expected off, detect or enforce"),
        "{stderr}"
    );
}

#[test]
fn without_a_launcher_the_example_says_what_is_missing() {
    let mut cmd = Command::new(example("tcp_allreduce"));
    for var in [
        "BYZCOLL_RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "RANK",
        "SLURM_PROCID",
        "BYZCOLL_LAUNCHER",
    ] {
        cmd.env_remove(var);
    }
    let (out, _) = run_with_limit(&mut cmd, Duration::from_secs(10));
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("no launcher environment found"), "{stderr}");
}

#[test]
fn info_lists_transports_rules_and_the_selection() {
    let (out, _) = run_with_limit(
        Command::new(byzcoll())
            .arg("info")
            .env("RANK", "2")
            .env("WORLD_SIZE", "4")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", "29500")
            .env("BYZCOLL_TRANSPORT", "tcp"),
        Duration::from_secs(10),
    );
    let (stdout, _) = text(&out);
    assert!(out.status.success());
    let nccl = if cfg!(feature = "nccl") {
        "nccl       yes"
    } else {
        "nccl       no"
    };
    for needle in [
        "tcp        yes",
        nccl,
        "median",
        "trimmed-mean",
        "launcher     torchrun",
        "rank         2 of 4",
        "store        127.0.0.1:29500",
        "transport    tcp (from BYZCOLL_TRANSPORT; available)",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in\n{stdout}");
    }
    // Whether this machine can run NCCL, not only whether the build has it.
    let nccl_here = if !cfg!(feature = "nccl") {
        "nccl: not in this build"
    } else if std::path::Path::new("/dev/nvidiactl").exists() {
        "nccl: "
    } else {
        "nccl: not usable on this machine: the CUDA driver library"
    };
    assert!(
        stdout.contains(nccl_here),
        "missing {nccl_here:?} in\n{stdout}"
    );
}

#[test]
fn quickstart_asserts_its_own_result() {
    let (out, _) = run_with_limit(
        &mut Command::new(example("quickstart")),
        Duration::from_secs(120),
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("OK: median and trimmed mean stayed inside"),
        "{stdout}"
    );
    assert!(stdout.contains("mean          | refused"), "{stdout}");
}

/// The processes whose environment holds `BYZCOLL_TEST_JOB=<marker>`: the launcher, its
/// watchdog, every rank and whatever the ranks started (zombies have no environment).
fn job_processes(marker: &str) -> Vec<u32> {
    let needle = format!("BYZCOLL_TEST_JOB={marker}");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if let Ok(env) = std::fs::read(entry.path().join("environ")) {
            if env.split(|&b| b == 0).any(|v| v == needle.as_bytes()) {
                pids.push(pid);
            }
        }
    }
    pids
}

/// Polls `done` every 20 ms for up to `limit`; whether it became true.
fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done()
}

/// Starts `launch -n 3` of ranks that ignore SIGTERM (so the grace period and SIGKILL are
/// needed) and each start a grandchild, sends `signal` to the launcher (to its whole process
/// group where `group`), and checks that the launcher ends with `expected` (an exit code, or
/// `None`: killed by the signal) and that no process of the job is left, all within 15 s.
fn signal_ends_the_whole_job(signal: i32, expected: Option<i32>, group: bool) {
    use std::os::unix::process::CommandExt;
    let marker = format!("signal-{signal}-{group}-{}", std::process::id());
    let start = Instant::now();
    let mut launcher = Command::new(byzcoll())
        .args(["launch", "-n", "3", "--grace-secs", "1", "--", "sh", "-c"])
        .arg("trap '' TERM; sleep 600 & sleep 600; :")
        .env("BYZCOLL_TEST_JOB", &marker)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // A group of its own (its pid), so that the whole group can be signalled.
        .process_group(0)
        .spawn()
        .expect("spawn the launcher");
    // Launcher + watchdog + 3 ranks, each a shell with two sleeps.
    let up = wait_for(Duration::from_secs(10), || {
        job_processes(&marker).len() >= 11
    });
    if !up {
        let _ = launcher.kill();
        panic!("the job did not start: {:?}", job_processes(&marker));
    }
    // SAFETY: kill and killpg have no memory-safety preconditions; the pid is our own
    // child's, and so is the group it leads.
    let sent = unsafe {
        match group {
            true => libc::killpg(launcher.id() as i32, signal),
            false => libc::kill(launcher.id() as i32, signal),
        }
    };
    assert_eq!(sent, 0);
    let mut status = None;
    let exited = wait_for(Duration::from_secs(10), || {
        status = launcher.try_wait().expect("wait");
        status.is_some()
    });
    if !exited {
        let _ = launcher.kill();
    }
    let gone = wait_for(Duration::from_secs(3), || job_processes(&marker).is_empty());
    let left = job_processes(&marker);
    for &pid in &left {
        // SAFETY: as above; these carry this test's marker.
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
        }
    }
    assert!(exited, "the launcher did not exit after signal {signal}");
    assert!(
        gone,
        "signal {signal} left processes of the job behind: {left:?}"
    );
    let mut stderr = String::new();
    use std::io::Read;
    if let Some(mut e) = launcher.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    let status = status.expect("exited");
    use std::os::unix::process::ExitStatusExt;
    match expected {
        Some(code) => {
            assert_eq!(
                status.code(),
                Some(code),
                "signal {signal}: {status:?}\n{stderr}"
            );
            assert!(stderr.contains("ending all ranks"), "{stderr}");
        }
        None => assert_eq!(status.signal(), Some(signal), "{status:?}\n{stderr}"),
    }
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(15), "took {elapsed:?}");
}

#[test]
fn sigterm_to_the_launcher_ends_every_rank_and_exits_143() {
    signal_ends_the_whole_job(libc::SIGTERM, Some(143), false);
}

#[test]
fn sighup_to_the_launcher_ends_every_rank_and_exits_129() {
    signal_ends_the_whole_job(libc::SIGHUP, Some(129), false);
}

#[test]
fn sigint_to_the_launcher_ends_every_rank_and_exits_130() {
    signal_ends_the_whole_job(libc::SIGINT, Some(130), false);
}

#[test]
fn sigkill_to_the_launcher_leaves_no_rank_or_grandchild_behind() {
    signal_ends_the_whole_job(libc::SIGKILL, None, false);
}

/// `timeout -s KILL byzcoll launch ...` kills the launcher's whole process group: the
/// watchdog is not in it, and ends the ranks and their children.
#[test]
fn sigkill_to_the_launchers_process_group_leaves_nothing_behind() {
    signal_ends_the_whole_job(libc::SIGKILL, None, true);
}

#[test]
fn a_huge_grace_period_is_refused_not_a_panic() {
    let (out, _) = run_with_limit(
        Command::new(byzcoll()).args([
            "launch",
            "-n",
            "1",
            "--grace-secs",
            "18446744073709551615",
            "--",
            "true",
        ]),
        Duration::from_secs(10),
    );
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("0..=3600"), "{stderr}");
}
