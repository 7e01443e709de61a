//! Test fixture: real PostgreSQL and RabbitMQ (started by `integration/servers.sh`,
//! or pointed at with `TEST_PG_URL` / `TEST_AMQP_URL`), one outbox table,
//! publication, slot, exchange and queue per test, and the relay binary as a
//! real child process.

#![allow(dead_code)]

mod example_consumer;
mod faults;
mod fixture;
mod observe;
mod producers;
mod relay;
mod servers;

// Each test binary uses some of these; `#![allow(dead_code)]` does not
// cover an unused re-export.
#[allow(unused_imports)]
pub use example_consumer::*;
#[allow(unused_imports)]
pub use faults::*;
#[allow(unused_imports)]
pub use fixture::*;
#[allow(unused_imports)]
pub use observe::*;
#[allow(unused_imports)]
pub use producers::*;
#[allow(unused_imports)]
pub use relay::*;
#[allow(unused_imports)]
pub use servers::*;
