use std::path::PathBuf;
use std::time::Duration;

use super::*;

fn config_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config")
}

#[test]
fn shipped_example_configs_are_valid() {
    for name in ["converged.toml", "pd.toml"] {
        let c =
            ServeConfig::load(&config_dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(c.rules.len(), 1, "{name}");
        assert!(c.admin_listen.ip().is_loopback(), "{name}");
        let rule = &c.rules[0];
        assert_eq!(rule.choice, Choice::KvExact);
        // `tcp://*:P` means the engine binds: we dial its host.
        let Some(Stream::Zmq(ev)) = rule.endpoints[0].streams.first() else {
            panic!("{name}: {:?}", rule.endpoints[0].streams);
        };
        assert_eq!(ev.endpoint.address, "tcp://127.0.0.1:5557");
        assert_eq!(ev.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
    }
    let pd = ServeConfig::load(&config_dir().join("pd.toml")).unwrap();
    assert_eq!(pd.rules[0].topology, Topology::PrefillDecode);
    assert!(pd.rules[0].endpoints[2].streams.is_empty());
}

/// A serve configuration of a listener and `extra`.
fn serve_config(extra: &str) -> Result<ServeConfig, ConfigError> {
    ServeConfig::from_toml(
        &format!("listen = \"127.0.0.1:0\"\n{extra}"),
        Path::new("."),
    )
}

/// The outlier keys and the streamed-header timeout: defaults as
/// documented, 0 refused where it would mean no ejection or no wait, a
/// maximum ejection below the first refused.
#[test]
fn outlier_keys_are_validated() {
    let file = serve_config;
    let c = file("").unwrap();
    assert_eq!(
        (
            c.health.outlier_stall_ms,
            c.health.outlier_consecutive_timeouts,
            c.health.outlier_ejection_ms,
            c.health.outlier_max_ejection_ms,
            c.limits.stream_header_timeout_ms
        ),
        (5_000, 3, 10_000, 300_000, 10_000)
    );
    // The streamed limit never exceeds the response-header limit.
    let c = file("[limits]\nresponse_header_timeout_ms = 500\n").unwrap();
    assert_eq!(c.limits.stream_header_timeout(), Duration::from_millis(500));
    let c = file("[health]\noutlier_stall_ms = 0\noutlier_consecutive_timeouts = 0\n");
    assert!(c.is_ok(), "0 turns either off");
    for (extra, want) in [
        (
            "[health]\noutlier_ejection_ms = 0",
            "health.outlier_ejection_ms: must be at least 1 ms",
        ),
        (
            "[health]\noutlier_ejection_ms = 20000\noutlier_max_ejection_ms = 10000",
            "health.outlier_max_ejection_ms: 10000 is below health.outlier_ejection_ms (20000)",
        ),
        (
            "[limits]\nstream_header_timeout_ms = 0",
            "limits.stream_header_timeout_ms: must be at least 1 ms",
        ),
    ] {
        let err = file(extra).map(|_| ()).unwrap_err().to_string();
        assert_eq!(err, want, "{extra}");
    }
}

fn rule_error(doc: &str) -> String {
    let text = format!("listen = \"127.0.0.1:0\"\n[[rules]]\n{doc}");
    ServeConfig::from_toml(&text, Path::new("."))
        .map(|_| String::new())
        .unwrap_or_else(|e| e.to_string())
}

#[test]
fn invalid_rules_name_the_field_at_fault() {
    let ep = "[[rules.endpoints]]\nurl = \"http://10.0.0.1:8000\"\nzmq = \"tcp://*:5557\"\n";
    let cases = [
        (format!("name = \"r\"\nmodels = [\"m\"]\n{ep}"), "rules[0].contract"),
        (
            format!("name = \"r\"\nmodels = [\"m\"]\ncontract = \"vllm@0.33.0:nope:block=16\"\n{ep}"),
            "rules[0].contract",
        ),
        (
            format!("name = \"r\"\nmodels = [\"m\"]\nchoice = \"magic\"\n{ep}"),
            "rules[0].choice",
        ),
        (format!("name = \"bad name\"\nmodels = [\"m\"]\n{ep}"), "rules[0].name"),
        (
            "name = \"r\"\nmodels = [\"m\"]\ncontract = \"vllm@0.33.0:sha256_cbor:block=16:seed=0\"\n[[rules.endpoints]]\nurl = \"http://10.0.0.1:8000\"\n".to_owned(),
            "rules[0].endpoints",
        ),
        (
            "name = \"r\"\nmodels = [\"m\"]\ncontract = \"vllm@0.33.0:sha256_cbor:block=16:seed=0\"\n[[rules.endpoints]]\nurl = \"http://10.0.0.1:8000\"\nengine = \"llama.cpp\"\nzmq = \"tcp://*:1\"\n".to_owned(),
            "content affinity",
        ),
        (
            format!("name = \"r\"\nmodels = [\"m\"]\ntopology = \"prefill_decode\"\ncontract = \"vllm@0.33.0:sha256_cbor:block=16:seed=0\"\n{ep}role = \"prefill\"\n"),
            "prefill and one decode",
        ),
        (
            "name = \"r\"\nmodels = [\"m\"]\nchoice = \"round_robin\"\n[[rules.endpoints]]\nurl = \"http://a:1\"\n[[rules.endpoints]]\nurl = \"http://a:1/\"\n".to_owned(),
            "listed twice",
        ),
        (
            "name = \"r\"\nmodels = [\"m\"]\ncontract = \"vllm@0.33.0:sha256_cbor:block=16:seed=0\"\n[[rules.endpoints]]\nurl = \"http://10.0.0.1:8000\"\nzmq = \"tcp://*:0\"\n".to_owned(),
            "rules[0].endpoints[0].zmq: \"tcp://*:0\": needs the engine's non-zero port",
        ),
        (
            format!("name = \"r\"\nmodels = [\"m\"]\ncontract = \"vllm@0.33.0:sha256_cbor:block=16:seed=0\"\n{ep}replay = \"tcp://127.0.0.1:0\"\n"),
            "rules[0].endpoints[0].replay",
        ),
        (
            "name = \"r\"\nmodels = [\"m\"]\nchoice = \"round_robin\"\n[[rules.endpoints]]\nurl = \"http://a:1\"\ncapacity = 4000000000\n".to_owned(),
            "rules[0].endpoints[0].capacity: 4000000000 is above 1000000",
        ),
    ];
    for (doc, want) in cases {
        let err = rule_error(&doc);
        assert!(err.contains(want), "want {want:?} in {err:?} for\n{doc}");
    }
    let two_defaults = "name = \"a\"\ndefault = true\nchoice = \"round_robin\"\n[[rules.endpoints]]\nurl = \"http://a:1\"\n[[rules]]\nname = \"b\"\ndefault = true\nchoice = \"round_robin\"\n[[rules.endpoints]]\nurl = \"http://b:1\"\n";
    assert!(rule_error(two_defaults).contains("already the default rule"));
}

/// The scorer of a one-rule file whose rule carries `extra` lines.
fn scorer_with(extra: &str) -> Result<Built, ConfigError> {
    let text = format!(
        "listen = \"127.0.0.1:0\"\n[[rules]]\nname = \"r\"\nmodels = [\"m\"]\nchoice = \"round_robin\"\n{extra}\n[[rules.endpoints]]\nurl = \"http://127.0.0.1:1\"\n"
    );
    ServeConfig::from_toml(&text, Path::new(".")).map(|c| Built::of(&c.rules[0].scorer))
}

/// A built-in scorer with its parameters, for comparisons.
#[derive(Debug, PartialEq)]
enum Built {
    Cost(CostConfig),
    LoadAware(LoadAwareConfig),
    Other(String),
}

impl Built {
    fn of(s: &ScorerRef) -> Self {
        let any: &dyn std::any::Any = &**s;
        if let Some(c) = any.downcast_ref::<CostScorer>() {
            Built::Cost(c.0)
        } else if let Some(l) = any.downcast_ref::<LoadAwareScorer>() {
            Built::LoadAware(l.0)
        } else {
            Built::Other(s.name().to_owned())
        }
    }
}

#[test]
fn rules_cost_sets_the_cost_scorer_and_is_validated() {
    assert_eq!(scorer_with("").unwrap(), Built::Cost(CostConfig::default()));
    assert_eq!(
        scorer_with("[rules.cost]\naffinity_tokens = 256\naffinity_slack = 0.2\nload_factor = inf\nload_headroom = 4\ndrain_queue = false\neviction_weight = 0")
        .unwrap(),
        Built::Cost(CostConfig {
            affinity_tokens: 256.0,
            affinity_slack: 0.2,
            load_factor: f64::INFINITY,
            load_headroom: 4,
            drain_queue: false,
            eviction_weight: 0.0,
            ..CostConfig::default()
        })
    );
    for (extra, field, want) in [
        (
            "[rules.cost]\naffinity_tokens = -1",
            "affinity_tokens",
            "out of range",
        ),
        (
            "[rules.cost]\naffinity_slack = nan",
            "affinity_slack",
            "out of range",
        ),
        (
            "[rules.cost]\nprefill_weight = 0.5",
            "prefill_weight",
            "out of range",
        ),
        (
            "[rules.cost]\neviction_weight = -1",
            "eviction_weight",
            "out of range",
        ),
        (
            "[rules.cost]\nload_factor = 0.9",
            "load_factor",
            "out of range",
        ),
        (
            "[rules.cost]\ndecode_tokens_per_request = inf",
            "decode_tokens_per_request",
            "out of range",
        ),
    ] {
        let err = scorer_with(extra).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("rules[0].cost.{field}: ")),
            "{extra}: {err}"
        );
        assert!(err.contains(want), "{extra}: {err}");
    }
    let err = scorer_with("scorer = \"longest_prefix\"\n[rules.cost]\naffinity_tokens = 1")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("rules[0].cost: ") && err.contains("only applies to scorer = \"cost\""),
        "{err}"
    );
    let err = scorer_with("[rules.cost]\naffinity = 1")
        .unwrap_err()
        .to_string();
    assert!(err.contains("affinity"), "{err}");
}

#[test]
fn load_slack_sets_the_load_aware_epsilon_and_is_validated() {
    assert_eq!(
        scorer_with("scorer = \"load_aware\"\nload_slack = 0.5").unwrap(),
        Built::LoadAware(LoadAwareConfig {
            epsilon: 0.5,
            ..LoadAwareConfig::default()
        })
    );
    assert_eq!(
        scorer_with("scorer = \"load_aware\"").unwrap(),
        Built::LoadAware(LoadAwareConfig::default())
    );
    assert_eq!(
        scorer_with("scorer = \"load_aware\"\nload_slack = 0").unwrap(),
        Built::LoadAware(LoadAwareConfig {
            epsilon: 0.0,
            ..LoadAwareConfig::default()
        })
    );
    for (extra, want) in [
        ("scorer = \"load_aware\"\nload_slack = -0.1", "out of range"),
        ("scorer = \"load_aware\"\nload_slack = nan", "out of range"),
        ("scorer = \"load_aware\"\nload_slack = inf", "out of range"),
        (
            "scorer = \"load_aware\"\nload_slack = 1000.0",
            "out of range",
        ),
        (
            "load_slack = 0.5",
            "only applies to scorer = \"load_aware\"",
        ),
    ] {
        let err = scorer_with(extra).unwrap_err().to_string();
        assert!(err.starts_with("rules[0].load_slack: "), "{extra}: {err}");
        assert!(err.contains(want), "{extra}: {err}");
    }
    // The admin API's JSON documents take the same field.
    let err = rule_from_json(
        br#"{"name": "r", "models": ["m"], "choice": "round_robin", "scorer": "load_aware",
             "load_slack": -1, "endpoints": [{"url": "http://127.0.0.1:1"}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(err.starts_with("rule.load_slack: "), "{err}");
}

fn lora_rule(contract: &str, lora: &str) -> Result<RuleSpec, String> {
    let text = format!(
        "listen = \"127.0.0.1:0\"\n[[rules]]\nname = \"r\"\nmodels = [\"base\", \"sql\"]\n{contract}\n{lora}\n[[rules.endpoints]]\nurl = \"http://10.0.0.1:8000\"\nzmq = \"tcp://*:5557\"\n"
    );
    ServeConfig::from_toml(&text, Path::new("."))
        .map(|mut c| c.rules.remove(0))
        .map_err(|e| e.to_string())
}

const VLLM: &str = "contract = \"vllm@0.33.0:sha256_cbor:block=16:seed=0\"";

#[test]
fn lora_adapters_map_model_names_to_hash_extras() {
    let rule = lora_rule(
        VLLM,
        "[[rules.lora]]\nmodel = \"sql\"\npath = \"/adapters/sql-lora\"\n",
    )
    .unwrap();
    assert_eq!(
        rule.lora.get("sql"),
        Some(&LoraAdapter {
            name: "sql".to_owned(),
            path: "/adapters/sql-lora".to_owned()
        })
    );
    assert_eq!(rule.lora.get("base"), None);
    // Its requests tokenize as the rule's first model that is not an adapter.
    assert_eq!(rule.lora_base.get("sql").map(String::as_str), Some("base"));
    // The admin API takes the same shape and lists it back.
    let json = serde_json::to_value(&rule.doc).unwrap();
    assert_eq!(json["lora"][0]["path"], "/adapters/sql-lora");
    let again = rule_from_json(json.to_string().as_bytes()).unwrap();
    assert_eq!(again.lora, rule.lora);
}

#[test]
fn invalid_lora_entries_name_the_field_at_fault() {
    let entry = |model: &str, path: &str| {
        format!("[[rules.lora]]\nmodel = \"{model}\"\npath = \"{path}\"\n")
    };
    let cases = [
        (
            VLLM.to_owned(),
            entry("", "/a"),
            "rules[0].lora[0].model: is empty",
        ),
        (
            VLLM.to_owned(),
            entry("other", "/a"),
            "rules[0].lora[0].model: \"other\" is not in rules[0].models",
        ),
        (
            VLLM.to_owned(),
            entry("sql", ""),
            "rules[0].lora[0].path: is empty",
        ),
        (
            VLLM.to_owned(),
            format!("{}base = \"other\"\n", entry("sql", "/a")),
            "rules[0].lora[0].base: \"other\" is not one of rules[0].models that is not an adapter",
        ),
        (
            VLLM.to_owned(),
            format!("{}base = \"sql\"\n", entry("sql", "/a")),
            "rules[0].lora[0].base: \"sql\" is not one of rules[0].models",
        ),
        (
            VLLM.to_owned(),
            format!("{}{}", entry("sql", "/a"), entry("sql", "/b")),
            "rules[0].lora[1].model: adapter \"sql\" is listed twice",
        ),
        (
            "choice = \"round_robin\"".to_owned(),
            entry("sql", "/a"),
            "rules[0].lora: LoRA adapters change block keys",
        ),
        // SGLang keys a LoRA by an internal uuid; older vLLM by another layout.
        (
            "contract = \"sglang@0.5.23:sha256_page_chain:page=16\"".to_owned(),
            entry("sql", "/a"),
            "rules[0].lora: contract",
        ),
        (
            "choice = \"round_robin\"\nunknown_field = 1".to_owned(),
            String::new(),
            "unknown field",
        ),
    ];
    for (contract, lora, want) in cases {
        let err = lora_rule(&contract, &lora).map(|_| ()).unwrap_err();
        assert!(err.contains(want), "want {want:?} in {err:?}");
    }
    let typo = lora_rule(
        VLLM,
        "[[rules.lora]]\nmodel = \"sql\"\npath = \"/a\"\nint_id = 1\n",
    )
    .unwrap_err();
    assert!(typo.contains("unknown field"), "{typo}");
}

/// Every enum field takes the libraries' names (`Display` of each value
/// parses back in a config) and names itself when given an unknown one.
#[test]
fn enum_fields_take_the_library_names_and_refuse_others_by_field() {
    let doc = |rule: &str, endpoint: &str| {
        format!(
            "listen = \"127.0.0.1:0\"\n[[rules]]\nname = \"r\"\nmodels = [\"m\"]\nchoice = \"round_robin\"\n{rule}\n[[rules.endpoints]]\nurl = \"http://10.0.0.1:8000\"\n{endpoint}\n"
        )
    };
    let parse = |text: String| ServeConfig::from_toml(&text, Path::new("."));
    for s in [
        SelectorKind::RoundRobin,
        SelectorKind::LeastLoad,
        SelectorKind::LeastPrefill,
        SelectorKind::PowerOfTwoChoices,
        SelectorKind::Chwbl,
        SelectorKind::Random,
        SelectorKind::Weighted,
    ] {
        let c = parse(doc(&format!("selector = \"{s}\""), "")).unwrap();
        assert_eq!(c.rules[0].selector, s);
    }
    for k in [
        ScorerKind::Cost,
        ScorerKind::OverlapCount,
        ScorerKind::LongestPrefix,
        ScorerKind::LoadAware,
    ] {
        let c = parse(doc(&format!("scorer = \"{k}\""), "")).unwrap();
        assert_eq!(c.rules[0].scorer.name(), k.build().name());
    }
    for (engine, want) in [
        ("vllm", "vllm"),
        ("sglang", "sglang"),
        ("trtllm", "trtllm"),
        ("llama.cpp", "llama.cpp"),
        ("llamacpp", "llama.cpp"),
    ] {
        let c = parse(doc("", &format!("engine = \"{engine}\""))).unwrap();
        assert_eq!(c.rules[0].endpoints[0].engine.name(), want, "{engine}");
    }
    for (rule, endpoint, field, names) in [
        (
            "choice = \"x\"",
            "",
            "rules[0].choice",
            "kv_exact, round_robin or content_affinity",
        ),
        (
            "topology = \"x\"",
            "",
            "rules[0].topology",
            "converged or prefill_decode",
        ),
        ("scorer = \"x\"", "", "rules[0].scorer", "load_aware"),
        (
            "selector = \"x\"",
            "",
            "rules[0].selector",
            "p2c, chwbl, random or weighted",
        ),
        (
            "",
            "role = \"x\"",
            "rules[0].endpoints[0].role",
            "both, prefill or decode",
        ),
        (
            "",
            "engine = \"x\"",
            "rules[0].endpoints[0].engine",
            "vllm, sglang, trtllm or llama.cpp",
        ),
    ] {
        let text = doc(rule, endpoint).replace("choice = \"round_robin\"\nchoice", "choice");
        let err = parse(text).map(|_| ()).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{field}: unknown ")), "{err}");
        assert!(
            err.contains("\"x\"; expected ") && err.contains(names),
            "{err}"
        );
    }
}

#[test]
fn zero_limits_are_refused_by_name() {
    for field in [
        "max_body_bytes",
        "max_prompt_tokens",
        "max_prompt_chars",
        "max_concurrent_tokenizations",
        "max_tokenize_bytes_in_flight",
    ] {
        let text = format!("listen = \"127.0.0.1:0\"\n[limits]\n{field} = 0\n");
        let err = ServeConfig::from_toml(&text, Path::new("."))
            .map(|_| String::new())
            .unwrap_or_else(|e| e.to_string());
        assert_eq!(err, format!("limits.{field}: must be at least 1"));
    }
    assert_eq!(LimitsConfig::default().max_prompt_chars, 1 << 20);
}

/// A rule with no options runs as a `KvRouter` with no options: every
/// default the gateway documents is the library's.
#[test]
fn the_gateways_defaults_are_the_librarys() {
    use kvroute::{EngineLoadConfig, HeaderTimeouts, OutlierConfig, ProbeConfig};
    use kvroute_select::BreakerConfig;

    let (limits, health) = (LimitsConfig::default(), HealthConfig::default());
    let ms = Duration::from_millis;
    assert_eq!(
        BreakerConfig::default(),
        BreakerConfig {
            failure_threshold: health.failure_threshold,
            cool_down: ms(health.cool_down_ms),
        }
    );
    assert_eq!(
        ProbeConfig::default(),
        ProbeConfig {
            path: health.path.clone(),
            interval: ms(health.interval_ms),
            timeout: ms(health.timeout_ms),
        }
    );
    let poll = EngineLoadConfig::default();
    assert_eq!(poll.interval, ms(limits.engine_load_poll_ms));
    assert_eq!(poll.timeout, poll.interval.max(ms(200)));
    assert_eq!(
        HeaderTimeouts::default(),
        HeaderTimeouts {
            response: Some(limits.response_header_timeout()),
            streamed: Some(limits.stream_header_timeout()),
        }
    );
    let o = OutlierConfig::default();
    assert_eq!(
        (
            o.stall_after,
            o.consecutive_timeouts,
            o.base_ejection,
            o.max_ejection
        ),
        (
            ms(health.outlier_stall_ms),
            health.outlier_consecutive_timeouts,
            ms(health.outlier_ejection_ms),
            ms(health.outlier_max_ejection_ms)
        )
    );
}

#[test]
fn burst_order_ms_is_kept_and_bounded() {
    let rule = |extra: &str| {
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[[rules]]\nname = \"r\"\nmodels = [\"m\"]\nchoice = \"round_robin\"\n{extra}\n[[rules.endpoints]]\nurl = \"http://127.0.0.1:1\"\n"
        );
        ServeConfig::from_toml(&text, Path::new(".")).map(|c| c.rules[0].doc.burst_order_ms)
    };
    assert_eq!(rule("").unwrap(), None);
    assert_eq!(rule("burst_order_ms = 0").unwrap(), Some(0));
    assert_eq!(rule("burst_order_ms = 1000").unwrap(), Some(1000));
    let err = rule("burst_order_ms = 1001").unwrap_err().to_string();
    assert!(
        err.starts_with("rules[0].burst_order_ms: ") && err.contains("out of range"),
        "{err}"
    );
    let err = rule("burst_order_ms = -1").unwrap_err().to_string();
    assert!(err.starts_with("rules[0].burst_order_ms"), "{err}");
}

/// The replicas' TTL must outlast the longest gap between two heartbeats:
/// the heartbeat plus one wake-up interval (`sync_interval_ms`, at most the
/// heartbeat), or idle replicas and endpoints would expire at the others.
#[test]
fn the_replica_ttl_must_outlast_a_heartbeat_and_a_wake_up() {
    let file = |extra: &str| serve_config(&format!("[replicas]\n{extra}")).map(|_| ());
    assert!(file("heartbeat_ms = 1000\nremote_ttl_ms = 1003").is_ok());
    for extra in [
        "heartbeat_ms = 1000\nremote_ttl_ms = 1002",
        "sync_interval_ms = 900\nheartbeat_ms = 1000\nremote_ttl_ms = 1500",
        "sync_interval_ms = 10000\nheartbeat_ms = 1000\nremote_ttl_ms = 2000",
    ] {
        let err = file(extra).unwrap_err().to_string();
        assert!(
            err.starts_with("replicas.remote_ttl_ms: must exceed"),
            "{extra}: {err}"
        );
    }
    assert!(file("sync_interval_ms = 10000\nheartbeat_ms = 1000\nremote_ttl_ms = 2001").is_ok());
}

/// `replicas.order`: unset by default (ranked by a random id per start),
/// read when set, a place beyond 32 bits refused.
#[test]
fn a_replica_order_is_read() {
    let file = |extra: &str| serve_config(&format!("[replicas]\n{extra}"));
    assert_eq!(file("").unwrap().replicas.order, None);
    assert_eq!(file("order = 0").unwrap().replicas.order, Some(0));
    assert_eq!(file("order = 3").unwrap().replicas.order, Some(3));
    let err = file("order = 4294967296").unwrap_err().to_string();
    assert!(err.contains("replicas.order"), "{err}");
}

/// `[[models]] max_model_len` and `content_format`: read, left out by
/// default, 0 and unknown formats refused.
#[test]
fn a_models_max_model_len_is_read_and_validated() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let model = |extra: &str| {
        serve_config(&format!(
            "[[models]]\nslug = \"m\"\ndir = \"{dir}\"\n{extra}\n"
        ))
    };
    assert_eq!(model("").unwrap().models[0].max_model_len, None);
    assert_eq!(
        model("max_model_len = 8192").unwrap().models[0].max_model_len,
        Some(8192)
    );
    let err = model("max_model_len = 0").unwrap_err().to_string();
    assert!(err.contains("models[0].max_model_len"), "{err}");
    // `content_format`: detected unless set; only the two formats.
    assert_eq!(model("").unwrap().models[0].content_format, None);
    assert_eq!(
        model("content_format = \"openai\"").unwrap().models[0].content_format,
        Some(crate::gateway::config::schema::ContentFormatDoc::Openai)
    );
    assert!(model("content_format = \"auto\"").is_err());
}
