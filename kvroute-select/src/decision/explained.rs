//! What a decision records of itself: the cached-token account every
//! decision keeps (cheap: a few numbers per pick), and the explanation a
//! host asked for ([`Decision::set_explain`]).

use kvroute_core::EndpointId;

use super::{Decision, Leg};
use crate::explain::{Explanation, PickStep, Reach, ScoreExplain, ScoreSummary, TokenAccount};
use crate::rule::Rule;
use crate::scoring::{ScoreInput, Scorer};

impl Decision {
    /// Records the [`Explanation`] of every following decision made into this
    /// value (`true`), or stops (`false`). The explanation's buffers are
    /// allocated once and reused by [`Rule::decide_into`]; a decision that
    /// was not asked records none of it and allocates nothing for it.
    pub fn set_explain(&mut self, on: bool) {
        if !on {
            self.explain = None;
        } else if self.explain.is_none() {
            self.explain = Some(Box::default());
        }
    }

    /// Whether this decision records its explanation.
    #[must_use]
    pub fn explains(&self) -> bool {
        self.explain.is_some()
    }

    /// The explanation of the decision (as of its last pick), when
    /// [`Decision::set_explain`] asked for it before the decision was made.
    #[must_use]
    pub fn explanation(&self) -> Option<&Explanation> {
        self.explain.as_deref()
    }

    /// Takes the explanation out (the decision stops explaining).
    pub fn take_explanation(&mut self) -> Option<Box<Explanation>> {
        self.explain.take()
    }

    /// The decision's cached-token account as of its last pick: what was
    /// reachable, what the target is credited with, and what each step gave
    /// up ([`crate::LostCause`]). A receipt settles it
    /// ([`Rule::settle`]).
    #[must_use]
    pub fn account(&self) -> TokenAccount {
        self.reach.selection(self.source, self.miss)
    }

    /// Tokens of endpoint `i`'s credited prefix (confirmed or predicted),
    /// at most the prompt.
    pub(super) fn credited_tokens(&self, i: usize, block_size: u32) -> u32 {
        credited_tokens(
            self.overlaps.get(i).map_or(0, |o| o.prefix),
            self.speculative.get(i).copied().unwrap_or(0),
            block_size,
            self.prompt_tokens,
        )
    }
}

fn credited_tokens(confirmed: u32, predicted: u32, block_size: u32, prompt_tokens: u32) -> u32 {
    confirmed
        .max(predicted)
        .saturating_mul(block_size)
        .min(prompt_tokens)
}

/// After a KV-exact pick of `index`: asks the scorer to explain it when the
/// host asked for the explanation, or when the winner holds less than the
/// best candidate (the account splits that between the cap and the
/// affinity slack by what the scorer says).
pub(super) fn explain_pick(
    scorer: &dyn Scorer,
    input: &ScoreInput<'_>,
    explain: Option<&mut Explanation>,
    reach: &mut Reach,
    index: usize,
) {
    let tokens = |blocks: u32| credited_tokens(blocks, 0, input.block_size, input.prompt_tokens);
    let chosen = input.candidate(index).map_or(0, |c| tokens(c.prefix()));
    let summary = match explain {
        Some(x) => {
            let mut out = ScoreExplain::with_rows(&mut x.endpoints);
            scorer.explain(input, &mut out);
            let s = out.summary;
            x.scorer = (s != ScoreSummary::default()).then_some(s);
            s
        }
        None if chosen < reach.last => {
            let mut out = ScoreExplain::summary_only();
            scorer.explain(input, &mut out);
            out.summary
        }
        None => return,
    };
    reach.admitted = summary.admitted_prefix_blocks.map(tokens);
}

impl Rule {
    /// Before a pick: the best credited prefix among its candidates (and,
    /// at the first pick, what the decision could reach at all).
    pub(super) fn reach_candidates(&self, d: &mut Decision, first: bool) {
        let bs = self.config.block_size;
        let best = crate::pool::Visit::new(&d.sampled, d.eligible.len())
            .filter(|i| d.eligible.get(*i).copied().unwrap_or(false))
            .map(|i| d.credited_tokens(i, bs))
            .max()
            .unwrap_or(0);
        d.reach.last = best;
        if first {
            d.reach.first = best;
        }
        d.reach.admitted = None;
        d.reach.diverted = false;
        if let Some(x) = d.explain.as_deref_mut() {
            x.scorer = None;
            for row in &mut x.endpoints {
                row.terms = None;
            }
        }
    }

    /// After a pick (the first, a retry, or a retry that found nothing):
    /// the chosen endpoint's credited prefix, and the explanation's step
    /// and endpoint rows.
    pub(super) fn after_pick(&self, d: &mut Decision, failed: Option<(EndpointId, Leg)>) {
        let bs = self.config.block_size;
        d.reach.chosen = d
            .target
            .map_or(0, |t| d.credited_tokens(t.endpoint.index(), bs));
        let Some(x) = d.explain.as_deref_mut() else {
            return;
        };
        x.prompt_tokens = d.prompt_tokens;
        x.block_size = bs;
        x.keys = u32::try_from(d.keys.len()).unwrap_or(u32::MAX);
        x.key_miss = d.key_miss;
        for (i, (row, e)) in x
            .endpoints
            .iter_mut()
            .zip(&self.config.endpoints)
            .enumerate()
        {
            let o = d.overlaps.get(i).copied().unwrap_or_default();
            let l = d.loads.get(i).copied().unwrap_or_default();
            row.role = e.role;
            row.capacity = e.capacity_or_one();
            row.confirmed_prefix_blocks = o.prefix;
            row.confirmed_blocks = o.blocks.max(o.prefix);
            row.predicted_prefix_blocks = d.speculative.get(i).copied().unwrap_or(0);
            row.contract_mismatch = d.mismatched.get(i).copied().unwrap_or(false);
            row.in_flight = l.in_flight;
            row.queued_prefill_tokens = l.queued_prefill_tokens;
            row.reported = d.reports.get(i).copied().flatten();
        }
        let kv = d.source == super::Source::KvExact;
        x.picks.push(PickStep {
            tier: d.source,
            miss: d.miss,
            endpoint: d.target.map(|t| t.endpoint),
            decode: d.target.and_then(|t| t.decode),
            failed,
            predicted_blocks: if kv { d.predicted_blocks } else { 0 },
            diverted: kv && d.reach.diverted,
        });
        x.account = d.reach.selection(d.source, d.miss);
    }
}
