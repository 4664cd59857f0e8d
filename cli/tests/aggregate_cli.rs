//! `byzcoll aggregate`: .npy in, robust aggregate out, with clear one-line errors.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use byzcoll_cli::npy::{self, Array};
use common::{byzcoll, run_with_limit, text};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "byzcoll-aggregate-cli-{}-{}-{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the temp dir");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn aggregate(args: &[&str], input: &Path, output: Option<&Path>) -> Output {
    let mut cmd = Command::new(byzcoll());
    cmd.arg("aggregate").args(args).arg(input);
    if let Some(output) = output {
        cmd.arg("-o").arg(output);
    }
    run_with_limit(&mut cmd, Duration::from_secs(60)).0
}

/// Runs an aggregation that must succeed; returns stdout and the output array.
fn ok(args: &[&str], input: &Path, output: &Path) -> (String, Array) {
    let out = aggregate(args, input, Some(output));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{args:?}\n{stdout}\n{stderr}");
    assert!(stderr.is_empty(), "{args:?}: {stderr}");
    (stdout, npy::read(output).expect("read the output"))
}

/// Runs an aggregation that must fail with status 1 and one line on stderr containing
/// every needle, leaving no output file and nothing on stdout.
fn fails(args: &[&str], input: &Path, output: &Path, needles: &[&str]) {
    let out = aggregate(args, input, Some(output));
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{args:?}\n{stdout}\n{stderr}");
    assert!(stdout.is_empty(), "{args:?}: {stdout}");
    assert!(
        stderr.starts_with("byzcoll aggregate: ") && stderr.ends_with('\n'),
        "{args:?}: {stderr:?}"
    );
    assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr:?}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{args:?}: {needle:?} not in {stderr:?}"
        );
    }
    assert!(
        !output.exists(),
        "{args:?}: {} was written",
        output.display()
    );
}

fn random_rows(seed: u64, n: usize, d: usize) -> Vec<Vec<f64>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| (0..d).map(|_| rng.gen_range(-10.0..10.0)).collect())
        .collect()
}

/// The sorted column `c` of `rows` (IEEE totalOrder, as the rules use).
fn column(rows: &[Vec<f64>], c: usize) -> Vec<f64> {
    let mut col: Vec<f64> = rows.iter().map(|r| r[c]).collect();
    col.sort_by(f64::total_cmp);
    col
}

fn flat32(rows: &[Vec<f64>]) -> Vec<f32> {
    rows.iter().flatten().map(|&x| x as f32).collect()
}

fn flat64(rows: &[Vec<f64>]) -> Vec<f64> {
    rows.iter().flatten().copied().collect()
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn median_of_float32_rows_ignores_byzantine_rows_and_reports_json() {
    let dir = TempDir::new("median");
    let (n, d) = (5, 1000);
    let mut rows = random_rows(1, n, d);
    // Two Byzantine rows: huge values and NaN.
    rows[1].iter_mut().for_each(|x| *x = 1e30);
    rows[3].iter_mut().for_each(|x| *x = f64::NAN);
    let rows: Vec<Vec<f64>> = rows
        .iter()
        .map(|r| r.iter().map(|&x| f64::from(x as f32)).collect())
        .collect();
    let input = dir.path("in.npy");
    npy::write_f32(&input, &[n, d], &flat32(&rows)).unwrap();
    let output = dir.path("out.npy");
    let (stdout, result) = ok(
        &["--rule", "median", "--f", "2", "--report", "json"],
        &input,
        &output,
    );
    assert!(
        stdout.starts_with(
            "{\"rule\":\"median\",\"n\":5,\"d\":1000,\"dtype\":\"float32\",\"selected\":null,\
             \"outlying\":[1,3],\"attribution\":["
        ),
        "{stdout}"
    );
    let Array::F32 { shape, data } = result else {
        panic!("not float32: {result:?}")
    };
    assert_eq!(shape, [d]);
    for (c, &v) in data.iter().enumerate() {
        let col = column(&rows, c);
        assert_eq!(v, col[n / 2] as f32, "coordinate {c}");
        assert!(v.is_finite() && v.abs() <= 10.0, "coordinate {c}: {v}");
    }
    // Without --report nothing is printed.
    std::fs::remove_file(&output).unwrap();
    let (stdout, again) = ok(&["--rule", "median", "-f", "2"], &input, &output);
    assert!(stdout.is_empty(), "{stdout}");
    assert_eq!(again.shape(), [d]);
}

#[test]
fn float64_stays_float64_for_median_and_trimmed_mean() {
    let dir = TempDir::new("f64");
    let (n, d) = (4, 333);
    let rows = random_rows(2, n, d);
    let input = dir.path("in.npy");
    npy::write_f64(&input, &[n, d], &flat64(&rows)).unwrap();

    // Even n: the mean of the two middle values.
    let output = dir.path("median.npy");
    let (stdout, result) = ok(
        &["--rule", "median", "--f", "1", "--report", "json"],
        &input,
        &output,
    );
    assert!(
        stdout.starts_with(r#"{"rule":"median","n":4,"d":333,"dtype":"float64","selected":null,"#),
        "{stdout}"
    );
    let Array::F64 { shape, data } = result else {
        panic!("not float64: {result:?}")
    };
    assert_eq!(shape, [d]);
    for (c, &v) in data.iter().enumerate() {
        let col = column(&rows, c);
        assert_eq!(v, col[1] * 0.5 + col[2] * 0.5, "coordinate {c}");
    }

    let (n, d) = (7, 257);
    let rows = random_rows(3, n, d);
    npy::write_f64(&input, &[n, d], &flat64(&rows)).unwrap();
    let output = dir.path("trimmed.npy");
    // The underscore spelling is accepted by `build`; the report names the rule canonically.
    let (stdout, result) = ok(
        &["--rule", "trimmed_mean", "--f", "2", "--report", "json"],
        &input,
        &output,
    );
    assert!(
        stdout.contains(r#""n":7,"d":257,"dtype":"float64","selected":null,"#),
        "{stdout}"
    );
    let Array::F64 { shape, data } = result else {
        panic!("not float64: {result:?}")
    };
    assert_eq!(shape, [d]);
    for (c, &v) in data.iter().enumerate() {
        let col = column(&rows, c);
        let expected = col[2..5].iter().sum::<f64>() / 3.0;
        assert!(
            close(v, expected, 1e-12),
            "coordinate {c}: {v} vs {expected}"
        );
    }
}

#[test]
fn trimmed_mean_and_mean_of_float32_rows() {
    let dir = TempDir::new("f32");
    let (n, d) = (6, 4097);
    let rows32 = flat32(&random_rows(4, n, d));
    let rows: Vec<Vec<f64>> = rows32
        .chunks(d)
        .map(|r| r.iter().map(|&x| f64::from(x)).collect())
        .collect();
    let input = dir.path("in.npy");
    npy::write_f32(&input, &[n, d], &rows32).unwrap();

    let (_, result) = ok(
        &["--rule", "trimmed-mean", "--f", "1"],
        &input,
        &dir.path("trimmed.npy"),
    );
    let Array::F32 { shape, data } = result else {
        panic!("not float32: {result:?}")
    };
    assert_eq!(shape, [d]);
    for (c, &v) in data.iter().enumerate() {
        let col = column(&rows, c);
        let expected = col[1..5].iter().sum::<f64>() / 4.0;
        assert!(
            close(f64::from(v), expected, 1e-6),
            "coordinate {c}: {v} vs {expected}"
        );
    }

    let (stdout, result) = ok(
        &["--rule", "mean", "--report", "json"],
        &input,
        &dir.path("mean.npy"),
    );
    assert!(stdout.starts_with(r#"{"rule":"mean","n":6,"d":4097,"dtype":"float32""#));
    let Array::F32 { shape, data } = result else {
        panic!("not float32: {result:?}")
    };
    assert_eq!(shape, [d]);
    for (c, &v) in data.iter().enumerate() {
        let expected = rows.iter().map(|r| r[c]).sum::<f64>() / n as f64;
        assert!(
            close(f64::from(v), expected, 1e-6),
            "coordinate {c}: {v} vs {expected}"
        );
    }
}

/// A `.npy` file with a hand-written header (for dtypes the writer does not produce).
fn raw_npy(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn bad_input_fails_with_one_line_naming_the_problem() {
    let dir = TempDir::new("errors");
    let out = dir.path("out.npy");
    let median = ["--rule", "median", "--f", "1"];

    let missing = dir.path("missing.npy");
    fails(&median, &missing, &out, &["missing.npy: cannot open"]);

    let one_d = dir.path("one_d.npy");
    npy::write_f32(&one_d, &[5], &[1.0; 5]).unwrap();
    fails(
        &median,
        &one_d,
        &out,
        &["one_d.npy: shape (5,) is not 2-D (n, d)"],
    );
    let three_d = dir.path("three_d.npy");
    npy::write_f64(&three_d, &[3, 2, 2], &[1.0; 12]).unwrap();
    fails(
        &median,
        &three_d,
        &out,
        &["shape (3, 2, 2) is not 2-D (n, d)"],
    );

    let int = dir.path("int.npy");
    std::fs::write(
        &int,
        raw_npy(
            "{'descr': '<i4', 'fortran_order': False, 'shape': (3, 2), }\n",
            &[0; 24],
        ),
    )
    .unwrap();
    fails(
        &median,
        &int,
        &out,
        &["int.npy: dtype '<i4' is not supported; expected float32 ('<f4'), float64 ('<f8'), float16 ('<f2') or uint16 ('<u2', bfloat16 bits)"],
    );

    let fortran = dir.path("fortran.npy");
    std::fs::write(
        &fortran,
        raw_npy(
            "{'descr': '<f4', 'fortran_order': True, 'shape': (3, 2), }\n",
            &[0; 24],
        ),
    )
    .unwrap();
    fails(&median, &fortran, &out, &["Fortran-order"]);

    let truncated = dir.path("truncated.npy");
    std::fs::write(
        &truncated,
        raw_npy(
            "{'descr': '<f8', 'fortran_order': False, 'shape': (3, 2), }\n",
            &[0; 40],
        ),
    )
    .unwrap();
    fails(
        &median,
        &truncated,
        &out,
        &["file is truncated: header says 48 bytes of data, 40 present"],
    );

    let not_npy = dir.path("not.npy");
    std::fs::write(&not_npy, "n,d\n1,2\n").unwrap();
    fails(&median, &not_npy, &out, &["not a .npy file"]);

    let four = dir.path("four.npy");
    npy::write_f32(&four, &[4, 3], &[1.0; 12]).unwrap();
    fails(
        &["--rule", "median", "--f", "2"],
        &four,
        &out,
        &["n > 2f", "n = 4, f = 2"],
    );
    fails(
        &["--rule", "trimmed-mean", "--f", "2"],
        &four,
        &out,
        &["n > 2f"],
    );

    let empty = dir.path("empty.npy");
    npy::write_f32(&empty, &[0, 3], &[]).unwrap();
    fails(&median, &empty, &out, &["n = 0"]);
    let no_coords = dir.path("no_coords.npy");
    npy::write_f32(&no_coords, &[5, 0], &[]).unwrap();
    fails(&median, &no_coords, &out, &["d = 0"]);

    fails(
        &["--rule", "average", "--f", "1"],
        &four,
        &out,
        &[
            "unknown rule",
            "average",
            "known rules:",
            "median",
            "trimmed-mean",
        ],
    );

    fails(
        &median,
        &four,
        &dir.path("no/such/dir/out.npy"),
        &["cannot create"],
    );
}

#[test]
fn argument_errors_exit_2_as_clap_does() {
    let dir = TempDir::new("args");
    let input = dir.path("in.npy");
    npy::write_f32(&input, &[3, 2], &[1.0; 6]).unwrap();
    for (args, needle) in [
        (vec!["--rule", "median"], "--output"),
        (vec!["-o", "x.npy"], "--rule"),
        (
            vec!["--rule", "median", "-o", "x.npy", "--report", "yaml"],
            "yaml",
        ),
        (vec!["--rule", "median", "-o", "x.npy", "--f", "-1"], "-1"),
    ] {
        let out = aggregate(&args, &input, None);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}\n{stdout}\n{stderr}");
        assert!(
            stderr.starts_with("error: ") && stderr.contains(needle),
            "{args:?}: {stderr}"
        );
    }
    assert!(!dir.path("x.npy").exists());
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
fn reads_files_numpy_saves_and_numpy_loads_the_result() {
    if !numpy() {
        return;
    }
    let dir = TempDir::new("numpy");
    let save = r#"
import sys, numpy as np
d = sys.argv[1]
x = np.random.default_rng(5).normal(size=(9, 17))
x[2] = 1e30
x[6, ::2] = np.nan
np.save(d + '/x64.npy', x)
np.save(d + '/x32.npy', x.astype(np.float32))
"#;
    let run_py = |script: &str| {
        let (out, _) = run_with_limit(
            Command::new("python3").args(["-c", script]).arg(&dir.0),
            Duration::from_secs(60),
        );
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        stdout
    };
    run_py(save);
    for dtype in ["32", "64"] {
        let input = dir.path(&format!("x{dtype}.npy"));
        let (stdout, _) = ok(
            &["--rule", "median", "--f", "4", "--report", "json"],
            &input,
            &dir.path(&format!("median{dtype}.npy")),
        );
        assert!(
            stdout.contains(&format!(r#""n":9,"d":17,"dtype":"float{dtype}""#)),
            "{stdout}"
        );
        ok(
            &["--rule", "trimmed-mean", "--f", "2"],
            &input,
            &dir.path(&format!("trimmed{dtype}.npy")),
        );
    }
    let check = r#"
import sys, numpy as np
d = sys.argv[1]
for t in ['32', '64']:
    x = np.load(d + '/x%s.npy' % t)
    # totalOrder puts NaN last, as np.sort does for positive NaN.
    s = np.sort(x, axis=0)
    m = np.load(d + '/median%s.npy' % t)
    assert m.dtype == x.dtype and m.shape == (17,), (m.dtype, m.shape)
    assert (m == s[4]).all(), (m, s[4])
    tm = np.load(d + '/trimmed%s.npy' % t)
    assert tm.dtype == x.dtype and tm.shape == (17,), (tm.dtype, tm.shape)
    want = s[2:7].astype(np.float64).mean(axis=0)
    assert np.allclose(tm, want, rtol=1e-6), (tm, want)
print('numpy ok')
"#;
    assert_eq!(run_py(check).trim(), "numpy ok");
}

/// `--device cuda` never falls back to the CPU: without the `cuda` feature, or without a GPU,
/// it fails with one line saying why, and writes nothing. (With a GPU, the CUDA rules are
/// checked against the CPU rules in byzcoll-cuda's tests.)
#[test]
fn device_cuda_without_a_gpu_fails_instead_of_running_on_the_cpu() {
    let dir = TempDir::new("cuda");
    let input = dir.path("in.npy");
    let rows = random_rows(5, 5, 64);
    npy::write_f32(&input, &[5, 64], &flat32(&rows)).unwrap();
    let gpu_here = std::path::Path::new("/dev/nvidiactl").exists();
    if gpu_here && cfg!(feature = "cuda") {
        let (_, out) = ok(
            &["--rule", "median", "--f", "1", "--device", "cuda"],
            &input,
            &dir.path("gpu.npy"),
        );
        let (_, cpu) = ok(
            &["--rule", "median", "--f", "1"],
            &input,
            &dir.path("cpu.npy"),
        );
        assert_eq!(
            out, cpu,
            "the GPU median is bitwise the CPU median for n = 5"
        );
        return;
    }
    let why = if cfg!(feature = "cuda") {
        "could not be loaded"
    } else {
        "--features cuda"
    };
    fails(
        &["--rule", "median", "--f", "1", "--device", "cuda"],
        &input,
        &dir.path("out.npy"),
        &["--device cuda", why],
    );
}

/// The report names the row that lay far from the aggregate: its deviation in median
/// deviations, and the share of coordinates where it was among the f lowest or highest; a row
/// of NaN is infinitely far, written null (JSON has no infinity).
#[test]
fn the_report_names_the_outlying_rows() {
    let dir = TempDir::new("outlying");
    let (n, d) = (6, 500);
    let mut rows: Vec<Vec<f64>> = random_rows(4, n, d)
        .into_iter()
        .map(|r| r.into_iter().map(|x| 1.0 + x.abs()).collect())
        .collect();
    rows[3] = rows[3].iter().map(|x| -20.0 * x).collect();
    rows[5] = vec![f64::NAN; d];
    let input = dir.path("in.npy");
    npy::write_f64(&input, &[n, d], &flat64(&rows)).unwrap();
    let output = dir.path("out.npy");
    let (stdout, _) = ok(
        &["--rule", "median", "--f", "2", "--report", "json"],
        &input,
        &output,
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["outlying"], serde_json::json!([3, 5]), "{stdout}");
    let rows = report["attribution"].as_array().unwrap();
    assert_eq!(rows.len(), n);
    assert!(rows[3]["score"].as_f64().unwrap() > 10.0, "{stdout}");
    assert_eq!(rows[3]["extreme"].as_f64(), Some(1.0), "{stdout}");
    assert!(
        rows[5]["deviation"].is_null() && rows[5]["score"].is_null(),
        "{stdout}"
    );
    for r in [0, 1, 2, 4] {
        assert!(rows[r]["score"].as_f64().unwrap() < 3.0, "{stdout}");
    }
}

/// float16 files (`<f2`) and bfloat16 bits in uint16 files (`<u2`, with `--dtype bf16`) are
/// aggregated in their own type: the output, in the input's dtype, is bitwise the library's
/// rule on the same values (median and trimmed mean, a NaN row and a far row among them). A
/// `<u2` file without `--dtype bf16`, and a `--dtype` the file does not hold, are refused.
#[test]
fn float16_and_bfloat16_inputs_aggregate_in_their_own_type() {
    use byzcoll::aggregators::{aggregate_into, build, Element, Params};

    fn library<T: Element>(rule: &str, f: usize, rows: &[Vec<T>]) -> Vec<T> {
        let rule = build(
            rule,
            &Params {
                f,
                ..Params::default()
            },
        )
        .unwrap();
        let refs: Vec<&[T]> = rows.iter().map(Vec::as_slice).collect();
        let mut out = vec![T::from_f64(0.0); rows[0].len()];
        aggregate_into(rule.as_ref(), &refs, &mut out).unwrap();
        out
    }
    fn rows<T: Element>(n: usize, d: usize) -> Vec<Vec<T>> {
        let mut rng = StdRng::seed_from_u64(16);
        (0..n)
            .map(|i| {
                (0..d)
                    .map(|_| match i {
                        0 => T::from_f64(f64::NAN),
                        1 => T::from_f64(3e4),
                        _ => T::from_f64(rng.gen_range(-8.0..8.0)),
                    })
                    .collect()
            })
            .collect()
    }
    let dir = TempDir::new("half");
    let (n, d) = (7, 33);

    let x16: Vec<Vec<half::f16>> = rows(n, d);
    let input = dir.path("x16.npy");
    npy::write_f16(&input, &[n, d], &x16.concat()).unwrap();
    for (rule, f) in [("median", 2), ("trimmed-mean", 2)] {
        let (stdout, out) = ok(
            &["--rule", rule, "--f", &f.to_string(), "--report", "json"],
            &input,
            &dir.path(&format!("{rule}16.npy")),
        );
        assert!(stdout.contains(r#""dtype":"float16""#), "{stdout}");
        let Array::F16 { shape, data } = out else {
            panic!("{out:?}")
        };
        assert_eq!(shape, [d]);
        let want = library(rule, f, &x16);
        assert_eq!(
            data.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{rule}"
        );
    }

    let xb: Vec<Vec<half::bf16>> = rows(n, d);
    let words: Vec<u16> = xb.concat().iter().map(|v| v.to_bits()).collect();
    let input = dir.path("xb.npy");
    npy::write_u16(&input, &[n, d], &words).unwrap();
    let out = dir.path("out.npy");
    fails(
        &["--rule", "median", "--f", "2"],
        &input,
        &out,
        &["xb.npy: dtype uint16 holds raw 16-bit words: pass --dtype bf16"],
    );
    fails(
        &["--rule", "median", "--f", "2", "--dtype", "f16"],
        &input,
        &out,
        &["xb.npy: dtype is uint16, but --dtype f16 needs float16"],
    );
    for (rule, f) in [("median", 2), ("trimmed-mean", 2)] {
        let (stdout, out) = ok(
            &[
                "--rule",
                rule,
                "--f",
                &f.to_string(),
                "--dtype",
                "bf16",
                "--report",
                "json",
            ],
            &input,
            &dir.path(&format!("{rule}b.npy")),
        );
        assert!(stdout.contains(r#""dtype":"bfloat16""#), "{stdout}");
        let Array::U16 { shape, data } = out else {
            panic!("{out:?}")
        };
        assert_eq!(shape, [d]);
        let want = library(rule, f, &xb);
        assert_eq!(
            data,
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{rule}"
        );
    }
}
