//! `byzcoll launch`: starts `n` local processes with the bootstrap environment set.
//!
//! The launcher hosts the rendezvous store itself on 127.0.0.1 (so no rank has to, and no
//! port has to be guessed), prefixes every line the ranks print with `[rank]`, and, as soon as
//! one rank fails, ends the others (SIGTERM to each rank's process group, SIGKILL after a grace
//! period), so no orphan is left behind. Its own exit status is the first failure's.

use std::ffi::OsString;
use std::io::Write;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use byzcoll_runtime::bootstrap::{JobAuth, JobSecret, StoreServer};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Number of ranks.
    pub ranks: usize,
    /// Program and arguments.
    pub command: Vec<OsString>,
    /// Time between SIGTERM and SIGKILL when ending the other ranks after a failure.
    pub grace: Duration,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
}

/// Why a launch could not run.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The options are unusable (no command, zero ranks).
    #[error("{0}")]
    Invalid(String),
    /// A rank could not be started.
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The store could not be started.
    #[error("cannot start the rendezvous store: {0}")]
    Store(std::io::Error),
}

/// How a launched job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// 0 when every rank succeeded; otherwise the first failing rank's exit code (128 + the
    /// signal number for a rank killed by a signal, 130 when the launcher was interrupted).
    pub exit_code: i32,
    /// The rank that failed first, if one did.
    pub failed_rank: Option<usize>,
}

fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// Runs the job to completion; see the module docs.
///
/// # Errors
/// [`LaunchError`] when the job cannot be started; a failing rank is not an error but the
/// [`LaunchOutcome`].
pub async fn launch(options: LaunchOptions) -> Result<LaunchOutcome, LaunchError> {
    if options.ranks == 0 {
        return Err(LaunchError::Invalid("-n must be at least 1".into()));
    }
    let Some(program) = options.command.first() else {
        return Err(LaunchError::Invalid("no command given after `--`".into()));
    };
    // One fresh secret per job, handed to the ranks in their environment (never on a command
    // line, where any local user could read it).
    let secret = JobSecret::generate().map_err(|e| LaunchError::Store(std::io::Error::other(e)))?;
    let store = StoreServer::bind(
        "127.0.0.1:0",
        options.ranks,
        JobAuth::Secret(secret.clone()),
    )
    .await
    .map_err(LaunchError::Store)?;
    let store_addr = store.local_addr().to_string();

    let (exits, mut exited) = mpsc::channel::<(usize, i32)>(options.ranks);
    let mut groups: Vec<i32> = Vec::with_capacity(options.ranks);
    let mut printers = Vec::new();
    for rank in 0..options.ranks {
        let mut cmd = Command::new(program);
        cmd.args(&options.command[1..])
            .env("BYZCOLL_RANK", rank.to_string())
            .env("BYZCOLL_WORLD_SIZE", options.ranks.to_string())
            .env("BYZCOLL_LOCAL_RANK", rank.to_string())
            .env("BYZCOLL_STORE", &store_addr)
            .env("BYZCOLL_STORE_HOSTED", "1")
            .env("BYZCOLL_SECRET", secret.to_hex())
            .env_remove("BYZCOLL_SECRET_FILE")
            .env_remove("BYZCOLL_ALLOW_UNAUTHENTICATED")
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Each rank leads its own process group, so ending a rank ends what it started.
            .process_group(0)
            .kill_on_drop(true);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                signal_groups(&groups, libc::SIGKILL);
                return Err(LaunchError::Spawn {
                    rank,
                    program: program.to_string_lossy().into_owned(),
                    source,
                });
            }
        };
        groups.push(child.id().map_or(0, |pid| pid as i32));
        if let Some(out) = child.stdout.take() {
            printers.push(tokio::spawn(prefix_lines(rank, out, false)));
        }
        if let Some(err) = child.stderr.take() {
            printers.push(tokio::spawn(prefix_lines(rank, err, true)));
        }
        let exits = exits.clone();
        tokio::spawn(async move {
            let code = child.wait().await.map(exit_code).unwrap_or(1);
            let _ = exits.send((rank, code)).await;
        });
    }
    drop(exits);

    let mut outcome = LaunchOutcome {
        exit_code: 0,
        failed_rank: None,
    };
    let mut ending = false;
    let mut running = options.ranks;
    let mut kill_at: Option<tokio::time::Instant> = None;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    while running > 0 {
        let grace_over = async {
            match kill_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some((rank, code)) = exited.recv() => {
                running -= 1;
                if code != 0 && !ending {
                    ending = true;
                    outcome = LaunchOutcome { exit_code: code, failed_rank: Some(rank) };
                    report(&format!(
                        "byzcoll launch: rank {rank} exited with status {code}; ending the other ranks"
                    ));
                    signal_groups(&groups, libc::SIGTERM);
                    kill_at = Some(tokio::time::Instant::now() + options.grace);
                }
            }
            _ = grace_over => {
                report("byzcoll launch: ranks still running after the grace period; killing them");
                signal_groups(&groups, libc::SIGKILL);
                kill_at = None;
            }
            _ = &mut interrupted, if !ending => {
                report("byzcoll launch: interrupted; ending all ranks");
                ending = true;
                outcome = LaunchOutcome { exit_code: 130, failed_rank: None };
                signal_groups(&groups, libc::SIGTERM);
                kill_at = Some(tokio::time::Instant::now() + options.grace);
            }
        }
    }
    if ending {
        // Whatever the ranks started in their groups goes too.
        signal_groups(&groups, libc::SIGKILL);
    }
    for p in printers {
        let _ = p.await;
    }
    drop(store);
    Ok(outcome)
}

fn signal_groups(groups: &[i32], signal: i32) {
    for &pgid in groups.iter().filter(|&&g| g > 0) {
        // SAFETY: killpg has no memory-safety preconditions; a group that no longer exists
        // yields ESRCH, which is fine to ignore.
        unsafe {
            libc::killpg(pgid, signal);
        }
    }
}

fn report(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}

/// Copies `stream` line by line to the launcher's stdout or stderr, prefixed with the rank.
async fn prefix_lines(rank: usize, stream: impl AsyncRead + Unpin, to_stderr: bool) {
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let mut out = format!("[{rank}] ").into_bytes();
                out.extend_from_slice(&line);
                if !out.ends_with(b"\n") {
                    out.push(b'\n');
                }
                let _ = if to_stderr {
                    std::io::stderr().lock().write_all(&out)
                } else {
                    std::io::stdout().lock().write_all(&out)
                };
            }
        }
    }
}
