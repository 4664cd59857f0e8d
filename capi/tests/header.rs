//! The checked-in `include/byzcoll.h` is exactly what cbindgen generates from the sources:
//! a stale header fails here. `BYZCOLL_BLESS=1` writes it instead.

use std::path::Path;

#[test]
fn checked_in_header_is_current() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the C ABI")
        .write(&mut generated);
    let path = crate_dir.join("include/byzcoll.h");
    if std::env::var_os("BYZCOLL_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "capi/include/byzcoll.h is stale: regenerate it with \
         `BYZCOLL_BLESS=1 cargo test -p byzcoll-capi --test header` and commit it"
    );
}
