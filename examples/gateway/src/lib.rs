//! The `kvroute` program as a library: the HTTP gateway ([`gateway`]) that
//! hosts one `kvroute::KvRouter` per rule, and the commands beside it (demo,
//! bench, parity, tokenize). A program that adds engines or scorers of its
//! own registers them ([`gateway::extensions`]) and starts the gateway
//! ([`gateway::start`]) with a configuration naming them.

pub mod bench;
pub mod demo;
pub mod gateway;
pub mod parity;
pub mod tokenize;
