//! The batched GPU executor's host side without a GPU: every decoder fixture's
//! golden prompts as one batch through the batched engine on the GPU executor
//! (runtime-stub/src/executor/gpu.rs) over a simulated device
//! (tests/src/sim_gpu.rs: each launch of the kernels' GPU forms run by the
//! kernel interpreter's GPU semantics), judged against the transformers goldens
//! and against the CPU executor on the same steps. What this covers is what the
//! executor does on the host: the weights, arenas, paged KV pool and step inputs
//! in device memory, the argument tables, each launch's grid and row count, the
//! decode steps' graphs per row count (captured once, replayed after), and the
//! logit rows copied back. scripts/gpu-check.sh runs the same on a real GPU.
//! SmolLM2 is left to the real GPU: the interpreter would take hours over it.

use std::collections::HashMap;

use maxc_tests::sim_gpu::SimDevice;
use maxc_tests::*;
use maxrun_runtime::artifact::Artifact;
use maxrun_engine::{load_tokenizer, Engine, Event, GenerationParams, ModelFacts, Request, RequestId};
use maxrun_runtime::executor::cpu::CpuExecutor;
use maxrun_runtime::executor::gpu::GpuExecutor;
use maxrun_runtime::executor::Executor;

/// Each request's prompt logits (by position) and generated tokens.
#[derive(Default)]
struct Outcome {
    logits: HashMap<usize, Vec<f32>>,
    tokens: Vec<u32>,
}

/// Every request submitted at once, stepped until all have finished.
fn run(engine: &mut Engine<'_>, requests: &[Request]) -> Vec<Outcome> {
    let ids: Vec<RequestId> = requests.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
    let mut out: HashMap<RequestId, Outcome> = HashMap::new();
    let mut steps = 0;
    while engine.has_work() {
        for e in engine.step().unwrap() {
            match e {
                Event::Logits { id, position, logits } => {
                    out.entry(id).or_default().logits.insert(position, logits);
                }
                Event::Token { id, token, .. } => out.entry(id).or_default().tokens.push(token),
                Event::Finished { .. } | Event::PromptLogprob { .. } => {}
            }
        }
        steps += 1;
        assert!(steps < 1000, "the engine does not finish");
    }
    ids.into_iter().map(|id| out.remove(&id).unwrap_or_default()).collect()
}

fn check(name: &str) {
    let dump = temp_dir(&format!("gpu-exec-ir-{name}"));
    let dump_arg = dump.as_path().to_str().unwrap().to_string();
    // Small plans and a short context: the simulated device copies each
    // launch's buffers from its address to the end of their allocation, so
    // arenas and pools sized for 256 rows, 16 sequences and 4096 positions
    // would make it ten times slower, and the golden prompts (3 of under 30
    // tokens, 24 generated each) need none of that.
    let flags = ["--quantization-encoding", "float32", "--target", "cpu,cuda:sm_90", "--max-batch-tokens", "64", "--max-sequences", "4", "--max-length", "256", "--dump-ir", &dump_arg];
    let mef = compile_model(&format!("gpu-exec-{name}"), &fixture(name), &flags);
    let artifact = Artifact::open(&mef).unwrap();
    let h = &artifact.header;
    let symbols: Vec<String> = h.kernels.iter().map(|k| k.symbol.clone()).collect();
    let device = SimDevice::from_dump(dump.as_path(), &symbols);
    let counts = device.counts.clone();
    // The smallest pool that holds one full-context sequence: the simulated
    // device copies a launch's buffers, so memory it never uses costs time.
    let limits = h.batch.expect("batch plans");
    let pool = maxrun_runtime::executor::block_bytes_all_layers(h, &limits) * limits.blocks_per_sequence;
    let gpu = GpuExecutor::new(&artifact, device, Some(pool), true).unwrap();
    assert!(gpu.describe().contains("simulated"));
    let cpu = CpuExecutor::new(&artifact, 2, Some(pool)).unwrap();
    assert_eq!(gpu.limits(), cpu.limits(), "{name}: both pools hold the same blocks");

    let golden = golden(name);
    let cases = cases(&golden);
    // As the goldens were generated: EOS suppressed on the arch-* fixtures.
    let ignore_eos = name.starts_with("arch-");
    let requests: Vec<Request> = cases
        .iter()
        .map(|c| Request {
            prompt: ids(&c["input_ids"]),
            params: GenerationParams { max_tokens: ids(&c["greedy_ids"]).len(), ignore_eos, ..GenerationParams::default() },
            all_logits: true,
        })
        .collect();
    let facts = || ModelFacts::of(&artifact);
    let on_gpu = run(&mut Engine::batched(facts(), Box::new(gpu), load_tokenizer(&artifact).unwrap()), &requests);
    let on_cpu = run(&mut Engine::batched(facts(), Box::new(cpu), load_tokenizer(&artifact).unwrap()), &requests);
    for (i, case) in cases.iter().enumerate() {
        let what = format!("{name} case {i}");
        let prompt = ids(&case["input_ids"]);
        let (_, gold) = golden_logits(name, case);
        let rows = |o: &Outcome| -> Vec<f32> { (0..prompt.len()).flat_map(|p| o.logits[&p].clone()).collect() };
        assert_eq!(on_gpu[i].logits.len(), prompt.len(), "{what}: a logits row for every prompt position");
        assert_logits_close(&format!("{what}: simulated GPU vs golden"), &rows(&on_gpu[i]), &gold);
        assert_logits_close(&format!("{what}: simulated GPU vs CPU executor"), &rows(&on_gpu[i]), &rows(&on_cpu[i]));
        assert_greedy_prefix(&format!("{what}: simulated GPU"), &on_gpu[i].tokens, &ids(&case["greedy_ids"]));
        assert_greedy_prefix(&format!("{what}: CPU executor"), &on_cpu[i].tokens, &ids(&case["greedy_ids"]));
    }
    // Decode steps of each row count were captured once and replayed after.
    let (captures, replays) = (counts.captures.get(), counts.replays.get());
    assert!(captures >= 1 && replays > captures, "{name}: {captures} graphs captured, {replays} replays");
    assert!(counts.launches.get() > 0);
}

// One test per fixture (each takes a minute or more in the interpreter), so
// the test threads share them out.
macro_rules! on_a_simulated_gpu {
    ($($test:ident: $fixture:literal,)*) => {$(
        #[test]
        fn $test() {
            check($fixture);
        }
    )*};
}

on_a_simulated_gpu! {
    tiny_llama_golden_prompts_as_one_batch_on_a_simulated_gpu: "tiny-llama",
    tiny_qwen2_golden_prompts_as_one_batch_on_a_simulated_gpu: "tiny-qwen2",
    qwen3_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-qwen3",
    gemma2_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-gemma2",
    phi3_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-phi3",
    granite_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-granite",
    olmo2_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-olmo2",
    gpt2_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-gpt2",
    // The mixture-of-experts fixtures the same way: the routed experts' GPU
    // forms (the grouped matmuls over panels read row by row, the router, the
    // grouping) through the engine's batch steps.
    qwen3_moe_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-qwen3-moe",
    mixtral_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-mixtral",
    // gpt-oss: the sinks in whole attention's key-row form and the combine's
    // GPU form, the biased router and experts, the clamped SwiGLU.
    gpt_oss_golden_prompts_as_one_batch_on_a_simulated_gpu: "arch-gpt-oss",
}
