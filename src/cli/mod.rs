//! The `kiln` binary's modules: the command line's definitions ([`args`]) and each
//! command group's handlers; `main.rs` dispatches between them.

pub(crate) mod args;
pub(crate) mod bench;
pub(crate) mod inspect;
pub(crate) mod prepare;
pub(crate) mod train;
