//! Where a ZeroMQ subscriber dials or listens, derived from the engine's own config.
//!
//! vLLM and SGLang decide per endpoint string whether their PUB socket binds or
//! connects (golden/vllm-events/README.md, golden/sglang-events/README.md): a
//! wildcard host (`*`, `0.0.0.0`, `::`) or an `ipc://` / `inproc://` address binds,
//! anything else connects. Our SUB must do the opposite. Data-parallel rank `r`
//! publishes on `port + r` (and replays on `replay_port + r`).

use super::EngineKind;

/// Whether our socket dials the engine or waits for the engine to dial us.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SocketRole {
    /// The engine binds; we connect (and reconnect) to it.
    Connect,
    /// The engine connects; we bind and it reconnects to us.
    Bind,
}

/// A ZeroMQ address together with what our socket does with it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ZmqEndpoint {
    /// `tcp://host:port` or `ipc://path`.
    pub address: String,
    /// Connect or bind.
    pub role: SocketRole,
}

/// An engine endpoint string that cannot be turned into a subscriber address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointError {
    /// Not `tcp://host:port`, `ipc://...` or `inproc://...`.
    #[error("unsupported ZeroMQ endpoint {0:?}: expected tcp://host:port or ipc://path")]
    Malformed(String),
    /// `inproc://` only works inside the engine's process.
    #[error("inproc endpoint {0:?} is only reachable inside the engine process")]
    InProcess(String),
    /// Engines offset only TCP ports by the data-parallel rank.
    #[error("data-parallel rank {rank} needs a tcp endpoint, got {endpoint:?}")]
    RankNeedsTcp {
        /// The endpoint.
        endpoint: String,
        /// The rank asked for.
        rank: u32,
    },
    /// `port + rank` is not a valid port.
    #[error("port {port} + data-parallel rank {rank} exceeds 65535")]
    PortOverflow {
        /// Base port.
        port: u16,
        /// Rank.
        rank: u32,
    },
}

impl ZmqEndpoint {
    /// Our socket connects to `address`.
    #[must_use]
    pub fn connect(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            role: SocketRole::Connect,
        }
    }

    /// Our socket binds `address`.
    #[must_use]
    pub fn bind(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            role: SocketRole::Bind,
        }
    }

    /// Derives the subscriber side from the endpoint string configured in the engine
    /// (`--kv-events-config '{"endpoint": ...}'`), for data-parallel rank `dp_rank`.
    ///
    /// `engine_host` replaces a wildcard host when the engine binds (we must dial a
    /// real address). When the engine connects, we bind the host it dials if it is an
    /// IP literal and every interface (`0.0.0.0`) otherwise. SGLang's explicit
    /// `"bind": true` on a non-wildcard endpoint is not visible in the string: build
    /// that case with [`ZmqEndpoint::connect`].
    ///
    /// ```
    /// use kvroute_engines::transport::{EngineKind, SocketRole, ZmqEndpoint};
    ///
    /// // The engine binds every interface: we dial its host, rank 1 on port + 1.
    /// let ep = ZmqEndpoint::for_engine(EngineKind::Vllm, "tcp://*:5557", "10.0.0.7", 1).unwrap();
    /// assert_eq!((ep.address.as_str(), ep.role), ("tcp://10.0.0.7:5558", SocketRole::Connect));
    ///
    /// // The engine dials the gateway: we listen.
    /// let ep = ZmqEndpoint::for_engine(EngineKind::Vllm, "tcp://10.0.0.1:5557", "10.0.0.7", 0).unwrap();
    /// assert_eq!((ep.address.as_str(), ep.role), ("tcp://10.0.0.1:5557", SocketRole::Bind));
    /// ```
    pub fn for_engine(
        engine: EngineKind,
        engine_endpoint: &str,
        engine_host: &str,
        dp_rank: u32,
    ) -> Result<Self, EndpointError> {
        let _ = engine; // vLLM and SGLang share the rule; kept for future divergence.
        let endpoint = offset_endpoint_port(engine_endpoint, dp_rank)?;
        if let Some(rest) = endpoint.strip_prefix("tcp://") {
            let (host, port) = split_host_port(rest)
                .ok_or_else(|| EndpointError::Malformed(engine_endpoint.to_owned()))?;
            return Ok(if is_wildcard_host(host) {
                Self::connect(format!("tcp://{}:{port}", bracket_v6(engine_host)))
            } else if engine_endpoint.contains("::") {
                // vLLM binds whenever the string contains "::" (an IPv6 literal).
                Self::connect(endpoint)
            } else if host
                .trim_matches(['[', ']'])
                .parse::<std::net::IpAddr>()
                .is_ok()
            {
                Self::bind(endpoint)
            } else {
                Self::bind(format!("tcp://0.0.0.0:{port}"))
            });
        }
        if endpoint.starts_with("ipc://") {
            return Ok(Self::connect(endpoint));
        }
        if endpoint.starts_with("inproc://") {
            return Err(EndpointError::InProcess(engine_endpoint.to_owned()));
        }
        Err(EndpointError::Malformed(engine_endpoint.to_owned()))
    }
}

/// The engines' `offset_endpoint_port`: `tcp://host:port` → `tcp://host:(port + rank)`.
///
/// Rank 0 returns the endpoint unchanged whatever its transport.
pub fn offset_endpoint_port(endpoint: &str, dp_rank: u32) -> Result<String, EndpointError> {
    if dp_rank == 0 {
        return Ok(endpoint.to_owned());
    }
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| EndpointError::RankNeedsTcp {
            endpoint: endpoint.to_owned(),
            rank: dp_rank,
        })?;
    let (host, port) =
        split_host_port(rest).ok_or_else(|| EndpointError::Malformed(endpoint.to_owned()))?;
    let shifted = u32::from(port)
        .checked_add(dp_rank)
        .and_then(|p| u16::try_from(p).ok())
        .ok_or(EndpointError::PortOverflow {
            port,
            rank: dp_rank,
        })?;
    Ok(format!("tcp://{host}:{shifted}"))
}

fn split_host_port(rest: &str) -> Option<(&str, u16)> {
    let (host, port) = rest.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

fn is_wildcard_host(host: &str) -> bool {
    matches!(host, "*" | "0.0.0.0" | "::" | "[::]" | "")
}

fn bracket_v6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_offsets_tcp_port_like_the_engines() {
        // golden/vllm-events/v0.33.0/zmq_capture.json: rank 1 resolves to P+1 / R+1.
        assert_eq!(
            offset_endpoint_port("tcp://127.0.0.1:5557", 1).unwrap(),
            "tcp://127.0.0.1:5558"
        );
        assert_eq!(
            offset_endpoint_port("tcp://*:5557", 3).unwrap(),
            "tcp://*:5560"
        );
        assert_eq!(
            offset_endpoint_port("ipc:///tmp/kv", 0).unwrap(),
            "ipc:///tmp/kv"
        );
        assert!(matches!(
            offset_endpoint_port("ipc:///tmp/kv", 1),
            Err(EndpointError::RankNeedsTcp { .. })
        ));
        assert!(matches!(
            offset_endpoint_port("tcp://h:65535", 1),
            Err(EndpointError::PortOverflow { .. })
        ));
    }

    #[test]
    fn subscriber_does_the_opposite_of_the_engine() {
        let cases = [
            (
                "tcp://*:5557",
                0,
                "tcp://10.1.2.3:5557",
                SocketRole::Connect,
            ),
            (
                "tcp://0.0.0.0:5557",
                2,
                "tcp://10.1.2.3:5559",
                SocketRole::Connect,
            ),
            (
                "tcp://127.0.0.1:5557",
                1,
                "tcp://127.0.0.1:5558",
                SocketRole::Bind,
            ),
            (
                "tcp://gateway.local:5557",
                0,
                "tcp://0.0.0.0:5557",
                SocketRole::Bind,
            ),
            (
                "tcp://[::1]:5557",
                0,
                "tcp://[::1]:5557",
                SocketRole::Connect,
            ),
            (
                "ipc:///run/kv.sock",
                0,
                "ipc:///run/kv.sock",
                SocketRole::Connect,
            ),
        ];
        for (engine_ep, rank, want, role) in cases {
            let ep =
                ZmqEndpoint::for_engine(EngineKind::Vllm, engine_ep, "10.1.2.3", rank).unwrap();
            assert_eq!((ep.address.as_str(), ep.role), (want, role), "{engine_ep}");
        }
        assert!(matches!(
            ZmqEndpoint::for_engine(EngineKind::Sglang, "inproc://kv", "h", 0),
            Err(EndpointError::InProcess(_))
        ));
        assert!(matches!(
            ZmqEndpoint::for_engine(EngineKind::Sglang, "udp://h:1", "h", 0),
            Err(EndpointError::Malformed(_))
        ));
    }
}
