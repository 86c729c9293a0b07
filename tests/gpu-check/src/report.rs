//! One row per (fixture, encoding, form): what was measured, the verdict, and the
//! Markdown table and JSON that docs/gpu.md and the GPU machine's output take.

use serde_json::{json, Value};

/// Passed, failed (with reasons), or not run (with why).
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Pass,
    Fail(Vec<String>),
    Skipped(String),
}

#[derive(Clone, Debug)]
pub struct Row {
    pub fixture: String,
    pub encoding: String,
    pub form: String,
    pub device: String,
    pub artifact_mib: Option<f64>,
    /// The worst case's max |ours - golden| over its float32 tolerance.
    pub golden_error: Option<f32>,
    /// (agreeing positions, positions).
    pub top1: Option<(usize, usize)>,
    pub mean_kl: Option<f64>,
    /// Per case: (greedy ids equal to the golden's from the start, ids compared).
    pub greedy: Vec<(usize, usize)>,
    /// Generators: the worst case's max |ours - CPU code| over the tolerance;
    /// encoders: 1 - the lowest cosine with the CPU code's embeddings.
    pub cpu_error: Option<f32>,
    /// Encoders: the lowest cosine with a golden embedding.
    pub cosine: Option<f64>,
    pub decode_tok_s: Option<f64>,
    pub seconds: f64,
    pub verdict: Verdict,
}

impl Row {
    pub fn new(fixture: &str, encoding: &str, form: &str, device: &str) -> Row {
        Row {
            fixture: fixture.into(),
            encoding: encoding.into(),
            form: form.into(),
            device: device.into(),
            artifact_mib: None,
            golden_error: None,
            top1: None,
            mean_kl: None,
            greedy: vec![],
            cpu_error: None,
            cosine: None,
            decode_tok_s: None,
            seconds: 0.0,
            verdict: Verdict::Pass,
        }
    }

    pub fn set_verdict(&mut self, failures: Vec<String>) {
        self.verdict = if failures.is_empty() { Verdict::Pass } else { Verdict::Fail(failures) };
    }

    pub fn set_skipped(&mut self, why: String) {
        self.verdict = Verdict::Skipped(why);
    }

    pub fn failed(&self) -> bool {
        matches!(self.verdict, Verdict::Fail(_))
    }

    fn verdict_text(&self) -> String {
        match &self.verdict {
            Verdict::Pass => "pass".into(),
            Verdict::Fail(why) => format!("FAIL: {}", why.join("; ")),
            Verdict::Skipped(why) => why.clone(),
        }
    }

    fn greedy_text(&self) -> String {
        self.greedy.iter().map(|(a, b)| format!("{a}/{b}")).collect::<Vec<_>>().join(" ")
    }

    /// One line for the log as the check goes.
    pub fn line(&self) -> String {
        format!(
            "{} {} {} on {}: {} ({:.1} s; golden {}, cpu {}, top-1 {}, KL {}, greedy {})",
            self.fixture,
            self.encoding,
            self.form,
            self.device,
            self.verdict_text(),
            self.seconds,
            opt(self.golden_error.map(|e| format!("{e:.3}x"))),
            opt(self.cpu_error.map(|e| format!("{e:.3}x"))),
            opt(self.top1.map(|(a, n)| format!("{a}/{n}"))),
            opt(self.mean_kl.map(|k| format!("{k:.1e}"))),
            self.greedy_text()
        )
    }

    pub fn json(&self) -> Value {
        json!({
            "fixture": self.fixture,
            "encoding": self.encoding,
            "form": self.form,
            "device": self.device,
            "artifact_mib": self.artifact_mib,
            "golden_error_over_tolerance": self.golden_error,
            "top1": self.top1.map(|(a, n)| json!([a, n])),
            "mean_kl": self.mean_kl,
            "greedy_prefix": self.greedy.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>(),
            "cpu_error_over_tolerance": self.cpu_error,
            "min_cosine": self.cosine,
            "decode_tok_s": self.decode_tok_s,
            "seconds": self.seconds,
            "verdict": self.verdict_text(),
        })
    }
}

fn opt(s: Option<String>) -> String {
    s.unwrap_or_else(|| "-".into())
}

/// The results table: errors as multiples of the float32 tolerance (1.0 is the
/// bound), top-1 and KL against the golden, greedy prefixes per case.
pub fn markdown(rows: &[Row]) -> String {
    let mut s = String::from(
        "| fixture | encoding | form | device | golden err / tol | vs CPU code / tol | top-1 | mean KL | greedy (per case) | decode tok/s | verdict |\n|---|---|---|---|---:|---:|---:|---:|---|---:|---|\n",
    );
    for r in rows {
        let golden = match (r.golden_error, r.cosine) {
            (Some(e), _) => format!("{e:.3}"),
            (None, Some(c)) => format!("cos {c:.6}"),
            _ => "-".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.fixture,
            r.encoding,
            r.form,
            r.device,
            golden,
            opt(r.cpu_error.map(|e| format!("{e:.3}"))),
            opt(r.top1.map(|(a, n)| format!("{a}/{n}"))),
            opt(r.mean_kl.map(|k| format!("{k:.1e}"))),
            r.greedy_text(),
            opt(r.decode_tok_s.map(|t| format!("{t:.0}"))),
            r.verdict_text()
        ));
    }
    let (pass, fail) = (rows.iter().filter(|r| r.verdict == Verdict::Pass).count(), rows.iter().filter(|r| r.failed()).count());
    s.push_str(&format!("\n{pass} passed, {fail} failed, {} not run\n", rows.len() - pass - fail));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_shows_in_the_table_and_the_count() {
        let mut ok = Row::new("tiny-llama", "float32", "gpu", "gpu");
        ok.set_verdict(vec![]);
        let mut bad = Row::new("tiny-llama", "q8_0", "fat", "gpu");
        bad.set_verdict(vec!["top-1 0.5 < 0.98".into()]);
        let mut skipped = Row::new("tiny-llama", "q8_0", "gpu", "cpu");
        skipped.set_skipped("dry run".into());
        let t = markdown(&[ok, bad.clone(), skipped]);
        assert!(t.contains("FAIL: top-1 0.5 < 0.98"), "{t}");
        assert!(t.contains("1 passed, 1 failed, 1 not run"), "{t}");
        assert!(bad.failed());
        assert_eq!(bad.json()["verdict"], "FAIL: top-1 0.5 < 0.98");
    }
}
