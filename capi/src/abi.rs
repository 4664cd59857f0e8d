// A file of its own: build.rs includes it to name the shared library.

/// The major version of the C ABI: the N of `libbyzcoll.so.N`, the shared library's SONAME. It
/// changes when a function, type or constant of this header changes incompatibly; a program
/// built against one N runs with any later library of the same N.
pub const BYZCOLL_ABI_VERSION: u32 = 0;
