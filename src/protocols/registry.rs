//! The one list of the bridge's protocols. Config parsing, start-up, `agentbridge check`,
//! the translation contract and the tests' protocol matrix all go through it; adding a
//! protocol is its folder, its `[section]`, and one line here.

use serde::de::MapAccess;

use super::endpoint::{Described, DescribedBy, Endpoint, Section};
use super::{grid, skynet, synapse, tracker};

macro_rules! registry {
    ($($endpoint:ty),* $(,)?) => {
        /// Every protocol's name, in the order the endpoints start.
        pub const PROTOCOLS: &[&str] = &[$(<$endpoint as Endpoint>::NAME),*];

        /// Reads the section of the protocol named `key` from `map`; `None` when no
        /// protocol has that name.
        pub fn read_section<'de, A: MapAccess<'de>>(
            key: &str,
            map: &mut A,
        ) -> Option<Result<Box<dyn Section>, A::Error>> {
            $(
                if key == <$endpoint as Endpoint>::NAME {
                    let section = map.next_value::<<$endpoint as Endpoint>::Config>();
                    return Some(section.map(|config| {
                        Box::new(super::endpoint::Configured::<$endpoint>(config)) as Box<dyn Section>
                    }));
                }
            )*
            None
        }

        /// Whether one agent of `protocol` may be online through several bridges of a
        /// fleet at once (`Endpoint::ONLINE_THROUGH_SEVERAL_BRIDGES`).
        pub fn online_through_several_bridges(protocol: &str) -> bool {
            $(
                if protocol == <$endpoint as Endpoint>::NAME {
                    return <$endpoint as Endpoint>::ONLINE_THROUGH_SEVERAL_BRIDGES;
                }
            )*
            false
        }

        /// Every protocol's translation, as the contract document sees it.
        pub fn translations() -> Vec<&'static dyn Described> {
            vec![$(&DescribedBy::<$endpoint>(std::marker::PhantomData)),*]
        }
    };
}

registry! {
    skynet::Skynet,
    tracker::Tracker,
    synapse::Synapse,
    grid::Grid,
}
