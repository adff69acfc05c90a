//! The bounded closed-loop load generator: `concurrency` clients share a fixed
//! list of requests, each sent once; every answer is checked and timed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use serde_json::Value;

/// One request: the URL it goes to and its JSON body.
pub struct Job {
    /// Full URL.
    pub url: String,
    /// Body bytes.
    pub body: Vec<u8>,
    /// Sent as the relay's `x-bench-id` header when set.
    pub id: Option<u64>,
}

/// What one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct RunStats {
    /// Requests sent.
    pub requests: usize,
    /// Answers that were a 200 with a well-formed completion.
    pub valid: usize,
    /// Requests that failed (transport error, non-200, malformed answer).
    pub errors: usize,
    /// The first error seen, for the report.
    pub first_error: Option<String>,
    /// Wall time of the whole run, seconds.
    pub seconds: f64,
    /// Completed requests per second.
    pub requests_per_second: f64,
    /// Median latency (send → whole body read), milliseconds.
    pub p50_ms: f64,
    /// 99th percentile latency, milliseconds.
    pub p99_ms: f64,
}

/// Nearest-rank percentile of sorted samples, milliseconds.
pub fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let i = rank.clamp(1, sorted.len()) - 1;
    sorted.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// `Ok` when `body` is a completion answer: `choices[0]` with text (completions)
/// or a message (chat), and a positive `usage.prompt_tokens`.
fn check_answer(body: &[u8]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let choice = &v["choices"][0];
    if !(choice["text"].is_string() || choice["message"]["content"].is_string()) {
        return Err(format!("no choices[0] text in {v}"));
    }
    if v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) == 0 {
        return Err(format!("no usage.prompt_tokens in {v}"));
    }
    Ok(())
}

async fn one(client: &reqwest::Client, job: &Job) -> Result<(), String> {
    let mut req = client
        .post(&job.url)
        .header("content-type", "application/json");
    if let Some(id) = job.id {
        req = req.header(super::relay::ID_HEADER, id.to_string());
    }
    let resp = req
        .body(job.body.clone())
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = resp.status();
    let body = resp.bytes().await.map_err(|e| format!("body: {e}"))?;
    if status != reqwest::StatusCode::OK {
        return Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    check_answer(&body)
}

/// Sends every job once with `concurrency` clients in a closed loop.
pub async fn run(client: &reqwest::Client, jobs: Arc<Vec<Job>>, concurrency: usize) -> RunStats {
    run_with_starts(client, jobs, concurrency).await.0
}

/// [`run`], also returning when each job (by index) was sent.
pub async fn run_with_starts(
    client: &reqwest::Client,
    jobs: Arc<Vec<Job>>,
    concurrency: usize,
) -> (RunStats, Vec<Option<Instant>>) {
    let next = Arc::new(AtomicUsize::new(0));
    let starts = Arc::new(Mutex::new(vec![None; jobs.len()]));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(jobs.len())));
    let errors = Arc::new(Mutex::new((0usize, None::<String>)));
    let started = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (client, jobs, next) = (client.clone(), Arc::clone(&jobs), Arc::clone(&next));
        let (latencies, errors) = (Arc::clone(&latencies), Arc::clone(&errors));
        let starts = Arc::clone(&starts);
        clients.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let t = Instant::now();
                if let Some(slot) = starts.lock().get_mut(i) {
                    *slot = Some(t);
                }
                match one(&client, job).await {
                    Ok(()) => latencies.lock().push(t.elapsed()),
                    Err(e) => {
                        let mut errs = errors.lock();
                        errs.0 += 1;
                        errs.1.get_or_insert(e);
                    }
                }
            }
        }));
    }
    for c in clients {
        if let Err(e) = c.await {
            let mut errs = errors.lock();
            errs.0 += 1;
            errs.1.get_or_insert(format!("client task failed: {e}"));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut lat = std::mem::take(&mut *latencies.lock());
    lat.sort_unstable();
    let (errors, first_error) = std::mem::take(&mut *errors.lock());
    #[allow(clippy::cast_precision_loss)]
    let requests_per_second = if seconds > 0.0 {
        lat.len() as f64 / seconds
    } else {
        0.0
    };
    let starts = std::mem::take(&mut *starts.lock());
    let stats = RunStats {
        requests: jobs.len(),
        valid: lat.len(),
        errors,
        first_error,
        seconds,
        requests_per_second,
        p50_ms: percentile_ms(&lat, 50.0),
        p99_ms: percentile_ms(&lat, 99.0),
    };
    (stats, starts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let ms = |n: u64| Duration::from_millis(n);
        let samples: Vec<Duration> = (1..=100).map(ms).collect();
        assert_eq!(percentile_ms(&samples, 50.0), 50.0);
        assert_eq!(percentile_ms(&samples, 99.0), 99.0);
        assert_eq!(percentile_ms(&samples, 100.0), 100.0);
        assert_eq!(percentile_ms(&[ms(7)], 99.0), 7.0);
        assert_eq!(percentile_ms(&[], 50.0), 0.0);
    }

    #[test]
    fn answers_are_checked() {
        let ok = br#"{"choices":[{"text":" the"}],"usage":{"prompt_tokens":12}}"#;
        assert!(check_answer(ok).is_ok());
        let chat = br#"{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":1}}"#;
        assert!(check_answer(chat).is_ok());
        assert!(check_answer(br#"{"choices":[],"usage":{"prompt_tokens":12}}"#).is_err());
        assert!(check_answer(br#"{"choices":[{"text":"x"}]}"#).is_err());
        assert!(check_answer(b"not json").is_err());
    }
}
