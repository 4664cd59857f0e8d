//! What the facade's integration tests share.

/// A port on 127.0.0.1 that was free a moment ago.
pub(crate) fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local address").port()
}
