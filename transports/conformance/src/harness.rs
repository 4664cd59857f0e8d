//! The world the test bodies run in: ranks built by a transport factory, communicators over
//! them, one task per rank, and the inputs and reference results the bodies compare against.

use std::future::Future;
use std::time::Duration;

use byzcoll_aggregators::{aggregate_into, Aggregator};
use byzcoll_runtime::{Communicator, Config, Transport};

/// Ranks 0 and 1 of a world of two.
pub(crate) async fn two_ranks<F, Fut>(factory: F) -> (Box<dyn Transport>, Box<dyn Transport>)
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Vec<Box<dyn Transport>>>,
{
    let mut ranks = factory(2).await.into_iter();
    let a = ranks.next().expect("rank 0");
    let b = ranks.next().expect("rank 1");
    (a, b)
}

/// Rank `r`'s test vector: small integers, so sums are exact in `f32`.
pub fn vector(rank: usize, d: usize) -> Vec<f32> {
    (0..d)
        .map(|j| ((rank * 31 + j * 7) % 101) as f32 - 50.0)
        .collect()
}

/// Communicators over `transports` with step deadline `timeout`. They wait for every input
/// (`Stragglers::Exactly(0)`, not the default `auto`): the bodies compare exact results, which
/// an honest input left out for its timing on a loaded machine would change. The quorum
/// bodies (`time.rs`) choose their stragglers themselves.
pub(crate) fn comms(transports: Vec<Box<dyn Transport>>, timeout: Duration) -> Vec<Communicator> {
    let mut config = Config::with_step_timeout(timeout);
    config.stragglers = byzcoll_runtime::Stragglers::Exactly(0);
    transports
        .into_iter()
        .map(|t| Communicator::new(t, config.clone()))
        .collect()
}

/// Runs `body` on every rank concurrently and returns the results in rank order.
pub async fn run_ranks<T, F, Fut>(comms: Vec<Communicator>, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Communicator) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let tasks: Vec<_> = comms
        .into_iter()
        .map(|c| tokio::spawn(body.clone()(c)))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("rank task panicked"));
    }
    out
}

pub(crate) fn reference(rule: &dyn Aggregator, inputs: &[Vec<f32>]) -> Vec<f32> {
    let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let mut out = vec![0.0; inputs.first().map_or(0, Vec::len)];
    aggregate_into(rule, &refs, &mut out).unwrap();
    out
}

/// The bytes of `elements` copies of `x`.
pub(crate) fn filled(x: f32, elements: usize) -> Vec<u8> {
    std::iter::repeat_n(x.to_le_bytes(), elements)
        .flatten()
        .collect()
}

/// The bits of a result, for bitwise comparisons.
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The [`Transport`] methods a test's wrapping transport passes on to its `inner` one (the
/// wrapper writes only its `exchange`).
macro_rules! passed_to_inner {
    () => {
        fn name(&self) -> &'static str {
            self.inner.name()
        }

        fn rank(&self) -> usize {
            self.inner.rank()
        }

        fn size(&self) -> usize {
            self.inner.size()
        }

        fn capabilities(&self) -> byzcoll_runtime::Capabilities {
            self.inner.capabilities()
        }
    };
}
pub(crate) use passed_to_inner;
