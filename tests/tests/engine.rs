//! The engine's pieces against the tokenizers of the fixtures: streamed text
//! reassembles to the tokenizer's own decode of the whole reply (the oracle),
//! stop strings cut it where `str::find` says, and nothing past a stop string
//! is ever handed out.

use maxc_tests::*;
use maxrun::engine::text::TextStream;

fn tokenizer(name: &str) -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_file(fixture(name).join("tokenizer.json")).unwrap()
}

/// Every golden reply of a fixture, as token ids.
fn replies(name: &str) -> Vec<Vec<u32>> {
    cases(&golden(name)).iter().map(|c| ids(&c["greedy_ids"])).collect()
}

#[test]
fn streamed_text_is_the_decode_of_the_whole_reply() {
    // A byte-level BPE vocabulary of 49152 (tiny-llama's is SmolLM2's) and the
    // arch fixtures' 1024-token one, whose greedy texts split characters.
    for name in ["tiny-llama", "arch-gemma2", "arch-gpt2", "arch-phi3"] {
        let tok = tokenizer(name);
        for ids in replies(name) {
            let mut stream = TextStream::new(vec![]);
            let mut streamed = String::new();
            for &id in &ids {
                stream.push(&tok, id).unwrap();
                let piece = stream.take();
                assert!(!piece.contains('\u{FFFD}') || tok.decode(&ids, false).unwrap().contains('\u{FFFD}'), "{name}: half a character handed out");
                streamed.push_str(&piece);
            }
            streamed.push_str(&stream.finish(&tok).unwrap());
            assert_eq!(streamed, tok.decode(&ids, false).unwrap(), "{name}: {ids:?}");
        }
    }
}

#[test]
fn a_stop_string_ends_the_text_before_it() {
    let tok = tokenizer("tiny-llama");
    for ids in replies("tiny-llama") {
        let full = tok.decode(&ids, false).unwrap();
        // A stop string from the middle of the reply, three characters long.
        let chars: Vec<char> = full.chars().collect();
        let mid = chars.len() / 2;
        let stop: String = chars[mid..mid + 3].iter().collect();
        let want = &full[..full.find(&stop).unwrap()];
        let mut stream = TextStream::new(vec!["never appears".into(), stop.clone()]);
        let mut streamed = String::new();
        for &id in &ids {
            stream.push(&tok, id).unwrap();
            streamed.push_str(&stream.take());
            assert!(!streamed.contains(&stop), "handed out the stop string {stop:?}: {streamed:?}");
            if stream.stopped() {
                break;
            }
        }
        assert!(stream.stopped(), "{stop:?} in {full:?}");
        streamed.push_str(&stream.finish(&tok).unwrap());
        assert_eq!(streamed, want);
        assert_eq!(stream.text(), want);
    }
}
