//! The `maxrun` command line's library half: what its subcommands compute
//! beyond running the engine, kept apart from `main.rs`'s argument parsing so
//! that they are unit-tested: `maxrun bench` (single stream, batched and
//! speculative figures), `maxrun inspect`'s text and `maxrun perplexity` (perplexity and KL divergence
//! against a base, llama-perplexity's method).

pub mod bench;
pub mod bench_speculation;
pub mod inspect_text;
pub mod perplexity;
