//! `byzcoll launch`: starts `n` local processes with the bootstrap environment set.
//!
//! The launcher hosts the rendezvous store itself on 127.0.0.1 (so no rank has to, and no
//! port has to be guessed), prefixes every line the ranks print with `[rank]`, and, as soon as
//! one rank fails, ends the others (SIGTERM to each rank's process group, SIGKILL after a grace
//! period), so no orphan is left behind. Its own exit status is the first failure's. With
//! [`LaunchOptions::restarts`], a rank that fails is started again instead (with
//! `BYZCOLL_REJOIN=1`, so that `byzcoll::init` rejoins the members' world at their next
//! `byzcoll::admit`), until the restarts are used up.
//!
//! The launcher leaves nothing behind however it ends:
//! - SIGTERM, SIGHUP or SIGINT to the launcher end every rank's process group the same way
//!   (SIGTERM, the grace period, SIGKILL), then it exits with 128 + the signal (143, 129, 130).
//! - SIGKILL to the launcher: every rank gets SIGKILL from the kernel (`PR_SET_PDEATHSIG`, set
//!   in the child before `exec`), and a small watchdog process, forked before the ranks, sees
//!   the launcher's end of a pipe close and SIGKILLs every rank's process group, so what the
//!   ranks started goes too.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child ends, not the process. So
//! [`launch`] must be driven by a thread that lives as long as the job: `byzcoll launch` runs
//! it with `block_on` on a current-thread runtime on the main thread (see `cli/src/main.rs`), and
//! the ranks are spawned directly in `launch`'s own body (never from a `tokio::spawn`ed task,
//! which a multi-thread runtime could run on a worker thread that is later retired).

use std::ffi::OsString;
use std::io::Write;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use std::path::PathBuf;
use std::sync::Arc;

use byzcoll::bootstrap::{
    keygen, Credentials, Identity, JobAuth, JobSecret, KeyRoster, StoreServer,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Number of ranks.
    pub ranks: usize,
    /// Program and arguments.
    pub command: Vec<OsString>,
    /// Time between SIGTERM and SIGKILL when ending the ranks after a failure or a signal.
    pub grace: Duration,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// How the ranks prove who they are.
    pub identity: LaunchIdentity,
    /// How many times in all a rank that fails is started again (with `BYZCOLL_REJOIN=1`)
    /// rather than ending the job; 0: the first failure ends it.
    pub restarts: u32,
}

/// How launched ranks prove who they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LaunchIdentity {
    /// Each rank gets a key of its own (in `BYZCOLL_KEY`, never on a command line) and every
    /// rank the public roster of all keys (`BYZCOLL_ROSTER_FILE`, a file in a private
    /// directory the launcher removes when it ends): a rank can claim no rank but its own.
    #[default]
    PerRank,
    /// Every rank gets the job secret alone: strangers are kept out, but a rank can register
    /// as another (reports say `identity: shared-secret`).
    SharedSecret,
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
    /// The signal handlers or the watchdog could not be set up.
    #[error("cannot set up the launcher's clean-up: {0}")]
    Cleanup(std::io::Error),
}

/// How a launched job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// 0 when every rank succeeded; otherwise the first failing rank's exit code (128 + the
    /// signal number for a rank killed by a signal; 143, 129 or 130 when the launcher got
    /// SIGTERM, SIGHUP or SIGINT).
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

/// Runs the job to completion; see the module docs. Poll it from a thread that outlives the
/// job (e.g. `block_on` on the main thread), as the module docs explain.
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
    // libucs (linked with the `ucx` feature) installs SIGTERM/SIGINT handlers at load time
    // that exit(1); tokio's handler would chain to them. Back to the defaults first, then
    // tokio's handlers, before any rank exists so that no signal can orphan one.
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: setting a standard disposition; no handler of ours is involved.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
    let mut signals = Vec::new();
    for kind in [
        SignalKind::terminate(),
        SignalKind::hangup(),
        SignalKind::interrupt(),
    ] {
        signals.push((
            kind.as_raw_value(),
            signal(kind).map_err(LaunchError::Cleanup)?,
        ));
    }
    let mut watchdog = Watchdog::start().map_err(LaunchError::Cleanup)?;
    let launcher_pid = std::process::id() as libc::pid_t;
    // One fresh secret per job, handed to the ranks in their environment (never on a command
    // line, where any local user could read it).
    let secret = JobSecret::generate().map_err(|e| LaunchError::Store(std::io::Error::other(e)))?;
    // Per-rank keys: made here, each handed to its rank alone; the store checks them.
    let (auth, keys) = match options.identity {
        LaunchIdentity::PerRank => {
            let (ids, roster) =
                keygen(options.ranks).map_err(|e| LaunchError::Store(std::io::Error::other(e)))?;
            let dir = RosterDir::write(&roster).map_err(LaunchError::Store)?;
            let auth = JobAuth::PerRank(Credentials::host(secret.clone(), Arc::new(roster)));
            (auth, Some((ids, dir)))
        }
        LaunchIdentity::SharedSecret => (JobAuth::Secret(secret.clone()), None),
    };
    let store = StoreServer::bind("127.0.0.1:0", options.ranks, auth)
        .await
        .map_err(LaunchError::Store)?;
    let store_addr = store.local_addr().to_string();

    let (exits, mut exited) = mpsc::channel::<(usize, i32)>(options.ranks);
    let spawner = Spawner {
        program,
        args: &options.command[1..],
        ranks: options.ranks,
        store: &store_addr,
        secret: secret.to_hex(),
        keys: keys.as_ref().map(|(ids, dir)| (&ids[..], &dir.roster)),
        env: &options.env,
        launcher_pid,
    };
    let mut groups: Vec<i32> = Vec::with_capacity(options.ranks);
    let mut printers = Vec::new();
    for rank in 0..options.ranks {
        match spawner.start(rank, false, &exits, &mut printers) {
            Ok(pgid) => {
                groups.push(pgid);
                watchdog.watch(pgid);
            }
            Err(source) => {
                signal_groups(&groups, libc::SIGKILL);
                return Err(LaunchError::Spawn {
                    rank,
                    program: program.to_string_lossy().into_owned(),
                    source,
                });
            }
        }
    }
    let mut restarts = options.restarts;

    let mut outcome = LaunchOutcome {
        exit_code: 0,
        failed_rank: None,
    };
    let mut ending = false;
    let mut running = options.ranks;
    let mut kill_at: Option<tokio::time::Instant> = None;
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
                if code != 0 && !ending && restarts > 0 {
                    restarts -= 1;
                    report(&format!(
                        "byzcoll launch: rank {rank} exited with status {code}; starting it again \
                         to rejoin ({} restart{} left)",
                        restarts,
                        if restarts == 1 { "" } else { "s" }
                    ));
                    // What the dead rank started goes with it.
                    signal_groups(&groups[rank..=rank], libc::SIGKILL);
                    match spawner.start(rank, true, &exits, &mut printers) {
                        Ok(pgid) => {
                            groups[rank] = pgid;
                            watchdog.watch(pgid);
                            running += 1;
                            continue;
                        }
                        Err(e) => report(&format!(
                            "byzcoll launch: cannot start rank {rank} again: {e}"
                        )),
                    }
                }
                if code != 0 && !ending {
                    ending = true;
                    outcome = LaunchOutcome { exit_code: code, failed_rank: Some(rank) };
                    report(&format!(
                        "byzcoll launch: rank {rank} exited with status {code}; ending the other ranks"
                    ));
                    signal_groups(&groups, libc::SIGTERM);
                    kill_at = Some(deadline(options.grace));
                }
            }
            _ = grace_over => {
                report("byzcoll launch: ranks still running after the grace period; killing them");
                signal_groups(&groups, libc::SIGKILL);
                kill_at = None;
            }
            sig = any_signal(&mut signals) => {
                if ending {
                    // A second request while ending: no more grace.
                    report(&format!("byzcoll launch: {}; killing all ranks", signal_name(sig)));
                    kill_at = Some(tokio::time::Instant::now());
                } else {
                    report(&format!("byzcoll launch: {}; ending all ranks", signal_name(sig)));
                    ending = true;
                    outcome = LaunchOutcome { exit_code: 128 + sig, failed_rank: None };
                    signal_groups(&groups, libc::SIGTERM);
                    kill_at = Some(deadline(options.grace));
                }
            }
        }
    }
    if ending {
        // Whatever the ranks started in their groups goes too.
        signal_groups(&groups, libc::SIGKILL);
    }
    for p in printers {
        if ending {
            // A process that left its rank's group may still hold the pipe: do not wait for it.
            let _ = tokio::time::timeout(Duration::from_secs(1), p).await;
        } else {
            let _ = p.await;
        }
    }
    watchdog.done();
    drop(store);
    Ok(outcome)
}

/// What starting a rank takes: the command, the bootstrap environment and the keys.
struct Spawner<'a> {
    program: &'a OsString,
    args: &'a [OsString],
    ranks: usize,
    store: &'a str,
    secret: String,
    /// Each rank's private key and the roster's path, under per-rank keys.
    keys: Option<(&'a [Identity], &'a PathBuf)>,
    env: &'a [(String, String)],
    launcher_pid: libc::pid_t,
}

impl Spawner<'_> {
    /// Starts rank `rank` (`rejoin`: again, after it failed), its output printed with its
    /// prefix by tasks added to `printers` and its exit code sent to `exits`; returns its
    /// process group. Runs in [`launch`]'s own body (see the module docs).
    fn start(
        &self,
        rank: usize,
        rejoin: bool,
        exits: &mpsc::Sender<(usize, i32)>,
        printers: &mut Vec<tokio::task::JoinHandle<()>>,
    ) -> std::io::Result<i32> {
        let mut cmd = Command::new(self.program);
        cmd.args(self.args)
            .env("BYZCOLL_RANK", rank.to_string())
            .env("BYZCOLL_WORLD_SIZE", self.ranks.to_string())
            .env("BYZCOLL_LOCAL_RANK", rank.to_string())
            .env("BYZCOLL_STORE", self.store)
            .env("BYZCOLL_STORE_HOSTED", "1")
            .env("BYZCOLL_SECRET", &self.secret)
            .env_remove("BYZCOLL_SECRET_FILE")
            .env_remove("BYZCOLL_ALLOW_UNAUTHENTICATED")
            .env_remove("BYZCOLL_KEY_FILE")
            .env_remove("BYZCOLL_KEY")
            .env_remove("BYZCOLL_ROSTER_FILE");
        if let Some((ids, roster)) = self.keys {
            cmd.env("BYZCOLL_KEY", ids[rank].to_hex())
                .env("BYZCOLL_ROSTER_FILE", roster);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
            // After the caller's environment: whether this start is a restart is the
            // launcher's to say.
            .env("BYZCOLL_REJOIN", if rejoin { "1" } else { "0" })
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Each rank leads its own process group, so ending a rank ends what it started.
            .process_group(0)
            .kill_on_drop(true);
        let launcher_pid = self.launcher_pid;
        // SAFETY: the closure runs in the child between fork and exec, and calls only
        // async-signal-safe functions (prctl, getppid, _exit) on values copied in; it does not
        // allocate or take locks.
        unsafe {
            cmd.pre_exec(move || {
                // The kernel SIGKILLs this rank when the launcher's spawning thread ends.
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died between fork and prctl: the signal will never come.
                if libc::getppid() != launcher_pid {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let pgid = child.id().map_or(0, |pid| pid as i32);
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
        Ok(pgid)
    }
}

/// When the grace period that starts now ends; now when it cannot be represented.
fn deadline(grace: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(grace).unwrap_or(now)
}

/// The first of `signals` to arrive, as its number.
async fn any_signal(signals: &mut [(i32, tokio::signal::unix::Signal)]) -> i32 {
    std::future::poll_fn(|cx| {
        for (number, s) in signals.iter_mut() {
            if s.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready(*number);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGTERM => "terminated (SIGTERM)",
        libc::SIGHUP => "hung up (SIGHUP)",
        libc::SIGINT => "interrupted (SIGINT)",
        _ => "signalled",
    }
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

/// A process forked before the ranks that outlives a launcher killed with SIGKILL: it reads
/// the ranks' process groups from a pipe and, when the launcher's end closes without a "done"
/// (0) first, SIGKILLs every group. `PR_SET_PDEATHSIG` reaches only the ranks themselves; this
/// reaches what they started.
#[derive(Debug)]
struct Watchdog {
    /// The launcher's (write) end of the pipe, close-on-exec so no rank holds it open.
    fd: libc::c_int,
    /// The watchdog's pid, reaped once the job is done.
    pid: libc::pid_t,
}

impl Watchdog {
    fn start() -> std::io::Result<Watchdog> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let [read_end, write_end] = fds;
        // SAFETY: fork in a possibly multi-threaded process; the child runs only
        // async-signal-safe calls (sigaction, open, dup2, close, read, killpg, _exit) on its
        // own stack and never returns into Rust code that could allocate or take a lock.
        match unsafe { libc::fork() } {
            -1 => {
                let e = std::io::Error::last_os_error();
                // SAFETY: closing the two descriptors pipe2 just created.
                unsafe {
                    libc::close(read_end);
                    libc::close(write_end);
                }
                Err(e)
            }
            // SAFETY: in the forked child, as above.
            0 => unsafe { watchdog_main(read_end, write_end) },
            pid => {
                // SAFETY: closing our copy of the child's end.
                unsafe {
                    libc::close(read_end);
                }
                Ok(Watchdog { fd: write_end, pid })
            }
        }
    }

    /// Adds a rank's process group (ignored unless positive).
    fn watch(&mut self, pgid: i32) {
        if pgid > 0 {
            self.send(pgid);
        }
    }

    /// The job ended cleanly: the watchdog exits without killing anything.
    /// Waits for it to exit (at once), so that no process of the job outlives the launch.
    fn done(&mut self) {
        self.send(0);
        // SAFETY: waiting for our own child, whose pid we hold; a null status pointer is
        // allowed. EINTR is retried; any other failure means it is already gone.
        unsafe {
            while libc::waitpid(self.pid, std::ptr::null_mut(), 0) < 0
                && *libc::__errno_location() == libc::EINTR
            {}
        }
    }

    fn send(&mut self, value: i32) {
        let bytes = value.to_ne_bytes();
        // SAFETY: writing 4 bytes from a live buffer to our pipe; a 4-byte write is atomic.
        // Failure (the watchdog died) leaves PR_SET_PDEATHSIG as the only guard; ignored.
        unsafe {
            libc::write(self.fd, bytes.as_ptr().cast(), bytes.len());
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // SAFETY: closing the descriptor this value owns.
        unsafe {
            libc::close(self.fd);
        }
    }
}

/// The watchdog's whole life, in the forked child. Only async-signal-safe calls.
unsafe fn watchdog_main(read_end: libc::c_int, write_end: libc::c_int) -> ! {
    // `byzcoll launch -n` allows at most 4096 ranks; beyond that a library caller's extra
    // ranks are covered by PR_SET_PDEATHSIG alone.
    const MAX_GROUPS: usize = 4096;
    // SAFETY (whole body): async-signal-safe libc calls on local data, see Watchdog::start.
    unsafe {
        libc::close(write_end);
        // Out of the launcher's process group: a SIGKILL to the whole group (`timeout -s
        // KILL`, a batch system's cleanup) must not take the watchdog with the launcher, or
        // the ranks' children would be left running.
        libc::setpgid(0, 0);
        // A signal sent to the launcher's whole process group must not end the watchdog
        // before it has done its work; it exits by itself once the launcher has gone.
        let mut ignore: libc::sigaction = std::mem::zeroed();
        ignore.sa_sigaction = libc::SIG_IGN;
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGPIPE] {
            libc::sigaction(sig, &ignore, std::ptr::null_mut());
        }
        // Let go of the launcher's stdio, so nobody waits on the watchdog for an EOF.
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
        let mut groups = [0 as libc::pid_t; MAX_GROUPS];
        let mut count = 0;
        loop {
            let mut buf = [0u8; 4];
            let got = libc::read(read_end, buf.as_mut_ptr().cast(), buf.len());
            if got == 4 {
                let pgid = i32::from_ne_bytes(buf);
                if pgid == 0 {
                    libc::_exit(0);
                }
                if count < MAX_GROUPS {
                    groups[count] = pgid;
                    count += 1;
                }
            } else if got < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            } else {
                // EOF without "done": the launcher is gone.
                for &pgid in &groups[..count] {
                    libc::killpg(pgid, libc::SIGKILL);
                }
                libc::_exit(0);
            }
        }
    }
}

/// The roster file of a launched job, in a directory of its own that only this user can enter;
/// removed when the launch ends.
#[derive(Debug)]
struct RosterDir {
    dir: PathBuf,
    roster: PathBuf,
}

impl RosterDir {
    fn write(roster: &KeyRoster) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let mut tag = [0u8; 8];
        getrandom::getrandom(&mut tag).map_err(std::io::Error::other)?;
        let name = format!(
            "byzcoll-launch-{}-{}",
            std::process::id(),
            tag.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let dir = std::env::temp_dir().join(name);
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let out = RosterDir {
            roster: dir.join("roster"),
            dir,
        };
        std::fs::write(&out.roster, roster.to_text())?;
        Ok(out)
    }
}

impl Drop for RosterDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
