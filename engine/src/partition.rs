//! How a pipeline cuts a model's blocks into stages: the one type the config's
//! `pipeline.partition`, `--partition` and the pipeline itself speak. A leaf, so the
//! config layer (which parses it) and the parallel layer (which cuts by it) share it
//! without importing each other; the cut itself is `parallel::pipeline_partition`.

use serde::Serialize;

/// How to cut the blocks.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionMethod {
    /// Balance the stages' parameter counts, embeddings and head included (DeepSpeed's
    /// default).
    Parameters,
    /// Blocks as evenly as counts allow, earlier stages taking the extra ones.
    Uniform,
    /// Blocks per stage, first stage first.
    Blocks(Vec<usize>),
    /// Balance measured time: per stage, the device's seconds per block, and for the
    /// ends the seconds of the embeddings (first stage) and the head (last stage). No
    /// config spells it; a caller that timed its devices gives it.
    Measured {
        per_block: Vec<f64>,
        embeddings: f64,
        head: f64,
    },
}

impl PartitionMethod {
    /// As `--partition` and the config spell it: `parameters`, `uniform`, `3,5`, or
    /// `measured`.
    pub fn spelled(&self) -> String {
        match self {
            PartitionMethod::Parameters => "parameters".to_string(),
            PartitionMethod::Uniform => "uniform".to_string(),
            PartitionMethod::Blocks(c) => {
                c.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
            }
            PartitionMethod::Measured { .. } => "measured".to_string(),
        }
    }

    /// `--partition`'s text: `uniform`, `parameters` or blocks per stage (`3,5`); an
    /// error saying what it takes.
    pub fn parse(text: &str) -> Result<PartitionMethod, String> {
        match text {
            "uniform" => Ok(PartitionMethod::Uniform),
            "parameters" => Ok(PartitionMethod::Parameters),
            counts => counts
                .split(',')
                .map(|c| c.trim().parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map(PartitionMethod::Blocks)
                .map_err(|_| {
                    format!(
                        "--partition {counts:?}: give `uniform`, `parameters` or blocks per \
                         stage such as `3,5`"
                    )
                }),
        }
    }
}
