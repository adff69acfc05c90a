/// Whether our socket dials the engine or waits for the engine to dial us.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SocketRole {
    /// The engine binds; we connect (and reconnect) to it.
    Connect,
    /// The engine connects; we bind and it reconnects to us.
    Bind,
}

/// A ZeroMQ address together with what our socket does with it.
///
/// Where a ZeroMQ subscriber dials or listens, derived from the engine's own config.
///
/// vLLM and SGLang decide per endpoint string whether their PUB socket binds or
/// connects (golden/vllm-events/README.md, golden/sglang-events/README.md): a
/// wildcard host (`*`, `0.0.0.0`, `::`) or an `ipc://` / `inproc://` address binds,
/// anything else connects. Our SUB must do the opposite. Data-parallel rank `r`
/// publishes on `port + r` (and replays on `replay_port + r`).
///
/// When our socket binds, it binds exactly what the address names
/// ([`ZmqEndpoint::bind_target`]): an IP literal as written, a host name on each
/// address the name resolves to (`localhost` → loopback), and every interface
/// only for a wildcard host (`*`, `0.0.0.0`, `::`) that the address spells out.
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
    /// A host name to bind resolved to no address, or to a wildcard address
    /// (which would listen on every interface although none was asked for).
    #[error("cannot bind {host:?}: {reason}")]
    BindName {
        /// The host name.
        host: String,
        /// What the resolution returned.
        reason: &'static str,
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
    /// real address). When the engine connects, we bind the host it dials: an IP
    /// literal as written, a host name on the addresses it resolves to when the
    /// subscriber starts (see [`ZmqEndpoint::bind_target`]) — never every
    /// interface. SGLang's explicit `"bind": true` on a non-wildcard endpoint is
    /// not visible in the string: build that case with [`ZmqEndpoint::connect`].
    ///
    /// ```
    /// use kvroute_engines::transport::{SocketRole, ZmqEndpoint};
    ///
    /// // The engine binds every interface: we dial its host, rank 1 on port + 1.
    /// let ep = ZmqEndpoint::for_engine("tcp://*:5557", "10.0.0.7", 1).unwrap();
    /// assert_eq!((ep.address.as_str(), ep.role), ("tcp://10.0.0.7:5558", SocketRole::Connect));
    ///
    /// // The engine dials the gateway: we listen.
    /// let ep = ZmqEndpoint::for_engine("tcp://10.0.0.1:5557", "10.0.0.7", 0).unwrap();
    /// assert_eq!((ep.address.as_str(), ep.role), ("tcp://10.0.0.1:5557", SocketRole::Bind));
    ///
    /// // ... on the name it dials, not on every interface.
    /// let ep = ZmqEndpoint::for_engine("tcp://localhost:5557", "10.0.0.7", 0).unwrap();
    /// assert_eq!((ep.address.as_str(), ep.role), ("tcp://localhost:5557", SocketRole::Bind));
    /// ```
    ///
    /// # Errors
    /// [`EndpointError`] for an endpoint that is not `tcp://host:port` or
    /// `ipc://...` (`inproc://` is only reachable inside the engine), an
    /// `ipc://` endpoint with a rank above 0, or a port overflow.
    pub fn for_engine(
        engine_endpoint: &str,
        engine_host: &str,
        dp_rank: u32,
    ) -> Result<Self, EndpointError> {
        let endpoint = offset_endpoint_port(engine_endpoint, dp_rank)?;
        if let Some(rest) = endpoint.strip_prefix("tcp://") {
            let (host, port) = split_host_port(rest)
                .ok_or_else(|| EndpointError::Malformed(engine_endpoint.to_owned()))?;
            return Ok(if is_wildcard_host(host) {
                Self::connect(format!("tcp://{}:{port}", bracket_v6(engine_host)))
            } else if engine_endpoint.contains("::") {
                // vLLM binds whenever the string contains "::" (an IPv6 literal).
                Self::connect(endpoint)
            } else {
                // An IP literal binds as written; a name is resolved by the
                // subscriber when it binds (bind_target), never widened to 0.0.0.0.
                Self::bind(endpoint)
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

/// What a binding subscriber listens on, decided from the address alone (no I/O);
/// see [`ZmqEndpoint::bind_target`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BindTarget {
    /// Bind this address as written (a TCP IP literal, `ipc://…`).
    Exact(String),
    /// The address spells out a wildcard host (`*`, `0.0.0.0`, `::`): every
    /// interface, as written by the operator. `*` becomes `0.0.0.0`.
    Wildcard(String),
    /// A host name: bind each address it resolves to
    /// ([`resolved_bind_addresses`]).
    Name {
        /// The name.
        host: String,
        /// The port.
        port: u16,
    },
}

impl ZmqEndpoint {
    /// Where a bound socket listens for this address.
    ///
    /// ```
    /// use kvroute_engines::transport::ZmqEndpoint;
    /// use kvroute_engines::transport::BindTarget;
    ///
    /// let name = ZmqEndpoint::bind("tcp://localhost:5557").bind_target().unwrap();
    /// assert_eq!(name, BindTarget::Name { host: "localhost".into(), port: 5557 });
    /// let any = ZmqEndpoint::bind("tcp://*:5557").bind_target().unwrap();
    /// assert_eq!(any, BindTarget::Wildcard("tcp://0.0.0.0:5557".into()));
    /// ```
    ///
    /// # Errors
    /// [`EndpointError::Malformed`] for a `tcp://` address without a port.
    pub fn bind_target(&self) -> Result<BindTarget, EndpointError> {
        let Some(rest) = self.address.strip_prefix("tcp://") else {
            return Ok(BindTarget::Exact(self.address.clone()));
        };
        let (host, port) =
            split_host_port(rest).ok_or_else(|| EndpointError::Malformed(self.address.clone()))?;
        if host == "*" || host.is_empty() {
            return Ok(BindTarget::Wildcard(format!("tcp://0.0.0.0:{port}")));
        }
        match host.trim_matches(['[', ']']).parse::<std::net::IpAddr>() {
            Ok(ip) if ip.is_unspecified() => Ok(BindTarget::Wildcard(self.address.clone())),
            Ok(_) => Ok(BindTarget::Exact(self.address.clone())),
            Err(_) => Ok(BindTarget::Name {
                host: host.to_owned(),
                port,
            }),
        }
    }
}

/// The `tcp://` addresses to bind for `host` given what it resolved to:
/// each distinct address once, in resolution order.
///
/// # Errors
/// [`EndpointError::BindName`] when the name resolved to nothing or to a
/// wildcard address: binding that would accept peers on every interface,
/// which the operator did not ask for.
///
/// ```
/// use kvroute_engines::transport::resolved_bind_addresses;
///
/// let v4 = std::net::Ipv4Addr::LOCALHOST.into();
/// let v6 = std::net::Ipv6Addr::LOCALHOST.into();
/// assert_eq!(
///     resolved_bind_addresses("localhost", 5557, [v4, v6, v4]).unwrap(),
///     ["tcp://127.0.0.1:5557", "tcp://[::1]:5557"]
/// );
/// ```
pub fn resolved_bind_addresses(
    host: &str,
    port: u16,
    resolved: impl IntoIterator<Item = std::net::IpAddr>,
) -> Result<Vec<String>, EndpointError> {
    let mut seen = Vec::new();
    for ip in resolved {
        if ip.is_unspecified() {
            return Err(EndpointError::BindName {
                host: host.to_owned(),
                reason: "it resolves to a wildcard address",
            });
        }
        if !seen.contains(&ip) {
            seen.push(ip);
        }
    }
    if seen.is_empty() {
        return Err(EndpointError::BindName {
            host: host.to_owned(),
            reason: "it resolves to no address",
        });
    }
    Ok(seen
        .into_iter()
        .map(|ip| match ip {
            std::net::IpAddr::V4(v4) => format!("tcp://{v4}:{port}"),
            std::net::IpAddr::V6(v6) => format!("tcp://[{v6}]:{port}"),
        })
        .collect())
}

/// The address our replay client dials for DP rank `dp_rank`, from the
/// engine's `replay_endpoint` as configured in the engine.
///
/// The engine's ROUTER always binds: a wildcard host (`*`, `0.0.0.0`, `::`,
/// `[::]`, empty) is replaced by `engine_host` (the endpoint's own host); any
/// other address is dialled as written. Rank `r` replays on `port + r`.
///
/// ```
/// use kvroute_engines::transport::replay_address;
///
/// assert_eq!(replay_address("tcp://*:5558", "10.0.0.7", 1).unwrap(), "tcp://10.0.0.7:5559");
/// assert_eq!(replay_address("tcp://0.0.0.0:5558", "::1", 0).unwrap(), "tcp://[::1]:5558");
/// assert_eq!(replay_address("tcp://10.0.0.9:5558", "10.0.0.7", 0).unwrap(), "tcp://10.0.0.9:5558");
/// assert!(replay_address("inproc://replay", "h", 0).is_err());
/// ```
///
/// # Errors
/// [`EndpointError`] for an endpoint that is not `tcp://host:port` or
/// `ipc://...`, an `ipc://` endpoint with a rank above 0, or a port overflow.
pub fn replay_address(
    engine_replay_endpoint: &str,
    engine_host: &str,
    dp_rank: u32,
) -> Result<String, EndpointError> {
    let endpoint = offset_endpoint_port(engine_replay_endpoint, dp_rank)?;
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let (host, port) = split_host_port(rest)
            .ok_or_else(|| EndpointError::Malformed(engine_replay_endpoint.to_owned()))?;
        return Ok(if is_wildcard_host(host) {
            format!("tcp://{}:{port}", bracket_v6(engine_host))
        } else {
            endpoint
        });
    }
    if endpoint.starts_with("ipc://") {
        return Ok(endpoint);
    }
    if endpoint.starts_with("inproc://") {
        return Err(EndpointError::InProcess(engine_replay_endpoint.to_owned()));
    }
    Err(EndpointError::Malformed(engine_replay_endpoint.to_owned()))
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
                "tcp://gateway.local:5557",
                SocketRole::Bind,
            ),
            (
                "tcp://localhost:5557",
                2,
                "tcp://localhost:5559",
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
            let ep = ZmqEndpoint::for_engine(engine_ep, "10.1.2.3", rank).unwrap();
            assert_eq!((ep.address.as_str(), ep.role), (want, role), "{engine_ep}");
        }
        assert!(matches!(
            ZmqEndpoint::for_engine("inproc://kv", "h", 0),
            Err(EndpointError::InProcess(_))
        ));
        assert!(matches!(
            ZmqEndpoint::for_engine("udp://h:1", "h", 0),
            Err(EndpointError::Malformed(_))
        ));
    }

    #[test]
    fn bind_target_never_widens_a_name() {
        let t = |a: &str| ZmqEndpoint::bind(a).bind_target().unwrap();
        assert_eq!(
            t("tcp://127.0.0.1:1"),
            BindTarget::Exact("tcp://127.0.0.1:1".into())
        );
        assert_eq!(
            t("tcp://[::1]:1"),
            BindTarget::Exact("tcp://[::1]:1".into())
        );
        assert_eq!(
            t("tcp://*:1"),
            BindTarget::Wildcard("tcp://0.0.0.0:1".into())
        );
        assert_eq!(
            t("tcp://0.0.0.0:1"),
            BindTarget::Wildcard("tcp://0.0.0.0:1".into())
        );
        assert_eq!(
            t("tcp://[::]:1"),
            BindTarget::Wildcard("tcp://[::]:1".into())
        );
        assert_eq!(
            t("tcp://gateway.local:7"),
            BindTarget::Name {
                host: "gateway.local".into(),
                port: 7
            }
        );
        assert_eq!(
            t("ipc:///run/kv.sock"),
            BindTarget::Exact("ipc:///run/kv.sock".into())
        );
        assert!(matches!(
            ZmqEndpoint::bind("tcp://host").bind_target(),
            Err(EndpointError::Malformed(_))
        ));
    }

    #[test]
    fn a_name_resolving_to_a_wildcard_or_nothing_is_refused() {
        use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
        assert!(matches!(
            resolved_bind_addresses("evil", 1, [IpAddr::V4(Ipv4Addr::UNSPECIFIED)]),
            Err(EndpointError::BindName { .. })
        ));
        assert!(matches!(
            resolved_bind_addresses(
                "evil",
                1,
                [Ipv4Addr::LOCALHOST.into(), Ipv6Addr::UNSPECIFIED.into()]
            ),
            Err(EndpointError::BindName { .. })
        ));
        assert!(matches!(
            resolved_bind_addresses("none", 1, []),
            Err(EndpointError::BindName { .. })
        ));
        assert_eq!(
            resolved_bind_addresses("h", 9, [IpAddr::from([10, 0, 0, 1])]).unwrap(),
            ["tcp://10.0.0.1:9"]
        );
    }
}
