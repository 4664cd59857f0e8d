//! Per-rank credentials: one Ed25519 key per rank, and the public roster that binds each rank
//! to its key, so that a process holding the job secret still cannot register as another rank
//! (issue #37, "one member, one vote").
//!
//! - [`KeyRoster`] is the public table, rank by rank, in the text form `byzcoll keygen` writes
//!   (`<rank> <64 hex digits>` a line, `#` comments), like SSH's `authorized_keys`. Every rank
//!   and the store host load it (`BYZCOLL_ROSTER_FILE`).
//! - A rank's own key is an [`Identity`] read from a private file (`BYZCOLL_KEY_FILE`, `%r`
//!   replaced by the rank) or, under `byzcoll launch`, from `BYZCOLL_KEY`; it must be the key
//!   the roster binds to that rank.
//! - [`Credentials`] is the job secret (which still keeps strangers out cheaply), the roster,
//!   and this process's own key (`None` for a store host that is not a rank, e.g. the
//!   launcher). With it, every store request proves the rank's key (the store refuses a
//!   process that claims a rank whose key it does not hold), and every transport's membership
//!   table must hold exactly the roster's keys.
//!
//! The guarantee is as strong as the separation of the key files: ranks that can read each
//! other's files or memory (same user on one host, a shared file system holding every key)
//! can still claim each other's ranks. `PROTOCOL.md` says so.

use std::fmt;
use std::sync::Arc;

use ed25519_dalek::{SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

use super::auth::{Identity, JobSecret};
use crate::{BootstrapError, Rank};

/// The most bytes a roster file may hold (a line per rank of [`super::MAX_WORLD`] ranks).
pub const MAX_ROSTER_FILE: u64 = 96 << 20;

/// The public roster: rank `r`'s Ed25519 key at position `r`.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyRoster {
    keys: Vec<VerifyingKey>,
    digest: [u8; 32],
}

impl fmt::Debug for KeyRoster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "KeyRoster({} ranks, {})",
            self.keys.len(),
            hex(&self.digest[..8])
        )
    }
}

impl KeyRoster {
    /// The roster of `keys[r]` = rank `r`'s public key.
    ///
    /// # Errors
    /// Naming the first rank whose key is not a valid Ed25519 point, or an empty roster.
    pub fn new(keys: &[[u8; 32]]) -> Result<Self, String> {
        if keys.is_empty() || keys.len() > super::MAX_WORLD {
            return Err(format!(
                "a roster of {} ranks (1 to {})",
                keys.len(),
                super::MAX_WORLD
            ));
        }
        let mut h = Sha256::new();
        h.update(b"byzcoll-v2 key roster");
        h.update((keys.len() as u64).to_le_bytes());
        let keys = keys
            .iter()
            .enumerate()
            .map(|(rank, k)| {
                h.update(k);
                VerifyingKey::from_bytes(k)
                    .map_err(|_| format!("rank {rank}'s key is not an Ed25519 public key"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(KeyRoster {
            keys,
            digest: h.finalize().into(),
        })
    }

    /// Parses the text form: a line `<rank> <64 hex digits>` for every rank from 0 up, in any
    /// order; blank lines and lines starting with `#` are skipped.
    ///
    /// # Errors
    /// Naming the line: not two fields, a rank that is not a number, out of range or given
    /// twice, a key that is not 64 hex digits or not a valid key; or a rank missing. The
    /// message quotes no key material beyond the line number.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut lines = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_ascii_whitespace();
            let (Some(rank), Some(key), None) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(format!("line {}: expected `<rank> <public key>`", i + 1));
            };
            let rank: usize = rank
                .parse()
                .map_err(|_| format!("line {}: the rank is not a number", i + 1))?;
            let key = parse_hex32(key).map_err(|why| format!("line {}: {why}", i + 1))?;
            lines.push((i + 1, rank, key));
        }
        let n = lines.len();
        let mut keys: Vec<Option<[u8; 32]>> = vec![None; n];
        for (line, rank, key) in lines {
            let slot = keys
                .get_mut(rank)
                .ok_or_else(|| format!("line {line}: rank {rank} in a roster of {n} lines"))?;
            if slot.replace(key).is_some() {
                return Err(format!("line {line}: rank {rank} is given twice"));
            }
        }
        // n lines, each rank below n, none twice: every slot is filled.
        let keys: Vec<[u8; 32]> = keys.into_iter().flatten().collect();
        Self::new(&keys)
    }

    /// The text form [`KeyRoster::parse`] reads.
    pub fn to_text(&self) -> String {
        let mut s = String::from("# byzcoll key roster: rank, Ed25519 public key\n");
        for (r, k) in self.keys.iter().enumerate() {
            s.push_str(&format!("{r} {}\n", hex(k.as_bytes())));
        }
        s
    }

    /// Reads the roster file at `path` (`BYZCOLL_ROSTER_FILE`): a regular file of at most
    /// [`MAX_ROSTER_FILE`] bytes. It is public, so its permissions are not checked.
    ///
    /// # Errors
    /// [`BootstrapError::InvalidVar`] naming the variable, the path and what is wrong.
    pub fn read_file(path: &str) -> Result<Self, BootstrapError> {
        use std::io::Read;
        let bad = |why: String| BootstrapError::InvalidVar {
            var: "BYZCOLL_ROSTER_FILE",
            value: path.to_string(),
            why,
        };
        let (file, meta) = open_regular(path, bad)?;
        if meta.len() > MAX_ROSTER_FILE {
            return Err(bad(format!(
                "{} bytes, more than a roster of the largest world ({MAX_ROSTER_FILE})",
                meta.len()
            )));
        }
        let mut text = String::new();
        file.take(MAX_ROSTER_FILE)
            .read_to_string(&mut text)
            .map_err(|e| bad(format!("cannot read it: {e}")))?;
        Self::parse(&text).map_err(bad)
    }

    /// The number of ranks.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Never true: a roster has at least one rank.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Rank `rank`'s key.
    pub fn key(&self, rank: usize) -> Option<&VerifyingKey> {
        self.keys.get(rank)
    }

    /// The digest of the whole roster, compared in every store handshake.
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }
}

/// One fresh key per rank and the roster of their public halves (`byzcoll keygen`,
/// `byzcoll launch`).
///
/// # Errors
/// When the OS has no randomness to give, or `ranks` is 0 or above [`super::MAX_WORLD`].
pub fn keygen(ranks: usize) -> Result<(Vec<Identity>, KeyRoster), BootstrapError> {
    if ranks == 0 || ranks > super::MAX_WORLD {
        return Err(BootstrapError::Auth(format!(
            "keys for {ranks} ranks (1 to {})",
            super::MAX_WORLD
        )));
    }
    let ids = (0..ranks)
        .map(|_| Identity::generate())
        .collect::<Result<Vec<_>, _>>()?;
    let publics: Vec<[u8; 32]> = ids.iter().map(Identity::public).collect();
    let roster = KeyRoster::new(&publics).map_err(BootstrapError::Auth)?;
    Ok((ids, roster))
}

/// What a process of a job with per-rank keys holds: the job secret, the roster, and its own
/// key (`None` for a store host that is not a rank). `Debug` shows no key material.
#[derive(Clone)]
pub struct Credentials {
    pub(crate) secret: JobSecret,
    pub(crate) roster: Arc<KeyRoster>,
    /// Boxed: a signing key is large beside the secret (`JobAuth` holds this inline).
    pub(crate) own: Option<(Rank, Box<Identity>)>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("secret", &self.secret)
            .field("roster", &self.roster)
            .field("own", &self.own)
            .finish()
    }
}

impl PartialEq for Credentials {
    fn eq(&self, other: &Self) -> bool {
        self.secret == other.secret
            && self.roster == other.roster
            && self.own.as_ref().map(|(r, id)| (*r, id.public()))
                == other.own.as_ref().map(|(r, id)| (*r, id.public()))
    }
}

impl Eq for Credentials {}

impl Credentials {
    /// The credentials of rank `rank`, holding `key`.
    ///
    /// # Errors
    /// [`BootstrapError::Auth`] when `rank` is not in the roster or `key` is not the key the
    /// roster binds to it (another rank's key file, or a stale roster).
    pub fn rank(
        secret: JobSecret,
        roster: Arc<KeyRoster>,
        rank: Rank,
        key: Identity,
    ) -> Result<Self, BootstrapError> {
        let bound = roster.key(rank).ok_or_else(|| {
            BootstrapError::Auth(format!(
                "rank {rank} is not in the key roster of {} ranks",
                roster.len()
            ))
        })?;
        if bound.as_bytes() != &key.public() {
            return Err(BootstrapError::Auth(format!(
                "this process's key is not the one the roster binds to rank {rank} (another \
                 rank's key file, or a roster from another keygen)"
            )));
        }
        Ok(Credentials {
            secret,
            roster,
            own: Some((rank, Box::new(key))),
        })
    }

    /// The credentials of a store host that is not a rank (the launcher): it checks every
    /// rank's key and holds none.
    pub fn host(secret: JobSecret, roster: Arc<KeyRoster>) -> Self {
        Credentials {
            secret,
            roster,
            own: None,
        }
    }

    /// The roster.
    pub fn roster(&self) -> &KeyRoster {
        &self.roster
    }

    /// This process's own key, when it is a rank.
    pub fn own(&self) -> Option<&Identity> {
        self.own.as_ref().map(|(_, id)| &**id)
    }

    /// Reads the per-rank variables for rank `rank` through `get` ([`rank_key_from_lookup`])
    /// and binds them to `secret`. `Ok(None)` when none is set.
    ///
    /// # Errors
    /// As [`rank_key_from_lookup`] and [`Credentials::rank`].
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
        secret: &JobSecret,
        rank: Rank,
    ) -> Result<Option<Self>, BootstrapError> {
        match rank_key_from_lookup(get, rank)? {
            Some((roster, key)) => Self::rank(secret.clone(), roster, rank, key).map(Some),
            None => Ok(None),
        }
    }
}

/// Reads rank `rank`'s key and the roster through `get`: `BYZCOLL_ROSTER_FILE` and one of
/// `BYZCOLL_KEY_FILE` (a private file as `BYZCOLL_SECRET_FILE`, `%r` replaced by the rank,
/// `%%` by `%`) or `BYZCOLL_KEY` (64 hex digits; how `byzcoll launch` hands a rank its key).
/// `Ok(None)` when none is set.
///
/// # Errors
/// [`BootstrapError::InvalidVar`] for a roster without a key or the reverse, both key
/// variables, unreadable or malformed files.
pub fn rank_key_from_lookup(
    get: impl Fn(&str) -> Option<String>,
    rank: Rank,
) -> Result<Option<(Arc<KeyRoster>, Identity)>, BootstrapError> {
    let roster = get("BYZCOLL_ROSTER_FILE");
    let file = get("BYZCOLL_KEY_FILE");
    let inline = get("BYZCOLL_KEY");
    let key = match (file, inline) {
        (Some(_), Some(_)) => {
            return Err(BootstrapError::InvalidVar {
                var: "BYZCOLL_KEY_FILE",
                value: "(set)".into(),
                why: "BYZCOLL_KEY is set too: set only one".into(),
            })
        }
        (Some(path), None) => Some(read_key_file(&path, rank)?),
        (None, Some(hex)) => {
            Some(
                Identity::from_hex(&hex).map_err(|why| BootstrapError::InvalidVar {
                    var: "BYZCOLL_KEY",
                    value: "(hidden)".into(),
                    why,
                })?,
            )
        }
        (None, None) => None,
    };
    match (roster, key) {
        (None, None) => Ok(None),
        (Some(path), Some(key)) => Ok(Some((Arc::new(KeyRoster::read_file(&path)?), key))),
        (Some(path), None) => Err(BootstrapError::InvalidVar {
            var: "BYZCOLL_ROSTER_FILE",
            value: path,
            why: "a roster without this rank's key: set BYZCOLL_KEY_FILE too".into(),
        }),
        (None, Some(_)) => Err(BootstrapError::InvalidVar {
            var: "BYZCOLL_KEY_FILE",
            value: "(set)".into(),
            why: "a rank key without the roster: set BYZCOLL_ROSTER_FILE too".into(),
        }),
    }
}

/// `BYZCOLL_KEY_FILE` with `%r` replaced by `rank` and `%%` by `%`.
///
/// # Errors
/// A `%` followed by anything else.
pub fn key_path(pattern: &str, rank: Rank) -> Result<String, String> {
    let mut out = String::with_capacity(pattern.len() + 8);
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('r') => out.push_str(&rank.to_string()),
            Some('%') => out.push('%'),
            _ => return Err("`%` must be followed by `r` (the rank) or `%`".into()),
        }
    }
    Ok(out)
}

fn read_key_file(pattern: &str, rank: Rank) -> Result<Identity, BootstrapError> {
    let path = key_path(pattern, rank).map_err(|why| BootstrapError::InvalidVar {
        var: "BYZCOLL_KEY_FILE",
        value: pattern.to_string(),
        why,
    })?;
    let seed = read_private_hex("BYZCOLL_KEY_FILE", &path)?;
    Ok(Identity::from_seed(seed))
}

/// 64 hex digits (surrounding whitespace ignored) as 32 bytes. Only ASCII hex digits are
/// taken, and the error quotes nothing of the value.
///
/// # Errors
/// What is wrong, without echoing the value.
pub fn parse_hex32(s: &str) -> Result<[u8; 32], String> {
    let s = s.trim().as_bytes();
    if s.len() != 64 {
        return Err(format!("expected 64 hex digits, got {} bytes", s.len()));
    }
    // Byte by byte: only ASCII hex digits (no sign, no other script's digits), and nothing
    // that could slice a character apart (or echo the value in a panic).
    let digit = |c: u8| (c as char).to_digit(16).filter(|_| c.is_ascii_hexdigit());
    let mut b = [0u8; 32];
    for (byte, pair) in b.iter_mut().zip(s.chunks_exact(2)) {
        match (digit(pair[0]), digit(pair[1])) {
            (Some(hi), Some(lo)) => *byte = (hi * 16 + lo) as u8,
            _ => return Err("expected 64 hex digits (0-9, a-f)".to_string()),
        }
    }
    Ok(b)
}

/// Opens the regular file at `path` for reading, non-blocking (a FIFO in its place is refused
/// rather than waited on), with its metadata from the same open file (so it cannot be swapped
/// in between); errors as `bad` makes them.
fn open_regular(
    path: &str,
    bad: impl Fn(String) -> BootstrapError,
) -> Result<(std::fs::File, std::fs::Metadata), BootstrapError> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    let meta = file
        .metadata()
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    Ok((file, meta))
}

/// Reads 64 hex digits from the private file `path`, named by `var` in errors: a regular file
/// owned by this user with no group or other permissions, checked and read through one open
/// file (so it cannot be swapped in between), and a FIFO in its place refused rather than
/// waited on.
///
/// # Errors
/// [`BootstrapError::InvalidVar`] naming `var`, the path and what is wrong (never the content).
pub fn read_private_hex(var: &'static str, path: &str) -> Result<[u8; 32], BootstrapError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let bad = |why: String| BootstrapError::InvalidVar {
        var,
        value: path.to_string(),
        why,
    };
    let (mut file, meta) = open_regular(path, bad)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(bad(format!(
            "owned by uid {}, not by this user ({me})",
            meta.uid()
        )));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(bad(format!(
            "mode {mode:03o} lets others read it: chmod 600 it"
        )));
    }
    if meta.len() > 1024 {
        return Err(bad(format!("{} bytes, expected 64 hex digits", meta.len())));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut file, &mut text)
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    parse_hex32(&text).map_err(bad)
}

impl Identity {
    /// The key whose 32-byte Ed25519 seed is `seed`.
    pub fn from_seed(seed: [u8; 32]) -> Self {
        Identity(SigningKey::from_bytes(&seed))
    }

    /// Parses a private key (its seed as 64 hex digits, the form of `byzcoll keygen`'s rank
    /// files and of `BYZCOLL_KEY`).
    ///
    /// # Errors
    /// What is wrong, without echoing the value.
    pub fn from_hex(s: &str) -> Result<Self, String> {
        parse_hex32(s).map(Self::from_seed)
    }

    /// The private key as 64 hex digits, to write to a rank's key file (mode 600) or hand to
    /// a rank over a trusted channel.
    pub fn to_hex(&self) -> String {
        hex(&self.0.to_bytes())
    }
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rosters_round_trip_and_bad_lines_are_named() {
        let (ids, roster) = keygen(3).unwrap();
        let text = roster.to_text();
        assert_eq!(KeyRoster::parse(&text).unwrap(), roster);
        // Any order, comments and blank lines.
        let mut lines: Vec<&str> = text.lines().skip(1).collect();
        lines.reverse();
        let shuffled = format!("\n# c\n{}\n\n", lines.join("\n"));
        assert_eq!(KeyRoster::parse(&shuffled).unwrap(), roster);
        let k = hex(&ids[0].public());
        for (bad, want) in [
            (format!("0 {k}\n0 {k}\n"), "line 2: rank 0 is given twice"),
            (
                format!("0 {k}\n2 {k}\n"),
                "line 2: rank 2 in a roster of 2 lines",
            ),
            (format!("x {k}\n"), "line 1: the rank is not a number"),
            (format!("0 {k} extra\n"), "line 1: expected"),
            ("0 abc\n".to_string(), "line 1: expected 64 hex digits"),
            (String::new(), "a roster of 0 ranks"),
        ] {
            let e = KeyRoster::parse(&bad).unwrap_err();
            assert!(e.contains(want), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_rank_must_hold_the_key_the_roster_binds_to_it() {
        let (ids, roster) = keygen(2).unwrap();
        let roster = Arc::new(roster);
        let secret = JobSecret::generate().unwrap();
        assert!(Credentials::rank(secret.clone(), roster.clone(), 1, ids[1].clone()).is_ok());
        let e = Credentials::rank(secret.clone(), roster.clone(), 1, ids[0].clone())
            .unwrap_err()
            .to_string();
        assert!(e.contains("not the one the roster binds to rank 1"), "{e}");
        let e = Credentials::rank(secret, roster, 2, ids[0].clone())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 2 is not in the key roster of 2 ranks"),
            "{e}"
        );
    }

    /// The store's side of the handshake under per-rank keys: a process holding the secret
    /// and some rank's key can claim that rank alone.
    #[tokio::test]
    async fn the_store_admits_a_rank_only_with_its_own_key() {
        use crate::bootstrap::auth::{initiate, respond, Endpoint, Purpose, STORE};
        use crate::bootstrap::JobAuth;
        let (ids, roster) = keygen(3).unwrap();
        let roster = Arc::new(roster);
        let secret = JobSecret::generate().unwrap();
        let host = JobAuth::PerRank(Credentials::host(secret.clone(), roster.clone()));
        let rank = |r: Rank, key: &Identity, roster: &Arc<KeyRoster>| {
            JobAuth::PerRank(Credentials {
                secret: secret.clone(),
                roster: roster.clone(),
                own: Some((r, Box::new(key.clone()))),
            })
        };
        fn ep(auth: &JobAuth, r: u32) -> Endpoint<'_> {
            Endpoint {
                auth,
                purpose: Purpose::Store,
                world: 3,
                rank: r,
                identity: None,
                frame_macs: false,
            }
        }
        let handshake = |client: JobAuth, claim: u32| {
            let host = host.clone();
            async move {
                let (mut x, mut y) = tokio::io::duplex(4096);
                let (i, r) = tokio::join!(
                    initiate(&mut x, ep(&client, claim), STORE),
                    respond(&mut y, ep(&host, STORE), |_| Ok(()))
                );
                (i.map(|_| ()), r.map(|s| s.peer))
            }
        };
        let (i, r) = handshake(rank(1, &ids[1], &roster), 1).await;
        assert!(i.is_ok(), "{i:?}");
        assert_eq!(r.unwrap(), 1);
        // Rank 2's process claims rank 1 with its own key: refused, naming rank 1.
        let (i, r) = handshake(rank(1, &ids[2], &roster), 1).await;
        assert!(i.is_err());
        let why = r.unwrap_err().to_string();
        assert!(
            why.contains("did not prove the identity of rank 1"),
            "{why}"
        );
        // The secret alone is not enough.
        let (i, _) = handshake(JobAuth::Secret(secret.clone()), 1).await;
        let why = i.unwrap_err().to_string();
        assert!(why.contains("requires per-rank keys"), "{why}");
        // A rank whose roster comes from another keygen is named.
        let (_, other) = keygen(3).unwrap();
        let (_, r) = handshake(rank(1, &ids[1], &Arc::new(other)), 1).await;
        let why = r.unwrap_err().to_string();
        assert!(why.contains("another key roster"), "{why}");
    }

    #[test]
    fn a_membership_table_must_hold_the_roster_keys() {
        use crate::bootstrap::{JobAuth, Membership};
        let (ids, roster) = keygen(2).unwrap();
        let secret = JobSecret::generate().unwrap();
        let auth = JobAuth::PerRank(
            Credentials::rank(secret, Arc::new(roster), 0, ids[0].clone()).unwrap(),
        );
        let good = [(ids[0].public(), &b"a"[..]), (ids[1].public(), &b"b"[..])];
        assert!(Membership::new(auth.clone(), ids[0].clone(), &good).is_ok());
        let impostor = Identity::generate().unwrap();
        let bad = [(ids[0].public(), &b"a"[..]), (impostor.public(), &b"b"[..])];
        let why = Membership::new(auth.clone(), ids[0].clone(), &bad)
            .unwrap_err()
            .to_string();
        assert!(why.contains("an impostor claims rank 1"), "{why}");
        let why = Membership::new(auth, ids[0].clone(), &good[..1])
            .unwrap_err()
            .to_string();
        assert!(
            why.contains("1 ranks registered, the key roster has 2"),
            "{why}"
        );
    }

    /// Keys without the secret are refused, not ignored: an unauthenticated job with a key
    /// set would otherwise run without the identity the user asked for.
    #[test]
    fn per_rank_variables_in_an_unauthenticated_job_are_refused() {
        use crate::bootstrap::JobAuth;
        for var in ["BYZCOLL_ROSTER_FILE", "BYZCOLL_KEY_FILE", "BYZCOLL_KEY"] {
            let get = |k: &str| (k == var).then(|| "x".to_string());
            let e = JobAuth::Unauthenticated
                .with_rank_keys(get, 0)
                .unwrap_err()
                .to_string();
            assert!(e.contains("need a job secret"), "{var}: {e}");
        }
    }

    #[test]
    fn key_paths_substitute_the_rank() {
        assert_eq!(key_path("keys/rank-%r", 7).unwrap(), "keys/rank-7");
        assert_eq!(key_path("a%%b-%r", 0).unwrap(), "a%b-0");
        assert!(key_path("keys/%d", 0).is_err());
        assert!(key_path("keys/%", 0).is_err());
    }

    #[test]
    fn keys_round_trip_and_show_nothing_private() {
        let id = Identity::generate().unwrap();
        let back = Identity::from_hex(&id.to_hex()).unwrap();
        assert_eq!(back.public(), id.public());
        assert!(!format!("{id:?}").contains(&id.to_hex()[..8]));
        let roster = KeyRoster::new(&[back.public()]).unwrap();
        let c =
            Credentials::rank(JobSecret::generate().unwrap(), Arc::new(roster), 0, back).unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains(&id.to_hex()[..8]), "{shown}");
    }
}
