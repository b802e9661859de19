//! Content negotiation: which representation a client asked for in `Accept` (pure).
//!
//! The whole comma-separated list is parsed and the best servable entry wins (q-values first,
//! then list order). Protobuf entries are skipped, not refused, because client-go metadata
//! informers offer protobuf first and JSON after it; 406 comes only when nothing is servable.

/// Wire encoding of the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Json,
    Yaml,
}

/// What to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Representation {
    /// The objects themselves.
    Object,
    /// `meta.k8s.io` Table of the given version (`v1` or `v1beta1`).
    Table(&'static str),
    /// `PartialObjectMetadata` / `PartialObjectMetadataList` of the given version.
    Metadata(&'static str),
    /// Aggregated discovery `APIGroupDiscoveryList` of the given version (`v2` / `v2beta1`).
    Discovery(&'static str),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    pub encoding: Encoding,
    pub representation: Representation,
}

impl Negotiated {
    pub const JSON: Negotiated = Negotiated {
        encoding: Encoding::Json,
        representation: Representation::Object,
    };

    /// The `Content-Type` to answer with.
    pub fn content_type(&self, list: bool) -> String {
        let base = match self.encoding {
            Encoding::Json => "application/json",
            Encoding::Yaml => "application/yaml",
        };
        match self.representation {
            Representation::Object => base.to_owned(),
            Representation::Table(v) => format!("{base};as=Table;v={v};g=meta.k8s.io"),
            Representation::Metadata(v) => {
                format!(
                    "{base};as={};v={v};g=meta.k8s.io",
                    if list {
                        "PartialObjectMetadataList"
                    } else {
                        "PartialObjectMetadata"
                    }
                )
            }
            Representation::Discovery(v) => {
                format!("{base};g=apidiscovery.k8s.io;v={v};as=APIGroupDiscoveryList")
            }
        }
    }
}

/// Where the response goes: which `as=` forms make sense there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A single object (get, and the results of writes).
    Object,
    /// A list or a watch.
    Collection,
    /// `/apis` and friends.
    Discovery,
}

struct Entry<'a> {
    media: &'a str,
    params: Vec<(&'a str, &'a str)>,
    q: f32,
}

fn parse_entries(accept: &str) -> Vec<Entry<'_>> {
    accept
        .split(',')
        .filter_map(|raw| {
            let mut parts = raw.split(';').map(str::trim);
            let media = parts.next().filter(|m| !m.is_empty())?;
            let mut params = Vec::new();
            let mut q = 1.0;
            for p in parts {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                let v = v.trim_matches('"');
                if k.eq_ignore_ascii_case("q") {
                    q = v.parse().unwrap_or(0.0);
                } else {
                    params.push((k, v));
                }
            }
            Some(Entry { media, params, q })
        })
        .collect()
}

fn param<'a>(e: &Entry<'a>, key: &str) -> Option<&'a str> {
    e.params
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(key))
        .map(|(_, v)| *v)
}

fn servable(e: &Entry<'_>, target: Target) -> Option<Negotiated> {
    let encoding = match e.media.to_ascii_lowercase().as_str() {
        "application/json" | "application/*" | "*/*" | "json" => Encoding::Json,
        "application/yaml" | "application/x-yaml" | "text/yaml" => Encoding::Yaml,
        _ => return None,
    };
    let representation = match param(e, "as") {
        None => Representation::Object,
        Some(as_) => {
            let (g, v) = (param(e, "g").unwrap_or(""), param(e, "v").unwrap_or(""));
            match (as_, g, v, target) {
                ("Table", "meta.k8s.io", "v1", Target::Object | Target::Collection) => {
                    Representation::Table("v1")
                }
                ("Table", "meta.k8s.io", "v1beta1", Target::Object | Target::Collection) => {
                    Representation::Table("v1beta1")
                }
                ("PartialObjectMetadata", "meta.k8s.io", "v1", Target::Object)
                | ("PartialObjectMetadataList", "meta.k8s.io", "v1", Target::Collection)
                | ("PartialObjectMetadata", "meta.k8s.io", "v1", Target::Collection) => {
                    Representation::Metadata("v1")
                }
                ("PartialObjectMetadata", "meta.k8s.io", "v1beta1", Target::Object)
                | ("PartialObjectMetadataList", "meta.k8s.io", "v1beta1", Target::Collection) => {
                    Representation::Metadata("v1beta1")
                }
                ("APIGroupDiscoveryList", "apidiscovery.k8s.io", "v2", Target::Discovery) => {
                    Representation::Discovery("v2")
                }
                ("APIGroupDiscoveryList", "apidiscovery.k8s.io", "v2beta1", Target::Discovery) => {
                    Representation::Discovery("v2beta1")
                }
                _ => return None,
            }
        }
    };
    Some(Negotiated {
        encoding,
        representation,
    })
}

/// Nothing in the Accept header can be served (406).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("none of the accepted media types can be served")]
pub struct NotAcceptable;

/// Picks the representation for `accept` (`None`: no header, plain JSON).
pub fn negotiate(accept: Option<&str>, target: Target) -> Result<Negotiated, NotAcceptable> {
    let Some(accept) = accept.map(str::trim).filter(|a| !a.is_empty()) else {
        return Ok(Negotiated::JSON);
    };
    let mut best: Option<(f32, Negotiated)> = None;
    for entry in parse_entries(accept) {
        if entry.q <= 0.0 {
            continue;
        }
        if let Some(n) = servable(&entry, target)
            && best.is_none_or(|(q, _)| entry.q > q)
        {
            best = Some((entry.q, n));
        }
    }
    best.map(|(_, n)| n).ok_or(NotAcceptable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubectl_get_prefers_table() {
        let accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";
        assert_eq!(
            negotiate(Some(accept), Target::Collection)
                .unwrap()
                .representation,
            Representation::Table("v1")
        );
    }

    #[test]
    fn protobuf_first_falls_back_to_json_metadata() {
        let accept = "application/vnd.kubernetes.protobuf;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json";
        let n = negotiate(Some(accept), Target::Collection).unwrap();
        assert_eq!(
            n,
            Negotiated {
                encoding: Encoding::Json,
                representation: Representation::Metadata("v1")
            }
        );
        assert_eq!(
            n.content_type(true),
            "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io"
        );
    }

    #[test]
    fn q_values_and_yaml() {
        let n = negotiate(
            Some("application/json;q=0.5, application/yaml"),
            Target::Object,
        )
        .unwrap();
        assert_eq!(n.encoding, Encoding::Yaml);
        assert_eq!(
            negotiate(
                Some("application/yaml;q=0, application/json"),
                Target::Object
            )
            .unwrap()
            .encoding,
            Encoding::Json
        );
    }

    #[test]
    fn nothing_servable_is_406() {
        assert!(negotiate(Some("application/vnd.kubernetes.protobuf"), Target::Object).is_err());
        assert!(negotiate(Some("text/html"), Target::Object).is_err());
        assert!(negotiate(Some("application/json;as=Foo;g=x;v=y"), Target::Object).is_err());
    }

    #[test]
    fn discovery_v2() {
        let accept = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,application/json";
        assert_eq!(
            negotiate(Some(accept), Target::Discovery)
                .unwrap()
                .representation,
            Representation::Discovery("v2")
        );
        assert_eq!(
            negotiate(Some("application/json"), Target::Discovery)
                .unwrap()
                .representation,
            Representation::Object
        );
    }

    #[test]
    fn wildcards_and_missing_header() {
        assert_eq!(negotiate(None, Target::Object).unwrap(), Negotiated::JSON);
        assert_eq!(
            negotiate(Some("*/*"), Target::Object).unwrap(),
            Negotiated::JSON
        );
    }
}
