//! MIG profile tables and their arithmetic, as the simulator serves them: the one copy lives
//! in `gpu_dra_device::mig_tables`, which `gpu-dra advise` reads too.

pub use gpu_dra_device::mig_tables::*;
