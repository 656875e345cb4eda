//! Trains the MLP classifier on built-in synthetic data (Gaussian clusters) on a GPU
//! adapter in mixed precision and reports held-out accuracy.
//!
//!     cargo run --release --example train_mlp -- [DEVICE] [f32|f16|bf16] [STEPS]
//!
//! DEVICE is a spec from `kiln devices` (default `vulkan`).

use std::time::Instant;

use kiln::engine::models::mlp::{clusters, Mlp, MlpConfig, Precision};
use kiln::wgpu::DeviceOptions;

fn main() -> anyhow::Result<()> {
    kiln::devices::quiet_device_select();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let spec: kiln::DeviceSpec = args.first().map_or("vulkan", |s| s.as_str()).parse()?;
    let precision = match args.get(1).map_or("f16", |s| s.as_str()) {
        "f32" => Precision::F32,
        "f16" => Precision::F16,
        "bf16" => Precision::BF16,
        other => anyhow::bail!("unknown precision `{other}`: use f32, f16 or bf16"),
    };
    let steps: usize = match args.get(2) {
        Some(s) => s
            .parse()
            .map_err(|_| anyhow::anyhow!("STEPS must be a whole number, not `{s}`"))?,
        None => 300,
    };
    let dev = kiln::open_device(&spec, &DeviceOptions::default())?;
    let cfg = MlpConfig {
        inputs: 16,
        hidden: 128,
        classes: 10,
        batch: 256,
        precision,
        lr: 3e-3,
        weight_decay: 0.01,
        seed: 1,
    };
    println!(
        "training a {}-{}-{} MLP in {precision:?} on {} ({})",
        cfg.inputs,
        cfg.hidden,
        cfg.classes,
        dev.caps().name,
        dev.caps().backend
    );
    let (x, y) = clusters(cfg.inputs, cfg.classes, cfg.batch * steps, 2.5, 7);
    let (hx, hy) = clusters(cfg.inputs, cfg.classes, cfg.batch * 5, 2.5, 7);
    let mut mlp = Mlp::new(dev.as_ref(), cfg.clone())?;
    let start = Instant::now();
    let mut skipped = 0;
    for s in 0..steps {
        let (b, i) = (cfg.batch, cfg.inputs);
        let st = mlp.train_step(
            dev.as_ref(),
            &x[s * b * i..(s + 1) * b * i],
            &y[s * b..(s + 1) * b],
        )?;
        skipped += st.skipped as usize;
        if s % 50 == 0 || s + 1 == steps {
            let rate = (s + 1) as f64 * cfg.batch as f64 / start.elapsed().as_secs_f64();
            println!(
                "step {s:4}  loss {:.4}  scale {:>7}  skipped {skipped}  {rate:.0} samples/s",
                st.loss, st.scale
            );
        }
    }
    // Held out: the tail of a stream that the training data did not cover.
    let (b, i) = (cfg.batch, cfg.inputs);
    let (loss, acc) = mlp.evaluate(dev.as_ref(), &hx[4 * b * i..5 * b * i], &hy[4 * b..5 * b])?;
    println!(
        "held-out loss {loss:.4}, accuracy {:.1}% (chance {:.1}%)",
        acc * 100.0,
        100.0 / cfg.classes as f32
    );
    Ok(())
}
