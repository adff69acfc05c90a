//! SGLang with EAGLE speculative decoding keys its radix tree by bigrams and
//! publishes each stored token as a (token, next token) pair. The events come
//! from SGLang 0.5.23's own `RadixCache` in EAGLE mode and its
//! `KVEventBatch` encoding (`tests/python/sglang_bigram_events.py`): the
//! decoder keeps each page's own tokens, the plain SHA-256 page chain does
//! not give the engine's keys (they hash the pairs), and a re-keying
//! contract, which recomputes keys from the tokens, matches the prompt.

mod interop_support;

use std::process::Command;

use interop_support::{python, script};
use kvroute_core::{sglang, BlockKey, Digest, EndpointId, Medium};
use kvroute_engines::events::{sglang as sgl_events, DecodeStats};
use kvroute_ingest::{
    BlockRekeyer, EndpointIngest, IndexConfig, IngestConfig, Keying, KvEvent, SharedIndex,
    XxhChainRekeyer,
};

#[test]
fn eagle_bigram_events_decode_and_match_under_rekey() {
    let tokens: Vec<u32> = (1..=10).collect();
    let out = Command::new(python())
        .arg(script("sglang_bigram_events.py"))
        .args(["--page", "4"])
        .args(tokens.iter().map(u32::to_string))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut stats = DecodeStats::default();
    let batch = sgl_events::decode(&out.stdout, 1, &mut stats).unwrap();
    assert_eq!((stats.malformed_events, stats.bigram_token_events), (0, 1));
    let [KvEvent::Stored(s)] = batch.events.as_slice() else {
        panic!("{:?}", batch.events);
    };
    // Ten tokens are nine bigrams: two full pages, each token's own first.
    assert_eq!(s.token_ids, (1..=8).collect::<Vec<u32>>());
    assert_eq!(s.keys.len(), 2);
    // Not the plain chain of those pages: the engine hashed the pairs.
    let plain = sglang::page_digest(&Digest::EMPTY, &tokens[..4]);
    assert_ne!(s.keys[0], plain.first8_be());

    let rekeyer = XxhChainRekeyer { seed: 1337 };
    let mut prompt_keys: Vec<BlockKey> = Vec::new();
    rekeyer.rekey(None, &tokens[..8], 4, &mut prompt_keys);
    let index = SharedIndex::new(1, IndexConfig::default());
    let mut ingest = EndpointIngest::new(
        EndpointId(0),
        IngestConfig::default(),
        Keying::Rekey(std::sync::Arc::new(rekeyer)),
    );
    let _ = ingest.apply_batch(&batch, &index);
    for k in &prompt_keys {
        assert!(index.contains(EndpointId(0), *k, Medium::Gpu), "{k:?}");
    }
}
