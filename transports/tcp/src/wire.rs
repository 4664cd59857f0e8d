//! Wire format of the TCP transport (little-endian).
//!
//! Handshake, both directions: `b"BZH1"`, world size `u32`, rank `u32`.
//! Data frame: a 32-byte [`FrameHeader`] followed by `len` payload bytes.

pub use byzcoll_runtime::wire::{FrameHeader, FRAME_MAGIC, HEADER_LEN};

/// Magic of a handshake.
pub const HELLO_MAGIC: [u8; 4] = *b"BZH1";
/// Length of a handshake.
pub const HELLO_LEN: usize = 12;

/// A handshake: who is on the other end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// World size the peer was started with.
    pub world: u32,
    /// The peer's rank.
    pub rank: u32,
}

impl Hello {
    /// Encodes the handshake.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..4].copy_from_slice(&HELLO_MAGIC);
        b[4..8].copy_from_slice(&self.world.to_le_bytes());
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b
    }

    /// Decodes a handshake.
    ///
    /// # Errors
    /// When the magic is wrong.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, String> {
        if b[..4] != HELLO_MAGIC {
            return Err("not a byzcoll TCP handshake".into());
        }
        Ok(Hello {
            world: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            rank: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips() {
        let hello = Hello { world: 8, rank: 3 };
        assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
    }
}
