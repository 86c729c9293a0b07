//! `maxrun --chat`: the model's chat template renders the golden prompt, and a
//! two-turn conversation answers the golden first reply while the second turn runs
//! only its new tokens (earlier turns stay in the KV cache).

use std::ffi::OsStr;
use std::io::Write;
use std::process::{Command, Stdio};

use maxc_tests::*;

fn smollm2_artifact() -> TempPath {
    compile_model("chat", &smollm2_gguf(), &[])
}

#[test]
fn chat_template_and_two_turns() {
    let mef = smollm2_artifact();
    let golden = golden("smollm2-135m");
    let chat = &golden["chat"];

    // The template stored in the artifact renders the golden prompt ids.
    let artifact = maxrun_runtime::artifact::Artifact::open(&mef).unwrap();
    let template = std::str::from_utf8(artifact.section(maxrun_runtime::format::SectionKind::ChatTemplate)).unwrap();
    let tokenizer: tokenizers::Tokenizer = artifact.tokenizer_json().unwrap().parse().unwrap();
    let messages: Vec<maxrun_runtime::chat::Message> = chat["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| maxrun_runtime::chat::Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    let prompt = maxrun_runtime::chat::render(template, &messages, true, "<|im_start|>", "<|im_end|>").unwrap();
    let ids = tokenizer.encode(prompt.as_str(), false).unwrap().get_ids().to_vec();
    assert_eq!(ids, maxc_tests::ids(&chat["input_ids"]));

    // Two turns through stdin.
    let mut child = Command::new(bin("maxrun"))
        .args([mef.as_os_str(), OsStr::new("--chat"), OsStr::new("--temperature"), OsStr::new("0"), OsStr::new("-n"), OsStr::new("48")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let first = messages[0].content.clone();
    writeln!(child.stdin.as_mut().unwrap(), "{first}\nAnd what about Germany?").unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let golden_reply = chat["greedy_text"].as_str().unwrap().trim_end_matches("<|im_end|>");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert_eq!(lines[0], golden_reply);
    assert!(!lines[1].is_empty());
    // Turn 2 reuses everything up to the end of the first answer.
    let turn2 = stderr.lines().find(|l| l.starts_with("turn 2:")).expect("turn 2 stats");
    let reused: usize = turn2.split('(').nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(reused >= ids.len() + 6, "turn 2 re-ran earlier turns: {turn2}");
}
