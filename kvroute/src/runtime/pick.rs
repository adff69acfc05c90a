//! [`Pick`]: one request's decision with its load charge, its retry and its
//! receipt — the one way any host drives a request through the router.

use std::sync::Arc;

use bytes::Bytes;
use kvroute_core::{BlockKey, EndpointId};
use kvroute_select::{
    Decision, Explanation, Leg, LoadGuard, PromptInput, Request, Settlement, Target, TokenAccount,
};

use super::outlier::{self, Stall};
use super::slots::Generation;
use super::view::RouterView;
use super::Shared;
use crate::prompt::{KeepText, PreparedPrompt};
use crate::receipt::{BodyKind, OnReceipt, Receipt, ReceiptBody, ReceiptTracker};

/// What a decision is made for.
pub(crate) enum Input {
    /// A prepared OpenAI request (tokens, keys, the bodies to forward).
    Prompt {
        prompt: Box<PreparedPrompt>,
        session: Option<String>,
    },
    /// Block keys the host computed under the router's contract.
    Keys {
        keys: Vec<BlockKey>,
        prompt_tokens: u32,
        turn: kvroute_select::Turn,
    },
}

impl Input {
    /// The turn the decision is made in.
    fn turn(&self) -> kvroute_select::Turn {
        match self {
            Self::Prompt { prompt, .. } => prompt.turn(),
            Self::Keys { turn, .. } => *turn,
        }
    }
}

/// No endpoint was available for a request (all removed, excluded, drained
/// or behind open breakers, or retries spent).
#[derive(Debug, thiserror::Error)]
#[error("no endpoint available")]
pub struct NoEndpoint {
    /// The decision as it ended (its miss reason, exclusions, retries).
    pub decision: Box<Decision>,
}

/// One request's routing: the decision, the load charge on its endpoint, and
/// what a retry needs. Forward to [`Pick::url`]; on a connect failure call
/// [`Pick::retry`] for the next endpoint; wrap the response body with
/// [`Pick::into_body`] so the receipt is recorded and the charge released
/// when the body ends or the client goes away. Dropped, it releases the
/// charge.
pub struct Pick {
    shared: Arc<Shared>,
    gen: Arc<Generation>,
    decision: Decision,
    guard: Option<LoadGuard>,
    input: Input,
    /// A receipt was recorded already (a P/D prefill leg's): the response
    /// body's is not recorded again.
    recorded: bool,
    /// A request without a prompt ([`crate::KvRouter::pick_unrouted`]): its
    /// answer carries no receipt and streams through unscanned.
    pub(crate) unrouted: bool,
}

impl std::fmt::Debug for Pick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pick")
            .field("url", &self.url())
            .field("decision", &self.decision)
            .finish_non_exhaustive()
    }
}

impl Pick {
    /// Decides for `input`; with `explain`, the decision records its
    /// [`Explanation`] ([`Decision::set_explain`]).
    pub(crate) fn decide(
        shared: &Arc<Shared>,
        input: Input,
        explain: bool,
    ) -> Result<Pick, NoEndpoint> {
        let gen = shared.current();
        let mut pick = Pick {
            shared: Arc::clone(shared),
            gen,
            decision: Decision::new(),
            guard: None,
            input,
            recorded: false,
            unrouted: false,
        };
        let now = shared.now();
        let mut decision = shared.recycled.take();
        decision.set_explain(explain);
        {
            let req = pick.request();
            let view = RouterView::new(shared, now)
                .in_turn(pick.input.turn())
                .of(&pick.gen);
            pick.gen
                .rule
                .decide_into(&mut decision, &req, &view, &view, &view, now);
        }
        pick.decision = decision;
        let Some(target) = pick.decision.target() else {
            return Err(NoEndpoint {
                decision: Box::new(std::mem::take(&mut pick.decision)),
            });
        };
        let prefill = pick
            .decision
            .predicted_prefill_tokens(shared.contract.block_size);
        pick.guard = Some(shared.tracker.charge(target, prefill));
        if let Some(r) = shared
            .replicas
            .as_ref()
            .filter(|_| pick.input.turn().in_turn)
        {
            r.decided_in_turn();
        }
        if let Some(outcome) = pick.ids_outcome() {
            shared.token_ids.record(outcome);
        }
        Ok(pick)
    }

    fn request(&self) -> Request<'_> {
        match &self.input {
            Input::Prompt { prompt, session } => {
                let req = prompt.request();
                match session {
                    Some(s) => req.with_session(s),
                    None => req,
                }
            }
            Input::Keys {
                keys,
                prompt_tokens,
                ..
            } => Request::new(PromptInput::Keys {
                keys,
                contract: &self.gen.rule.config().contract,
                prompt_tokens: *prompt_tokens,
            }),
        }
    }

    fn prompt(&self) -> Option<&PreparedPrompt> {
        match &self.input {
            Input::Prompt { prompt, .. } => Some(&**prompt),
            Input::Keys { .. } => None,
        }
    }

    /// The decision (target, tier, miss reason, predicted overlap).
    #[must_use]
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// Takes the decision's [`Explanation`] (as of its last pick) out, when
    /// it was made by [`crate::KvRouter::pick_explained`]: later retries of
    /// this pick record none.
    pub fn take_explanation(&mut self) -> Option<Box<Explanation>> {
        self.decision.take_explanation()
    }

    /// The endpoint that receives the request (the prefill endpoint in P/D):
    /// its `http://host:port`. Empty once [`Pick::retry`] has returned `None`.
    #[must_use]
    pub fn url(&self) -> &str {
        self.decision
            .target()
            .and_then(|t| self.gen.urls.get(t.endpoint.index()))
            .map_or("", |u| u)
    }

    /// P/D: the decode endpoint of the target.
    #[must_use]
    pub fn decode_url(&self) -> Option<&str> {
        let d = self.decision.target()?.decode?;
        self.gen.urls.get(d.index()).map(|u| &**u)
    }

    /// The target's endpoint id (its slot).
    #[must_use]
    pub fn endpoint_id(&self) -> Option<EndpointId> {
        self.decision.target().map(|t| t.endpoint)
    }

    /// The model the body named.
    #[must_use]
    pub fn model(&self) -> Option<&str> {
        self.prompt().and_then(PreparedPrompt::model)
    }

    /// Cached tokens the decision predicts the target will report.
    #[must_use]
    pub fn predicted_cached_tokens(&self) -> u32 {
        self.decision
            .predicted_cached_tokens(self.shared.contract.block_size)
    }

    /// The body to forward to the current target: the client's, or the same
    /// with `stream_options.include_usage` added (streamed requests, unless
    /// the builder turned it off), and with
    /// [`crate::KvRouterBuilder::forward_token_ids`] a completions `prompt`
    /// replaced by its token ids when the target's engine takes them as the
    /// same request (ask again after [`Pick::retry`]: the next endpoint may
    /// be of another engine).
    #[must_use]
    pub fn upstream_body(&self, original: &Bytes) -> Bytes {
        if let Some(Ok(b)) = self.ids_body() {
            return b.clone();
        }
        self.text_body(original)
    }

    /// The body to forward as text: the client's, or the same with
    /// `stream_options.include_usage` added — what a host sends when it
    /// builds bodies of its own from it (a P/D two-step).
    #[must_use]
    pub fn text_body(&self, original: &Bytes) -> Bytes {
        self.prompt()
            .and_then(PreparedPrompt::rewritten)
            .cloned()
            .unwrap_or_else(|| original.clone())
    }

    /// The id body for the current target, or why it gets the text; `None`
    /// while forwarding is off.
    fn ids_body(&self) -> Option<Result<&Bytes, KeepText>> {
        let ids = self.prompt()?.ids()?;
        let target = self.decision.target();
        // A P/D target's legs are built from the text by the two-step.
        if target.is_some_and(|t| t.decode.is_some()) {
            return Some(Err(KeepText::PrefillDecode));
        }
        let engine = target.and_then(|t| self.gen.engines.get(t.endpoint.index()));
        Some(match engine {
            Some(e) => ids.for_engine(&**e),
            None => Err(KeepText::Engine),
        })
    }

    /// Whether [`Pick::upstream_body`] sends token ids to the current target
    /// (`Ok`), or the text and why; `None` while forwarding is off.
    #[must_use]
    pub fn ids_outcome(&self) -> Option<Result<(), KeepText>> {
        self.ids_body().map(|r| r.map(|_| ()))
    }

    /// The connection to the target failed (refused, unreachable, reset
    /// before a response): counts a failure on its breaker, excludes it, and
    /// returns the next endpoint (the next-best overlap inside the KV tier;
    /// never a decode-only endpoint for the prefill leg), or `None` when none
    /// is left or retries are spent (the load charge is released then).
    pub fn retry(&mut self) -> Option<&str> {
        self.retry_leg(Leg::Endpoint)?;
        Some(self.url())
    }

    /// [`Pick::retry`] for one leg of a P/D target.
    pub fn retry_leg(&mut self, leg: Leg) -> Option<Target> {
        let now = self.shared.now();
        let before = self.decision.target();
        if let Some(t) = before {
            let failed = match leg {
                Leg::Endpoint => t.endpoint,
                Leg::Decode => t.decode.unwrap_or(t.endpoint),
            };
            // Only if the slot still holds the endpoint that failed.
            if let Some(s) = self
                .shared
                .slots
                .get(failed.index())
                .filter(|_| self.gen.current(&self.shared, failed.index()))
            {
                s.breaker.on_failure(now);
            }
        }
        let mut decision = std::mem::take(&mut self.decision);
        let next = {
            let req = self.request();
            let view = RouterView::new(&self.shared, now).of(&self.gen);
            self.gen
                .rule
                .retry(&mut decision, leg, &req, &view, &view, now)
        };
        self.decision = decision;
        match next {
            Some(t) => {
                let prefill = self
                    .decision
                    .predicted_prefill_tokens(self.shared.contract.block_size);
                // A new decode endpoint behind the same prefill endpoint:
                // the prefill leg is not run again (it may have answered
                // already), so only the decode charge moves.
                let decode_only =
                    before.is_some_and(|b| b.endpoint == t.endpoint) && leg == Leg::Decode;
                match (self.guard.as_mut(), t.decode) {
                    (Some(g), Some(d)) if decode_only => g.retarget_decode(d),
                    (Some(g), _) => g.retarget(t, prefill),
                    (None, _) => self.guard = Some(self.shared.tracker.charge(t, prefill)),
                }
            }
            None => self.guard = None,
        }
        next
    }

    /// Waits for `response`, the upstream's answer to this request's current
    /// target (`leg`: the endpoint, or a P/D target's decode endpoint), up to
    /// its response headers: the host's HTTP client future, `Ok` once the
    /// status line and headers arrived. Meanwhile the router's outlier
    /// detection follows the attempt: it gives up with a [`Stall`] when the
    /// endpoint is ejected while the request waits on it, or when no headers
    /// came within the builder's [`crate::HeaderTimeouts`] (the streamed
    /// limit for a streamed request, except a P/D prefill leg, which is not
    /// streamed); a timeout counts against the endpoint. After a [`Stall`]
    /// nothing reached the client: call [`Pick::retry_leg`] for another
    /// endpoint. An `Err` of `response` is the host's to judge (a refused
    /// connection is retryable, a reset after sending may not be).
    ///
    /// # Errors
    /// [`Stall`].
    pub async fn await_headers<T, E, F>(&self, leg: Leg, response: F) -> Result<Result<T, E>, Stall>
    where
        F: std::future::Future<Output = Result<T, E>>,
    {
        let Some(t) = self.decision.target() else {
            return Ok(response.await);
        };
        let endpoint = match leg {
            Leg::Endpoint => t.endpoint,
            Leg::Decode => t.decode.unwrap_or(t.endpoint),
        };
        let prefill_leg = leg == Leg::Endpoint && t.decode.is_some();
        let streamed = !prefill_leg && self.prompt().is_some_and(PreparedPrompt::streamed);
        let shared = &*self.shared;
        let timeouts = shared.outliers.timeouts();
        let limit = if streamed {
            timeouts
                .streamed
                .or(timeouts.response)
                .map(|d| (d, Stall::StreamHeaderTimeout(d)))
        } else {
            timeouts.response.map(|d| (d, Stall::HeaderTimeout(d)))
        };
        // Outside outlier detection — an endpoint removed (or its slot
        // reused) since the decision, whose answer or silence says nothing
        // about the slot's endpoint now, or detection off — the header
        // timeout still applies.
        let untracked = |response: F| async move {
            match limit {
                Some((d, stall)) => tokio::time::timeout(d, response).await.map_err(|_| stall),
                None => Ok(response.await),
            }
        };
        if !self.gen.current(&self.shared, endpoint.index()) {
            return untracked(response).await;
        }
        let mut ejections = shared.outliers.subscribe();
        // Ejected since the decision: that change came before the
        // subscription, which would not wake on it.
        if shared.outliers.is_ejected(endpoint, shared.now()) {
            return Err(Stall::Ejected);
        }
        let Some(attempt) = shared.outliers.sent(endpoint, shared.now()) else {
            return untracked(response).await;
        };
        let mut waiting = Waiting {
            shared,
            endpoint,
            attempt: Some(attempt),
        };
        let start = tokio::time::Instant::now();
        let deadline = limit.map(|(d, _)| start + d);
        // When this attempt reaches the stall age: evaluated then (later
        // engine reports evaluate as they come).
        let stall_after = shared.outliers.stall_after();
        let mut stall_check = (!stall_after.is_zero()).then(|| start + stall_after);
        let mut watching = true;
        let mut response = std::pin::pin!(response);
        loop {
            tokio::select! {
                r = &mut response => {
                    if let Some(a) = waiting.attempt.take() {
                        match &r {
                            Ok(_) => outlier::answered(shared, endpoint, a, shared.now()),
                            Err(_) => shared.outliers.abandoned(endpoint, a),
                        }
                    }
                    return Ok(r);
                }
                () = sleep_until(deadline) => {
                    if let Some(a) = waiting.attempt.take() {
                        outlier::timed_out(shared, endpoint, a, shared.now());
                    }
                    return Err(limit.map_or(Stall::Ejected, |(_, s)| s));
                }
                () = sleep_until(stall_check) => {
                    stall_check = None;
                    outlier::evaluate(shared, shared.now());
                }
                changed = ejections.changed(), if watching => {
                    watching = changed.is_ok();
                }
            }
            if shared.outliers.is_ejected(endpoint, shared.now()) {
                return Err(Stall::Ejected);
            }
        }
    }

    /// The target answered (closes a half-open breaker).
    pub fn connected(&self) {
        if let Some(t) = self.decision.target() {
            for e in std::iter::once(t.endpoint).chain(t.decode) {
                self.answered(e);
            }
        }
    }

    /// P/D: only `leg`'s endpoint was reached and answered (a prefill leg
    /// that refused the request; a request the decode endpoint served
    /// whole): the other endpoint's breaker is left as it is.
    pub fn connected_leg(&self, leg: Leg) {
        if let Some(t) = self.decision.target() {
            let e = match leg {
                Leg::Endpoint => t.endpoint,
                Leg::Decode => t.decode.unwrap_or(t.endpoint),
            };
            self.answered(e);
        }
    }

    fn answered(&self, e: EndpointId) {
        if let Some(s) = self
            .shared
            .slots
            .get(e.index())
            .filter(|_| self.gen.current(&self.shared, e.index()))
        {
            s.breaker.on_success();
        }
    }

    /// The target sent its first byte (its first token, for a streamed
    /// request): the request's uncached prompt tokens stop counting as
    /// queued prefill.
    pub fn first_byte(&mut self) {
        if let Some(g) = self.guard.as_mut() {
            g.first_byte();
        }
    }

    /// Records the engine's cached-token receipt for this decision (what
    /// [`Pick::into_body`] does by itself at the body's end; after this call
    /// it records nothing more — a P/D host records the prefill leg's
    /// answer here). `false` when the receipt was not counted (no target, or
    /// implausible: more than the prompt).
    pub fn record_receipt(&mut self, cached_tokens: u32) -> bool {
        self.record_usage(cached_tokens, None)
    }

    /// [`Pick::record_receipt`] with the engine's own `usage.prompt_tokens`
    /// from the same answer ([`crate::receipt::prompt_tokens`]), which
    /// bounds a plausible receipt when the router could not count the
    /// prompt (see [`kvroute_select::Rule::record_usage`]).
    pub fn record_usage(&mut self, cached_tokens: u32, prompt_tokens: Option<u32>) -> bool {
        self.settle(cached_tokens, prompt_tokens).drift_alarm_raised
    }

    /// [`Pick::record_usage`], returning what the receipt settled: whether
    /// it was counted, and the decision's cached-token account
    /// ([`kvroute_select::Rule::settle`]).
    pub fn settle(&mut self, cached_tokens: u32, prompt_tokens: Option<u32>) -> Settlement {
        self.recorded = true;
        // An endpoint that left its slot settles nothing: the slot's
        // counters belong to whatever endpoint is there now.
        let gone = self
            .decision
            .target()
            .is_some_and(|t| !self.gen.current(&self.shared, t.endpoint.index()));
        if gone {
            return Settlement::default();
        }
        self.gen
            .rule
            .settle(&self.decision, cached_tokens, prompt_tokens)
    }

    /// The response body's usage is not this decision's receipt (a P/D
    /// decode leg's answer): [`Pick::into_body`] records nothing.
    pub fn skip_body_receipt(&mut self) {
        self.recorded = true;
    }

    /// P/D: the prefill leg runs again for the current target. A decode
    /// endpoint that received the request before failing (no headers in
    /// time, ejected meanwhile) may have pulled the prefilled KV blocks, and
    /// the prefill engine may have freed them: a retry must not hand the
    /// same transfer to another decode endpoint. The prefill endpoint is
    /// charged again, as at a decision (and counts the prefill twice: it
    /// runs twice). Call it after [`Pick::retry_leg`] for
    /// [`Leg::Decode`], before the new prefill leg.
    pub fn prefill_again(&mut self) {
        let Some(t) = self.decision.target() else {
            return;
        };
        let prefill = self
            .decision
            .predicted_prefill_tokens(self.shared.contract.block_size);
        if let Some(g) = self.guard.as_mut() {
            g.retarget(t, prefill);
        }
    }

    /// The request's load charge (e.g. [`LoadGuard::prefill_leg_done`] after
    /// a P/D prefill leg).
    pub fn guard_mut(&mut self) -> Option<&mut LoadGuard> {
        self.guard.as_mut()
    }

    /// Wraps the upstream response body: the receipt in it is recorded
    /// against this decision when it ends, and the load charge is released
    /// when it ends, errors or is dropped (a client disconnect). `headers`
    /// are the response's (SSE or JSON).
    pub fn into_body<B: http_body::Body>(
        self,
        headers: &http::HeaderMap,
        body: B,
    ) -> ReceiptBody<B> {
        self.into_receipt(headers).body(body)
    }

    /// [`Pick::into_body`] that also hands the [`Receipt`] to `on_end`.
    pub fn into_body_with<B: http_body::Body>(
        self,
        headers: &http::HeaderMap,
        body: B,
        on_end: impl FnOnce(Receipt) + Send + 'static,
    ) -> ReceiptBody<B> {
        self.into_receipt_with(headers, on_end).body(body)
    }

    /// [`Pick::into_body_with`] whose `on_end` also gets the decision's
    /// cached-token account as the receipt settled it (`None`: no receipt
    /// was counted by this body — none came, it was implausible, the body
    /// did not end, or [`Pick::settle`] had recorded one already).
    pub fn into_body_settled<B: http_body::Body>(
        self,
        headers: &http::HeaderMap,
        body: B,
        on_end: impl FnOnce(Receipt, Option<TokenAccount>) + Send + 'static,
    ) -> ReceiptBody<B> {
        self.into_receipt_settled(headers, on_end).body(body)
    }

    /// [`Pick::into_body`] for a host that is handed the response body in
    /// chunks (pingora's `response_body_filter`): feed the tracker each
    /// chunk and call [`ReceiptTracker::on_end`] at the end; the receipt is
    /// recorded against this decision then, and the load charge released
    /// then or when the tracker is dropped.
    pub fn into_receipt(self, headers: &http::HeaderMap) -> ReceiptTracker {
        self.into_receipt_with(headers, |_| {})
    }

    /// [`Pick::into_receipt`] that also hands the [`Receipt`] to `on_end`.
    pub fn into_receipt_with(
        self,
        headers: &http::HeaderMap,
        on_end: impl FnOnce(Receipt) + Send + 'static,
    ) -> ReceiptTracker {
        self.into_receipt_settled(headers, move |r, _| on_end(r))
    }

    /// [`Pick::into_receipt_with`] whose `on_end` also gets the settled
    /// account, as [`Pick::into_body_settled`].
    pub fn into_receipt_settled(
        mut self,
        headers: &http::HeaderMap,
        on_end: impl FnOnce(Receipt, Option<TokenAccount>) + Send + 'static,
    ) -> ReceiptTracker {
        let guard = self.guard.take();
        let gen = Arc::clone(&self.gen);
        let shared = Arc::clone(&self.shared);
        let decision = std::mem::take(&mut self.decision);
        let recorded = self.recorded;
        let done: OnReceipt = Box::new(move |r: Receipt| {
            let mut account = None;
            // A receipt of an endpoint that left its slot settles nothing:
            // the slot's counters belong to whatever endpoint is there now.
            let gone = decision
                .target()
                .is_some_and(|t| !gen.current(&shared, t.endpoint.index()));
            if let (false, true, Some(c), false) = (recorded, r.complete, r.cached_tokens, gone) {
                account = gen.rule.settle(&decision, c, r.prompt_tokens).account;
            }
            shared.recycled.put(decision);
            on_end(r, account);
        });
        let kind = if self.unrouted {
            BodyKind::Opaque
        } else {
            BodyKind::of(headers)
        };
        ReceiptTracker::new(kind, guard, done)
    }
}

impl Drop for Pick {
    /// A pick dropped with its decision (no answer to settle it against)
    /// leaves the decision's buffers to the next request.
    fn drop(&mut self) {
        self.shared.recycled.put(std::mem::take(&mut self.decision));
    }
}

/// An attempt [`Pick::await_headers`] waits on; one it leaves without an
/// outcome (ejected, or its future dropped: the client went away) is
/// abandoned.
struct Waiting<'a> {
    shared: &'a Shared,
    endpoint: kvroute_core::EndpointId,
    attempt: Option<kvroute_select::AttemptId>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.attempt.take() {
            self.shared.outliers.abandoned(self.endpoint, a);
        }
    }
}

/// Sleeps until `at`; forever without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvroute_core::{BlockKey, EndpointId};
    use kvroute_select::{Leg, Load, Role};

    use super::super::test_support::{host_router, HostEngine};
    use crate::{Backend, Change, KvRouter, Topology};
    use kvroute_select::BreakerState;

    /// The engine at `url` reports holding `keys` (4-token blocks).
    fn holds(router: &KvRouter, url: &str, keys: &[BlockKey]) {
        use kvroute_ingest::{BlockStored, EventBatch, KvEvent};
        let batch = EventBatch {
            seq: 0,
            timestamp: 0.0,
            dp_rank: None,
            events: vec![KvEvent::Stored(BlockStored {
                keys: keys.to_vec(),
                block_size: 4,
                ..BlockStored::default()
            })],
        };
        assert!(router.ingest(url, &batch), "{url}");
    }

    fn host_backend(url: &str) -> Backend {
        let engine: Arc<dyn crate::engine::Engine> = Arc::new(HostEngine);
        Backend::new(engine, url.to_owned()).host_events()
    }

    /// A P/D router: prefill endpoint `http://p0`, decode endpoints
    /// `http://d0..` (`decodes` of them).
    fn pd_router(decodes: usize) -> crate::KvRouterBuilder {
        let engine: Arc<dyn crate::engine::Engine> = Arc::new(HostEngine);
        let mut b = KvRouter::builder_for_keys("test/bs4", 4)
            .no_engine_load()
            .no_health_probes()
            .topology(Topology::PrefillDecode);
        let urls = std::iter::once(("http://p0".to_owned(), Role::Prefill))
            .chain((0..decodes).map(|i| (format!("http://d{i}"), Role::Decode)));
        for (url, role) in urls {
            b = b.endpoint(
                Backend::new(Arc::clone(&engine), url)
                    .role(role)
                    .host_events(),
            );
        }
        b
    }

    /// The endpoint at `old` leaves and one at `new` joins.
    fn replace(router: &KvRouter, old: &str, new: &str) {
        router
            .apply(Change::Remove(old.to_owned()))
            .expect("remove");
        router
            .apply(Change::Insert(host_backend(new)))
            .expect("insert");
    }

    /// Retries of requests decided before an endpoint left never take the
    /// endpoint that reused its slot for one they may go to: it is not the
    /// endpoint their decision's rule names there.
    #[test]
    fn a_retry_decided_before_a_slot_was_reused_does_not_go_there() {
        let router = host_router(3).build().expect("router");
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        let mut pick = router.pick_keys(&keys, 32).expect("pick");
        let first = pick.decision().target().expect("target").endpoint;
        let others: Vec<usize> = (0..3).filter(|&i| i != first.index()).collect();
        let (reused, other) = (others[0], others[1]);
        // The slot of an endpoint that leaves is taken by an idle newcomer
        // holding the whole prompt, which a retry would prefer to the busy
        // third endpoint.
        let busy = format!("http://e{other}");
        let _busy = [router.charge_unrouted(&busy), router.charge_unrouted(&busy)];
        replace(&router, &format!("http://e{reused}"), "http://new");
        assert_eq!(
            router.endpoint_id("http://new"),
            Some(EndpointId(reused as u32))
        );
        holds(&router, "http://new", &keys);
        let retried = pick.retry_leg(Leg::Endpoint).expect("a retry");
        assert_eq!(retried.endpoint, EndpointId(other as u32));
        // A request decided now may go to the newcomer.
        let now = router.pick_keys(&keys, 32).expect("pick");
        assert_eq!(
            now.decision().target().map(|t| t.endpoint),
            Some(EndpointId(reused as u32))
        );
    }

    /// A call naming an endpoint by URL that looked it up just before it
    /// left (an event batch, an engine report, a connect outcome, a drain)
    /// acts on nothing once it has left, never on the newcomer in its slot.
    #[test]
    fn a_call_that_looked_an_endpoint_up_before_it_left_never_reaches_its_slots_next_one() {
        use std::sync::atomic::Ordering;
        let router = host_router(2).build().expect("router");
        let shared = &router.shared;
        let epoch = shared.slots[1].epoch.load(Ordering::Acquire);
        assert_eq!(
            super::super::slots::at_epoch(shared, 1, epoch, |s, i| (s, i.is_some())),
            Some((1, true))
        );
        router
            .apply(Change::Remove("http://e1".to_owned()))
            .expect("remove");
        // Gone at once, before anything takes the slot.
        assert_eq!(
            super::super::slots::at_epoch(shared, 1, epoch, |s, _| s),
            None
        );
        router
            .apply(Change::Insert(host_backend("http://new")))
            .expect("insert");
        assert_eq!(router.endpoint_id("http://new"), Some(EndpointId(1)));
        assert_eq!(
            super::super::slots::at_epoch(shared, 1, epoch, |s, _| s),
            None
        );
        assert_eq!(
            super::super::slots::at_url(shared, "http://new", |s, _| s),
            Some(1)
        );
        assert_eq!(
            super::super::slots::at_url(shared, "http://e1", |s, _| s),
            None
        );
    }

    /// An engine's reported KV capacity bounds its inventory, but never above
    /// the configured bound (a huge figure would lift the memory bound, or
    /// remove it), and a report of 0 changes nothing (it would evict every
    /// key the endpoint holds).
    #[test]
    fn a_reported_capacity_never_lifts_or_empties_the_inventory_bound() {
        use kvroute_core::Medium;
        let router = host_router(1).build().expect("router");
        let index = &router.shared.index;
        let configured = index.capacity(EndpointId(0), Medium::Gpu);
        assert!(configured.is_some());
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        holds(&router, "http://e0", &keys);
        for (reported, bound) in [(u64::MAX, configured), (0, configured), (6, Some(6))] {
            router.report_engine_load(
                "http://e0",
                kvroute_select::EngineReport {
                    kv_capacity_blocks: Some(reported),
                    ..kvroute_select::EngineReport::default()
                },
            );
            assert_eq!(
                index.capacity(EndpointId(0), Medium::Gpu),
                bound,
                "{reported}"
            );
            // The scorer's cache room reads the bound in force (0: unknown).
            let seen = router
                .shared
                .reported
                .report(EndpointId(0), router.shared.now())
                .and_then(|r| r.kv_capacity_blocks);
            let want = bound.filter(|_| reported != 0);
            assert_eq!(seen, want, "{reported}");
        }
        assert_eq!(index.inventory(EndpointId(0)).total(), 6);
    }

    /// A new endpoint in a reused slot keeps nothing of the old one: not the
    /// inventory bound its engine reported, nor the predicted entries that
    /// credited it.
    #[test]
    fn a_reused_slot_starts_without_the_old_endpoints_bound_or_predictions() {
        use kvroute_core::Medium;
        let router = host_router(2).build().expect("router");
        let index = &router.shared.index;
        let default = index.capacity(EndpointId(1), Medium::Gpu);
        router.report_engine_load(
            "http://e1",
            kvroute_select::EngineReport {
                kv_capacity_blocks: Some(64),
                ..kvroute_select::EngineReport::default()
            },
        );
        assert_eq!(index.capacity(EndpointId(1), Medium::Gpu), Some(64));
        replace(&router, "http://e1", "http://x1");
        assert_eq!(router.endpoint_id("http://x1"), Some(EndpointId(1)));
        assert_eq!(index.capacity(EndpointId(1), Medium::Gpu), default);

        // Two requests for one prompt: the second is credited with the
        // first's predicted entries where the first went.
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        let first = router.pick_keys(&keys, 32).expect("pick");
        let e = first.decision().target().expect("target").endpoint;
        let second = router.pick_keys(&keys, 32).expect("pick");
        assert_eq!(second.decision().speculative_prefix()[e.index()], 8);
        drop((first, second));
        let url = router.endpoints()[e.index()].clone();
        replace(&router, &url, "http://new");
        assert_eq!(router.endpoint_id("http://new"), Some(e));
        let third = router.pick_keys(&keys, 32).expect("pick");
        let credited = third.decision().speculative_prefix();
        assert_eq!(
            credited.get(e.index()).copied().unwrap_or(0),
            0,
            "{credited:?}"
        );
    }

    /// A request whose endpoint left while it waited for headers still gives
    /// up after the header timeout (outlier detection no longer follows it).
    #[tokio::test(flavor = "current_thread")]
    async fn a_wait_on_a_removed_endpoint_still_times_out() {
        let router = host_router(2)
            .header_timeouts(crate::HeaderTimeouts {
                response: Some(std::time::Duration::from_millis(200)),
                streamed: None,
            })
            .build()
            .expect("router");
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        let pick = router.pick_keys(&keys, 32).expect("pick");
        let url = pick.url().to_owned();
        router.apply(Change::Remove(url)).expect("remove");
        let never = std::future::pending::<Result<(), ()>>();
        // Bounded here too: without the limit the wait would never end.
        let waited = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            pick.await_headers(Leg::Endpoint, never),
        )
        .await
        .expect("the header timeout ended the wait");
        assert_eq!(
            waited.err(),
            Some(crate::Stall::HeaderTimeout(
                std::time::Duration::from_millis(200)
            ))
        );
    }

    /// An endpoint ejected between the decision and the wait for its
    /// headers gives the wait up as ejected (the ejection's notice came
    /// before the wait subscribed to notices), not by the header timeout.
    #[tokio::test(flavor = "current_thread")]
    async fn an_endpoint_ejected_before_the_wait_is_given_up_at_once() {
        let router = host_router(2)
            .outlier_detection(kvroute_select::OutlierConfig {
                consecutive_timeouts: 1,
                stall_after: std::time::Duration::from_secs(60),
                ..kvroute_select::OutlierConfig::default()
            })
            .header_timeouts(crate::HeaderTimeouts {
                response: Some(std::time::Duration::from_secs(1)),
                streamed: None,
            })
            .build()
            .expect("router");
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        let pick = router.pick_keys(&keys, 32).expect("pick");
        let e = pick.decision().target().expect("target").endpoint;
        let shared = &router.shared;
        let a = shared.outliers.sent(e, shared.now()).expect("attempt");
        super::outlier::timed_out(shared, e, a, shared.now());
        assert!(shared.outliers.is_ejected(e, shared.now()));
        let never = std::future::pending::<Result<(), ()>>();
        // Not the header timeout's stall (1 s): the ejection's.
        let waited = pick.await_headers(Leg::Endpoint, never).await;
        assert_eq!(waited.err(), Some(crate::Stall::Ejected));
    }

    /// Failures of requests sent to an endpoint that has left since do not
    /// open the breaker of the endpoint now in its slot.
    #[test]
    fn failures_of_a_removed_endpoint_do_not_reach_its_slots_next_endpoint() {
        // One failure opens a breaker.
        let router = host_router(2)
            .breaker(kvroute_select::BreakerConfig {
                failure_threshold: 1,
                cool_down: std::time::Duration::from_secs(60),
            })
            .build()
            .expect("router");
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        let mut pick = router.pick_keys(&keys, 32).expect("pick");
        let failing = pick.decision().target().expect("target").endpoint;
        let url = format!("http://e{}", failing.index());
        replace(&router, &url, "http://new");
        // The request sent to the endpoint that left fails.
        let _ = pick.retry_leg(Leg::Endpoint);
        let status = router.endpoint_status("http://new").expect("new");
        assert_eq!(status.slot, failing.index());
        assert_eq!(status.breaker, BreakerState::Closed);
        // The same failure of the endpoint now in the slot opens it.
        holds(&router, "http://new", &keys);
        let mut pick = router.pick_keys(&keys, 32).expect("pick");
        assert_eq!(pick.decision().target().map(|t| t.endpoint), Some(failing));
        let _ = pick.retry_leg(Leg::Endpoint);
        let status = router.endpoint_status("http://new").expect("new");
        assert_eq!(status.breaker, BreakerState::Open);
    }

    /// P/D: a request only one leg of which reached its engine (a prefill
    /// leg that refused it, a body the decode endpoint served whole) closes
    /// that endpoint's breaker only; the other's failures still count.
    #[test]
    fn a_connect_of_one_leg_credits_only_that_endpoints_breaker() {
        let router = pd_router(1)
            .breaker(kvroute_select::BreakerConfig {
                failure_threshold: 2,
                cool_down: std::time::Duration::from_secs(60),
            })
            .build()
            .expect("router");
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        // One failure each: a second would open either breaker.
        router.record_connect("http://p0", false);
        router.record_connect("http://d0", false);
        let pick = router.pick_keys(&keys, 32).expect("pick");
        pick.connected_leg(Leg::Endpoint);
        router.record_connect("http://p0", false);
        router.record_connect("http://d0", false);
        let state = |u: &str| router.endpoint_status(u).expect("status").breaker;
        assert_eq!(state("http://p0"), BreakerState::Closed);
        assert_eq!(state("http://d0"), BreakerState::Open);
    }

    /// A P/D request whose decode endpoint fails after the prefill leg
    /// answered: the retry moves the decode charge alone. The prefill
    /// endpoint is not charged again for a prefill that does not run again,
    /// and its charged-token counter (the drain model's and the other
    /// replicas' measure of its work) counts the prefill once.
    #[test]
    fn a_decode_retry_leaves_the_prefill_leg_as_it_was() {
        let router = pd_router(2).build().expect("router");
        let keys: Vec<BlockKey> = (1..=8).map(BlockKey).collect();
        let mut pick = router.pick_keys(&keys, 32).expect("pick");
        let first = pick.decision().target().expect("target");
        assert_eq!(first.endpoint, EndpointId(0));
        let charged = router.shared.tracker.charged_tokens(EndpointId(0));
        assert!(charged > 0);
        // The prefill leg answered; the decode endpoint then fails.
        pick.guard_mut().expect("guard").prefill_leg_done();
        let retried = pick
            .retry_leg(Leg::Decode)
            .expect("another decode endpoint");
        assert_eq!(retried.endpoint, EndpointId(0));
        assert_ne!(retried.decode, first.decode);
        let tracker = &router.shared.tracker;
        assert_eq!(tracker.load(EndpointId(0)).in_flight, 0);
        assert_eq!(tracker.load(EndpointId(0)).queued_prefill_tokens, 0);
        assert_eq!(tracker.charged_tokens(EndpointId(0)), charged);
        assert_eq!(tracker.started(EndpointId(0)), 1);
        let decode = retried.decode.expect("decode");
        assert_eq!(tracker.load(decode).in_flight, 1);
        assert_eq!(tracker.load(first.decode.expect("decode")).in_flight, 0);
        drop(pick);
        for e in 0..3 {
            assert_eq!(tracker.load(EndpointId(e)).in_flight, 0);
        }
    }
}
