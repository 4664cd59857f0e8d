//! A small, dependency-free reader and writer for NumPy `.npy` files.
//!
//! Only what byzcoll needs: C-order (`'fortran_order': False`), little-endian `float32`
//! (`'<f4'`), `float64` (`'<f8'`), `float16` (`'<f2'`) and `uint16` (`'<u2'`, the raw words
//! bfloat16 is kept in, NumPy having no bfloat16) arrays of any shape, with format version 1.0,
//! 2.0 or 3.0 headers. Everything else is rejected with a one-line [`NpyError`] that says what
//! was found.
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
    /// Little-endian `float16` (`'<f2'`).
    F16 {
        /// Dimensions, outermost first.
        shape: Vec<usize>,
        /// Elements in C (row-major) order; `data.len()` is the product of `shape`.
        data: Vec<half::f16>,
    },
    /// Little-endian `uint16` (`'<u2'`): raw 16-bit words, such as bfloat16 bits (read them
    /// as bfloat16 with [`bf16_words`]).
    U16 {
        /// Dimensions, outermost first.
        shape: Vec<usize>,
        /// Elements in C (row-major) order; `data.len()` is the product of `shape`.
        data: Vec<u16>,
    },
}

/// Raw 16-bit words as the bfloat16 values whose bits they are (no copy).
pub fn bf16_words(words: &[u16]) -> &[half::bf16] {
    bytemuck::cast_slice(words)
}

impl Array {
    /// The array's dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        match self {
            Array::F32 { shape, .. }
            | Array::F64 { shape, .. }
            | Array::F16 { shape, .. }
            | Array::U16 { shape, .. } => shape,
        }
    }

    /// NumPy's name of the element type: `float32`, `float64`, `float16` or `uint16`.
    pub fn dtype_name(&self) -> &'static str {
        self.kind().name()
    }

    /// The `descr` written in the header: `<f4`, `<f8`, `<f2` or `<u2`.
    pub fn descr(&self) -> &'static str {
        self.kind().descr()
    }

    fn kind(&self) -> Kind {
        match self {
            Array::F32 { .. } => Kind::F32,
            Array::F64 { .. } => Kind::F64,
            Array::F16 { .. } => Kind::F16,
            Array::U16 { .. } => Kind::U16,
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
            Array::F16 { data, .. } => MappedData::F16(data),
            Array::U16 { data, .. } => MappedData::U16(data),
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
            Array::F16 { shape, data } => write_f16(path, shape, data),
            Array::U16 { shape, data } => write_u16(path, shape, data),
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
            Array::F16 { shape, data } => write_impl(w, shape, data),
            Array::U16 { shape, data } => write_impl(w, shape, data),
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
    /// An element type other than little-endian float32, float64, float16 or uint16.
    #[error(
        "dtype {dtype} is not supported; expected float32 ('<f4'), float64 ('<f8'), float16 \
         ('<f2') or uint16 ('<u2', bfloat16 bits){hint}"
    )]
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
float!(half::f16, "<f2", 2);
float!(u16, "<u2", 2);

/// The element type named by a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    F32,
    F64,
    F16,
    U16,
}

impl Kind {
    fn size(self) -> usize {
        match self {
            Kind::F32 => f32::SIZE,
            Kind::F64 => f64::SIZE,
            Kind::F16 => half::f16::SIZE,
            Kind::U16 => u16::SIZE,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::F32 => "float32",
            Kind::F64 => "float64",
            Kind::F16 => "float16",
            Kind::U16 => "uint16",
        }
    }

    fn descr(self) -> &'static str {
        match self {
            Kind::F32 => f32::DESCR,
            Kind::F64 => f64::DESCR,
            Kind::F16 => half::f16::DESCR,
            Kind::U16 => u16::DESCR,
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
    /// Little-endian `float16`.
    F16(&'a [half::f16]),
    /// Little-endian `uint16` (raw words; bfloat16 bits through [`bf16_words`]).
    U16(&'a [u16]),
}

impl Mapped {
    /// The array's dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// `"float32"`, `"float64"`, `"float16"` or `"uint16"`.
    pub fn dtype_name(&self) -> &'static str {
        self.kind.name()
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
            Kind::F16 => MappedData::F16(bytemuck::try_cast_slice(bytes).ok()?),
            Kind::U16 => MappedData::U16(bytemuck::try_cast_slice(bytes).ok()?),
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

/// Writes a C-order little-endian float16 `.npy` file; see [`write_f32`].
///
/// # Errors
/// As [`write_f32`].
pub fn write_f16(path: &Path, shape: &[usize], data: &[half::f16]) -> Result<(), NpyError> {
    write_path(path, shape, data)
}

/// Writes a C-order little-endian uint16 `.npy` file (raw words, e.g. bfloat16 bits); see
/// [`write_f32`].
///
/// # Errors
/// As [`write_f32`].
pub fn write_u16(path: &Path, shape: &[usize], data: &[u16]) -> Result<(), NpyError> {
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

/// Reads a whole array. `total` is the stream's length when it is known (a file or a slice);
/// every size is then checked against it before anything is allocated.
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
        Kind::F16 => Array::F16 {
            data: read_data(r, count, expected, known)?,
            shape,
        },
        Kind::U16 => Array::U16 {
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
    let header = parse_header(&text, major < 3)?;

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

/// Parses the header dictionary as NumPy writes it, `{'descr': '<f4', 'fortran_order': False,
/// 'shape': (2, 3), }`, with what NumPy's own reader accepts of its variations: the keys in any
/// order, any spacing, a trailing comma or none, strings in single or double quotes (with
/// Python 2's `u` prefix) and, in format 1.0 and 2.0 headers (`long_ints`), Python 2's `L`
/// suffix on integers. Nothing else of Python's literal syntax is accepted.
fn parse_header(bytes: &[u8], long_ints: bool) -> Result<Header, NpyError> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| NpyError::Header("it is not ASCII/UTF-8 text".to_string()))?;
    let [descr, fortran, shape] =
        dict_entries(text).map_err(|e| NpyError::Header(format!("{e} in {}", shown(text))))?;
    let kind = match as_str(descr) {
        Some(s) if s == f32::DESCR => Kind::F32,
        Some(s) if s == f64::DESCR => Kind::F64,
        Some(s) if s == half::f16::DESCR => Kind::F16,
        Some(s) if s == u16::DESCR => Kind::U16,
        Some(s) => return Err(NpyError::DType {
            dtype: format!("'{s}'"),
            hint: match s {
                ">f4" | ">f8" | ">f2" | ">u2" => {
                    " (this one is big-endian: convert with a.astype(a.dtype.newbyteorder('<')))"
                }
                _ => "",
            },
        }),
        None => {
            return Err(NpyError::DType {
                dtype: shown_value(descr),
                hint: "",
            })
        }
    };
    match fortran {
        "False" => {}
        "True" => return Err(NpyError::FortranOrder),
        other => {
            return Err(NpyError::Header(format!(
                "'fortran_order' must be True or False, not {}",
                shown_value(other)
            )))
        }
    }
    Ok(Header {
        kind,
        shape: parse_shape(shape, long_ints)?,
    })
}

/// The text of the values of 'descr', 'fortran_order' and 'shape' (in that order), each given
/// exactly once in a dictionary with no other key.
fn dict_entries(text: &str) -> Result<[&str; 3], String> {
    const KEYS: [&str; 3] = ["descr", "fortran_order", "shape"];
    let mut p = Scanner { s: text, pos: 0 };
    match p.peek() {
        Some(b'{') => p.pos += 1,
        Some(_) => return Err("expected a dictionary".to_string()),
        None => return Err("unexpected end of header".to_string()),
    }
    let mut values = [None; 3];
    loop {
        match p.peek() {
            Some(b'}') => break,
            None => return Err("expected '}' at the end".to_string()),
            Some(_) => {}
        }
        let key = p.string()?;
        let Some(slot) = KEYS.iter().position(|k| *k == key) else {
            return Err(format!(
                "unexpected key '{key}' (expected 'descr', 'fortran_order', 'shape')"
            ));
        };
        if p.peek() != Some(b':') {
            return Err(format!("expected ':' at byte {}", p.pos));
        }
        p.pos += 1;
        if values[slot].replace(p.value()?).is_some() {
            return Err(format!("key '{key}' appears twice"));
        }
        match p.peek() {
            Some(b',') => p.pos += 1,
            Some(b'}') => {}
            Some(c) => {
                return Err(format!(
                    "expected ',' or '}}' at byte {}, found '{}'",
                    p.pos,
                    c.escape_ascii()
                ))
            }
            None => return Err("expected '}' at the end".to_string()),
        }
    }
    p.pos += 1;
    p.skip_ws();
    if p.pos < text.len() {
        return Err(format!(
            "unexpected text after the dictionary at byte {}",
            p.pos
        ));
    }
    let mut out = [""; 3];
    for ((slot, value), key) in out.iter_mut().zip(values).zip(KEYS) {
        *slot = value.ok_or_else(|| format!("key '{key}' is missing"))?;
    }
    Ok(out)
}

/// A shape as NumPy writes it: `()`, `(3,)`, `(2, 3)`. `(3)` is not a tuple in Python.
fn parse_shape(text: &str, long_ints: bool) -> Result<Vec<usize>, NpyError> {
    let bad = || {
        NpyError::Header(format!(
            "'shape' must be a tuple of non-negative integers, not {}",
            shown_value(text)
        ))
    };
    let inner = text
        .strip_prefix('(')
        .and_then(|t| t.strip_suffix(')'))
        .ok_or_else(bad)?;
    if inner.trim_matches(is_ws).is_empty() {
        return Ok(Vec::new());
    }
    let mut dims: Vec<&str> = inner.split(',').map(|d| d.trim_matches(is_ws)).collect();
    let trailing_comma = dims.last() == Some(&"");
    if trailing_comma {
        dims.pop();
    }
    if dims.len() == 1 && !trailing_comma {
        return Err(bad());
    }
    dims.into_iter()
        .map(|dim| {
            let digits = match dim.strip_suffix('L') {
                Some(digits) if long_ints => digits,
                _ => dim,
            };
            // Python refuses leading zeros (`010`), and NumPy never writes them.
            let decimal = digits.bytes().all(|c| c.is_ascii_digit())
                && (digits == "0" || !digits.starts_with('0'));
            if digits.is_empty() || !decimal {
                return Err(bad());
            }
            digits.parse().map_err(|_| {
                NpyError::Header(format!(
                    "dimension {digits} in 'shape' {} is too large",
                    shown_value(text)
                ))
            })
        })
        .collect()
}

/// The contents of a string value (`'<f4'`, `"<f4"`, `u'<f4'`), or `None` for anything else.
fn as_str(value: &str) -> Option<&str> {
    let value = value.strip_prefix(['u', 'U']).unwrap_or(value);
    let quote = value.chars().next().filter(|&q| q == '\'' || q == '"')?;
    let inner = value[1..].strip_suffix(quote)?;
    (!inner.contains(quote)).then_some(inner)
}

/// Whitespace between Python tokens.
fn is_ws(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0c')
}

/// The header as a quoted one-line string for error messages, cut at 200 characters.
fn shown(text: &str) -> String {
    let t = text.trim_end();
    let cut: String = t.chars().take(200).collect();
    if cut.len() < t.len() {
        format!("{cut:?}...")
    } else {
        format!("{cut:?}")
    }
}

/// A value's text for error messages: on one line, cut at 80 characters.
fn shown_value(value: &str) -> String {
    let one_line = value
        .split(is_ws)
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    match one_line.char_indices().nth(80) {
        Some((cut, _)) => format!("{}...", &one_line[..cut]),
        None => one_line,
    }
}

/// A cursor over the header's text. Its errors are messages that [`parse_header`] completes.
struct Scanner<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Scanner<'a> {
    fn skip_ws(&mut self) {
        let rest = &self.s[self.pos..];
        self.pos += rest.len() - rest.trim_start_matches(is_ws).len();
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.as_bytes().get(self.pos).copied()
    }

    /// A string (optionally `u`-prefixed), without its quotes. Escapes are refused: NumPy
    /// writes none, and a quote or bracket hidden behind one would mislead [`Scanner::value`].
    fn string(&mut self) -> Result<&'a str, String> {
        let start = self.pos;
        let bytes = self.s.as_bytes();
        if matches!(bytes.get(self.pos), Some(b'u' | b'U')) {
            self.pos += 1;
        }
        let Some(&quote @ (b'\'' | b'"')) = bytes.get(self.pos) else {
            return Err(format!("expected a string at byte {start}"));
        };
        let body = self.pos + 1;
        let not_closed = || format!("string starting at byte {start} is not closed");
        let len = self.s[body..]
            .find([char::from(quote), '\\', '\n'])
            .ok_or_else(not_closed)?;
        match bytes[body + len] {
            b'\\' => Err(format!(
                "escape sequence at byte {} (a .npy header has none)",
                body + len
            )),
            b'\n' => Err(not_closed()),
            _ => {
                self.pos = body + len + 1;
                Ok(&self.s[body..body + len])
            }
        }
    }

    /// The text of one value, up to the `,` or `}` that ends it (or a misplaced `:`) outside
    /// brackets and strings, without surrounding whitespace. Brackets are counted, not
    /// recursed into.
    fn value(&mut self) -> Result<&'a str, String> {
        self.skip_ws();
        let start = self.pos;
        let mut depth = 0usize;
        while let Some(&c) = self.s.as_bytes().get(self.pos) {
            match c {
                b',' | b'}' | b':' if depth == 0 => break,
                b'(' | b'[' | b'{' => depth += 1,
                b')' | b']' | b'}' => {
                    depth = depth
                        .checked_sub(1)
                        .ok_or_else(|| format!("unmatched '{}' at byte {}", c as char, self.pos))?;
                }
                b'\'' | b'"' => {
                    self.string()?;
                    continue;
                }
                _ => {}
            }
            self.pos += 1;
        }
        let value = self.s[start..self.pos].trim_end_matches(is_ws);
        if value.is_empty() {
            return Err(format!("expected a value at byte {start}"));
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests;
