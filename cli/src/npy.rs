//! A small, dependency-free reader and writer for NumPy `.npy` files.
//!
//! Only what byzcoll needs: C-order (`'fortran_order': False`), little-endian `float32`
//! (`'<f4'`) and `float64` (`'<f8'`) arrays of any shape, with format version 1.0, 2.0 or 3.0
//! headers. Everything else is rejected with a one-line [`NpyError`] that says what was found.
//!
//! Input is untrusted: the magic string, the version, the header length (against the file's
//! size), the shape's element count and byte size (checked multiplication) and the data length
//! (against what the file holds) are all verified before the data buffer is allocated, so a
//! header that announces `(2**62, 2**62)` elements is an error, not an allocation failure.
//!
//! ```
//! let mut bytes = Vec::new();
//! byzcoll_cli::npy::write_f32_to(&mut bytes, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
//! let array = byzcoll_cli::npy::from_bytes(&bytes).unwrap();
//! assert_eq!(array.shape(), &[2, 3]);
//! assert_eq!(array.dtype_name(), "float32");
//! ```

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// The first six bytes of every `.npy` file.
const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// Largest header this reader accepts. NumPy itself refuses headers over 10 000 bytes by
/// default; this is more lenient, but bounds what an untrusted length field can make us read.
pub const MAX_HEADER_LEN: u64 = 1 << 20;

/// Bytes converted per chunk when reading or writing data.
const CHUNK: usize = 64 * 1024;

/// Headers are padded so that the data starts at a multiple of this (as NumPy does).
const ALIGN: usize = 64;

/// An array read from a `.npy` file: its shape (C order) and its elements.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    /// Little-endian `float32` (`'<f4'`).
    F32 {
        /// Dimensions, outermost first.
        shape: Vec<usize>,
        /// Elements in C (row-major) order; `data.len()` is the product of `shape`.
        data: Vec<f32>,
    },
    /// Little-endian `float64` (`'<f8'`).
    F64 {
        /// Dimensions, outermost first.
        shape: Vec<usize>,
        /// Elements in C (row-major) order; `data.len()` is the product of `shape`.
        data: Vec<f64>,
    },
}

impl Array {
    /// The array's dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        match self {
            Array::F32 { shape, .. } | Array::F64 { shape, .. } => shape,
        }
    }

    /// NumPy's name of the element type: `float32` or `float64`.
    pub fn dtype_name(&self) -> &'static str {
        match self {
            Array::F32 { .. } => "float32",
            Array::F64 { .. } => "float64",
        }
    }

    /// The `descr` written in the header: `<f4` or `<f8`.
    pub fn descr(&self) -> &'static str {
        match self {
            Array::F32 { .. } => f32::DESCR,
            Array::F64 { .. } => f64::DESCR,
        }
    }

    /// `(n, d)` for a 2-D array.
    ///
    /// # Errors
    /// [`NpyError::NotMatrix`] when the array is not 2-D.
    pub fn matrix_dims(&self) -> Result<(usize, usize), NpyError> {
        matrix_dims(self.shape())
    }

    /// The elements, borrowed.
    pub fn view(&self) -> MappedData<'_> {
        match self {
            Array::F32 { data, .. } => MappedData::F32(data),
            Array::F64 { data, .. } => MappedData::F64(data),
        }
    }

    /// Writes the array to `path` (see [`write_f32`]).
    ///
    /// # Errors
    /// As [`write_f32`].
    pub fn write(&self, path: &Path) -> Result<(), NpyError> {
        match self {
            Array::F32 { shape, data } => write_f32(path, shape, data),
            Array::F64 { shape, data } => write_f64(path, shape, data),
        }
    }

    /// Writes the array to `w` (see [`write_f32_to`]).
    ///
    /// # Errors
    /// As [`write_f32_to`].
    pub fn write_to<W: Write>(&self, w: W) -> Result<(), NpyError> {
        match self {
            Array::F32 { shape, data } => write_f32_to(w, shape, data),
            Array::F64 { shape, data } => write_f64_to(w, shape, data),
        }
    }
}

/// Why a `.npy` file could not be read or written. Every message is one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NpyError {
    /// An error about the file at `path` (the message is prefixed with the path).
    #[error("{}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: Box<NpyError>,
    },
    /// Opening, reading or writing failed.
    #[error("cannot {action}: {source}")]
    Io {
        /// What was being done (`open`, `read`, `create`, `write`).
        action: &'static str,
        /// The operating system's error.
        source: io::Error,
    },
    /// The file does not start with `\x93NUMPY`.
    #[error("not a .npy file: it does not start with the magic string \\x93NUMPY")]
    BadMagic,
    /// The file ends inside the fixed-size preamble.
    #[error("file is truncated: {len} bytes is too short for a .npy preamble")]
    TooShort {
        /// Bytes present.
        len: u64,
    },
    /// A format version this reader does not know.
    #[error("unsupported .npy format version {major}.{minor}; expected 1.0, 2.0 or 3.0")]
    Version {
        /// Major version byte.
        major: u8,
        /// Minor version byte.
        minor: u8,
    },
    /// The header length field points past the end of the file.
    #[error("header length {header_len} runs past the end of the file ({available} bytes follow the length field)")]
    HeaderPastEof {
        /// Header length announced.
        header_len: u64,
        /// Bytes actually present after the length field.
        available: u64,
    },
    /// The header length is larger than [`MAX_HEADER_LEN`].
    #[error("header length {0} exceeds the limit of {MAX_HEADER_LEN} bytes")]
    HeaderTooLong(u64),
    /// The header is not a well-formed dictionary with the three required keys.
    #[error("malformed header: {0}")]
    Header(String),
    /// An element type other than little-endian float32 or float64.
    #[error("dtype {dtype} is not supported; expected float32 ('<f4') or float64 ('<f8'){hint}")]
    DType {
        /// The `descr` as written in the header, e.g. `'<i4'`.
        dtype: String,
        /// Extra advice (may be empty).
        hint: &'static str,
    },
    /// The array is stored in Fortran (column-major) order.
    #[error("Fortran-order (column-major) arrays are not supported; save a C-order array (np.ascontiguousarray)")]
    FortranOrder,
    /// The shape's element count or byte size does not fit in memory addresses.
    #[error("shape {shape} is too large: its size in bytes overflows")]
    TooLarge {
        /// The shape, as Python writes it.
        shape: String,
    },
    /// Fewer data bytes than the header announces.
    #[error("file is truncated: header says {expected} bytes of data, {present} present")]
    Truncated {
        /// Bytes the shape and dtype call for.
        expected: u64,
        /// Bytes present.
        present: u64,
    },
    /// More bytes than the header announces.
    #[error(
        "file has {extra} unexpected bytes after the {expected} bytes of data the header announces"
    )]
    TrailingData {
        /// Bytes the shape and dtype call for.
        expected: u64,
        /// Bytes beyond them.
        extra: u64,
    },
    /// The array is not 2-D where `(n, d)` was needed.
    #[error("shape {shape} is not 2-D (n, d)")]
    NotMatrix {
        /// The shape, as Python writes it.
        shape: String,
    },
    /// Writing: the data's length differs from the shape's element count.
    #[error("shape {shape} has {expected} elements but {len} were given")]
    ShapeMismatch {
        /// The shape, as Python writes it.
        shape: String,
        /// Product of the shape.
        expected: usize,
        /// Elements given.
        len: usize,
    },
}

impl NpyError {
    fn at(self, path: &Path) -> NpyError {
        NpyError::File {
            path: path.to_path_buf(),
            source: Box::new(self),
        }
    }

    fn io(action: &'static str) -> impl FnOnce(io::Error) -> NpyError {
        move |source| NpyError::Io { action, source }
    }
}

/// The element types this module reads and writes.
trait Float: Copy + Default + bytemuck::Pod {
    const DESCR: &'static str;
    const SIZE: usize;
    fn from_le(bytes: &[u8]) -> Self;
    fn put_le(self, out: &mut Vec<u8>);
}

macro_rules! float {
    ($t:ty, $descr:literal, $size:literal) => {
        impl Float for $t {
            const DESCR: &'static str = $descr;
            const SIZE: usize = $size;
            #[inline]
            fn from_le(bytes: &[u8]) -> Self {
                let mut b = [0u8; $size];
                b.copy_from_slice(bytes);
                <$t>::from_le_bytes(b)
            }
            #[inline]
            fn put_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    };
}

float!(f32, "<f4", 4);
float!(f64, "<f8", 8);

/// The element type named by a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    F32,
    F64,
}

impl Kind {
    fn size(self) -> usize {
        match self {
            Kind::F32 => f32::SIZE,
            Kind::F64 => f64::SIZE,
        }
    }
}

/// Reads a `.npy` file.
///
/// # Errors
/// [`NpyError::File`] wrapping the reason: the file cannot be opened or read, or it is not a
/// C-order little-endian float32/float64 `.npy` file whose length matches its header.
pub fn read(path: &Path) -> Result<Array, NpyError> {
    let read = || -> Result<Array, NpyError> {
        let file = File::open(path).map_err(NpyError::io("open"))?;
        let meta = file.metadata().map_err(NpyError::io("read"))?;
        if meta.is_dir() {
            return Err(NpyError::Io {
                action: "read",
                source: io::Error::other("it is a directory"),
            });
        }
        // Only a regular file's size is meaningful; read anything else (a pipe) as a stream.
        let len = meta.is_file().then_some(meta.len());
        read_impl(&mut BufReader::with_capacity(CHUNK, file), len)
    };
    read().map_err(|e| e.at(path))
}

/// A `.npy` file mapped into memory: its elements are read where the page cache holds them,
/// without a copy ([`map`]).
#[derive(Debug)]
pub struct Mapped {
    map: memmap2::Mmap,
    shape: Vec<usize>,
    kind: Kind,
    offset: usize,
}

/// The elements of a [`Mapped`] file, borrowed from the mapping.
#[derive(Debug, Clone, Copy)]
pub enum MappedData<'a> {
    /// Little-endian `float32`.
    F32(&'a [f32]),
    /// Little-endian `float64`.
    F64(&'a [f64]),
}

impl Mapped {
    /// The array's dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// `"float32"` or `"float64"`.
    pub fn dtype_name(&self) -> &'static str {
        match self.kind {
            Kind::F32 => "float32",
            Kind::F64 => "float64",
        }
    }

    /// `(n, d)` for a 2-D array.
    ///
    /// # Errors
    /// [`NpyError::NotMatrix`] when the array is not 2-D.
    pub fn matrix_dims(&self) -> Result<(usize, usize), NpyError> {
        matrix_dims(&self.shape)
    }

    /// The elements in place, or `None` where they cannot be viewed as they lie: a
    /// big-endian host, or data not aligned to its element size (a header NumPy would not
    /// write); [`read`] converts those.
    pub fn data(&self) -> Option<MappedData<'_>> {
        if cfg!(target_endian = "big") {
            return None;
        }
        let bytes = &self.map[self.offset..];
        Some(match self.kind {
            Kind::F32 => MappedData::F32(bytemuck::try_cast_slice(bytes).ok()?),
            Kind::F64 => MappedData::F64(bytemuck::try_cast_slice(bytes).ok()?),
        })
    }
}

/// Maps a C-order little-endian float32/float64 `.npy` file (read-only, pages loaded up front)
/// after checking its header and length as [`read`] does. The file must not change while the
/// mapping lives.
///
/// # Errors
/// As [`read`]; also when the file is not a regular file (read a pipe with [`read`]).
pub fn map(path: &Path) -> Result<Mapped, NpyError> {
    let map = || -> Result<Mapped, NpyError> {
        let file = File::open(path).map_err(NpyError::io("open"))?;
        let meta = file.metadata().map_err(NpyError::io("read"))?;
        if !meta.is_file() {
            return Err(NpyError::Io {
                action: "map",
                source: io::Error::other("not a regular file"),
            });
        }
        // SAFETY: a read-only private mapping of a regular file; the caller keeps the file
        // unchanged while it lives (documented), so the bytes do not change under the slices.
        let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }
            .map_err(NpyError::io("map"))?;
        let layout = read_layout(&mut &map[..], Some(map.len() as u64))?;
        Ok(Mapped {
            shape: layout.shape,
            kind: layout.kind,
            // At most the file's length, which is mapped.
            offset: layout.preamble as usize,
            map,
        })
    };
    map().map_err(|e| e.at(path))
}

/// Reads a `.npy` array from a stream of unknown length. The data buffer grows with the bytes
/// that actually arrive, so a lying header cannot make it allocate more than the stream holds.
///
/// # Errors
/// As [`read`], without the path.
pub fn read_from<R: Read>(mut reader: R) -> Result<Array, NpyError> {
    read_impl(&mut reader, None)
}

/// Reads a `.npy` array held in memory.
///
/// # Errors
/// As [`read`], without the path.
pub fn from_bytes(mut bytes: &[u8]) -> Result<Array, NpyError> {
    let len = bytes.len() as u64;
    read_impl(&mut bytes, Some(len))
}

/// Writes a C-order little-endian float32 `.npy` file (format 1.0, or 2.0 if the header needs
/// it), replacing any existing file.
///
/// # Errors
/// [`NpyError::File`] wrapping [`NpyError::ShapeMismatch`] when `data.len()` is not the
/// product of `shape`, or an I/O error.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<(), NpyError> {
    write_path(path, shape, data)
}

/// Writes a C-order little-endian float64 `.npy` file; see [`write_f32`].
///
/// # Errors
/// As [`write_f32`].
pub fn write_f64(path: &Path, shape: &[usize], data: &[f64]) -> Result<(), NpyError> {
    write_path(path, shape, data)
}

/// Writes a float32 `.npy` array to `w`.
///
/// # Errors
/// [`NpyError::ShapeMismatch`] when `data.len()` is not the product of `shape`, or an I/O error.
pub fn write_f32_to<W: Write>(w: W, shape: &[usize], data: &[f32]) -> Result<(), NpyError> {
    write_impl(w, shape, data)
}

/// Writes a float64 `.npy` array to `w`.
///
/// # Errors
/// As [`write_f32_to`].
pub fn write_f64_to<W: Write>(w: W, shape: &[usize], data: &[f64]) -> Result<(), NpyError> {
    write_impl(w, shape, data)
}

fn write_path<T: Float>(path: &Path, shape: &[usize], data: &[T]) -> Result<(), NpyError> {
    let write = || -> Result<(), NpyError> {
        check_len(shape, data.len())?;
        let file = File::create(path).map_err(NpyError::io("create"))?;
        let mut w = BufWriter::with_capacity(CHUNK, file);
        write_impl(&mut w, shape, data)?;
        w.into_inner().map(drop).map_err(|e| NpyError::Io {
            action: "write",
            source: e.into_error(),
        })
    };
    write().map_err(|e| e.at(path))
}

fn check_len(shape: &[usize], len: usize) -> Result<(), NpyError> {
    let expected = shape
        .iter()
        .try_fold(1usize, |acc, &x| acc.checked_mul(x))
        .ok_or_else(|| NpyError::TooLarge {
            shape: format_shape(shape),
        })?;
    if expected != len {
        return Err(NpyError::ShapeMismatch {
            shape: format_shape(shape),
            expected,
            len,
        });
    }
    Ok(())
}

/// The header NumPy would write: the dict, padded with spaces and a final newline so that the
/// data starts at a multiple of [`ALIGN`]; version 1.0 when the length fits in 16 bits.
fn header_bytes(descr: &str, shape: &[usize]) -> Vec<u8> {
    let dict = format!(
        "{{'descr': '{descr}', 'fortran_order': False, 'shape': {}, }}",
        format_shape(shape)
    );
    let mut out = Vec::with_capacity(dict.len() + ALIGN + 12);
    for (version, len_bytes) in [(1u8, 2usize), (2, 4)] {
        let prefix = MAGIC.len() + 2 + len_bytes;
        let unpadded = prefix + dict.len() + 1;
        let total = unpadded.div_ceil(ALIGN) * ALIGN;
        let header_len = total - prefix;
        if version == 1 && header_len > usize::from(u16::MAX) {
            continue;
        }
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[version, 0]);
        if version == 1 {
            // Checked just above: header_len fits in 16 bits.
            out.extend_from_slice(&(header_len as u16).to_le_bytes());
        } else {
            out.extend_from_slice(&(header_len as u32).to_le_bytes());
        }
        out.extend_from_slice(dict.as_bytes());
        out.resize(total - 1, b' ');
        out.push(b'\n');
        break;
    }
    out
}

fn write_impl<T: Float, W: Write>(mut w: W, shape: &[usize], data: &[T]) -> Result<(), NpyError> {
    check_len(shape, data.len())?;
    write_all(&mut w, shape, data).map_err(NpyError::io("write"))
}

fn write_all<T: Float, W: Write>(w: &mut W, shape: &[usize], data: &[T]) -> io::Result<()> {
    w.write_all(&header_bytes(T::DESCR, shape))?;
    if cfg!(target_endian = "little") {
        // The elements' bytes are the file's: one write, no conversion.
        w.write_all(bytemuck::cast_slice(data))?;
        return w.flush();
    }
    let mut buf = Vec::with_capacity(CHUNK);
    for chunk in data.chunks(CHUNK / T::SIZE) {
        buf.clear();
        for &v in chunk {
            v.put_le(&mut buf);
        }
        w.write_all(&buf)?;
    }
    w.flush()
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full<R: Read + ?Sized>(r: &mut R, buf: &mut [u8]) -> Result<usize, NpyError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(NpyError::Io {
                    action: "read",
                    source,
                })
            }
        }
    }
    Ok(got)
}

/// The parsed header.
struct Header {
    kind: Kind,
    shape: Vec<usize>,
}

/// Reads a whole array. `total` is the stream's length when it is known (a file or a slice);
/// every size is then checked against it before anything is allocated.
/// What a `.npy` header says, checked against the file's length when it is known.
struct Layout {
    shape: Vec<usize>,
    kind: Kind,
    /// Elements in the data.
    count: usize,
    /// Bytes of data the header promises.
    expected: u64,
    /// Bytes before the data (magic, version, length field, header).
    preamble: u64,
    /// The stream's length was known and matches the header.
    known: bool,
}

fn read_impl<R: Read + ?Sized>(r: &mut R, total: Option<u64>) -> Result<Array, NpyError> {
    let Layout {
        shape,
        kind,
        count,
        expected,
        known,
        ..
    } = read_layout(r, total)?;
    Ok(match kind {
        Kind::F32 => Array::F32 {
            data: read_data(r, count, expected, known)?,
            shape,
        },
        Kind::F64 => Array::F64 {
            data: read_data(r, count, expected, known)?,
            shape,
        },
    })
}

/// Reads and checks the preamble and header, leaving `r` at the first data byte.
fn read_layout<R: Read + ?Sized>(r: &mut R, total: Option<u64>) -> Result<Layout, NpyError> {
    let mut pre = [0u8; 8];
    let got = read_full(r, &mut pre)?;
    let m = got.min(MAGIC.len());
    if pre[..m] != MAGIC[..m] {
        return Err(NpyError::BadMagic);
    }
    if got < pre.len() {
        return Err(NpyError::TooShort { len: got as u64 });
    }
    let (major, minor) = (pre[6], pre[7]);
    let len_bytes = match (major, minor) {
        (1, 0) => 2,
        (2, 0) | (3, 0) => 4,
        _ => return Err(NpyError::Version { major, minor }),
    };
    let mut len_field = [0u8; 4];
    let got = read_full(r, &mut len_field[..len_bytes])?;
    if got < len_bytes {
        return Err(NpyError::TooShort {
            len: (pre.len() + got) as u64,
        });
    }
    let header_len = u64::from(u32::from_le_bytes(len_field));
    let preamble = (pre.len() + len_bytes) as u64 + header_len;
    if let Some(total) = total {
        if preamble > total {
            return Err(NpyError::HeaderPastEof {
                header_len,
                available: total.saturating_sub((pre.len() + len_bytes) as u64),
            });
        }
    }
    if header_len > MAX_HEADER_LEN {
        return Err(NpyError::HeaderTooLong(header_len));
    }
    // Bounded by MAX_HEADER_LEN just above.
    let mut text = vec![0u8; header_len as usize];
    let got = read_full(r, &mut text)?;
    if got < text.len() {
        return Err(NpyError::HeaderPastEof {
            header_len,
            available: got as u64,
        });
    }
    let header = parse_header(&text)?;

    let shape_err = || NpyError::TooLarge {
        shape: format_shape(&header.shape),
    };
    let count = header
        .shape
        .iter()
        .try_fold(1usize, |acc, &x| acc.checked_mul(x))
        .ok_or_else(shape_err)?;
    let expected = count
        .checked_mul(header.kind.size())
        .and_then(|b| u64::try_from(b).ok())
        .ok_or_else(shape_err)?;
    let known = match total {
        Some(total) => {
            let present = total - preamble;
            if present < expected {
                return Err(NpyError::Truncated { expected, present });
            }
            if present > expected {
                return Err(NpyError::TrailingData {
                    expected,
                    extra: present - expected,
                });
            }
            true
        }
        None => false,
    };
    Ok(Layout {
        shape: header.shape,
        kind: header.kind,
        count,
        expected,
        preamble,
        known,
    })
}

/// Reads `count` elements (`expected` bytes). With `known` the stream's length has been
/// checked and the vector is allocated at once; otherwise it grows with the data that arrives.
fn read_data<T: Float, R: Read + ?Sized>(
    r: &mut R,
    count: usize,
    expected: u64,
    known: bool,
) -> Result<Vec<T>, NpyError> {
    let mut data = Vec::with_capacity(if known { count } else { count.min(CHUNK) });
    let mut buf = vec![0u8; CHUNK];
    while data.len() < count {
        let want = (count - data.len()).min(CHUNK / T::SIZE) * T::SIZE;
        let got = read_full(r, &mut buf[..want])?;
        data.extend(
            buf[..got - got % T::SIZE]
                .chunks_exact(T::SIZE)
                .map(T::from_le),
        );
        if got < want {
            return Err(NpyError::Truncated {
                expected,
                present: (data.len() * T::SIZE + got % T::SIZE) as u64,
            });
        }
    }
    if !known {
        let extra = read_full(r, &mut buf)?;
        if extra > 0 {
            let mut extra = extra as u64;
            loop {
                let k = read_full(r, &mut buf)?;
                if k == 0 {
                    break;
                }
                extra += k as u64;
            }
            return Err(NpyError::TrailingData { expected, extra });
        }
    }
    Ok(data)
}

fn matrix_dims(shape: &[usize]) -> Result<(usize, usize), NpyError> {
    match *shape {
        [n, d] => Ok((n, d)),
        _ => Err(NpyError::NotMatrix {
            shape: format_shape(shape),
        }),
    }
}

/// The shape as Python writes a tuple: `()`, `(3,)`, `(3, 4)`.
fn format_shape(shape: &[usize]) -> String {
    match shape {
        [] => "()".to_string(),
        [x] => format!("({x},)"),
        _ => {
            let mut s = String::from("(");
            for (i, x) in shape.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                let _ = write!(s, "{x}");
            }
            s.push(')');
            s
        }
    }
}

fn parse_header(bytes: &[u8]) -> Result<Header, NpyError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| NpyError::Header("it is not ASCII/UTF-8 text".to_string()))?;
    let shown = || {
        let t = text.trim_end();
        let t: String = t.chars().take(200).collect();
        if text.trim_end().chars().count() > 200 {
            format!("{t:?}...")
        } else {
            format!("{t:?}")
        }
    };
    let mut p = Parser {
        s: text.as_bytes(),
        pos: 0,
        depth: 0,
    };
    let dict = p
        .value()
        .and_then(|v| {
            p.skip_ws();
            if p.pos < p.s.len() {
                Err(format!(
                    "unexpected text after the dictionary at byte {}",
                    p.pos
                ))
            } else {
                Ok(v)
            }
        })
        .map_err(|e| NpyError::Header(format!("{e} in {}", shown())))?;
    let Value::Dict(entries) = dict else {
        return Err(NpyError::Header(format!(
            "expected a dictionary, found {}",
            shown()
        )));
    };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    for (key, value) in entries {
        let slot = match key.as_str() {
            "descr" => &mut descr,
            "fortran_order" => &mut fortran,
            "shape" => &mut shape,
            other => {
                return Err(NpyError::Header(format!(
                    "unexpected key '{other}' (expected 'descr', 'fortran_order', 'shape')"
                )))
            }
        };
        if slot.replace(value).is_some() {
            return Err(NpyError::Header(format!("key '{key}' appears twice")));
        }
    }
    let missing = |k: &str| NpyError::Header(format!("key '{k}' is missing in {}", shown()));
    let descr = descr.ok_or_else(|| missing("descr"))?;
    let fortran = fortran.ok_or_else(|| missing("fortran_order"))?;
    let shape = shape.ok_or_else(|| missing("shape"))?;

    let kind =
        match &descr {
            Value::Str(s) if s == f32::DESCR => Kind::F32,
            Value::Str(s) if s == f64::DESCR => Kind::F64,
            Value::Str(s) if s == ">f4" || s == ">f8" => return Err(NpyError::DType {
                dtype: descr.repr(),
                hint: " (this one is big-endian: convert with a.astype(a.dtype.newbyteorder('<')))",
            }),
            _ => {
                return Err(NpyError::DType {
                    dtype: descr.repr(),
                    hint: "",
                })
            }
        };
    match fortran {
        Value::Bool(false) => {}
        Value::Bool(true) => return Err(NpyError::FortranOrder),
        other => {
            return Err(NpyError::Header(format!(
                "'fortran_order' must be True or False, not {}",
                other.repr()
            )))
        }
    }
    let bad_shape = |v: &Value| {
        NpyError::Header(format!(
            "'shape' must be a tuple of non-negative integers, not {}",
            v.repr()
        ))
    };
    let Value::Tuple(dims) = &shape else {
        return Err(bad_shape(&shape));
    };
    let mut out = Vec::with_capacity(dims.len());
    for dim in dims {
        match dim {
            Value::Int(x) if *x >= 0 => out.push(usize::try_from(*x).map_err(|_| {
                NpyError::Header(format!(
                    "dimension {x} in 'shape' {} is too large",
                    shape.repr()
                ))
            })?),
            _ => return Err(bad_shape(&shape)),
        }
    }
    Ok(Header { kind, shape: out })
}

/// A Python literal, as far as `.npy` headers use them.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(String, Value)>),
}

impl Value {
    /// Python's `repr`, for error messages.
    fn repr(&self) -> String {
        fn seq(items: &[Value], open: char, close: char, one_comma: bool) -> String {
            let mut s = String::new();
            s.push(open);
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                s.push_str(&v.repr());
            }
            if one_comma && items.len() == 1 {
                s.push(',');
            }
            s.push(close);
            s
        }
        match self {
            Value::Str(s) => format!("'{}'", s.escape_debug()),
            Value::Int(x) => x.to_string(),
            Value::Bool(true) => "True".to_string(),
            Value::Bool(false) => "False".to_string(),
            Value::None => "None".to_string(),
            Value::Tuple(items) => seq(items, '(', ')', true),
            Value::List(items) => seq(items, '[', ']', false),
            Value::Dict(entries) => {
                let mut s = String::from("{");
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    let _ = write!(s, "'{}': {}", k.escape_debug(), v.repr());
                }
                s.push('}');
                s
            }
        }
    }
}

/// Nesting limit, so that `((((...` cannot exhaust the stack.
const MAX_DEPTH: usize = 32;

/// A recursive-descent parser for the Python literals found in `.npy` headers.
struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
    depth: usize,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while self
            .s
            .get(self.pos)
            .is_some_and(|c| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c'))
        {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.pos).copied()
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        match self.peek() {
            Some(x) if x == c => {
                self.pos += 1;
                Ok(())
            }
            Some(x) => Err(format!(
                "expected '{}' at byte {}, found '{}'",
                c as char,
                self.pos,
                x.escape_ascii()
            )),
            None => Err(format!("expected '{}' at the end", c as char)),
        }
    }

    fn value(&mut self) -> Result<Value, String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("nesting deeper than {MAX_DEPTH} levels"));
        }
        let v = self.value_inner();
        self.depth -= 1;
        v
    }

    fn value_inner(&mut self) -> Result<Value, String> {
        let Some(c) = self.peek() else {
            return Err("unexpected end of header".to_string());
        };
        match c {
            b'{' => {
                self.pos += 1;
                let mut entries = Vec::new();
                loop {
                    if self.peek() == Some(b'}') {
                        self.pos += 1;
                        return Ok(Value::Dict(entries));
                    }
                    let at = self.pos;
                    let Value::Str(key) = self.value()? else {
                        return Err(format!("dictionary key at byte {at} is not a string"));
                    };
                    self.expect(b':')?;
                    entries.push((key, self.value()?));
                    match self.peek() {
                        Some(b',') => self.pos += 1,
                        Some(b'}') => {}
                        _ => self.expect(b'}')?,
                    }
                }
            }
            b'(' | b'[' => {
                let close = if c == b'(' { b')' } else { b']' };
                self.pos += 1;
                let mut items = Vec::new();
                let mut comma = false;
                loop {
                    if self.peek() == Some(close) {
                        self.pos += 1;
                        break;
                    }
                    items.push(self.value()?);
                    match self.peek() {
                        Some(b',') => {
                            self.pos += 1;
                            comma = true;
                        }
                        Some(x) if x == close => {}
                        _ => self.expect(close)?,
                    }
                }
                Ok(match (close, comma, items.len()) {
                    // `(3)` is just 3 in Python; `(3,)` is a tuple.
                    (b')', false, 1) => items.pop().unwrap_or(Value::None),
                    (b')', _, _) => Value::Tuple(items),
                    _ => Value::List(items),
                })
            }
            b'\'' | b'"' => self.string(),
            b'u' | b'b' | b'U' | b'B' if matches!(self.s.get(self.pos + 1), Some(b'\'' | b'"')) => {
                self.pos += 1;
                self.string()
            }
            b'0'..=b'9' | b'-' | b'+' => self.int(),
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = self.pos;
                while self
                    .s
                    .get(self.pos)
                    .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
                {
                    self.pos += 1;
                }
                match &self.s[start..self.pos] {
                    b"True" => Ok(Value::Bool(true)),
                    b"False" => Ok(Value::Bool(false)),
                    b"None" => Ok(Value::None),
                    word => Err(format!(
                        "unexpected name '{}' at byte {start}",
                        word.escape_ascii()
                    )),
                }
            }
            other => Err(format!(
                "unexpected character '{}' at byte {}",
                other.escape_ascii(),
                self.pos
            )),
        }
    }

    fn string(&mut self) -> Result<Value, String> {
        let start = self.pos;
        let quote = self.s[self.pos];
        self.pos += 1;
        let mut out = Vec::new();
        loop {
            let Some(&c) = self.s.get(self.pos) else {
                return Err(format!("string starting at byte {start} is not closed"));
            };
            self.pos += 1;
            match c {
                b'\\' => {
                    let Some(&e) = self.s.get(self.pos) else {
                        return Err(format!("string starting at byte {start} is not closed"));
                    };
                    self.pos += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'\\' | b'\'' | b'"' => out.push(e),
                        other => out.extend_from_slice(&[b'\\', other]),
                    }
                }
                b'\n' => return Err(format!("string starting at byte {start} is not closed")),
                c if c == quote => break,
                c => out.push(c),
            }
        }
        String::from_utf8(out)
            .map(Value::Str)
            .map_err(|_| format!("string at byte {start} is not valid UTF-8"))
    }

    fn int(&mut self) -> Result<Value, String> {
        let start = self.pos;
        let negative = match self.s[self.pos] {
            b'-' => {
                self.pos += 1;
                true
            }
            b'+' => {
                self.pos += 1;
                false
            }
            _ => false,
        };
        let digits = self.pos;
        let mut x: i128 = 0;
        while let Some(&c) = self.s.get(self.pos).filter(|c| c.is_ascii_digit()) {
            x = x
                .checked_mul(10)
                .and_then(|x| x.checked_add(i128::from(c - b'0')))
                .ok_or_else(|| format!("integer at byte {start} is too large"))?;
            self.pos += 1;
        }
        if self.pos == digits {
            return Err(format!("expected a number at byte {start}"));
        }
        // Python 2 wrote long integers with an `L` suffix: `(3L, 4L)`.
        if matches!(self.s.get(self.pos), Some(b'L' | b'l')) {
            self.pos += 1;
        }
        if self
            .s
            .get(self.pos)
            .is_some_and(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_'))
        {
            return Err(format!("expected an integer at byte {start}"));
        }
        Ok(Value::Int(if negative { -x } else { x }))
    }
}

#[cfg(test)]
mod tests {
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
                MappedData::F64(_) => None,
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
                assert_eq!(a.unwrap(), expected, "v{major} {header:?}");
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
            "dtype '<i4' is not supported; expected float32 ('<f4') or float64 ('<f8')"
        );
        let e = err(&h("'>f4'", "False"));
        assert!(
            e.starts_with("dtype '>f4' is not supported") && e.contains("big-endian"),
            "{e}"
        );
        for descr in ["'<f2'", "'|u1'", "'=f4'", "'<c8'", "[('a', '<f4')]", "'O'"] {
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
                "'shape' must be a tuple of non-negative integers, not 2",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 1)}",
                "not (-2, 1)",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2.5,)}",
                "expected an integer",
            ),
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
            ("{'descr': '<f4', 'fortran_order': false, 'shape': ()}", "unexpected name 'false'"),
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
        assert!(err(&raw(2, &deep, &[])).contains("nesting deeper"));
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
                "{}: dtype '<i4' is not supported; expected float32 ('<f4') or float64 ('<f8')",
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
}
