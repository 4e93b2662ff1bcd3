//! Opaque configuration API for the GPU DRA driver.
