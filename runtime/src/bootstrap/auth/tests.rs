use super::*;

fn secret(b: u8) -> JobAuth {
    JobAuth::Secret(JobSecret([b; 32]))
}

fn ep(auth: &JobAuth, rank: u32) -> Endpoint<'_> {
    Endpoint {
        auth,
        purpose: Purpose::Store,
        world: 4,
        rank,
        identity: None,
        frame_macs: false,
    }
}

async fn run(
    a: Endpoint<'_>,
    b: Endpoint<'_>,
) -> (
    Result<Session, HandshakeError>,
    Result<Session, HandshakeError>,
) {
    let (mut x, mut y) = tokio::io::duplex(4096);
    let to = b.rank;
    tokio::join!(initiate(&mut x, a, to), respond(&mut y, b, |_| Ok(())))
}

#[tokio::test]
async fn same_secret_agrees_on_a_session_key() {
    let s = secret(7);
    let (i, r) = run(ep(&s, 2), ep(&s, STORE)).await;
    let (i, r) = (i.unwrap(), r.unwrap());
    assert_eq!(i.key, r.key);
    assert_eq!(r.peer, 2);
}

#[tokio::test]
async fn wrong_secret_and_mode_are_refused_both_ways() {
    let (a, b) = (secret(1), secret(2));
    let (i, r) = run(ep(&a, 2), ep(&b, STORE)).await;
    assert!(matches!(i, Err(HandshakeError::Refused(m)) if m.contains("wrong job secret")));
    assert!(matches!(
        r,
        Err(HandshakeError::Rejected {
            code: Refusal::OtherJob,
            ..
        })
    ));
    // The unauthenticated peer is told nothing of this side's mode; the log says more.
    let open = JobAuth::Unauthenticated;
    let (i, r) = run(ep(&open, 2), ep(&a, STORE)).await;
    let msg = i.unwrap_err().to_string();
    assert!(msg.contains("not of this job"), "{msg}");
    assert!(!msg.contains("unauthenticated"), "{msg}");
    let log = r.unwrap_err().to_string();
    assert!(log.contains("peer runs unauthenticated"), "{log}");
}

#[tokio::test]
async fn identities_are_checked_against_the_roster() {
    let s = secret(3);
    let ids: Vec<Identity> = (0..2).map(|_| Identity::generate().unwrap()).collect();
    let entries: Vec<([u8; 32], &[u8])> = ids.iter().map(|i| (i.public(), &b"x"[..])).collect();
    let roster = Roster::new(&entries).unwrap();
    let tcp = |rank: u32, id: &'static Identity, roster: &'static Roster| Endpoint {
        auth: Box::leak(Box::new(s.clone())),
        purpose: Purpose::Tcp,
        world: 2,
        rank,
        identity: Some((id, roster)),
        frame_macs: false,
    };
    let ids: &'static [Identity] = Box::leak(ids.into_boxed_slice());
    let roster: &'static Roster = Box::leak(Box::new(roster));
    let (i, r) = run(tcp(1, &ids[1], roster), tcp(0, &ids[0], roster)).await;
    assert!(i.is_ok() && r.is_ok());
    // Rank 0 claiming to be rank 1 (it has the secret, not rank 1's key).
    let (i, r) = run(tcp(1, &ids[0], roster), tcp(0, &ids[0], roster)).await;
    assert!(i.is_err());
    let msg = r.unwrap_err().to_string();
    assert!(msg.contains("identity of rank 1"), "{msg}");
    // A roster with another address for rank 1.
    let other = Box::leak(Box::new(
        Roster::new(&[(ids[0].public(), &b"x"[..]), (ids[1].public(), &b"y"[..])]).unwrap(),
    ));
    let (_, r) = run(tcp(1, &ids[1], other), tcp(0, &ids[0], roster)).await;
    let msg = r.unwrap_err().to_string();
    assert!(msg.contains("another membership table"), "{msg}");
}

#[tokio::test]
async fn old_protocol_and_garbage_are_named() {
    let s = secret(1);
    for (input, want) in [
        (&b"BZS1xxxxxxxx"[..], "protocol version 1, this side 2"),
        (b"GET / HTTP/1.0", "not a byzcoll"),
    ] {
        let (mut x, mut y) = tokio::io::duplex(4096);
        x.write_all(input).await.unwrap();
        let r = respond(&mut y, ep(&s, STORE), |_| Ok(())).await;
        assert!(r.unwrap_err().to_string().contains(want));
        drop(y);
        let e = read_status(&mut x).await.unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}

/// A malformed secret is an error that shows no part of it, never a panic: a no-break
/// space pasted into 64 digits, a sign, another script's digits, and arbitrary strings
/// made of pieces of a real secret.
#[test]
fn a_malformed_secret_is_refused_without_echo_or_panic() {
    let good = JobSecret::generate().unwrap().to_hex();
    let mut cases = vec![
        format!("{}\u{a0}{}", &good[..30], &good[32..]),
        format!("{}\u{a0}{}", &good[..31], &good[32..]),
        "+f".repeat(32),
        format!("{}\u{663}\u{664}", &good[..60]),
        format!("{}é", &good[..62]),
        format!("-{}", &good[1..]),
        format!("0x{}", &good[2..]),
    ];
    // Pseudo-random strings from the secret's digits and hostile characters.
    let pieces = [
        "\u{a0}", "+", "-", "é", "\u{663}", "\0", " ", "g", "ff", "0",
    ];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..2000 {
        let mut v = String::new();
        while v.len() < 64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 4 {
                0 => v.push_str(pieces[(x >> 8) as usize % pieces.len()]),
                _ => v.push_str(&good[(x >> 8) as usize % 63..][..2]),
            }
        }
        cases.push(v);
    }
    for v in cases {
        let Err(why) = JobSecret::from_hex(&v) else {
            assert!(
                v.trim().bytes().all(|c| c.is_ascii_hexdigit()),
                "{v:?} accepted"
            );
            continue;
        };
        let e = JobAuth::from_lookup(|k| (k == "BYZCOLL_SECRET").then(|| v.clone()))
            .unwrap_err()
            .to_string();
        // No run of 8 of the value's characters shows in either message.
        let chars: Vec<char> = v.chars().collect();
        for w in chars.windows(8) {
            let piece: String = w.iter().collect();
            assert!(!why.contains(&piece), "{why:?} shows {piece:?} of {v:?}");
            assert!(!e.contains(&piece), "{e:?} shows {piece:?} of {v:?}");
        }
    }
}

#[test]
fn secrets_parse_and_files_must_be_private() {
    let s = JobSecret::generate().unwrap();
    assert_eq!(JobSecret::from_hex(&s.to_hex()).unwrap(), s);
    assert!(JobSecret::from_hex("abc").is_err());
    assert!(JobSecret::from_hex(&"zz".repeat(32)).is_err());
    assert!(!format!("{s:?}").contains(&s.to_hex()[..8]));
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    assert!(matches!(
        JobAuth::from_lookup(vars(&[])),
        Err(BootstrapError::NoSecret)
    ));
    assert_eq!(
        JobAuth::from_lookup(vars(&[("BYZCOLL_ALLOW_UNAUTHENTICATED", "1")])).unwrap(),
        JobAuth::Unauthenticated
    );
    assert!(JobAuth::from_lookup(vars(&[("BYZCOLL_ALLOW_UNAUTHENTICATED", "yes")])).is_err());
    let dir = std::env::temp_dir().join(format!("byzcoll-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("secret");
    std::fs::write(&path, s.to_hex()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let p = path.to_string_lossy().into_owned();
    let get = |k: &str| (k == "BYZCOLL_SECRET_FILE").then(|| p.clone());
    let err = JobAuth::from_lookup(get).unwrap_err().to_string();
    assert!(err.contains("chmod 600"), "{err}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(JobAuth::from_lookup(get).unwrap(), JobAuth::Secret(s));
    // A FIFO in its place is refused at once, not waited on.
    let fifo = dir.join("fifo");
    let c = std::ffi::CString::new(fifo.to_string_lossy().into_owned()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let f = fifo.to_string_lossy().into_owned();
    let err = JobAuth::from_lookup(|k| (k == "BYZCOLL_SECRET_FILE").then(|| f.clone()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a regular file"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
