//! The kernel source and its compilation by NVRTC.
//!
//! One `.cu` file ([`SOURCE`]) holds every kernel. A [`Variant`] says which compile-time
//! parameters to prepend: the generic build (selection, means, distances) for an element type,
//! or a sorting-network build for a given `n`, mode and rank range, whose network is generated
//! here from the same comparator list the CPU rules use. Compiling needs only NVRTC, no GPU, so
//! CI checks that every variant compiles.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{self, CompileOptions, Ptx};

use crate::plan::{self, Mode};
use crate::GpuError;

/// The kernels' CUDA C++ source.
pub const SOURCE: &str = include_str!("../kernels/robust.cu");

/// Element type of inputs and outputs on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemKind {
    /// `float`.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

impl ElemKind {
    /// Every element type.
    pub const ALL: [ElemKind; 3] = [ElemKind::F32, ElemKind::Bf16, ElemKind::F16];

    /// The kernels' `ELEM` code.
    pub fn code(self) -> i32 {
        match self {
            ElemKind::F32 => 0,
            ElemKind::Bf16 => 1,
            ElemKind::F16 => 2,
        }
    }
}

/// Which build of the source a kernel comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Variant {
    /// `coordinate_select`, `mean_rows`, `distance_tiles`, `distance_reduce` (64-row tiles).
    Generic,
    /// The generic build with distance tiles of `tile` rows (16 or 32; 64 is [`Variant::Generic`]).
    Distance {
        /// Rows per tile side.
        tile: usize,
    },
    /// `coordinate_network` (and `bulyan_network`) for `n` inputs, reading sorted `ranks`.
    Network {
        /// Number of inputs.
        n: usize,
        /// Median or trimmed mean.
        mode: Mode,
        /// Sorted ranks the rule reads (all of `0..n` for Bulyan).
        ranks: std::ops::Range<usize>,
    },
}

/// The source of `variant` for `elem`: defines, then [`SOURCE`].
pub fn source(elem: ElemKind, variant: &Variant) -> String {
    let mut s = format!("#define ELEM {}\n", elem.code());
    if let Variant::Distance { tile } = variant {
        let _ = writeln!(s, "#define DTILE {tile}");
    }
    if let Variant::Network { n, mode, ranks } = variant {
        let _ = writeln!(s, "#define N {n}");
        let _ = writeln!(s, "#define MODE {}", mode.code());
        let _ = writeln!(s, "#define LO {}", ranks.start);
        let _ = writeln!(s, "#define HI {}", ranks.end);
        s.push_str("#define NETWORK");
        for (a, b) in plan::network(*n, ranks.clone()) {
            let _ = write!(s, " CS({a}, {b})");
        }
        s.push('\n');
    }
    s.push_str(SOURCE);
    s
}

/// Compiles `variant` for `elem` to PTX for `arch` (e.g. `compute_90` for PTX the driver
/// finishes, `sm_90` to have NVRTC run the assembler as well).
///
/// # Errors
/// [`GpuError::NoLibrary`] when NVRTC cannot be loaded; [`GpuError::Compile`] with NVRTC's log.
pub fn compile(elem: ElemKind, variant: &Variant, arch: &str) -> Result<Ptx, GpuError> {
    nvrtc_present()?;
    let opts = CompileOptions {
        // Sums are ordered and unfused as in the CPU reference; the distance kernel fuses
        // explicitly where it wants to.
        fmad: Some(false),
        options: vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()],
        name: Some(format!("robust_{elem:?}_{}.cu", variant_name(variant))),
        ..Default::default()
    };
    nvrtc::compile_ptx_with_opts(source(elem, variant), opts).map_err(|e| GpuError::Compile {
        variant: format!("{elem:?} {variant:?}"),
        message: match e {
            nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })
}

/// PTX compiled in this process, by element type, variant and architecture.
type Compiled = HashMap<(ElemKind, Variant, String), Arc<Ptx>>;

/// [`compile`], once per process: NVRTC runs the first time a variant is asked for, whatever the
/// number of [`crate::Gpu`]s (each still loads the PTX into its own context). Two threads asking
/// for a new variant at once may both compile it; the first result is kept.
///
/// # Errors
/// As [`compile`]; [`GpuError::Poisoned`] if a thread panicked holding the cache.
pub fn compiled(elem: ElemKind, variant: &Variant, arch: &str) -> Result<Arc<Ptx>, GpuError> {
    static CACHE: OnceLock<Mutex<Compiled>> = OnceLock::new();
    let cache = CACHE.get_or_init(Mutex::default);
    let key = (elem, variant.clone(), arch.to_string());
    if let Some(ptx) = cache.lock().map_err(|_| GpuError::Poisoned)?.get(&key) {
        return Ok(ptx.clone());
    }
    // Compiled without the lock: it takes seconds, and other variants may be wanted meanwhile.
    let ptx = Arc::new(compile(elem, variant, arch)?);
    Ok(cache
        .lock()
        .map_err(|_| GpuError::Poisoned)?
        .entry(key)
        .or_insert(ptx)
        .clone())
}

fn variant_name(variant: &Variant) -> String {
    match variant {
        Variant::Generic => "generic".into(),
        Variant::Distance { tile } => format!("distance_{tile}"),
        Variant::Network { n, mode, ranks } => {
            format!("{mode:?}_{n}_{}_{}", ranks.start, ranks.end).to_lowercase()
        }
    }
}

/// Errors unless NVRTC can be loaded (cudarc would panic on first use otherwise).
pub(crate) fn nvrtc_present() -> Result<(), GpuError> {
    // SAFETY: only tries to open the library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::NoLibrary {
            library: "NVRTC (libnvrtc.so)",
            hint: "install the CUDA toolkit or `pip install nvidia-cuda-nvrtc` and put its lib \
                   directory on LD_LIBRARY_PATH",
        })
    }
}

/// The build holding the distance kernels for `n` inputs.
pub fn distance_variant(n: usize) -> Variant {
    match plan::distance_tile(n) {
        64 => Variant::Generic,
        tile => Variant::Distance { tile },
    }
}

/// The variants compiled in CI: every element type's generic builds, and networks for a spread
/// of `n` (odd, even, powers of two and their neighbours, up to the largest) in each mode, with
/// Bulyan's full sort.
pub fn catalogue() -> Vec<(ElemKind, Variant)> {
    let mut out = Vec::new();
    for elem in ElemKind::ALL {
        out.push((elem, Variant::Generic));
        for tile in [16, 32] {
            out.push((elem, Variant::Distance { tile }));
        }
        for n in [
            1,
            2,
            3,
            4,
            5,
            8,
            16,
            17,
            31,
            32,
            33,
            63,
            plan::NETWORK_MAX_INPUTS,
        ] {
            let f = (n - 1) / 2;
            for mode in [Mode::Median, Mode::Trimmed] {
                out.push((
                    elem,
                    Variant::Network {
                        n,
                        mode,
                        ranks: plan::ranks(mode, n, f),
                    },
                ));
            }
            out.push((
                elem,
                Variant::Network {
                    n,
                    mode: Mode::Median,
                    ranks: 0..n,
                },
            ));
        }
    }
    out
}
