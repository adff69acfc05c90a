//! Per-request inputs that change block keys besides the tokens themselves.

use serde::{Deserialize, Serialize};

/// A LoRA adapter as vLLM's `LoRARequest` names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoraAdapter {
    /// `lora_name`.
    pub name: String,
    /// `lora_path`: vLLM ≥ 0.31 hashes it too, so two paths under one name never share blocks.
    pub path: String,
}

/// One multimodal item's placeholder run in the prompt (vLLM `mm_features`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmFeature {
    /// The item's identifier (its content hash or user-supplied uuid).
    pub identifier: String,
    /// First placeholder token position in the prompt.
    pub offset: u64,
    /// Number of placeholder tokens.
    pub length: u64,
}

/// The SHA-256 of the raw `prompt_embeds` bytes of one hashed window, supplied by the caller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptEmbedsDigest {
    /// First token position of the window.
    pub start: u64,
    /// One past the last token position of the window.
    pub end: u64,
    /// `sha256(prompt_embeds[start:end].numpy().tobytes())`.
    #[serde(with = "hex32")]
    pub digest: [u8; 32],
}

mod hex32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&crate::Digest::from_32(*v))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let text = String::deserialize(d)?;
        let mut out = [0u8; 32];
        match crate::digest::decode_hex_into(&text, &mut out) {
            Some(32) => Ok(out),
            _ => Err(serde::de::Error::custom("expected 64 hex digits")),
        }
    }
}

/// Everything about one request, besides its tokens, that some engine mixes into
/// block keys.
///
/// Each field belongs to the engines named in its doc. A field set for an engine
/// that does not use it is an error at hashing time (see
/// [`HashError::ExtraNotSupported`](crate::HashError::ExtraNotSupported)), never
/// silently ignored: ignoring it would produce keys the engine never publishes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequestExtras {
    /// vLLM: the LoRA adapter (`("lora", name, path)` on every block).
    pub lora: Option<LoraAdapter>,
    /// vLLM: multimodal items (`("mm", identifier, offset - block_start)`).
    pub mm_features: Vec<MmFeature>,
    /// vLLM (block 0 only) and SGLang ≥ 0.5.18 (chain seed): the request's `cache_salt`.
    pub cache_salt: Option<String>,
    /// vLLM: per-window prompt-embeds digests for prompt-embeds requests.
    pub prompt_embeds: Vec<PromptEmbedsDigest>,
    /// SGLang: the radix-cache `extra_key` of a registered LoRA (namespaces every key).
    pub sglang_extra_key: Option<String>,
    /// TensorRT-LLM: `lora_task_id`.
    pub trtllm_lora_task_id: Option<u64>,
    /// TensorRT-LLM: `cache_salt_id` (mixed into the first block only).
    pub trtllm_cache_salt_id: Option<u64>,
    /// TensorRT-LLM: `input_token_extra_ids`, one per prompt token.
    pub trtllm_token_extra_ids: Option<Vec<u64>>,
}

impl RequestExtras {
    /// No extras: a plain text request.
    pub const NONE: RequestExtras = RequestExtras {
        lora: None,
        mm_features: Vec::new(),
        cache_salt: None,
        prompt_embeds: Vec::new(),
        sglang_extra_key: None,
        trtllm_lora_task_id: None,
        trtllm_cache_salt_id: None,
        trtllm_token_extra_ids: None,
    };

    /// Names of the fields that are set (for "not supported by this engine" errors).
    pub(crate) fn set_fields(&self) -> impl Iterator<Item = &'static str> + '_ {
        [
            ("lora", self.lora.is_some()),
            ("mm_features", !self.mm_features.is_empty()),
            ("cache_salt", self.cache_salt.is_some()),
            ("prompt_embeds", !self.prompt_embeds.is_empty()),
            ("sglang_extra_key", self.sglang_extra_key.is_some()),
            ("trtllm_lora_task_id", self.trtllm_lora_task_id.is_some()),
            ("trtllm_cache_salt_id", self.trtllm_cache_salt_id.is_some()),
            (
                "trtllm_token_extra_ids",
                self.trtllm_token_extra_ids.is_some(),
            ),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
    }
}
