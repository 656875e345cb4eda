//! The library example (`demos/classifier.rs`): a model written outside the engine
//! against the model contract trains in fp16 to a stated held-out accuracy, and a run
//! checkpointed half way and resumed in a fresh trainer is bit-identical to one that was
//! never stopped.

mod common;

#[allow(dead_code)]
#[path = "../demos/classifier.rs"]
mod classifier;

#[test]
fn the_user_defined_classifier_learns_and_resumes_bit_identically() {
    let dev = common::gpu("vulkan", false);
    let dir = std::env::temp_dir().join(format!("kiln-demo-classifier-{}", std::process::id()));
    let report = classifier::run(dev.as_ref(), 60, &dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    eprintln!(
        "held-out accuracy {}, losses {:?} .. {:?}",
        report.held_out_accuracy,
        &report.losses[..2],
        &report.losses[58..]
    );
    // Ten clusters in 16 dimensions, noise 1.5 around centres in [-2, 2): separable
    // enough that 60 steps of 128 reach well over 90% (measured: 98.4%); chance is 10%.
    assert!(
        report.held_out_accuracy >= 0.9,
        "held-out accuracy {}",
        report.held_out_accuracy
    );
    assert!(
        report.losses[0] > 2.0,
        "first loss {} (ln 10 = 2.3)",
        report.losses[0]
    );
    assert!(report.losses[59] < 0.5, "last loss {}", report.losses[59]);
    // Resumed from the step-30 checkpoint: every later loss has the same bits.
    assert_eq!(report.losses, report.uninterrupted);
}
