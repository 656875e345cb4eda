//! The library example (`demos/finetune.rs`): weights loaded from a checkpoint into a
//! fresh `Trainer` continue from the checkpoint's loss, fine-tuning lowers it further,
//! and the KV-cached generator completes a prompt in the task's form (that cached
//! decoding equals full recomputation is tests/generate.rs and tests/sample.rs).

mod common;

#[allow(dead_code)]
#[path = "../demos/finetune.rs"]
mod finetune;

use kiln::engine::data::Addition;

#[test]
fn a_checkpoint_fine_tunes_from_its_own_loss_and_generates() {
    let dev = common::gpu("vulkan", false);
    let dir = std::env::temp_dir().join(format!("kiln-demo-finetune-{}", std::process::id()));
    let r = finetune::run(dev.as_ref(), 400, 40, "47+85=", &dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let mean = |l: &[f32]| l.iter().sum::<f32>() / l.len() as f32;
    let (pre_end, fine_start) = (mean(&r.pretrain[390..]), r.finetune[0]);
    eprintln!(
        "pretrain {} -> {pre_end}; finetune {fine_start} -> {}; {:?}",
        r.pretrain[0],
        mean(&r.finetune[30..]),
        r.text
    );
    // A fresh model starts near ln 13 = 2.56 on the answers; loaded weights start where
    // the checkpoint's run ended (a batch of new problems: within 0.3 of its last ten).
    assert!(r.pretrain[0] > 2.0, "first loss {}", r.pretrain[0]);
    assert!(
        (fine_start - pre_end).abs() < 0.3 && fine_start < 1.5,
        "fine-tuning started at {fine_start}, the checkpoint's run ended at {pre_end}"
    );
    assert!(mean(&r.finetune[30..]) < pre_end, "{:?}", r.finetune);
    // The completion: the prompt, three sum digits (reversed) and the line's end.
    let answer = r.text.strip_prefix("47+85=").unwrap();
    assert_eq!(answer.len(), 4, "{:?}", r.text);
    assert!(
        answer[..3].bytes().all(|b| b.is_ascii_digit()),
        "{:?}",
        r.text
    );
    assert!(answer.ends_with('\n'), "{:?}", r.text);
    assert!(Addition::encode(answer).is_some());
}
