//! Every default `docs/configuration.md` gives is the gateway's own.
//!
//! `config_reference.rs` checks that a documented default is *accepted*;
//! this checks that it is what an absent key *means*. For each key whose
//! default column is a value in backticks, a minimal file (one model, one
//! rule with two endpoints, plus the keys the row's `needs` column names,
//! plus the key's parent tables, empty) is read by the gateway's own loader
//! (`FileConfig::from_toml`, what `kvroute serve --config` runs), written back
//! with serde, and the key's value there must equal the page's. A default
//! changed in the code (or in a library the gateway takes it from, as
//! `[replicas]` takes its timings from `kvroute::ReplicaConfig::new`) without
//! the page fails here, naming the key.

mod config_page;

use std::collections::BTreeSet;
use std::path::PathBuf;

use config_page::{rows, segments, set, toml_value, MODEL_AND_RULE, PAGE};
use kvroute_gateway::gateway::config::FileConfig;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The dotted paths (without indices) whose values are arrays of tables in `v`.
fn arrays_in(v: &toml::Value, at: &str, out: &mut BTreeSet<String>) {
    let join = |k: &str| {
        if at.is_empty() {
            k.to_owned()
        } else {
            format!("{at}.{k}")
        }
    };
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                arrays_in(v, &join(k), out);
            }
        }
        toml::Value::Array(items) if items.iter().all(toml::Value::is_table) => {
            if !items.is_empty() {
                out.insert(at.to_owned());
            }
            for item in items {
                arrays_in(item, at, out);
            }
        }
        _ => {}
    }
}

/// The value at `path` (index 0, or the given one, in arrays), if any.
fn lookup<'a>(v: &'a toml::Value, path: &str) -> Option<&'a toml::Value> {
    let mut v = v;
    for (name, index) in segments(path) {
        v = v.get(name.as_str())?;
        if let toml::Value::Array(items) = v {
            if items.iter().all(toml::Value::is_table) && !items.is_empty() {
                v = items.get(index)?;
            }
        }
    }
    Some(v)
}

/// What the gateway uses for a key its file schema leaves unset when absent:
/// the library's own default, read from the library (a rule's thresholds
/// and scorer settings are filled in from these when its router is built).
fn resolved(key: &str) -> Option<toml::Value> {
    let th = kvroute_select::Thresholds::default();
    let cost = kvroute_select::CostConfig::default();
    let load_aware = kvroute_select::LoadAwareConfig::default();
    let endpoint: kvroute_gateway::gateway::config::EndpointDoc =
        toml::from_str(r#"url = "http://127.0.0.1:9""#).ok()?;
    Some(match key {
        "rules.min_overlap_blocks" => toml::Value::Integer(th.min_overlap_blocks.into()),
        "rules.max_retries" => toml::Value::Integer(th.max_retries.into()),
        "rules.sample_size" => toml::Value::Integer(th.sample_size.into()),
        "rules.burst_order_ms" => toml::Value::Integer(
            i64::try_from(kvroute_select::DEFAULT_BURST_ORDER.as_millis()).ok()?,
        ),
        "rules.load_slack" => toml::Value::Float(load_aware.epsilon),
        "rules.cost.affinity_tokens" => toml::Value::Float(cost.affinity_tokens),
        "rules.cost.affinity_slack" => toml::Value::Float(cost.affinity_slack),
        "rules.cost.decode_tokens_per_request" => {
            toml::Value::Float(cost.decode_tokens_per_request)
        }
        "rules.cost.prefill_weight" => toml::Value::Float(cost.prefill_weight),
        "rules.cost.load_factor" => toml::Value::Float(cost.load_factor),
        "rules.cost.load_headroom" => toml::Value::Integer(cost.load_headroom.into()),
        "rules.cost.tie_tokens" => toml::Value::Float(cost.tie_tokens),
        "rules.cost.drain_queue" => toml::Value::Boolean(cost.drain_queue),
        "rules.cost.eviction_weight" => toml::Value::Float(cost.eviction_weight),
        // Not written back when false.
        "rules.endpoints.drain" => toml::Value::Boolean(endpoint.drain),
        _ => return None,
    })
}

/// Equal as configuration values: an integer and a float of the same value
/// are the same default.
fn same(a: &toml::Value, b: &toml::Value) -> bool {
    use toml::Value::{Float, Integer};
    match (a, b) {
        #[allow(clippy::cast_precision_loss)]
        (Integer(i), Float(f)) | (Float(f), Integer(i)) => (*i as f64) == *f,
        _ => a == b,
    }
}

#[test]
fn every_documented_default_is_the_built_in_one() {
    let page = std::fs::read_to_string(repo().join(PAGE)).unwrap();
    // The smallest file with every array of tables the page documents keys in.
    let base: toml::Table =
        toml::from_str(&format!("listen = \"127.0.0.1:8080\"\n{MODEL_AND_RULE}")).unwrap();
    let mut arrays = BTreeSet::new();
    arrays_in(&toml::Value::Table(base.clone()), "", &mut arrays);

    let (mut checked, mut failures) = (0usize, Vec::new());
    for row in rows(&page) {
        let Some(default) = &row.default else {
            continue;
        };
        let documented = match toml_value(default) {
            Ok(v) => v,
            Err(e) => {
                failures.push(format!(
                    "`{}`: default `{default}` is not TOML: {e}",
                    row.key
                ));
                continue;
            }
        };
        let mut doc = base.clone();
        for (path, value) in &row.needs {
            match toml_value(value) {
                Ok(v) => set(&mut doc, path, v, &arrays),
                Err(e) => failures.push(format!("`{}`: needs `{path} = {value}`: {e}", row.key)),
            }
        }
        // The key's parent tables, empty: a table the file leaves out may
        // have no defaults of its own to show.
        let segs = segments(&row.key);
        let mut parent = String::new();
        for (name, _) in segs.iter().take(segs.len().saturating_sub(1)) {
            if !parent.is_empty() {
                parent.push('.');
            }
            parent.push_str(name);
            let exists = lookup(&toml::Value::Table(doc.clone()), &parent).is_some();
            if !arrays.contains(&parent) && !exists {
                set(
                    &mut doc,
                    &parent,
                    toml::Value::Table(toml::Table::new()),
                    &arrays,
                );
            }
        }
        let text = toml::to_string(&doc).unwrap();
        let cfg = match FileConfig::from_toml(&text) {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!(
                    "`{}`: the file for its default is refused: {e}\n{text}",
                    row.key
                ));
                continue;
            }
        };
        let built_in = toml::Value::try_from(&cfg).unwrap();
        checked += 1;
        match lookup(&built_in, &row.key).cloned().or_else(|| resolved(&row.key)) {
            Some(v) if same(&v, &documented) => {}
            Some(v) => failures.push(format!(
                "`{}`: the page says the default is `{default}`, the gateway's is `{v}`",
                row.key
            )),
            None => failures.push(format!(
                "`{}`: the page gives the default `{default}`; an absent key is unset in the gateway",
                row.key
            )),
        }
    }
    assert!(checked > 20, "{PAGE}: only {checked} defaults checked");
    assert!(
        failures.is_empty(),
        "{PAGE}'s defaults and the gateway's differ ({} of {checked}):\n  {}",
        failures.len(),
        failures.join("\n  ")
    );
}
