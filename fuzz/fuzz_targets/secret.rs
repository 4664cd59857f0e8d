//! The job secret's parser (`BYZCOLL_SECRET`, the secret file, `byzcoll info`) on arbitrary
//! bytes: it never panics, takes only 64 ASCII hex digits, and its error shows no run of 8 of
//! the value's hex digits (what a secret is made of; the messages' own words are not).
#![no_main]

use byzcoll_runtime::bootstrap::{JobAuth, JobSecret};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match JobSecret::from_hex(&text) {
        Ok(s) => {
            let t = text.trim();
            assert!(t.len() == 64 && t.bytes().all(|c| c.is_ascii_hexdigit()));
            assert_eq!(s.to_hex(), t.to_ascii_lowercase());
        }
        Err(why) => {
            let e = JobAuth::from_lookup(|k| (k == "BYZCOLL_SECRET").then(|| text.to_string()))
                .expect_err("refused by both")
                .to_string();
            let chars: Vec<char> = text.chars().collect();
            for w in chars.windows(8) {
                if !w.iter().all(char::is_ascii_hexdigit) {
                    continue;
                }
                let piece: String = w.iter().collect();
                assert!(!why.contains(&piece), "echoed {piece:?}");
                assert!(!e.contains(&piece), "echoed {piece:?}");
            }
        }
    }
});
