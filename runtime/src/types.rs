//! Buffers shared by every layer above the protocol core.

use bytes::Bytes;

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Ordinary host memory.
    Host,
}

/// An owned message buffer. Owned so that dropping a future can never leave a transport
/// reading from or writing into memory that has been freed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Payload {
    /// Bytes in host memory.
    Host(Bytes),
}

impl Payload {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Payload::Host(b) => b.len(),
        }
    }

    /// `true` when the payload holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of a payload in host memory (`None` for any other memory).
    pub fn as_host(&self) -> Option<&Bytes> {
        match self {
            Payload::Host(b) => Some(b),
        }
    }

    /// The memory the payload lives in.
    pub fn memory_kind(&self) -> MemoryKind {
        match self {
            Payload::Host(_) => MemoryKind::Host,
        }
    }
}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Self {
        Payload::Host(b)
    }
}

/// A host slice's bytes as a payload (pooled from 64 KiB, on huge pages from 1 MiB:
/// [`crate::pool::payload_from`]).
pub(crate) fn to_bytes<T: bytemuck::Pod>(buf: &[T]) -> bytes::Bytes {
    crate::pool::payload_from(bytemuck::cast_slice(buf))
}

/// A payload of `len` elements that `fill` computes in place (in the same memory as
/// [`to_bytes`]): `fill` must write every element.
pub(crate) fn fill_bytes<T: bytemuck::Pod>(
    len: usize,
    fill: impl FnOnce(&mut [T]),
) -> bytes::Bytes {
    let bytes = len * std::mem::size_of::<T>();
    crate::pool::payload_with(bytes, |buf| {
        match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
            Ok(elements) => fill(elements),
            // Only where a buffer is not aligned for `T` (a plain allocation below the huge-page
            // size, or a refused mapping): computed aside, then copied.
            Err(_) => {
                let mut aside = vec![T::zeroed(); len];
                fill(&mut aside);
                buf.copy_from_slice(bytemuck::cast_slice(&aside));
            }
        }
    })
}

/// A host payload's bytes.
pub(crate) fn host_bytes(payload: &Payload) -> &[u8] {
    match payload {
        Payload::Host(b) => b,
    }
}

/// Views a received payload as elements, copying only if the buffer is misaligned.
pub(crate) fn cast_payload<T: bytemuck::Pod>(payload: &Payload) -> std::borrow::Cow<'_, [T]> {
    cast_bytes(host_bytes(payload))
}

/// Views bytes as elements, copying only if they are misaligned.
pub(crate) fn cast_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(v) => std::borrow::Cow::Borrowed(v),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}
