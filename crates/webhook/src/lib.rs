//! The admission webhook.
