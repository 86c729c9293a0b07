//! `gpu-check`: compiles every golden fixture at every encoding, GPU-only and fat,
//! runs each golden case on the GPU (or, as a dry run, on the CPU), and reports
//! the error against the goldens and against the CPU code of the same weights.
//!
//! scripts/gpu-check.sh builds and runs it; docs/gpu.md holds its results. For each
//! (fixture, encoding) the fat artifact runs first: its CPU code gives the
//! reference of the same quantized weights, against which both forms' GPU runs
//! must stay within the fixtures README's float32 tolerance, whatever the
//! encoding's budget against the golden.

mod matrix;
mod metrics;
mod report;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use serde_json::Value;

use maxrun_runtime::artifact::Artifact;
use maxrun_runtime::runner::{Device, Runner};

use matrix::{Budget, Fixture, Form, Kind};
use report::Row;

#[derive(Parser)]
#[command(name = "gpu-check", about = "Run every golden fixture at every encoding on a device and compare with the goldens")]
struct Cli {
    /// The maxc binary that compiles the artifacts.
    #[arg(long)]
    maxc: PathBuf,
    /// The golden fixtures (the layout of ../shared/fixtures).
    #[arg(long)]
    fixtures: PathBuf,
    /// SmolLM2-135M-Instruct's Q4_1 GGUF (skipped when not given).
    #[arg(long)]
    smollm2_gguf: Option<PathBuf>,
    /// all-MiniLM-L6-v2's folder (skipped when not given).
    #[arg(long)]
    minilm: Option<PathBuf>,
    /// Where artifacts are written (removed after their runs unless --keep).
    #[arg(long)]
    work: PathBuf,
    /// gpu: GPU runs checked against the goldens and the CPU code; cpu: a dry run
    /// (fat artifacts on the CPU, GPU-only artifacts only compiled and assembled).
    #[arg(long, default_value = "gpu")]
    device: String,
    /// The GPU architecture to compile for.
    #[arg(long, default_value = "sm_90")]
    arch: String,
    /// Only these fixtures (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Only these encodings.
    #[arg(long, value_delimiter = ',')]
    encodings: Vec<String>,
    /// Only these forms (gpu, fat).
    #[arg(long, value_delimiter = ',')]
    forms: Vec<String>,
    /// At most this many golden cases per fixture (all by default).
    #[arg(long)]
    cases: Option<usize>,
    /// At most this many greedy tokens per case (the golden's count by default).
    #[arg(long)]
    greedy_tokens: Option<usize>,
    /// ptxas, to assemble GPU-only artifacts' PTX in a dry run.
    #[arg(long)]
    ptxas: Option<PathBuf>,
    /// Keep the artifacts, and reuse those already in --work.
    #[arg(long)]
    keep: bool,
    /// Write the rows as JSON here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write the Markdown table here (it is printed either way).
    #[arg(long)]
    markdown: Option<PathBuf>,
}

/// What one run of an artifact produced for each golden case.
#[derive(Clone, Debug, Default)]
struct Outputs {
    /// Generators: `[seq, vocab]` logits per case. Encoders: one embedding per sentence.
    values: Vec<Vec<f32>>,
    /// Greedy ids per case (generators).
    greedy: Vec<Vec<u32>>,
    /// Decode tokens per second over the greedy runs.
    decode_tok_s: f64,
}

/// The golden of one fixture.
struct Golden {
    inputs: Vec<Vec<u32>>,
    /// Logits per case, or embeddings per sentence.
    values: Vec<Vec<f32>>,
    greedy: Vec<Vec<u32>>,
}

fn ids(v: &Value) -> Result<Vec<u32>> {
    v.as_array().ok_or_else(|| anyhow!("not an id list"))?.iter().map(|x| x.as_u64().map(|i| i as u32).ok_or_else(|| anyhow!("not an id"))).collect()
}

fn load_golden(f: &Fixture, max_cases: Option<usize>) -> Result<Golden> {
    let path = f.golden.join("golden.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).with_context(|| path.display().to_string())?)?;
    let take = max_cases.unwrap_or(usize::MAX);
    match f.kind {
        Kind::Generator => {
            let cases = v["cases"].as_array().ok_or_else(|| anyhow!("{}: no cases", path.display()))?;
            let mut g = Golden { inputs: vec![], values: vec![], greedy: vec![] };
            for case in cases.iter().take(take) {
                g.inputs.push(ids(&case["input_ids"])?);
                g.greedy.push(ids(&case["greedy_ids"])?);
                let file = f.golden.join(case["logits_file"].as_str().ok_or_else(|| anyhow!("no logits_file"))?);
                g.values.push(maxrun_runtime::npy::read_f32(&file).map_err(|e| anyhow!("{e}"))?.1);
            }
            Ok(g)
        }
        Kind::Encoder => {
            let inputs: Vec<Vec<u32>> = v["input_ids"].as_array().ok_or_else(|| anyhow!("no input_ids"))?.iter().map(ids).collect::<Result<_>>()?;
            let (shape, data) = maxrun_runtime::npy::read_f32(&f.golden.join("embeddings.npy")).map_err(|e| anyhow!("{e}"))?;
            let width = shape[1];
            let values: Vec<Vec<f32>> = data.chunks(width).map(<[f32]>::to_vec).collect();
            let n = inputs.len().min(take);
            Ok(Golden { inputs: inputs[..n].to_vec(), values: values[..n].to_vec(), greedy: vec![] })
        }
    }
}

/// The greedy choice, never an end-of-sequence token when `eos` lists them.
fn greedy(logits: &[f32], eos: &[u32]) -> u32 {
    if eos.is_empty() {
        return maxrun_runtime::sampler::argmax(logits);
    }
    let mut masked = logits.to_vec();
    for &e in eos {
        if let Some(l) = masked.get_mut(e as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
    maxrun_runtime::sampler::argmax(&masked)
}

/// Runs every golden input through `artifact` on `device`.
fn run(artifact: &Path, device: Device, golden: &Golden, f: &Fixture, greedy_tokens: Option<usize>) -> Result<Outputs> {
    let kind = f.kind;
    let a = Artifact::open(artifact).map_err(|e| anyhow!("{e}"))?;
    let eos = if f.ignore_eos { a.header.tokenizer.eos_token_ids.clone() } else { vec![] };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (mut runner, _) = Runner::open(&a, threads, device).map_err(|e| anyhow!("{e}"))?;
    let mut out = Outputs::default();
    let (mut decoded, mut decode_time) = (0usize, 0.0f64);
    for (i, input) in golden.inputs.iter().enumerate() {
        runner.reset();
        out.values.push(runner.forward(input).map_err(|e| anyhow!("{e}"))?.to_vec());
        if kind == Kind::Encoder {
            continue;
        }
        let n = golden.greedy[i].len().min(greedy_tokens.unwrap_or(usize::MAX));
        runner.reset();
        let mut next = greedy(runner.forward_last(input).map_err(|e| anyhow!("{e}"))?, &eos);
        let mut ids = Vec::with_capacity(n);
        let start = Instant::now();
        while ids.len() < n {
            ids.push(next);
            if ids.len() < n {
                next = greedy(runner.forward_last(&[next]).map_err(|e| anyhow!("{e}"))?, &eos);
            }
        }
        decode_time += start.elapsed().as_secs_f64();
        decoded += n.saturating_sub(1);
        out.greedy.push(ids);
    }
    out.decode_tok_s = if decode_time > 0.0 { decoded as f64 / decode_time } else { 0.0 };
    Ok(out)
}

/// `maxc compile` of one (fixture, encoding, form); `ptx` also asks for the PTX text.
fn compile(maxc: &Path, f: &Fixture, encoding: &str, target: &str, out: &Path, ptx: Option<&Path>) -> Result<()> {
    let mut cmd = Command::new(maxc);
    cmd.arg("compile").arg("--model").arg(&f.model).arg("-o").arg(out).args(["--quantization-encoding", encoding, "--target", target]);
    if let Some(dir) = ptx {
        cmd.arg("--emit-ptx").arg(dir);
    }
    let o = cmd.output().with_context(|| format!("running {}", maxc.display()))?;
    if !o.status.success() {
        bail!("maxc compile failed: {}", String::from_utf8_lossy(&o.stderr).trim());
    }
    Ok(())
}

/// Where the artifact of (fixture, encoding, form) is written.
fn artifact_path(work: &Path, f: &Fixture, encoding: &str, form: Form) -> PathBuf {
    work.join(format!("{}-{encoding}-{}.mef", f.name, form.name()))
}

/// Where a dry run asks maxc for the PTX of (fixture, encoding, form).
fn ptx_path(work: &Path, f: &Fixture, encoding: &str, form: Form) -> PathBuf {
    work.join(format!("{}-{encoding}-{}.ptx", f.name, form.name()))
}

/// Assembles every `.ptx` in `dir` with ptxas for `arch`.
fn assemble(ptxas: &Path, dir: &Path, arch: &str) -> Result<usize> {
    let mut n = 0;
    for entry in std::fs::read_dir(dir)? {
        let p = entry?.path();
        if p.extension().is_some_and(|e| e == "ptx") {
            let o = Command::new(ptxas).arg(format!("-arch={arch}")).arg(&p).arg("-o").arg(p.with_extension("cubin")).output()?;
            if !o.status.success() {
                bail!("ptxas rejected {}: {}", p.display(), String::from_utf8_lossy(&o.stderr).trim());
            }
            n += 1;
        }
    }
    if n == 0 {
        bail!("maxc wrote no PTX to {}", dir.display());
    }
    Ok(n)
}

/// Judges `ours` against the golden and, where given, against the CPU code's
/// outputs of the same weights; fills the row's measurements and verdict.
fn judge(row: &mut Row, kind: Kind, golden: &Golden, ours: &Outputs, cpu: Option<&Outputs>, budget: Budget) {
    let mut failures = Vec::new();
    match kind {
        Kind::Generator => {
            let mut agreement = metrics::Agreement::default();
            let mut worst = 0.0f32;
            for (i, g) in golden.values.iter().enumerate() {
                let (err, bound) = (metrics::max_error(&ours.values[i], g), metrics::tolerance(g));
                worst = worst.max(err / bound);
                let vocab = g.len() / golden.inputs[i].len().max(1);
                agreement.add(metrics::agreement(&ours.values[i], g, vocab));
                let prefix = metrics::common_prefix(&ours.greedy[i], &golden.greedy[i]);
                row.greedy.push((prefix, golden.greedy[i].len().min(ours.greedy[i].len())));
                if budget == Budget::Exact && err > bound {
                    failures.push(format!("case {i}: logits off by {err:.3e} > {bound:.3e}"));
                }
                if budget == Budget::Exact && prefix < 16.min(ours.greedy[i].len()) {
                    failures.push(format!("case {i}: greedy ids differ at {prefix}"));
                }
            }
            row.golden_error = Some(worst);
            row.top1 = Some((agreement.top1, agreement.positions));
            row.mean_kl = Some(agreement.mean_kl());
            if let Budget::Statistical { min_top1, max_kl, near_ties_agree } = budget {
                let rate = agreement.top1_rate(near_ties_agree);
                if rate < min_top1 {
                    failures.push(format!("top-1 {rate:.3} < {min_top1}"));
                }
                if !(agreement.mean_kl() <= max_kl) {
                    failures.push(format!("mean KL {:.3e} > {max_kl:.0e}", agreement.mean_kl()));
                }
            }
            if let Some(cpu) = cpu {
                let mut worst = 0.0f32;
                for (i, c) in cpu.values.iter().enumerate() {
                    worst = worst.max(metrics::max_error(&ours.values[i], c) / metrics::tolerance(c));
                }
                row.cpu_error = Some(worst);
                if worst > 1.0 {
                    failures.push(format!("logits {worst:.2}x the float32 tolerance away from the CPU code's"));
                }
            }
            row.decode_tok_s = Some(ours.decode_tok_s);
        }
        Kind::Encoder => {
            let worst = golden.values.iter().zip(&ours.values).map(|(g, o)| metrics::cosine(g, o)).fold(1.0f64, f64::min);
            row.cosine = Some(worst);
            if budget == Budget::Exact && worst < 0.9999 {
                failures.push(format!("cosine {worst:.6} < 0.9999"));
            }
            if let Some(cpu) = cpu {
                let vs = cpu.values.iter().zip(&ours.values).map(|(c, o)| metrics::cosine(c, o)).fold(1.0f64, f64::min);
                row.cpu_error = Some((1.0 - vs) as f32);
                if vs < 0.9999 {
                    failures.push(format!("cosine {vs:.6} with the CPU code's"));
                }
            }
        }
    }
    row.set_verdict(failures);
}

fn main() -> ExitCode {
    match check(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("gpu-check: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn check(cli: Cli) -> Result<bool> {
    let gpu = match cli.device.as_str() {
        "gpu" => true,
        "cpu" => false,
        other => bail!("--device {other}: use gpu or cpu"),
    };
    let encodings: Vec<&str> = if cli.encodings.is_empty() { matrix::ENCODINGS.to_vec() } else { cli.encodings.iter().map(String::as_str).collect() };
    let forms: Vec<Form> = if cli.forms.is_empty() {
        vec![Form::Fat, Form::Gpu]
    } else {
        let mut f: Vec<Form> = cli.forms.iter().map(|s| Form::parse(s).ok_or_else(|| anyhow!("--forms {s}: use gpu or fat"))).collect::<Result<_>>()?;
        f.sort_by_key(|f| *f != Form::Fat);
        f
    };
    std::fs::create_dir_all(&cli.work)?;
    let mut rows: Vec<Row> = Vec::new();
    let all = matrix::fixtures(&cli.fixtures, cli.smollm2_gguf.as_deref(), cli.minilm.as_deref());
    for f in all.iter().filter(|f| cli.only.is_empty() || cli.only.contains(&f.name)) {
        let golden = load_golden(f, cli.cases).with_context(|| format!("the golden of {}", f.name))?;
        // Every (encoding, form) of the fixture is compiled at once, one maxc per
        // artifact (a GPU machine has the cores; the runs that follow are short).
        let mut compiled: HashMap<(String, Form), Result<(), String>> = std::thread::scope(|scope| {
            let jobs: Vec<_> = encodings
                .iter()
                .flat_map(|&encoding| forms.iter().map(move |&form| (encoding, form)))
                .map(|(encoding, form)| {
                    let (mef, ptx_dir) = (artifact_path(&cli.work, f, encoding, form), ptx_path(&cli.work, f, encoding, form));
                    let ptx = (!gpu && form == Form::Gpu && cli.ptxas.is_some()).then_some(ptx_dir);
                    let (cli, f) = (&cli, f);
                    let handle = scope.spawn(move || {
                        if cli.keep && mef.is_file() {
                            return Ok(());
                        }
                        compile(&cli.maxc, f, encoding, &form.target(&cli.arch), &mef, ptx.as_deref()).map_err(|e| format!("{e:#}"))
                    });
                    ((encoding.to_string(), form), handle)
                })
                .collect();
            jobs.into_iter().map(|(key, h)| (key, h.join().unwrap_or_else(|_| Err("the compile thread panicked".into())))).collect()
        });
        for &encoding in &encodings {
            let budget = matrix::budget(&f.name, encoding);
            let mut cpu_reference: Option<Outputs> = None;
            for &form in &forms {
                let started = Instant::now();
                let mut row = Row::new(&f.name, encoding, form.name(), if gpu { "gpu" } else { "cpu" });
                let (mef, ptx_dir) = (artifact_path(&cli.work, f, encoding, form), ptx_path(&cli.work, f, encoding, form));
                let dry_gpu_only = !gpu && form == Form::Gpu;
                let result = (|| -> Result<()> {
                    compiled.remove(&(encoding.to_string(), form)).unwrap_or_else(|| Err("not compiled".into())).map_err(|e| anyhow!(e))?;
                    row.artifact_mib = Some(std::fs::metadata(&mef)?.len() as f64 / (1024.0 * 1024.0));
                    if dry_gpu_only {
                        // No CPU code to run here: the PTX is what can be checked.
                        match &cli.ptxas {
                            Some(ptxas) => {
                                let n = assemble(ptxas, &ptx_dir, &cli.arch)?;
                                row.set_skipped(format!("dry run: compiled; ptxas assembled {n} module(s)"));
                            }
                            None => row.set_skipped("dry run: compiled (no CPU code to run)".into()),
                        }
                        return Ok(());
                    }
                    if form == Form::Fat {
                        let cpu = run(&mef, Device::Cpu, &golden, f, cli.greedy_tokens)?;
                        cpu_reference = Some(cpu);
                    }
                    let ours = if gpu { run(&mef, Device::Gpu(0), &golden, f, cli.greedy_tokens)? } else { cpu_reference.clone().expect("fat runs first") };
                    let reference = if gpu { cpu_reference.as_ref() } else { None };
                    judge(&mut row, f.kind, &golden, &ours, reference, budget);
                    Ok(())
                })();
                if let Err(e) = result {
                    row.set_verdict(vec![format!("{e:#}")]);
                }
                row.seconds = started.elapsed().as_secs_f64();
                if !cli.keep {
                    let _ = std::fs::remove_file(&mef);
                    let _ = std::fs::remove_dir_all(&ptx_dir);
                }
                eprintln!("{}", row.line());
                rows.push(row);
            }
        }
    }
    let table = report::markdown(&rows);
    println!("{table}");
    if let Some(p) = &cli.markdown {
        std::fs::write(p, &table)?;
    }
    if let Some(p) = &cli.report {
        std::fs::write(p, serde_json::to_string_pretty(&rows.iter().map(Row::json).collect::<Vec<_>>())?)?;
    }
    Ok(rows.iter().all(|r| !r.failed()))
}
