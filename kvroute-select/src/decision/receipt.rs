//! Delivery evidence: the engine's receipt for a decision, judged
//! plausible, counted against the prediction and settled into the
//! decision's cached-token account.

use super::Decision;
use crate::counters::MissReason;
use crate::explain::{settle, unexamined, TokenAccount};
use crate::rule::Rule;

/// What [`Rule::settle`] made of a receipt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[must_use]
pub struct Settlement {
    /// The receipt was counted (the decision had a target and the receipt
    /// was plausible).
    pub counted: bool,
    /// This receipt raised the endpoint's contract-drift alarm.
    pub drift_alarm_raised: bool,
    /// The decision's cached-token account, settled by the receipt (when
    /// counted).
    pub account: Option<TokenAccount>,
}

impl Rule {
    /// The backend answered: `cached_tokens` is its
    /// `usage.prompt_tokens_details.cached_tokens`. Feeds predicted-vs-delivered
    /// accuracy and the contract-drift alarm; returns `true` when this receipt
    /// raised the alarm. [`Rule::record_usage`] without the engine's own
    /// prompt count.
    pub fn record_receipt(&self, d: &Decision, cached_tokens: u32) -> bool {
        self.record_usage(d, cached_tokens, None)
    }

    /// [`Rule::record_receipt`] with the engine's own `usage.prompt_tokens`
    /// from the same answer, when it sent one.
    ///
    /// A receipt claiming more cached tokens than the prompt has is refused
    /// and counted as implausible (it would skew accuracy and hide drift):
    /// more than the decision's prompt length when it is known, than the
    /// engine's own prompt count when it sent one, and in any case than
    /// [`crate::Thresholds::max_receipt_tokens`].
    pub fn record_usage(
        &self,
        d: &Decision,
        cached_tokens: u32,
        prompt_tokens: Option<u32>,
    ) -> bool {
        self.settle(d, cached_tokens, prompt_tokens)
            .drift_alarm_raised
    }

    /// [`Rule::record_usage`], returning what the receipt settled: besides
    /// the predicted-vs-delivered evidence, it counts the decision's
    /// cached-token account ([`Decision::account`] settled by the receipt:
    /// reachable, achieved, and lost by [`crate::LostCause`]) against the
    /// target endpoint.
    pub fn settle(
        &self,
        d: &Decision,
        cached_tokens: u32,
        prompt_tokens: Option<u32>,
    ) -> Settlement {
        let Some(t) = d.target else {
            return Settlement::default();
        };
        let bound = [
            (d.prompt_tokens > 0).then_some(d.prompt_tokens),
            prompt_tokens,
            Some(self.config.thresholds.max_receipt_tokens),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(u32::MAX);
        if cached_tokens > bound {
            self.counters.implausible_receipt();
            tracing::debug!(rule = %self.config.name, cached_tokens, prompt_tokens = d.prompt_tokens,
                reported_prompt_tokens = ?prompt_tokens,
                "receipt claims more cached tokens than the prompt has; ignored");
            return Settlement::default();
        }
        let i = t.endpoint.index();
        let account = if d.key_miss == Some(MissReason::TokenizeOverloaded) {
            // Nothing is known of an untokenized prompt's cache: its whole
            // blocks, as the engine counted them, bound what was reachable.
            let bs = self.config.block_size.max(1);
            let prompt = prompt_tokens
                .unwrap_or(0)
                .min(self.config.thresholds.max_receipt_tokens);
            unexamined(prompt / bs * bs, cached_tokens)
        } else {
            let mismatch = d.mismatched.get(i).copied().unwrap_or(false)
                || self.counters.drift_alarm(t.endpoint);
            settle(d.account(), cached_tokens, mismatch)
        };
        self.counters.account(i, &account);
        let predicted = d.predicted_cached_tokens(self.config.block_size);
        let raised = self.counters.receipt(
            t.endpoint.index(),
            u64::from(predicted),
            u64::from(cached_tokens),
            self.config.thresholds.drift_alarm_after,
        );
        if raised {
            tracing::warn!(
                rule = %self.config.name,
                endpoint = %t.endpoint,
                "predicted KV hits keep delivering zero cached tokens: hash contract drift?"
            );
        }
        Settlement {
            counted: true,
            drift_alarm_raised: raised,
            account: Some(account),
        }
    }
}
