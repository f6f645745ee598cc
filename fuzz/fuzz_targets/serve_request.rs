//! `gturbo serve`'s request parsers on arbitrary bytes: the OpenAI chat completion,
//! Anthropic Messages and count_tokens bodies, their conversion into a conversation and
//! sampling parameters, and the error documents, give a request or an error, never a
//! panic; the stop-string matcher releases exactly the text before the first stop.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gturbo::cli::serve::parse_untrusted(data);
});
