//! Incremental hashing == one-shot hashing, and chain continuation (attestation)
//! == the matching suffix of the one-shot chain, for every contract kind.

use kvroute_core::{BlockHasher, Digest, HashContract, LoraAdapter, MmFeature, RequestExtras};
use proptest::prelude::*;

fn contracts() -> Vec<(BlockHasher, RequestExtras)> {
    let vllm_extras = RequestExtras {
        lora: Some(LoraAdapter {
            name: "sql".into(),
            path: "/a/sql".into(),
        }),
        mm_features: vec![
            MmFeature {
                identifier: "img0".into(),
                offset: 3,
                length: 9,
            },
            MmFeature {
                identifier: "img1".into(),
                offset: 30,
                length: 2,
            },
        ],
        cache_salt: Some("tenant".into()),
        ..RequestExtras::default()
    };
    let specs: Vec<(&str, RequestExtras)> = vec![
        (
            "vllm@0.33.0:sha256_cbor:block=4:seed=0",
            vllm_extras.clone(),
        ),
        ("vllm@0.33.0:sha256:block=3", vllm_extras.clone()),
        (
            "vllm@0.33.0:xxhash:block=5:seed=42:lookahead=2",
            vllm_extras,
        ),
        (
            "vllm@0.33.0:xxhash_cbor:block=1:seed=0",
            RequestExtras::NONE,
        ),
        (
            "sglang@0.5.23:sha256_page_chain:block=4:format=dynamo",
            RequestExtras {
                cache_salt: Some("t".into()),
                ..RequestExtras::default()
            },
        ),
        (
            "sglang@0.5.23:sha256_page_chain:block=2",
            RequestExtras {
                sglang_extra_key: Some("k".into()),
                ..RequestExtras::default()
            },
        ),
        ("sglang@0.5.5:legacy_pyhash:block=4", RequestExtras::NONE),
        (
            "trtllm:v1_block_key:block=4",
            RequestExtras {
                trtllm_cache_salt_id: Some(9),
                trtllm_lora_task_id: Some(3),
                trtllm_token_extra_ids: Some((0..200).collect()),
                ..RequestExtras::default()
            },
        ),
        ("rekey:xxh3_64_chain:block=4:seed=1337", RequestExtras::NONE),
    ];
    specs
        .into_iter()
        .map(|(s, e)| (s.parse::<HashContract>().unwrap().hasher().unwrap(), e))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn incremental_equals_one_shot(
        tokens in prop::collection::vec(0u32..(1 << 31), 0..120),
        cuts in prop::collection::vec(0usize..120, 0..6),
    ) {
        for (hasher, extras) in contracts() {
            let mut one_shot = Vec::new();
            hasher.hash_prompt(&tokens, &extras, &mut one_shot).unwrap();
            prop_assert_eq!(one_shot.len(), hasher.hashable_blocks(tokens.len()));

            let mut cuts: Vec<usize> = cuts.iter().map(|&c| c.min(tokens.len())).collect();
            cuts.sort_unstable();
            cuts.push(tokens.len());
            let mut prompt = hasher.prompt(&extras).unwrap();
            let mut keys = Vec::new();
            let mut digests = Vec::new();
            for &cut in &cuts {
                let before = keys.len();
                let added = prompt.extend_with_digests(&tokens[..cut], &mut keys, &mut digests).unwrap();
                prop_assert_eq!(added, keys.len() - before);
                prop_assert_eq!(prompt.blocks_done(), keys.len());
            }
            prop_assert_eq!(&keys, &one_shot, "{}", hasher.contract());
            prop_assert_eq!(digests.len(), keys.len());

            // Continue the chain from any block boundary, as attestation does.
            let b = hasher.block_size();
            for k in 0..=keys.len() {
                let parent = if k == 0 { hasher.root(&extras).unwrap() } else { digests[k - 1] };
                if k > 0 {
                    if let Some(from_key) = hasher.parent_from_key(keys[k - 1]) {
                        prop_assert_eq!(from_key, parent);
                    }
                }
                let mut suffix = Vec::new();
                let mut suffix_digests = Vec::new();
                let last = hasher
                    .hash_chain(&extras, &parent, k, &tokens[k * b..], &mut suffix, Some(&mut suffix_digests))
                    .unwrap();
                prop_assert_eq!(&suffix[..], &one_shot[k..], "{} from block {}", hasher.contract(), k);
                prop_assert_eq!(last, suffix_digests.last().copied().unwrap_or(parent));
            }
        }
    }
}

#[test]
fn chaining_needs_full_digests_for_vllm_and_sglang() {
    let key = kvroute_core::BlockKey(5);
    for (hasher, _) in contracts() {
        let expect = matches!(
            hasher.contract(),
            HashContract::Trtllm(_) | HashContract::Rekey(_)
        ) || hasher.contract().to_string().contains("legacy");
        assert_eq!(
            hasher.parent_from_key(key).is_some(),
            expect,
            "{}",
            hasher.contract()
        );
    }
    let h = "vllm@0.33.0:sha256_cbor:block=4:seed=0"
        .parse::<HashContract>()
        .unwrap()
        .hasher()
        .unwrap();
    let err = h
        .hash_chain(
            &RequestExtras::NONE,
            &Digest::from_u64(5),
            1,
            &[1, 2, 3, 4],
            &mut Vec::new(),
            None,
        )
        .unwrap_err();
    assert_eq!(
        err,
        kvroute_core::HashError::ParentLength {
            got: 8,
            expected: 32
        }
    );
}

#[test]
fn reset_starts_over() {
    let (hasher, extras) = contracts().remove(0);
    let tokens: Vec<u32> = (0..17).collect();
    let mut prompt = hasher.prompt(&extras).unwrap();
    let mut a = Vec::new();
    prompt.extend(&tokens, &mut a).unwrap();
    prompt.reset();
    assert_eq!(prompt.blocks_done(), 0);
    assert_eq!(*prompt.parent(), hasher.root(&extras).unwrap());
    let mut b = Vec::new();
    prompt.extend(&tokens, &mut b).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.len(), 4);
}
