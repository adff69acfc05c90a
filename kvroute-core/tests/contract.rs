//! Contract descriptors: parsing, validation errors and their advice.

use kvroute_core::{
    ContractError, HashContract, HashError, LoraAdapter, PythonHashSeed, RequestExtras,
};

fn parse(spec: &str) -> HashContract {
    spec.parse().unwrap_or_else(|e| panic!("{spec}: {e}"))
}

fn build_err(spec: &str) -> ContractError {
    parse(spec).hasher().expect_err(spec)
}

#[test]
fn readme_none_hash_table() {
    // golden/vllm/README.md "NONE_HASH reference values".
    let rows = [
        (
            "vllm@0.33.0:sha256_cbor:block=16",
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        ),
        (
            "vllm@0.33.0:sha256_cbor:block=16:seed=0",
            "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
        ),
        (
            "vllm@0.33.0:sha256_cbor:block=16:seed=42",
            "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780",
        ),
        (
            "vllm@0.33.0:sha256:block=16",
            "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        ),
        (
            "vllm@0.33.0:xxhash_cbor:block=16:seed=0",
            "1ebe36576dcb573f26b99533a20aaeca",
        ),
    ];
    for (spec, want) in rows {
        let root = parse(spec)
            .hasher()
            .unwrap()
            .root(&RequestExtras::NONE)
            .unwrap();
        assert_eq!(root.to_hex(), want, "{spec}");
    }
}

#[test]
fn random_roots_are_refused_with_advice() {
    for spec in [
        "vllm@0.33.0:xxhash_cbor:block=16",
        "vllm@0.33.0:xxhash:block=16",
        "vllm@0.28.0:sha256_cbor:block=16",
        "vllm@0.10.2:sha256:block=16",
    ] {
        let err = build_err(spec);
        assert!(
            matches!(err, ContractError::RandomRoot { .. }),
            "{spec}: {err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("set PYTHONHASHSEED=0 on the engine"), "{msg}");
        assert!(msg.contains("`seed=0` in the contract"), "{msg}");
        // The example the message gives is the refused contract made reproducible.
        let example = format!("`{spec}:seed=0`");
        assert!(msg.contains(&example), "{msg} lacks {example}");
        parse(example.trim_matches('`')).hasher().unwrap();
    }
    // 0.29+ uses the fixed seed for sha256 algorithms.
    parse("vllm@0.29.0:sha256_cbor:block=16").hasher().unwrap();
}

#[test]
fn seed_text_is_hashed_verbatim() {
    // "" and "random" are set values: vLLM hashes the text itself, reproducibly,
    // even with xxhash.
    let empty = parse("vllm@0.33.0:xxhash_cbor:block=16:seed=")
        .hasher()
        .unwrap();
    let random = parse("vllm@0.33.0:xxhash_cbor:block=16:seed=random")
        .hasher()
        .unwrap();
    let e = empty.root(&RequestExtras::NONE).unwrap();
    let r = random.root(&RequestExtras::NONE).unwrap();
    assert_eq!(
        e,
        kvroute_core::vllm::none_hash(kvroute_core::VllmAlgorithm::XxhashCbor, "")
    );
    assert_eq!(
        r,
        kvroute_core::vllm::none_hash(kvroute_core::VllmAlgorithm::XxhashCbor, "random")
    );
    assert_ne!(e, r);
    // "007" and "7" are different texts, so different roots.
    let a = parse("vllm@0.33.0:sha256_cbor:block=16:seed=007")
        .hasher()
        .unwrap();
    let b = parse("vllm@0.33.0:sha256_cbor:block=16:seed=7")
        .hasher()
        .unwrap();
    assert_ne!(
        a.root(&RequestExtras::NONE).unwrap(),
        b.root(&RequestExtras::NONE).unwrap()
    );
}

#[test]
fn seeds_cpython_rejects_are_refused() {
    for bad in ["kvroute", "4294967296", "-1", "1.5", "0x10", "12 "] {
        let seed = PythonHashSeed::Value(bad.to_owned());
        assert!(!seed.accepted_by_cpython(), "{bad:?}");
        let err = build_err(&format!("vllm@0.33.0:sha256_cbor:block=16:seed={bad}"));
        assert!(
            matches!(err, ContractError::SeedRejectedByCpython { .. }),
            "{bad}: {err:?}"
        );
        assert!(err.to_string().contains("[0, 4294967295]"));
    }
    for good in ["0", "4294967295", "random", "", "+5", " 9", "0000000000042"] {
        assert!(
            PythonHashSeed::Value(good.to_owned()).accepted_by_cpython(),
            "{good:?}"
        );
    }
}

#[test]
fn version_and_algorithm_rules() {
    assert!(matches!(
        build_err("vllm@0.10.1:sha256_cbor:block=16:seed=0"),
        ContractError::UnsupportedVersion { .. }
    ));
    assert!(matches!(
        build_err("vllm@0.12.0:xxhash_cbor:block=16:seed=0"),
        ContractError::AlgorithmVersionMismatch { .. }
    ));
    assert!(matches!(
        build_err("sglang@0.5.5:sha256_page_chain:block=4"),
        ContractError::AlgorithmVersionMismatch { .. }
    ));
    assert!(matches!(
        build_err("sglang@0.5.6:legacy_pyhash:block=4"),
        ContractError::AlgorithmVersionMismatch { .. }
    ));
    assert!(matches!(
        build_err("sglang@0.4.7:legacy_pyhash:block=4"),
        ContractError::UnsupportedVersion { .. }
    ));
    assert!(matches!(
        build_err("sglang@0.5.21:sha256_page_chain:block=4:format=dynamo"),
        ContractError::SettingNotSupported { .. }
    ));
    parse("sglang@0.5.5.post3:legacy_pyhash:block=4")
        .hasher()
        .unwrap();
    parse("sglang@0.5.22:sha256_page_chain:block=4:format=dynamo")
        .hasher()
        .unwrap();
}

#[test]
fn bad_specs_and_names() {
    let err = "vllm@0.33.0:sha512:block=16"
        .parse::<HashContract>()
        .unwrap_err();
    assert!(matches!(err, ContractError::UnknownAlgorithm { .. }));
    assert!(err.to_string().contains("sha256_cbor"));
    let err = "vllm@0.33.0:sha256_cbor:block=0"
        .parse::<HashContract>()
        .unwrap_err();
    assert_eq!(err, ContractError::ZeroBlockSize);
    assert!(err.to_string().contains("--block-size"));
    for bad in [
        "vllm:sha256_cbor:block=16",
        "vllm@0.33.0:sha256_cbor",
        "vllm@0.33.0:sha256_cbor:block=16:format=dynamo",
        "llama@1.0:x:block=1",
        "rekey:xxh3_64_chain:block=16",
        "vllm@0.33.0:sha256_cbor:block=16:colour=red",
    ] {
        assert!(
            matches!(
                bad.parse::<HashContract>(),
                Err(ContractError::BadSpec { .. })
            ),
            "{bad}"
        );
    }
}

#[test]
fn serde_and_spec_round_trip() {
    for spec in [
        "vllm@0.33.0:sha256_cbor:block=16:seed=0",
        "vllm@0.33.0:sha256:block=16",
        "vllm@0.33.0:xxhash:block=32:seed=random:lookahead=1",
        "sglang@0.5.23:sha256_page_chain:block=4:format=dynamo",
        "sglang@0.5.5:legacy_pyhash:block=1",
        "trtllm@1.1.0:v1_block_key:block=32",
        "trtllm:v1_block_key:block=32",
        "rekey:xxh3_64_chain:block=16:seed=1337",
    ] {
        let c = parse(spec);
        assert_eq!(c.to_string(), spec);
        let json = serde_json::to_string(&c).unwrap();
        let back: HashContract = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c, "{json}");
    }
    let c: HashContract = serde_json::from_str(
        r#"{"engine":"sglang","version":"0.5.23","algorithm":"sha256_page_chain","page_size":4}"#,
    )
    .unwrap();
    assert_eq!(c.to_string(), "sglang@0.5.23:sha256_page_chain:block=4");
    let err = serde_json::from_str::<HashContract>(
        r#"{"engine":"vllm","version":"0.33.0","algorithm":"sha256_cbor","block_size":0}"#,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("block size must be at least 1"),
        "{err}"
    );
    let err = serde_json::from_str::<HashContract>(
        r#"{"engine":"vllm","version":"0.33.0","algorithm":"md5","block_size":16}"#,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("unknown vllm hash algorithm"),
        "{err}"
    );
    let err = serde_json::from_str::<HashContract>(
        r#"{"engine":"vllm","version":"0.33.0","algorithm":"sha256","block_size":16,"seed":"0"}"#,
    )
    .unwrap_err();
    assert!(err.to_string().contains("unknown field"), "{err}");
}

#[test]
fn extras_an_engine_does_not_hash_are_refused() {
    let lora = RequestExtras {
        lora: Some(LoraAdapter {
            name: "a".into(),
            path: "/a".into(),
        }),
        ..RequestExtras::default()
    };
    let tokens: Vec<u32> = (0..32).collect();
    let mut keys = Vec::new();
    for spec in [
        "vllm@0.30.0:sha256_cbor:block=16:seed=0",
        "sglang@0.5.23:sha256_page_chain:block=16",
        "trtllm:v1_block_key:block=16",
        "rekey:xxh3_64_chain:block=16:seed=1337",
    ] {
        let h = parse(spec).hasher().unwrap();
        let err = h.hash_prompt(&tokens, &lora, &mut keys).unwrap_err();
        assert!(
            matches!(err, HashError::ExtraNotSupported { field: "lora", .. }),
            "{spec}: {err}"
        );
    }
    let salted = RequestExtras {
        cache_salt: Some("t".into()),
        ..RequestExtras::default()
    };
    let h = parse("sglang@0.5.17:sha256_page_chain:block=16")
        .hasher()
        .unwrap();
    assert!(h
        .hash_prompt(&tokens, &salted, &mut keys)
        .unwrap_err()
        .to_string()
        .contains("0.5.18"));
    assert!(keys.is_empty());
}

#[test]
fn trtllm_token_range_and_extra_ids() {
    let h = parse("trtllm:v1_block_key:block=4").hasher().unwrap();
    let mut keys = Vec::new();
    let err = h
        .hash_prompt(&[1, 2, 3, 1 << 31], &RequestExtras::NONE, &mut keys)
        .unwrap_err();
    assert_eq!(
        err,
        HashError::TokenOutOfRange {
            token: 1 << 31,
            position: 3,
            rule: "TensorRT-LLM, whose token ids are int32 (< 2^31)"
        }
    );
    let short = RequestExtras {
        trtllm_token_extra_ids: Some(vec![0; 6]),
        ..RequestExtras::default()
    };
    let err = h
        .hash_prompt(&[1, 2, 3, 4, 5, 6, 7, 8], &short, &mut keys)
        .unwrap_err();
    assert!(matches!(
        err,
        HashError::ExtraIdsTooShort { got: 6, needed: 8 }
    ));
}

#[test]
fn prompt_embeds_need_a_digest_per_window() {
    let h = parse("vllm@0.33.0:sha256_cbor:block=4:seed=0")
        .hasher()
        .unwrap();
    let extras = RequestExtras {
        prompt_embeds: vec![kvroute_core::PromptEmbedsDigest {
            start: 0,
            end: 4,
            digest: [7; 32],
        }],
        ..RequestExtras::default()
    };
    let mut keys = Vec::new();
    let err = h
        .hash_prompt(&[1, 2, 3, 4, 5, 6, 7, 8], &extras, &mut keys)
        .unwrap_err();
    assert_eq!(
        err,
        HashError::MissingPromptEmbedsDigest { start: 4, end: 8 }
    );
}
