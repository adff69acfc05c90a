//! TensorRT-LLM `GET /metrics`: a JSON array of iteration stats, one object per
//! executor iteration (and, with attention DP, per rank: `attentionDpRank`).
//!
//! Field names as serialized by the executor (`numActiveRequests`,
//! `numQueuedRequests`, `kvCacheStats.{maxNumBlocks, usedNumBlocks, freeNumBlocks,
//! tokensPerBlock}`, `inflightBatchingStats.numQueuedCtxTokens`), read in
//! TensorRT-LLM's `tensorrt_llm/metrics/collector.py::log_iteration_stats` and
//! checked against `tests/unittest/llmapi/apps/_test_openai_metrics.py`.
//!
//! The array is folded while it is read: only the latest iteration of each rank is
//! kept, so memory is bounded by the number of ranks, not by the body.

use std::fmt;

use serde::de::{DeserializeSeed, SeqAccess, Visitor};
use serde::Deserialize;

use super::{combine, EngineLoadReport, LoadReportError, RankLoad, MAX_RANKS};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Row {
    iter: Option<f64>,
    attention_dp_rank: Option<f64>,
    num_active_requests: Option<f64>,
    num_queued_requests: Option<f64>,
    kv_cache_stats: Option<KvStats>,
    inflight_batching_stats: Option<Inflight>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct KvStats {
    max_num_blocks: Option<f64>,
    used_num_blocks: Option<f64>,
    free_num_blocks: Option<f64>,
    tokens_per_block: Option<f64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Inflight {
    num_queued_ctx_tokens: Option<f64>,
}

/// The latest row per rank.
struct Latest {
    ranks: Vec<(i64, f64, RankLoad)>,
    saw_active: bool,
    error: Option<LoadReportError>,
}

fn count(v: Option<f64>, metric: &'static str) -> Result<Option<f64>, LoadReportError> {
    match v {
        Some(x) if !(x.is_finite() && x >= 0.0) => {
            Err(LoadReportError::InvalidValue { metric, line: 0 })
        }
        other => Ok(other),
    }
}

impl Latest {
    fn push(&mut self, row: Row) -> Result<(), LoadReportError> {
        let running = count(row.num_active_requests, "numActiveRequests")?;
        let waiting = count(row.num_queued_requests, "numQueuedRequests")?;
        self.saw_active |= running.is_some();
        let mut load = RankLoad {
            running,
            waiting,
            ..RankLoad::default()
        };
        if let Some(kv) = row.kv_cache_stats {
            let max = count(kv.max_num_blocks, "kvCacheStats.maxNumBlocks")?;
            let used = count(kv.used_num_blocks, "kvCacheStats.usedNumBlocks")?;
            let free = count(kv.free_num_blocks, "kvCacheStats.freeNumBlocks")?;
            load.capacity_blocks = max;
            load.block_size = count(kv.tokens_per_block, "kvCacheStats.tokensPerBlock")?;
            let used = used.or_else(|| Some(max? - free?));
            load.kv_usage = match (used, max) {
                (Some(u), Some(m)) if m > 0.0 => Some((u / m).clamp(0.0, 1.0)),
                _ => None,
            };
        }
        if let Some(ifb) = row.inflight_batching_stats {
            load.waiting_prefill_tokens = count(
                ifb.num_queued_ctx_tokens,
                "inflightBatchingStats.numQueuedCtxTokens",
            )?;
        }
        let rank = row
            .attention_dp_rank
            .filter(|r| r.is_finite())
            .map_or(0, |r| r as i64);
        let iter = row.iter.filter(|i| i.is_finite()).unwrap_or(f64::MIN);
        let full = self.ranks.len() == MAX_RANKS;
        match self.ranks.iter_mut().find(|(r, _, _)| *r == rank) {
            // Later entries of the same iteration win: the queue is in order.
            Some(slot) if iter >= slot.1 => *slot = (rank, iter, load),
            Some(_) => {}
            None if full => return Err(LoadReportError::TooManyRanks { limit: MAX_RANKS }),
            None => self.ranks.push((rank, iter, load)),
        }
        Ok(())
    }
}

struct Fold<'a>(&'a mut Latest);

impl<'de> DeserializeSeed<'de> for Fold<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Fold<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of iteration stats")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(row) = seq.next_element::<Row>()? {
            if self.0.error.is_some() {
                continue;
            }
            if let Err(e) = self.0.push(row) {
                self.0.error = Some(e);
            }
        }
        Ok(())
    }
}

pub(super) fn parse(body: &[u8]) -> Result<EngineLoadReport, LoadReportError> {
    let mut latest = Latest {
        ranks: Vec::new(),
        saw_active: false,
        error: None,
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    Fold(&mut latest)
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|e| LoadReportError::Json {
            reason: e.to_string(),
        })?;
    if let Some(e) = latest.error {
        return Err(e);
    }
    if !latest.ranks.is_empty() && !latest.saw_active {
        return Err(LoadReportError::MissingMetric {
            dialect: super::MetricsDialect::Trtllm,
            metric: "numActiveRequests",
        });
    }
    latest.ranks.sort_by_key(|(r, _, _)| *r);
    let ranks: Vec<RankLoad> = latest.ranks.into_iter().map(|(_, _, l)| l).collect();
    Ok(combine(&ranks))
}
