//! `maxrun perplexity` against perplexities computed here from transformers'
//! float32 logits (the golden fixtures) over the same chunks, and against NLL
//! and KL divergence computed here from `maxrun --dump-logits` of each chunk
//! (to the levels of a base file, or exactly with `--base`); and its refusals
//! of texts, token files and base files that do not fit.
//!
//! The golden bound: the fixtures hold a correct float32 implementation to
//! `|z - z_golden| <= eps = 1e-3 max(1, max |z_golden|)` per logit. A
//! position's NLL, `log sum exp(z) - z_target`, then moves by at most `2 eps`
//! (each term by at most `eps`), and so does the mean NLL, which is `ln PPL`.

use std::ffi::OsStr;
use std::path::Path;

use maxc_tests::*;
use serde_json::Value;

/// A paragraph of plain English for the text path and the KL runs.
const TEXT: &str = "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt \
and wind. Every evening the keeper climbed the spiral stairs, one hundred and twelve of them, to light the lamp that \
warned the fishing boats away from the rocks below. He had done this for thirty years, through storms that shook the \
glass and calm nights when the sea lay flat as a mirror. The village had grown used to the steady beam sweeping across \
the water, and children fell asleep counting its turns. When the harbour board announced that an automatic light \
would replace him in the spring, the keeper said nothing at first. He finished his rounds, wrote the weather in his \
log as he always had, and in the morning walked down to the harbour to ask the fishermen what they thought. Most of \
them shrugged: a light is a light. But the oldest of them, a woman who had lost two brothers to the reef before the \
lighthouse was built, told him that a machine would never notice a boat in trouble, and that she would write to the \
board herself.";

/// `-log softmax(row)[target]` in f64, computed as plainly as possible:
/// shifted exponentials summed, then logs.
fn nll(row: &[f32], target: u32) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &z| m.max(z as f64));
    let sum: f64 = row.iter().map(|&z| (z as f64 - max).exp()).sum();
    -((row[target as usize] as f64 - max) - sum.ln())
}

/// `KL(p || q)` of the softmaxes of two rows, in f64.
fn kl(p_row: &[f32], q_row: &[f32]) -> f64 {
    let log_probs = |row: &[f32]| {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &z| m.max(z as f64));
        let lse = max + row.iter().map(|&z| (z as f64 - max).exp()).sum::<f64>().ln();
        row.iter().map(move |&z| z as f64 - lse).collect::<Vec<f64>>()
    };
    log_probs(p_row).iter().zip(log_probs(q_row)).map(|(lp, lq)| lp.exp() * (lp - lq)).sum()
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &z)| if z > m.1 { (i, z) } else { m }).0
}

/// A `--token-ids-file` holding `ids`.
fn token_file(tag: &str, ids: &[u32]) -> TempPath {
    let path = temp_file(tag, "ids.txt");
    let text: Vec<String> = ids.iter().map(u32::to_string).collect();
    std::fs::write(&path, text.join(" ")).unwrap();
    path
}

/// `maxrun perplexity MEF ARGS --json`, which must succeed.
fn perplexity<S: AsRef<OsStr>>(mef: &Path, args: &[S]) -> Value {
    let mut all: Vec<&OsStr> = vec!["perplexity".as_ref(), mef.as_os_str()];
    all.extend(args.iter().map(AsRef::as_ref));
    all.push("--json".as_ref());
    let (code, out, err) = run_bin("maxrun", &all);
    assert_eq!(code, 0, "maxrun perplexity {all:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// `maxrun perplexity` over golden prompts as token files: one chunk of case
/// 2's 17 tokens, and two chunks of 10 (case 0, then case 2's first 10 tokens,
/// then case 1's 5, which fill no chunk and are left out). Causal attention
/// makes the logits of a prefix the first rows of the prompt's, so each
/// chunk's expected NLLs come from the golden rows of its prompt. Also checks
/// that the NLLs are exactly those of `maxrun --dump-logits` on each chunk.
fn check_against_golden(name: &str, mef: &Path) {
    let golden = golden(name);
    let cases = cases(&golden);
    let ids: Vec<Vec<u32>> = cases.iter().map(|c| ids(&c["input_ids"])).collect();
    let logits: Vec<(Vec<usize>, Vec<f32>)> = cases.iter().map(|c| golden_logits(name, c)).collect();
    // (token sequence, ctx, the chunks as (case, tokens of the case))
    let scenarios: [(Vec<u32>, usize, Vec<usize>); 2] = [
        (ids[2].clone(), 17, vec![2]),
        ([&ids[0][..], &ids[2][..10], &ids[1][..]].concat(), 10, vec![0, 2]),
    ];
    for (tokens, ctx, chunk_cases) in scenarios {
        let file = token_file(&format!("ppl-golden-{name}-{ctx}"), &tokens);
        let r = perplexity(mef, &["--token-ids-file".as_ref(), file.as_os_str(), "--ctx".as_ref(), ctx.to_string().as_ref()]);
        let first = ctx / 2;
        let (mut gold, mut ours, mut eps) = (Vec::new(), Vec::new(), 0.0f64);
        for (chunk, &case) in chunk_cases.iter().enumerate() {
            let (shape, g) = &logits[case];
            let vocab = shape[1];
            let max_golden = g.iter().fold(0.0f32, |m, z| m.max(z.abs())) as f64;
            eps = eps.max(1e-3 * max_golden.max(1.0));
            let chunk_ids = &tokens[chunk * ctx..(chunk + 1) * ctx];
            assert_eq!(chunk_ids, &ids[case][..ctx]);
            let (_, dumped) = dump_logits(mef, &serde_json::json!({ "input_ids": chunk_ids }));
            // Positions first..ctx-2 predict the next token.
            for p in first..ctx - 1 {
                gold.push(nll(&g[p * vocab..(p + 1) * vocab], chunk_ids[p + 1]));
                ours.push(nll(&dumped[p * vocab..(p + 1) * vocab], chunk_ids[p + 1]));
            }
        }
        let n = gold.len() as f64;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / n;
        let (gold_mean, ours_mean) = (mean(&gold), mean(&ours));
        let what = format!("{name}, ctx {ctx}");
        assert_eq!((r["ctx"].as_u64(), r["chunks"].as_u64(), r["tokens_scored"].as_u64()), (Some(ctx as u64), Some(chunk_cases.len() as u64), Some(gold.len() as u64)), "{what}: {r}");
        let ln_ppl = f(&r["ppl"]).ln();
        eprintln!("{what}: PPL {} (golden {:.6}, {} tokens), |ln PPL - golden| {:.2e} <= 2 eps = {:.2e}", r["ppl"], gold_mean.exp(), gold.len(), (ln_ppl - gold_mean).abs(), 2.0 * eps);
        assert!((ln_ppl - gold_mean).abs() <= 2.0 * eps, "{what}: ln PPL {ln_ppl} vs golden {gold_mean}, beyond 2 eps = {}", 2.0 * eps);
        // The same logits as --dump-logits gives: the scoring itself is exact.
        assert!((ln_ppl - ours_mean).abs() <= 1e-9 * ours_mean.abs().max(1.0), "{what}: ln PPL {ln_ppl} vs {ours_mean} from --dump-logits");
        // Standard error: the sample deviation of the NLLs over sqrt(n) (n - 1
        // in the variance); each NLL within 2 eps moves it by at most 2 eps / sqrt(n - 1).
        let stderr = |v: &[f64], m: f64| (v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n / (n - 1.0)).sqrt();
        let (u_gold, u_ours) = (stderr(&gold, gold_mean), stderr(&ours, ours_mean));
        let reported = f(&r["ppl_stderr"]) / f(&r["ppl"]);
        assert!((reported - u_ours).abs() <= 1e-9, "{what}: stderr / PPL {reported} vs {u_ours}");
        assert!((reported - u_gold).abs() <= 2.0 * eps / (n - 1.0).sqrt() + 1e-12, "{what}: stderr / PPL {reported} vs golden {u_gold}");
    }
}

/// tiny-llama (float32, transformers' goldens), the text path, and every
/// refusal: missing, empty and short texts, bad token files, a --ctx beyond the
/// artifact, base files from another ctx or text, damaged base files.
#[test]
fn tiny_llama_perplexity_matches_transformers_and_bad_inputs_are_refused() {
    let mef = compile_model("ppl-tiny-llama", &fixture("tiny-llama"), &["--quantization-encoding", "float32", "--max-length", "128"]);
    check_against_golden("tiny-llama", &mef);

    // -f TEXT is the artifact's tokenizer's ids (special tokens as it adds them).
    let dir = temp_dir("ppl-text");
    let text = dir.join("text.txt");
    std::fs::write(&text, TEXT).unwrap();
    let tokenizer: tokenizers::Tokenizer = maxrun_runtime::artifact::Artifact::open(&mef).unwrap().tokenizer_json().unwrap().parse().unwrap();
    let ids = tokenizer.encode(TEXT, true).unwrap().get_ids().to_vec();
    assert!(ids.len() > 150, "{} tokens", ids.len());
    let ids_file = token_file("ppl-text-ids", &ids);
    let by_text = perplexity(&mef, &["-f".as_ref(), text.as_os_str(), "--ctx".as_ref(), "32".as_ref()]);
    let by_ids = perplexity(&mef, &["--token-ids-file".as_ref(), ids_file.as_os_str(), "--ctx".as_ref(), "32".as_ref()]);
    assert_eq!(by_text, by_ids, "the text and its token ids score alike");
    assert_eq!(by_text["chunks"].as_u64(), Some(ids.len() as u64 / 32));
    assert_eq!(perplexity(&mef, &["-f".as_ref(), text.as_os_str(), "--ctx".as_ref(), "32".as_ref(), "--chunks".as_ref(), "2".as_ref()])["tokens_scored"].as_u64(), Some(2 * 15));
    // The default ctx is the artifact's context when it is below 512 (128 here).
    assert_eq!(perplexity(&mef, &["-f".as_ref(), text.as_os_str()])["ctx"].as_u64(), Some(128));

    let run = |args: &[&OsStr]| {
        let mut all: Vec<&OsStr> = vec!["perplexity".as_ref(), mef.as_os_str()];
        all.extend_from_slice(args);
        run_bin("maxrun", &all)
    };
    let missing = dir.join("missing.txt");
    assert_clean_error(&run(&["-f".as_ref(), missing.as_os_str()]), 1, &["missing.txt"]);
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "  \n").unwrap();
    assert_clean_error(&run(&["-f".as_ref(), empty.as_os_str()]), 1, &["empty.txt", "empty"]);
    assert_clean_error(&run(&["-f".as_ref(), text.as_os_str(), "--ctx".as_ref(), "100000".as_ref()]), 1, &["--ctx 100000", "128", "max_length"]);
    let short = dir.join("short.txt");
    std::fs::write(&short, "A short text.").unwrap();
    assert_clean_error(&run(&["-f".as_ref(), short.as_os_str(), "--ctx".as_ref(), "64".as_ref()]), 1, &["short.txt", "needs (64)", "tokens, fewer"]);
    let bad_ids = dir.join("bad.txt");
    std::fs::write(&bad_ids, "1 2 99999999").unwrap();
    assert_clean_error(&run(&["--token-ids-file".as_ref(), bad_ids.as_os_str(), "--ctx".as_ref(), "3".as_ref()]), 1, &["bad.txt", "item 3", "outside"]);
    assert_clean_error(&run(&[]), 2, &["-f TEXT"]);
    assert_clean_error(&run(&["-f".as_ref(), text.as_os_str(), "--kl-divergence".as_ref()]), 2, &["--kl-divergence-base"]);

    // A base file, then runs that do not fit it.
    let base = dir.join("base.kld");
    let written = perplexity(&mef, &["-f".as_ref(), text.as_os_str(), "--ctx".as_ref(), "32".as_ref(), "--kl-divergence-base".as_ref(), base.as_os_str()]);
    assert_eq!(written["ppl"], by_text["ppl"]);
    let with = |extra: &[&OsStr]| {
        let mut args: Vec<&OsStr> = vec!["--kl-divergence-base".as_ref(), base.as_os_str(), "--kl-divergence".as_ref()];
        args.extend_from_slice(extra);
        run(&args)
    };
    // Without a text the base's own tokens are used.
    let same = perplexity(&mef, &[OsStr::new("--kl-divergence-base"), base.as_os_str(), OsStr::new("--kl-divergence")]);
    assert_eq!((same["ppl"].clone(), same["kl"]["ppl_base"].clone(), same["kl"]["same_top"].as_f64()), (by_text["ppl"].clone(), by_text["ppl"].clone(), Some(1.0)));
    assert!(f(&same["kl"]["mean_kld"]).abs() < 1e-7, "{}", same["kl"]);
    assert_clean_error(&with(&["-f".as_ref(), text.as_os_str(), "--ctx".as_ref(), "16".as_ref()]), 1, &["base.kld", "--ctx 32", "--ctx 16"]);
    let other_text = dir.join("other.txt");
    std::fs::write(&other_text, TEXT.replace("lighthouse", "windmill")).unwrap();
    assert_clean_error(&with(&["-f".as_ref(), other_text.as_os_str()]), 1, &["base.kld", "other.txt", "another text"]);
    assert_clean_error(&with(&["-f".as_ref(), short.as_os_str()]), 1, &["base.kld", "short.txt", "gives only"]);
    assert_clean_error(&run(&["-f".as_ref(), text.as_os_str(), "--kl-divergence-base".as_ref(), text.as_os_str()]), 1, &["text.txt", "an input"]);
    let good = std::fs::read(&base).unwrap();
    let mut damaged = good.clone();
    let at = damaged.len() - 1000;
    damaged[at] ^= 0x40;
    std::fs::write(&base, &damaged).unwrap();
    assert_clean_error(&with(&["-f".as_ref(), text.as_os_str()]), 1, &["base.kld", "checksum", "write it again"]);
    std::fs::write(&base, &good[..good.len() / 2]).unwrap();
    assert_clean_error(&with(&["-f".as_ref(), text.as_os_str()]), 1, &["base.kld", "short"]);
    std::fs::write(&base, TEXT).unwrap();
    assert_clean_error(&with(&["-f".as_ref(), text.as_os_str()]), 1, &["base.kld", "MAXRUNKL"]);
}

/// SmolLM2 (a real model): float32 against transformers' goldens; then the KL
/// divergence of a q8_0 artifact against the float32 one, through a base file
/// and with `--base`, against KL, top-1 agreement and PPLs computed here from
/// `--dump-logits` of every chunk; and the float32 artifact against its own
/// base (KL 0, every top the same).
#[test]
fn smollm2_perplexity_and_kl_divergence_match_direct_computation() {
    let gguf = smollm2_gguf();
    let f32_mef = compile_model("ppl-smollm2-f32", &gguf, &["--quantization-encoding", "float32", "--max-length", "256"]);
    check_against_golden("smollm2-135m", &f32_mef);
    let q8_mef = compile_model("ppl-smollm2-q8_0", &gguf, &["--quantization-encoding", "q8_0", "--max-length", "256"]);

    let tokenizer: tokenizers::Tokenizer = maxrun_runtime::artifact::Artifact::open(&f32_mef).unwrap().tokenizer_json().unwrap().parse().unwrap();
    let ids = tokenizer.encode(TEXT, true).unwrap().get_ids().to_vec();
    let ctx = 64;
    let chunks = ids.len() / ctx;
    assert!(chunks >= 3, "{} tokens", ids.len());
    let ids_file = token_file("ppl-smollm2-ids", &ids);
    let dir = temp_dir("ppl-smollm2-base");
    let base = dir.join("f32.kld");
    let common: Vec<&OsStr> = vec!["--token-ids-file".as_ref(), ids_file.as_os_str(), "--ctx".as_ref(), "64".as_ref()];
    let args = |extra: &[&OsStr]| -> Vec<std::ffi::OsString> { common.iter().chain(extra).map(|a| a.to_os_string()).collect() };

    // Direct: per chunk, both artifacts' logits, then every scored position.
    let (mut kls, mut same_top, mut nll_f32, mut nll_q8) = (Vec::new(), 0, Vec::new(), Vec::new());
    for c in 0..chunks {
        let chunk = &ids[c * ctx..(c + 1) * ctx];
        let case = serde_json::json!({ "input_ids": chunk });
        let ((shape, p), (_, q)) = (dump_logits(&f32_mef, &case), dump_logits(&q8_mef, &case));
        let vocab = shape[1];
        for pos in ctx / 2..ctx - 1 {
            let (pr, qr) = (&p[pos * vocab..(pos + 1) * vocab], &q[pos * vocab..(pos + 1) * vocab]);
            kls.push(kl(pr, qr));
            same_top += (argmax(pr) == argmax(qr)) as usize;
            nll_f32.push(nll(pr, chunk[pos + 1]));
            nll_q8.push(nll(qr, chunk[pos + 1]));
        }
    }
    let n = kls.len() as f64;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / n;
    let (mean_kl, max_kl) = (mean(&kls), kls.iter().fold(0.0f64, |m, &k| m.max(k)));
    let (ppl_f32, ppl_q8, top) = (mean(&nll_f32).exp(), mean(&nll_q8).exp(), same_top as f64 / n);
    eprintln!("direct: {n} positions, PPL f32 {ppl_f32:.4}, q8_0 {ppl_q8:.4}, mean KL {mean_kl:.3e}, max {max_kl:.3e}, same top {top:.4}");
    assert!(mean_kl > 1e-5 && mean_kl < 0.05, "q8_0 against float32: small but not nothing ({mean_kl})");

    let written = perplexity(&f32_mef, &args(&["--kl-divergence-base".as_ref(), base.as_os_str()]));
    assert!((f(&written["ppl"]) - ppl_f32).abs() <= 1e-9 * ppl_f32, "{written}");
    assert_eq!(written["tokens_scored"].as_u64(), Some(n as u64));

    // The float32 artifact against its own base: the same PPL, KL 0 to the levels' rounding.
    let itself = perplexity(&f32_mef, &args(&["--kl-divergence-base".as_ref(), base.as_os_str(), "--kl-divergence".as_ref()]));
    let k = &itself["kl"];
    assert_eq!((itself["ppl"].clone(), k["ppl_base"].clone(), k["same_top"].as_f64(), k["ln_ppl_ratio"].as_f64()), (written["ppl"].clone(), written["ppl"].clone(), Some(1.0), Some(0.0)), "{itself}");
    assert!(f(&k["mean_kld"]).abs() < 1e-7 && f(&k["kld"]["max"]) < 1e-6, "{k}");

    // q8_0 against the base file and against the float32 artifact run beside it.
    let from_file = perplexity(&q8_mef, &args(&["--kl-divergence-base".as_ref(), base.as_os_str(), "--kl-divergence".as_ref()]));
    let beside = perplexity(&q8_mef, &args(&["--base".as_ref(), f32_mef.as_os_str()]));
    for (how, r, tolerance) in [("--base", &beside, 1e-9f64), ("base file", &from_file, 1e-5)] {
        let k = &r["kl"];
        eprintln!("{how}: PPL {} base {} mean KL {} max {} same top {}", r["ppl"], k["ppl_base"], k["mean_kld"], k["kld"]["max"], k["same_top"]);
        assert!((f(&r["ppl"]) - ppl_q8).abs() <= 1e-9 * ppl_q8, "{how}: PPL {} vs {ppl_q8}", r["ppl"]);
        assert!((f(&k["ppl_base"]) - ppl_f32).abs() <= 1e-9 * ppl_f32, "{how}: base PPL {} vs {ppl_f32}", k["ppl_base"]);
        assert!((f(&k["mean_kld"]) - mean_kl).abs() <= tolerance.max(1e-9 * mean_kl), "{how}: mean KL {} vs {mean_kl}", k["mean_kld"]);
        assert!((f(&k["kld"]["max"]) - max_kl).abs() <= 10.0 * tolerance, "{how}: max KL {} vs {max_kl}", k["kld"]["max"]);
        assert_eq!(k["same_top"].as_f64(), Some(top), "{how}");
    }
}
