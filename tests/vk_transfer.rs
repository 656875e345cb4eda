//! The raw Vulkan backend's transfer queue: downloads copied beside the compute
//! stream. lavapipe has one queue family (with one queue), so these tests force the
//! transfer path onto the compute queue (`use_transfer_path_on_compute_queue`): its own
//! command pool, timeline and semaphore waits run as on a GPU with a DMA engine, under
//! the validation layer. One in-order queue runs a copy before any later compute
//! whether or not that compute waits for it, so a missing wait shows neither in the
//! data nor (with the layer installed here, 1.3.239) as a validation error: the tests
//! count the waits that reach the queue (`transfer_counts`) instead.

mod common;

use common::*;
use kiln::engine::kernels::{Axpy, Fill, Scale};
use kiln::engine::models::gpt::{Gpt, GptConfig};
use kiln::engine::models::MicroBatch;
use kiln::engine::train::trainer::Trainer;
use kiln::engine::{DType, Device, HostData, Kernel};
use kiln::vulkan::VkDevice;

/// `vk:0` with downloads on the transfer path.
fn moved() -> VkDevice {
    let dev = vk_device(false);
    dev.use_transfer_path_on_compute_queue().unwrap();
    assert!(dev.transfer_family().is_some());
    dev
}

/// Uploads, a launch and downloads of whole buffers and views, in each storage dtype.
fn round_trips(dev: &VkDevice) -> Vec<HostData> {
    let mut out = vec![];
    for (seed, dtype) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let x = put(dev, &data(dtype, 300, seed as u64, true));
        let y = dev.alloc(dtype, 300).unwrap();
        dev.launch(&Kernel::Scale(Scale {
            alpha: 0.5,
            x,
            out: y,
        }))
        .unwrap();
        let v = dev.view(x, 128, 20).unwrap();
        for b in [y, v, x] {
            out.push(dev.download(b).unwrap());
        }
    }
    out
}

#[test]
fn downloads_on_the_transfer_path_equal_the_compute_streams_bit_for_bit() {
    let plain = vk_device(false);
    // lavapipe has no copy-only queue family: downloads stay in the compute stream.
    assert_eq!(plain.transfer_family(), None);
    let moved = moved();
    let (a, b) = (round_trips(&plain), round_trips(&moved));
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert_bits_eq(&format!("download {i}"), b, a);
    }
    assert_eq!(plain.transfer_counts(), (0, 0));
    assert_eq!(moved.transfer_counts(), (9, 0));
}

/// A launch or upload that overwrites a buffer a transfer copy still reads waits for
/// the copy (and the download keeps the old values); launches that leave it alone add
/// no wait, so they run beside the copy.
#[test]
fn an_overwrite_of_a_buffer_being_downloaded_waits_for_the_copy_and_nothing_else_does() {
    let dev = moved();
    let old = data(DType::F32, 4096, 3, false);
    let x = put(&dev, &old);
    let pending = dev.begin_download(x).unwrap();
    // At once: nothing else on the queue orders the copy before it.
    dev.launch(&Kernel::Fill(Fill { dst: x, value: 7.0 }))
        .unwrap();
    dev.submit().unwrap();
    assert_eq!(dev.transfer_counts(), (1, 1));
    assert_bits_eq("download", &dev.finish_download(pending).unwrap(), &old);
    assert_eq!(dev.download(x).unwrap(), HostData::F32(vec![7.0; 4096]));
    assert_eq!(dev.transfer_counts(), (2, 1));

    // The rest of a backward: reads the buffer being downloaded, writes others.
    let y = put(&dev, &old);
    let pending = dev.begin_download(y).unwrap();
    dev.launch(&Kernel::Axpy(Axpy {
        alpha: 1.0,
        x: y,
        y: x,
    }))
    .unwrap();
    dev.submit().unwrap();
    assert_eq!(dev.transfer_counts(), (3, 1));
    assert_bits_eq("beside", &dev.finish_download(pending).unwrap(), &old);

    // An upload over it waits as a launch does.
    let pending = dev.begin_download(x).unwrap();
    let new = data(DType::F32, 4096, 4, false);
    dev.upload(x, &new).unwrap();
    dev.submit().unwrap();
    assert_eq!(dev.transfer_counts(), (4, 2));
    let HostData::F32(o) = &old else {
        unreachable!()
    };
    let sum = HostData::F32(o.iter().map(|v| v + 7.0).collect());
    assert_bits_eq(
        "before upload",
        &dev.finish_download(pending).unwrap(),
        &sum,
    );
    assert_bits_eq("upload", &dev.download(x).unwrap(), &new);
    dev.wait().unwrap();
}

/// Reads are tracked per buffer, so writing another view of a buffer being
/// downloaded waits too; a buffer freed while its copy runs lives until the copy is
/// done, however much is allocated and launched meanwhile.
#[test]
fn views_and_a_free_right_after_begin_download_keep_the_copy_whole() {
    let dev = moved();
    let whole = data(DType::F32, 128, 5, false);
    let x = put(&dev, &whole);
    let (a, b) = (dev.view(x, 0, 64).unwrap(), dev.view(x, 64, 64).unwrap());
    let pending = dev.begin_download(a).unwrap();
    dev.launch(&Kernel::Fill(Fill { dst: b, value: 1.0 }))
        .unwrap();
    dev.submit().unwrap();
    assert_eq!(dev.transfer_counts(), (1, 1));
    let HostData::F32(w) = &whole else {
        unreachable!()
    };
    assert_eq!(
        dev.finish_download(pending).unwrap(),
        HostData::F32(w[..64].to_vec())
    );
    dev.free(a).unwrap();
    dev.free(b).unwrap();

    let kept = data(DType::F32, 1 << 16, 6, false);
    let z = put(&dev, &kept);
    // The copy stays pending while the compute work before it completes.
    dev.hold_transfers().unwrap();
    let pending = dev.begin_download(z).unwrap();
    dev.free(z).unwrap();
    // Meanwhile the compute work before the copy completes, so the next allocations
    // would get z's memory if the free let it go before the copy.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(
        dev.retired_bytes().unwrap() >= 4 << 16,
        "z was released during its copy"
    );
    for i in 0..8 {
        let w = dev.alloc(DType::F32, 1 << 16).unwrap();
        dev.launch(&Kernel::Fill(Fill {
            dst: w,
            value: i as f64,
        }))
        .unwrap();
        dev.submit().unwrap();
        dev.free(w).unwrap();
    }
    dev.release_transfers().unwrap();
    assert_bits_eq("freed", &dev.finish_download(pending).unwrap(), &kept);
    dev.free(x).unwrap();
    dev.wait().unwrap();
    assert_eq!(dev.allocated_bytes(), 0);
}

/// Two data-parallel steps on two `vk` devices with the gradient exchange overlapped
/// with backward (each bucket's download begun mid-backward) train bit for bit as with
/// the downloads in the compute stream.
#[test]
fn an_overlapped_data_parallel_step_on_the_transfer_path_changes_no_bits() {
    const B: usize = 2;
    const T: usize = 8;
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: T,
        vocab_size: 13,
        padded_vocab_size: None,
    };
    let devs = [vk_device(false), vk_device(false)];
    let refs: Vec<&dyn Device> = devs.iter().map(|d| d as &dyn Device).collect();
    let mut rng = Rng::new(7);
    let steps: Vec<Vec<Vec<MicroBatch>>> = (0..2)
        .map(|_| {
            (0..2)
                .map(|_| {
                    let tokens: Vec<u32> = (0..B * T + 1).map(|_| rng.next_u32() % 13).collect();
                    vec![MicroBatch::tokens(&tokens[..B * T], &tokens[1..])]
                })
                .collect()
        })
        .collect();
    let run = || {
        let mut c = ds_config(B, 1, DType::F32, 2);
        c.zero.overlap_comm = true;
        c.zero.reduce_bucket_size = 3000;
        let gpt = std::sync::Arc::new(Gpt::new(cfg.clone(), T));
        let mut group = Trainer::new_group(&refs, gpt, c, 3).unwrap();
        let stats: Vec<_> = steps
            .iter()
            .map(|s| group.step_group(&refs, s).unwrap())
            .collect();
        (stats, group.param_states(&refs).unwrap())
    };
    let plain = run();
    for d in &devs {
        d.use_transfer_path_on_compute_queue().unwrap();
    }
    let moved = run();
    assert_eq!(moved, plain);
    for d in &devs {
        let (copies, _) = d.transfer_counts();
        assert!(copies > 2, "{copies} downloads on the transfer path");
    }
}

/// Set in the child processes of the next test: the KILN_VK_TRANSFER it runs under.
const TRANSFER_PROBE: &str = "KILN_TEST_VK_TRANSFER_PROBE";

/// KILN_VK_TRANSFER as the device opens: `same-queue` takes the transfer path on the
/// compute queue, `0` keeps downloads in the compute stream, anything else is an error
/// naming the variable; KILN_GEMM_LOG=1 says which at open. Each case runs in a child
/// process, since the variable is read as the device opens.
#[test]
fn kiln_vk_transfer_picks_the_download_path_at_open_and_the_log_says_which() {
    if let Ok(case) = std::env::var(TRANSFER_PROBE) {
        let opened = VkDevice::open(vk_index(), &Default::default());
        if case == "bad" {
            let e = opened.err().expect("no device").to_string();
            assert!(
                e.contains("KILN_VK_TRANSFER=dma") && e.contains("use 0"),
                "{e}"
            );
            return;
        }
        let dev = opened.unwrap_or_else(|e| panic!("{e}"));
        let x = put(&dev, &HostData::F32(vec![1.5; 64]));
        assert_eq!(dev.download(x).unwrap(), HostData::F32(vec![1.5; 64]));
        let copies = dev.transfer_counts().0;
        match case.as_str() {
            "same-queue" => assert!(dev.transfer_family().is_some() && copies == 1),
            _ => assert!(dev.transfer_family().is_none() && copies == 0),
        }
        return;
    }
    let name = "kiln_vk_transfer_picks_the_download_path_at_open_and_the_log_says_which";
    for (case, value, said) in [
        // lavapipe has one queue family.
        ("auto", None, "has no dedicated transfer queue family"),
        (
            "same-queue",
            Some("same-queue"),
            "through the transfer path on its compute queue",
        ),
        (
            "off",
            Some("0"),
            "copies downloads on its compute queue (KILN_VK_TRANSFER=0)",
        ),
        ("bad", Some("dma"), ""),
    ] {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(TRANSFER_PROBE, case)
            .env_remove("KILN_VK_TRANSFER")
            .env("KILN_GEMM_LOG", "1");
        if let Some(v) = value {
            child.env("KILN_VK_TRANSFER", v);
        }
        let out = child.output().unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success() && stdout.contains("1 passed") && stderr.contains(said),
            "case {case}: {stdout}\n{stderr}"
        );
    }
}
