//! Unit tests of the `.npy` reader and writer, with NumPy itself where it is installed.

use super::*;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "byzcoll-npy-{}-{}-{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `.npy` file with a hand-written header and data.
fn raw(major: u8, header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&[major, 0]);
    if major == 1 {
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

impl Array {
    fn view_f32(&self) -> Option<&[f32]> {
        match self.view() {
            MappedData::F32(d) => Some(d),
            _ => None,
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn err(bytes: &[u8]) -> String {
    let e = from_bytes(bytes).unwrap_err().to_string();
    // The stream reader must reach the same verdict.
    let s = read_from(bytes).unwrap_err().to_string();
    assert!(!e.contains('\n'), "{e}");
    assert!(!s.contains('\n'), "{s}");
    e
}

#[test]
fn round_trips_f32_and_f64() {
    let data32: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
    let mut bytes = Vec::new();
    write_f32_to(&mut bytes, &[3, 4], &data32).unwrap();
    assert_eq!((bytes.len() - 48) % ALIGN, 0);
    let a = from_bytes(&bytes).unwrap();
    assert_eq!(
        a,
        Array::F32 {
            shape: vec![3, 4],
            data: data32.clone()
        }
    );
    assert_eq!(read_from(&bytes[..]).unwrap(), a);
    assert_eq!(a.matrix_dims().unwrap(), (3, 4));
    assert_eq!(a.dtype_name(), "float32");

    // float16 and raw uint16 words: the same bits back, under their own descr.
    let data16 = vec![
        half::f16::MIN_POSITIVE,
        half::f16::NEG_INFINITY,
        half::f16::from_f32(-2.5),
    ];
    let mut bytes = Vec::new();
    Array::F16 {
        shape: vec![3],
        data: data16.clone(),
    }
    .write_to(&mut bytes)
    .unwrap();
    let a = from_bytes(&bytes).unwrap();
    assert_eq!((a.dtype_name(), a.descr()), ("float16", "<f2"));
    assert_eq!(
        a,
        Array::F16 {
            shape: vec![3],
            data: data16
        }
    );
    let words = vec![0x3f80u16, 0xff80, 0x0001, 0x7fc0];
    let mut bytes = Vec::new();
    Array::U16 {
        shape: vec![2, 2],
        data: words.clone(),
    }
    .write_to(&mut bytes)
    .unwrap();
    let a = from_bytes(&bytes).unwrap();
    assert_eq!((a.dtype_name(), a.descr()), ("uint16", "<u2"));
    let Array::U16 { data, .. } = &a else {
        panic!("{a:?}")
    };
    assert_eq!(data, &words);
    assert_eq!(bf16_words(data)[0], half::bf16::ONE);

    let data64 = vec![f64::MIN_POSITIVE, -0.0, 1e300, f64::INFINITY, 3.25];
    let mut bytes = Vec::new();
    write_f64_to(&mut bytes, &[5], &data64).unwrap();
    let a = from_bytes(&bytes).unwrap();
    assert_eq!(a.shape(), &[5]);
    assert_eq!(a.dtype_name(), "float64");
    let Array::F64 { data, .. } = &a else {
        panic!("{a:?}")
    };
    assert_eq!(
        data.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        data64.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(
        a.matrix_dims().unwrap_err().to_string(),
        "shape (5,) is not 2-D (n, d)"
    );

    // NaN payloads survive bit for bit; 0-d and empty arrays work.
    let nan = f32::from_bits(0x7fc0_1234);
    let mut bytes = Vec::new();
    write_f32_to(&mut bytes, &[], &[nan]).unwrap();
    let Array::F32 { shape, data } = from_bytes(&bytes).unwrap() else {
        panic!()
    };
    assert!(shape.is_empty());
    assert_eq!(data[0].to_bits(), nan.to_bits());
    let mut bytes = Vec::new();
    write_f64_to(&mut bytes, &[0, 7], &[]).unwrap();
    assert_eq!(
        from_bytes(&bytes).unwrap(),
        Array::F64 {
            shape: vec![0, 7],
            data: vec![]
        }
    );

    // Larger than one chunk, through files.
    let dir = TempDir::new("roundtrip");
    let big: Vec<f64> = (0..100_003).map(|i| (i as f64).sin()).collect();
    let path = dir.0.join("big.npy");
    write_f64(&path, &[7, 14_285], &big[..7 * 14_285]).unwrap();
    let back = read(&path).unwrap();
    assert_eq!(back.shape(), &[7, 14_285]);
    let Array::F64 { data, .. } = back else {
        panic!()
    };
    assert_eq!(data, big[..7 * 14_285]);
    let a = Array::F32 {
        shape: vec![100_003],
        data: big.iter().map(|&x| x as f32).collect(),
    };
    a.write(&path).unwrap();
    assert_eq!(read(&path).unwrap(), a);
}

#[test]
fn mapped_files_view_the_same_elements_and_are_checked_alike() {
    let dir = TempDir::new("map");
    let data32: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
    let path = dir.0.join("a.npy");
    write_f32(&path, &[3, 4], &data32).unwrap();
    let m = map(&path).unwrap();
    assert_eq!((m.shape(), m.matrix_dims().unwrap()), (&[3, 4][..], (3, 4)));
    assert_eq!(m.dtype_name(), "float32");
    assert!(matches!(m.data(), Some(MappedData::F32(d)) if d == data32.as_slice()));
    let data64 = vec![f64::MIN_POSITIVE, -0.0, 1e300];
    write_f64(&path, &[3], &data64).unwrap();
    let m = map(&path).unwrap();
    assert!(matches!(m.data(), Some(MappedData::F64(d)) if d == data64.as_slice()));

    // A header NumPy would not write (data at an odd offset) is not viewed in place; the
    // reader converts it.
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
    let odd = raw(1, header, &f32_bytes(&[1.5, -2.0]));
    assert_ne!((10 + header.len()) % 4, 0);
    std::fs::write(&path, &odd).unwrap();
    assert!(map(&path).unwrap().data().is_none());
    assert_eq!(read(&path).unwrap().view_f32(), Some(&[1.5f32, -2.0][..]));

    // Truncated, trailing or malformed files fail as they do for the reader, and so does
    // something that is not a regular file.
    for bad in [
        &odd[..odd.len() - 1],
        &[odd.as_slice(), &[0]].concat(),
        b"NUMPY",
    ] {
        std::fs::write(&path, bad).unwrap();
        let (m, r) = (map(&path).unwrap_err(), read(&path).unwrap_err());
        assert_eq!(m.to_string(), r.to_string());
    }
    assert!(map(&dir.0)
        .unwrap_err()
        .to_string()
        .contains("not a regular file"));
}

#[test]
fn writer_rejects_a_shape_that_does_not_match_the_data() {
    let e = write_f32_to(Vec::new(), &[2, 3], &[1.0; 5]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "shape (2, 3) has 6 elements but 5 were given"
    );
    let e = write_f32_to(Vec::new(), &[usize::MAX, 2], &[]).unwrap_err();
    assert!(e.to_string().contains("too large"), "{e}");
}

#[test]
fn reads_v1_v2_and_v3_headers_with_any_spacing() {
    let data = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let expected = Array::F32 {
        shape: vec![2, 3],
        data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
    };
    for header in [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }          \n",
        "{'descr':'<f4','fortran_order':False,'shape':(2,3)}",
        "{\"shape\": (2L, 3L), \"fortran_order\": False, \"descr\": \"<f4\"}\n",
        "{ 'fortran_order' : False ,\n 'descr' : u'<f4' , 'shape' : ( 2 , 3 , ) , }\t \n",
    ] {
        for major in [1, 2, 3] {
            let a = from_bytes(&raw(major, header, &data));
            // As NumPy: Python 2's `2L` only where Python 2 could have written it.
            if major == 3 && header.contains("2L") {
                let e = a.unwrap_err().to_string();
                assert!(e.contains("'shape' must be a tuple"), "{e}");
            } else {
                assert_eq!(a.unwrap(), expected, "v{major} {header:?}");
            }
        }
    }
    // A header longer than 64 KiB needs version 2; the writer switches by itself.
    let shape = vec![1usize; 30_000];
    let mut bytes = Vec::new();
    write_f32_to(&mut bytes, &shape, &[7.5]).unwrap();
    assert_eq!(bytes[6], 2);
    assert_eq!(from_bytes(&bytes).unwrap().shape(), &shape[..]);
}

#[test]
fn rejects_a_wrong_magic_string_and_version() {
    assert!(err(b"PK\x03\x04 not npy at all").contains("not a .npy file"));
    assert!(err(b"").contains("too short"));
    assert!(err(b"\x93NUM").contains("too short"));
    let mut v = raw(
        1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (0,)}",
        &[],
    );
    v[6] = 4;
    assert_eq!(
        err(&v),
        "unsupported .npy format version 4.0; expected 1.0, 2.0 or 3.0"
    );
}

#[test]
fn rejects_fortran_order_other_dtypes_and_big_endian() {
    let h = |descr: &str, fortran: &str| {
        raw(
            1,
            &format!("{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': (2, 2), }}\n"),
            &[0; 32],
        )
    };
    assert!(err(&h("'<f4'", "True")).contains("Fortran-order"));
    assert_eq!(
        err(&h("'<i4'", "False")),
        "dtype '<i4' is not supported; expected float32 ('<f4'), float64 ('<f8'), float16 ('<f2') or uint16 ('<u2', bfloat16 bits)"
    );
    let e = err(&h("'>f4'", "False"));
    assert!(
        e.starts_with("dtype '>f4' is not supported") && e.contains("big-endian"),
        "{e}"
    );
    for descr in ["'>f2'", "'>u2'"] {
        let e = err(&h(descr, "False"));
        assert!(e.contains("big-endian"), "{e}");
    }
    for descr in [
        "'<u4'",
        "'<i2'",
        "'|u1'",
        "'=f4'",
        "'<c8'",
        "[('a', '<f4')]",
        "'O'",
    ] {
        let e = err(&h(descr, "False"));
        assert!(e.starts_with(&format!("dtype {descr} is not")), "{e}");
    }
    assert!(err(&h("'<f8'", "0")).contains("'fortran_order' must be True or False"));
}

#[test]
fn rejects_malformed_headers() {
    for (header, needle) in [
        ("{'descr': '<f4', 'shape': (2,)}", "key 'fortran_order' is missing"),
        ("{'descr': '<f4', 'fortran_order': False}", "key 'shape' is missing"),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}",
            "unexpected key 'x'",
        ),
        (
            "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}",
            "appears twice",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2)}",
            "'shape' must be a tuple of non-negative integers, not (2)",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 1)}",
            "not (-2, 1)",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2.5,)}",
            "not (2.5,)",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3]}",
            "not [2, 3]",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (010,)}",
            "not (010,)",
        ),
        (
            "{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}",
            "expected ',' or '}' at byte",
        ),
        (
            "{'descr': '<\\x66\\x34', 'fortran_order': False, 'shape': (2,)}",
            "escape sequence",
        ),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': 2)}", "unmatched ')'"),
        ("{descr: '<f4', 'fortran_order': False, 'shape': ()}", "expected a string"),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999999999999999999999,)}",
            "too large",
        ),
        (
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,)}",
            "is too large",
        ),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "expected '}'"),
        ("{'descr': '<f4}", "not closed"),
        (
            "{'descr': '<f4', 'fortran_order': false, 'shape': ()}",
            "'fortran_order' must be True or False, not false",
        ),
        ("[1, 2]", "expected a dictionary"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': ()} junk", "unexpected text"),
        ("", "unexpected end"),
    ] {
        let e = err(&raw(1, header, &[0; 8]));
        assert!(e.starts_with("malformed header") && e.contains(needle), "{header}: {e}");
    }
    let deep = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': {}{}}}",
        "(".repeat(10_000),
        ")".repeat(10_000)
    );
    // Brackets are counted, not recursed into, and the message stays short.
    let e = err(&raw(2, &deep, &[]));
    assert!(
        e.contains("'shape' must be a tuple") && e.len() < 200,
        "{e}"
    );
    let mut latin1 = raw(
        1,
        "{'descr': 'X', 'fortran_order': False, 'shape': ()}",
        &[],
    );
    let at = latin1.iter().position(|&c| c == b'X').unwrap();
    latin1[at] = 0xe9;
    assert!(err(&latin1).contains("not ASCII/UTF-8"));
}

#[test]
fn rejects_truncated_and_oversized_data_before_allocating() {
    let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (300,), }\n";
    let e = err(&raw(1, h, &[0; 800]));
    assert_eq!(
        e,
        "file is truncated: header says 1200 bytes of data, 800 present"
    );
    let e = err(&raw(1, h, &[0; 1201]));
    assert!(e.contains("1 unexpected bytes after the 1200 bytes"), "{e}");
    // A partial last element.
    assert!(err(&raw(1, h, &[0; 1199])).contains("1199 present"));

    // Shapes whose byte size overflows are refused without touching the allocator.
    for shape in [
        "(4611686018427387904, 4611686018427387904)",
        "(4611686018427387904,)",
    ] {
        let e = err(&raw(
            1,
            &format!("{{'descr': '<f8', 'fortran_order': False, 'shape': {shape}, }}"),
            &[0; 16],
        ));
        assert_eq!(
            e,
            format!("shape {shape} is too large: its size in bytes overflows")
        );
    }
    // A shape that fits in usize but not in this file (4 TiB) is refused before allocating,
    // by both the sized and the stream reader (which grows with the data that arrives).
    let e = err(&raw(
        1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }",
        &[0; 16],
    ));
    assert_eq!(
        e,
        "file is truncated: header says 4398046511104 bytes of data, 16 present"
    );
}

#[test]
fn rejects_a_header_length_past_the_end_of_the_file() {
    let mut v = raw(
        1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': ()}",
        &[],
    );
    v[8..10].copy_from_slice(&1000u16.to_le_bytes());
    let e = from_bytes(&v).unwrap_err().to_string();
    assert!(e.starts_with("header length 1000 runs past the end"), "{e}");
    let e = read_from(&v[..]).unwrap_err().to_string();
    assert!(e.starts_with("header length 1000 runs past the end"), "{e}");
    // Version 2 allows 4 GiB headers: refused from the file size, or from the limit.
    let mut v = raw(2, "{}", &[]);
    v[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(from_bytes(&v)
        .unwrap_err()
        .to_string()
        .contains("past the end"));
    assert!(read_from(&v[..])
        .unwrap_err()
        .to_string()
        .contains("exceeds the limit"));
}

#[test]
fn file_errors_name_the_path() {
    let dir = TempDir::new("paths");
    let missing = dir.0.join("missing.npy");
    let e = read(&missing).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("{}: cannot open: ", missing.display())),
        "{e}"
    );
    let e = read(&dir.0).unwrap_err().to_string();
    assert!(e.contains("cannot read: it is a directory"), "{e}");
    let bad = dir.0.join("input.npy");
    std::fs::write(
        &bad,
        raw(
            1,
            "{'descr': '<i4', 'fortran_order': False, 'shape': (1,)}",
            &[0; 4],
        ),
    )
    .unwrap();
    assert_eq!(
        read(&bad).unwrap_err().to_string(),
        format!(
            "{}: dtype '<i4' is not supported; expected float32 ('<f4'), float64 ('<f8'), float16 ('<f2') or uint16 ('<u2', bfloat16 bits)",
            bad.display()
        )
    );
    let e = write_f32(&dir.0.join("no/such/dir.npy"), &[1], &[1.0]).unwrap_err();
    assert!(e.to_string().contains("cannot create"), "{e}");
}

fn numpy() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: python3 with numpy is not available");
    }
    ok
}

#[test]
fn reads_what_numpy_writes_and_numpy_reads_what_we_write() {
    if !numpy() {
        return;
    }
    let dir = TempDir::new("numpy");
    let script = r#"
import sys, numpy as np
from numpy.lib import format as fmt
d = sys.argv[1]
x = (np.arange(12, dtype=np.float64).reshape(3, 4) - 5.5) / 3
np.save(d + '/f64.npy', x)
np.save(d + '/f32.npy', x.astype(np.float32))
for v in [(1, 0), (2, 0), (3, 0)]:
    with open(d + '/v%d.npy' % v[0], 'wb') as f:
        fmt.write_array(f, x.astype(np.float32), version=v)
np.save(d + '/fortran.npy', np.asfortranarray(x))
np.save(d + '/int.npy', np.arange(4, dtype=np.int32))
np.save(d + '/big.npy', x.astype('>f4'))
np.save(d + '/scalar.npy', np.float64(2.5))
np.save(d + '/t.npy', x.T)  # a transposed view is saved in Fortran order
ours = np.load(d + '/ours32.npy')
assert ours.dtype == np.float32 and ours.shape == (2, 3), (ours.dtype, ours.shape)
assert (ours == np.array([[1, 2, 3], [4, 5, 6.5]], np.float32)).all()
ours = np.load(d + '/ours64.npy')
assert ours.dtype == np.float64 and ours.shape == (0,), (ours.dtype, ours.shape)
ours = np.load(d + '/ourswide.npy')
assert ours.shape == (1,) * 40 and ours.dtype == np.float64
print('numpy ok')
"#;
    write_f32(
        &dir.0.join("ours32.npy"),
        &[2, 3],
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5],
    )
    .unwrap();
    write_f64(&dir.0.join("ours64.npy"), &[0], &[]).unwrap();
    write_f64(&dir.0.join("ourswide.npy"), &[1; 40], &[1.0]).unwrap();
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&dir.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let expected: Vec<f64> = (0..12).map(|i| (f64::from(i) - 5.5) / 3.0).collect();
    assert_eq!(
        read(&dir.0.join("f64.npy")).unwrap(),
        Array::F64 {
            shape: vec![3, 4],
            data: expected.clone()
        }
    );
    let expected32 = Array::F32 {
        shape: vec![3, 4],
        data: expected.iter().map(|&x| x as f32).collect(),
    };
    assert_eq!(read(&dir.0.join("f32.npy")).unwrap(), expected32);
    for v in 1..=3 {
        let path = dir.0.join(format!("v{v}.npy"));
        assert_eq!(std::fs::read(&path).unwrap()[6], v);
        assert_eq!(read(&path).unwrap(), expected32, "version {v}");
    }
    assert_eq!(
        read(&dir.0.join("scalar.npy")).unwrap(),
        Array::F64 {
            shape: vec![],
            data: vec![2.5]
        }
    );
    for (name, needle) in [
        ("fortran.npy", "Fortran-order"),
        ("t.npy", "Fortran-order"),
        ("int.npy", "dtype '<i4' is not supported"),
        ("big.npy", "dtype '>f4' is not supported"),
    ] {
        let e = read(&dir.0.join(name)).unwrap_err().to_string();
        assert!(e.contains(needle), "{name}: {e}");
    }
}
