//! The end-to-end headers of a proxied HTTP message (RFC 9110 §7.6.1): what
//! a host forwards between the client and the engine, in both directions.

use http::header::{
    HeaderMap, HeaderName, HeaderValue, ACCEPT_ENCODING, CONNECTION, CONTENT_LENGTH, HOST,
};

/// Headers that describe one hop and are never forwarded.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Copies `from`'s end-to-end headers to `to`: not the hop-by-hop ones (the
/// fixed list and every header `from`'s `Connection` header names), not
/// `Host` (the next hop's own), and not `Content-Length` when `skip_length`
/// (a body the host sends with a length of its own).
///
/// ```
/// use http::HeaderMap;
/// let mut from = HeaderMap::new();
/// from.insert("connection", "close, x-hop".parse().unwrap());
/// from.insert("x-hop", "1".parse().unwrap());
/// from.insert("keep-alive", "timeout=5".parse().unwrap());
/// from.insert("content-length", "2".parse().unwrap());
/// from.insert("x-end", "1".parse().unwrap());
/// let mut to = HeaderMap::new();
/// kvroute::headers::copy_end_to_end(&from, &mut to, true);
/// assert_eq!(to.len(), 1);
/// assert_eq!(to["x-end"], "1");
/// ```
pub fn copy_end_to_end(from: &HeaderMap, to: &mut HeaderMap, skip_length: bool) {
    let listed: Vec<&str> = from
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let hop = |name: &HeaderName| {
        HOP_BY_HOP.contains(&name.as_str())
            || listed.iter().any(|l| l.eq_ignore_ascii_case(name.as_str()))
    };
    for (name, value) in from {
        if hop(name) || name == HOST || (skip_length && name == CONTENT_LENGTH) {
            continue;
        }
        to.append(name.clone(), value.clone());
    }
}

/// Copies a client request's end-to-end headers to the request forwarded to
/// an engine ([`copy_end_to_end`], without `Content-Length`: the host sends
/// the body with a length of its own), asking for an uncompressed answer
/// (`Accept-Encoding: identity`): the receipt scanner reads the answer's
/// usage, which a compressed answer hides. Uncompressed is an answer every
/// client accepts.
///
/// ```
/// use http::HeaderMap;
/// let mut from = HeaderMap::new();
/// from.insert("accept-encoding", "gzip, br".parse().unwrap());
/// from.insert("authorization", "Bearer k".parse().unwrap());
/// let mut to = HeaderMap::new();
/// kvroute::headers::copy_to_engine(&from, &mut to);
/// assert_eq!(to["accept-encoding"], "identity");
/// assert_eq!(to["authorization"], "Bearer k");
/// ```
pub fn copy_to_engine(from: &HeaderMap, to: &mut HeaderMap) {
    copy_end_to_end(from, to, true);
    to.insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
}
