//! P/D affinity tiers: session id → last prefill endpoint, and an approximate
//! prefix trie of recent prompt text → endpoint (the idea of SGLang's cache-aware
//! router). Both are bounded by configuration and take time as an argument.

use std::time::Duration;

use kvroute_core::EndpointId;

use crate::bounded::{chain, hash_bytes, BoundedMap};

/// Bounds of the affinity tiers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AffinityConfig {
    /// Sessions remembered at most.
    pub session_capacity: usize,
    /// A session's endpoint is forgotten this long after its last request.
    pub session_ttl: Duration,
    /// Trie nodes kept at most.
    pub trie_capacity: usize,
    /// Trie nodes expire this long after their last write.
    pub trie_ttl: Duration,
    /// Bytes of prompt text per trie node.
    pub trie_chunk_bytes: usize,
    /// Trie depth at most (longer prompts only index their first chunks).
    pub trie_max_depth: usize,
    /// Fraction of the prompt's chunks that must match for the trie to decide.
    pub trie_min_match: f64,
    /// P/D ladder order. `false` (default): an exact KV-exact hit on a
    /// prefill endpoint wins over the approximate trie match, which then only
    /// decides requests KV-exact misses. `true`: the seed's order (trie
    /// affinity before KV-exact).
    pub trie_before_kv: bool,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        Self {
            session_capacity: 65_536,
            session_ttl: Duration::from_secs(600),
            trie_capacity: 262_144,
            trie_ttl: Duration::from_secs(300),
            trie_chunk_bytes: 64,
            trie_max_depth: 256,
            trie_min_match: 0.5,
            trie_before_kv: false,
        }
    }
}

/// Session id → the prefill endpoint it used last.
pub(crate) struct SessionMap {
    map: BoundedMap<EndpointId>,
}

impl SessionMap {
    pub(crate) fn new(cfg: &AffinityConfig) -> Self {
        Self {
            map: BoundedMap::new(cfg.session_capacity, cfg.session_ttl),
        }
    }

    pub(crate) fn get(&self, session: &str, now: Duration) -> Option<EndpointId> {
        self.map.get(hash_bytes(session.as_bytes()), now)
    }

    pub(crate) fn remember(&mut self, session: &str, endpoint: EndpointId, now: Duration) {
        self.map
            .insert(hash_bytes(session.as_bytes()), endpoint, now);
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Forgets every session that last used `endpoint`.
    pub(crate) fn forget(&mut self, endpoint: EndpointId) {
        self.map.retain_values(|e| e != endpoint);
    }
}

/// A trie whose nodes are fixed-size chunks of prompt text, each node stored
/// under the hash of its whole path — so a bounded hash map is the trie and
/// eviction never has to relink nodes. It is approximate twice over: chunk
/// granularity, and a 64-bit path hash standing for the path.
pub(crate) struct PrefixTrie {
    nodes: BoundedMap<EndpointId>,
    chunk: usize,
    max_depth: usize,
    min_match: f64,
}

/// The deepest trie match for a prompt.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct TrieMatch {
    pub(crate) endpoint: EndpointId,
    pub(crate) matched_chunks: usize,
    pub(crate) total_chunks: usize,
}

impl PrefixTrie {
    pub(crate) fn new(cfg: &AffinityConfig) -> Self {
        Self {
            nodes: BoundedMap::new(cfg.trie_capacity, cfg.trie_ttl),
            chunk: cfg.trie_chunk_bytes.max(1),
            max_depth: cfg.trie_max_depth,
            min_match: cfg.trie_min_match,
        }
    }

    fn path_hashes<'t>(&'t self, text: &'t str) -> impl Iterator<Item = u64> + 't {
        let bytes = text.as_bytes();
        bytes
            .chunks_exact(self.chunk)
            .take(self.max_depth)
            .scan(0u64, |path, c| {
                *path = chain(*path, hash_bytes(c));
                Some(*path)
            })
    }

    /// Longest stored prefix of `text`, if it covers at least `min_match` of it.
    pub(crate) fn lookup(&self, text: &str, now: Duration) -> Option<TrieMatch> {
        let total_chunks = (text.len() / self.chunk).min(self.max_depth);
        if total_chunks == 0 {
            return None;
        }
        let mut best = None;
        for (depth, path) in self.path_hashes(text).enumerate() {
            match self.nodes.get(path, now) {
                Some(endpoint) => best = Some((endpoint, depth + 1)),
                None => break,
            }
        }
        let (endpoint, matched_chunks) = best?;
        #[allow(clippy::cast_precision_loss)]
        let fraction = matched_chunks as f64 / total_chunks as f64;
        (fraction >= self.min_match).then_some(TrieMatch {
            endpoint,
            matched_chunks,
            total_chunks,
        })
    }

    /// Forgets every node pointing at `endpoint`.
    pub(crate) fn forget(&mut self, endpoint: EndpointId) {
        self.nodes.retain_values(|e| e != endpoint);
    }

    /// Records that `text` was sent to `endpoint`.
    pub(crate) fn remember(&mut self, text: &str, endpoint: EndpointId, now: Duration) {
        // Deepest first, so ancestors are the most recently written and a chain
        // loses its leaves before its root under capacity pressure.
        let paths: Vec<u64> = self.path_hashes(text).collect();
        for path in paths.into_iter().rev() {
            self.nodes.insert(path, endpoint, now);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> AffinityConfig {
        AffinityConfig {
            trie_chunk_bytes: 4,
            trie_capacity: 16,
            ..AffinityConfig::default()
        }
    }

    #[test]
    fn trie_matches_shared_prefix_and_rejects_short_matches() {
        let mut t = PrefixTrie::new(&cfg());
        let now = Duration::ZERO;
        t.remember("aaaabbbbcccc", EndpointId(2), now);
        let m = t.lookup("aaaabbbbdddd", now).unwrap();
        assert_eq!(
            (m.endpoint, m.matched_chunks, m.total_chunks),
            (EndpointId(2), 2, 3)
        );
        assert!(t.lookup("aaaazzzzzzzzzzzz", now).is_none()); // 1 of 4 chunks
        assert!(t.lookup("xyz", now).is_none());
    }

    #[test]
    fn trie_node_count_is_bounded() {
        let mut t = PrefixTrie::new(&cfg());
        let text: String = (0..200)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        t.remember(&text, EndpointId(1), Duration::ZERO);
        assert!(t.len() <= 16);
        // The root survives: leaves were written first and evicted first.
        assert_eq!(
            t.lookup(&text[..8], Duration::ZERO).map(|m| m.endpoint),
            Some(EndpointId(1))
        );
    }

    #[test]
    fn session_expires_after_ttl() {
        let c = AffinityConfig {
            session_ttl: Duration::from_secs(10),
            ..cfg()
        };
        let mut s = SessionMap::new(&c);
        s.remember("s1", EndpointId(3), Duration::from_secs(1));
        assert_eq!(s.get("s1", Duration::from_secs(5)), Some(EndpointId(3)));
        assert_eq!(s.get("s1", Duration::from_secs(11)), None);
        assert_eq!(s.get("s2", Duration::from_secs(5)), None);
        assert_eq!(s.len(), 1);
    }
}
